"""Fit a GPU's achievable efficiencies on published timings.

Two physical parameters are fitted, nothing per row: `gemm_efficiency` (the
fraction of dense peak a large GEMM reaches) and `hbm_efficiency` (the fraction
of HBM bandwidth element-wise kernels reach). The kernel overhead and the link
efficiencies stay as the profiles give them. The fit minimises relative error
(scipy least squares, bounded to [0.2, 1]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models import StrategyArrays
from cost_models.comm import TierCommModel
from cost_models.step import per_layer_times
from planner.specs import ClusterSpec, Strategy, TrainSpec
from benchmarks.validation import LayerCase, StepCase, predict


@dataclass(frozen=True)
class Fit:
    gemm_efficiency: float
    hbm_efficiency: float
    layer_residuals: list[tuple[str, float, float, float, float]]  # label, fwd pred, fwd meas, bwd pred, bwd meas
    step_residuals: list[tuple[str, float, float]]  # label, step pred, step meas


def with_efficiencies(cluster: ClusterSpec, gemm: float, hbm: float) -> ClusterSpec:
    gpu = cluster.gpu.model_copy(update={"gemm_efficiency": float(gemm), "hbm_efficiency": float(hbm)})
    return cluster.model_copy(update={"gpu": gpu})


def predict_layer(case: LayerCase, cluster: ClusterSpec, train_options: dict) -> tuple[float, float]:
    """Predicted (forward_s, backward_s) of one layer, recompute included in backward."""
    strategy = Strategy(dp=1, tp=case.tp, micro_batch_size=case.micro_batch_size, sequence_parallel=case.sequence_parallel,
                        recompute=case.recompute)
    st = StrategyArrays.from_strategies([strategy])
    train = TrainSpec(global_batch_size=case.micro_batch_size, seq_len=case.seq_len, **train_options)
    pl = per_layer_times(case.model, train, cluster.gpu, TierCommModel(cluster), st, cluster.comm_overlap)
    return float(pl.fwd_s[0]), float(pl.bwd_s[0])


def predict_step(case: StepCase, cluster: ClusterSpec) -> float:
    """Fastest predicted step under the case's constraints (what the authors would have tuned)."""
    prediction = predict(case, cluster)
    if prediction.predicted_step_s is None:
        raise ValueError(f"calibration row {case.label!r} has no fitting strategy: {prediction.note}")
    return prediction.predicted_step_s


def fit_efficiencies(layer_cases: list[LayerCase], step_cases: list[StepCase], cluster: ClusterSpec,
                     layer_train_options: dict) -> Fit:
    """Two stages: (gemm, hbm) on the per-layer rows, whose SP / non-SP pairs pin the
    element-wise (HBM) share; then gemm alone on the per-layer and end-to-end rows
    together, with hbm fixed. Residuals are relative errors."""
    from scipy.optimize import least_squares

    def layer_res(c: ClusterSpec) -> list[float]:
        out = []
        for case in layer_cases:
            f, b = predict_layer(case, c, layer_train_options)
            out += [f / case.forward_s - 1, b / case.backward_s - 1]
        return out

    first = least_squares(lambda x: np.array(layer_res(with_efficiencies(cluster, x[0], x[1]))),
                          x0=np.array([0.7, 0.8]), bounds=([0.2, 0.2], [1.0, 1.0]))
    hbm = float(first.x[1])
    gemm = float(first.x[0])
    if step_cases:
        def all_res(x: np.ndarray) -> np.ndarray:
            c = with_efficiencies(cluster, x[0], hbm)
            return np.array(layer_res(c) + [predict_step(k, c) / k.measured_step_s - 1 for k in step_cases])

        gemm = float(least_squares(all_res, x0=np.array([gemm]), bounds=([0.2], [1.0])).x[0])
    fitted = with_efficiencies(cluster, gemm, hbm)
    layers = []
    for case in layer_cases:
        f, b = predict_layer(case, fitted, layer_train_options)
        layers.append((case.label, f, case.forward_s, b, case.backward_s))
    steps = [(k.label, predict_step(k, fitted), k.measured_step_s) for k in step_cases]
    return Fit(gemm_efficiency=gemm, hbm_efficiency=hbm, layer_residuals=layers, step_residuals=steps)
