"""What finished trials teach the cost model: a calibration fit, and a memory reserve after an OOM.

The fit (`fit_trials`) uses the package's least-squares engine (`planner.calibrate.fit_parameters`,
soft-L1 robust loss on log errors) over at most one physical parameter per group of
`PARAMETER_GROUPS`: the compute-efficiency scale, the bus bandwidth of the link tier the trials'
groups use, the fraction of communication that overlaps compute, and the fixed cost per kernel.
In a group the first field that moves any trial's prediction is fitted (on a GPU with kernel
tables the sustained fraction of their throughput, without tables the GEMM efficiency; the
intra-node tier on one node); a field that moves none is left as it is and reported as not
identified. The fitted set is the one of every subset (at most `MAX_FITTED` parameters, at most
one per `TRIALS_PER_PARAMETER` trials) whose fit has the lowest weighted mean |log error| with
each parameter charged `MIN_GAIN` (the error divided by (1 - MIN_GAIN) per parameter), the
profile itself (no parameter) included: a parameter that does not lower the error by that much
is not moved, and when none does the profile stays as it is (a tiny model's steps are kernel
overhead, a large one's compute: the data say which). Each trial's residual is weighted by
sqrt(weight) (`measure.BUSY_WEIGHT` for a measurement taken on a busy host). The compute and bandwidth parameters are fitted as scale
factors of the present values (the engine's steps are relative), and written as values.

An OOM (`reserve_after_oom`) raises the GPU's framework memory reserve just enough that the
strategy that ran out of memory no longer fits, so the search stops proposing its neighbours.
"""

from __future__ import annotations

import itertools
import statistics

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from planner.calibrate import apply_parameters, fit_parameters
from planner.calibrate.fit import FitParameter
from planner.search import evaluate_one
from planner.specs import ClusterSpec, Estimate, ModelSpec, Strategy, TrainSpec
from planner.specs.hardware import EFFICIENCY_RANGE

PARAMETER_GROUPS = {
    "compute": ("sustained_compute_fraction", "gemm_efficiency"),
    "bandwidth": ("intra_node_bw_bytes_per_s", "inter_node_bw_bytes_per_s"),
    "overlap": ("comm_overlap",),
    "overhead": ("kernel_overhead_s",),
}
"""Per physical effect, the fields that express it, in order of preference."""
SCALE_BOUNDS = {"compute": (0.1, 10.0), "bandwidth": (0.05, 20.0), "overhead": (0.1, 50.0)}
"""How far a fit may move the compute efficiency, the bandwidth and the per-kernel overhead from the
profile's value (factors); the overlap fraction is fitted as a value in [0, 1]."""
PROBE_FACTOR = 0.8
"""A field is identified when scaling it by this factor moves some trial's prediction by more than
`PROBE_MIN_CHANGE`."""
PROBE_MIN_CHANGE = 0.005
MIN_FIT_TRIALS = 2
"""Fewest ok trials a fit needs (one parameter on two trials)."""
MAX_FITTED = 3
"""Most parameters one fit moves."""
TRIALS_PER_PARAMETER = 3
"""A fit moves at most one parameter per this many ok trials (at least one): with fewer, a parameter
fits the noise of the trials it saw and predicts the next ones worse (a held-out check of
benchmarks/tune_cpu.py saw this with two parameters on three trials)."""
MIN_GAIN = 0.1
"""Forward selection adds a parameter only if it lowers the weighted mean |log error| by at least this
share: a smaller gain is what any extra free parameter buys on noisy measurements."""
OOM_MARGIN = 0.02
"""After an OOM the reserve leaves the failed strategy this share of the GPU's memory short of fitting."""


class TrialRun(BaseModel):
    """One ok trial as the fit sees it."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    number: int
    label: str
    strategy: Strategy
    model: ModelSpec  # as executed (fewer layers where the run built fewer)
    measured_step_s: float
    weight: float = 1.0


class FitReport(BaseModel):
    """A fit's values (SI, `apply_parameters` names), the fields it could not identify, and each
    trial's relative error (predicted / measured - 1) before and after."""

    values: dict[str, float]
    fitted: list[str]
    not_identified: list[str]
    at_bound: list[str] = Field(default_factory=list, description="Fitted parameters that ended on a bound of "
                                "their range: the trials ask for more than the parameter can give, a sign of an "
                                "effect the model does not have (or of a bound too tight).")
    standard_errors: dict[str, float | None]
    before: dict[int, float]
    after: dict[int, float]
    score_before: float = Field(0.0, description="Weighted mean |log(predicted / measured)| on the profile: what the "
                                "fit lowers (weights: sqrt of each trial's weight).")
    score_after: float = Field(0.0, description="The same with the fitted values.")
    converged: bool
    message: str

    @staticmethod
    def median_abs(errors: dict[int, float]) -> float | None:
        return statistics.median(abs(e) for e in errors.values()) if errors else None


def current_value(cluster: ClusterSpec, name: str) -> float:
    if name == "intra_node_bw_bytes_per_s":
        return cluster.intra_node.bw_bytes_per_s
    if name == "inter_node_bw_bytes_per_s":
        return cluster.inter_node.bw_bytes_per_s
    if name in type(cluster.gpu).model_fields:
        return float(getattr(cluster.gpu, name))
    return float(getattr(cluster, name))


def predictions(runs: list[TrialRun], cluster: ClusterSpec, train: TrainSpec) -> np.ndarray:
    return np.array([evaluate_one(r.model, cluster, train, r.strategy).step_time_s for r in runs])


def _errors(runs: list[TrialRun], cluster: ClusterSpec, train: TrainSpec) -> dict[int, float]:
    pred = predictions(runs, cluster, train)
    return {r.number: float(p / r.measured_step_s - 1) for r, p in zip(runs, pred)}


def identified_fields(runs: list[TrialRun], cluster: ClusterSpec, train: TrainSpec) -> tuple[list[str], list[str]]:
    """Per group, the first field that moves a prediction (`PROBE_FACTOR`), and the groups' fields that
    were probed and moved nothing."""
    base = predictions(runs, cluster, train)
    chosen, idle = [], []
    for fields in PARAMETER_GROUPS.values():
        for name in fields:
            value = current_value(cluster, name)
            probe = value * PROBE_FACTOR if value > 0 else 0.5
            moved = float(np.max(np.abs(predictions(runs, apply_parameters(cluster, {name: probe}), train) / base - 1)))
            if moved > PROBE_MIN_CHANGE:
                chosen.append(name)
                break
            idle.append(name)
    return chosen, idle


def _group(name: str) -> str:
    return next(g for g, fields in PARAMETER_GROUPS.items() if name in fields)


def fit_trials(runs: list[TrialRun], cluster: ClusterSpec, train: TrainSpec) -> FitReport | None:
    """Fit the identified parameters on `runs` (module docstring): the subset that pays for its
    parameters. None with fewer than `MIN_FIT_TRIALS` runs, nothing identified, or no subset that
    beats the profile itself."""
    if len(runs) < MIN_FIT_TRIALS:
        return None
    candidates, idle = identified_fields(runs, cluster, train)
    if not candidates:
        return None
    weights = np.sqrt(np.array([r.weight for r in runs]))
    measured = np.array([r.measured_step_s for r in runs])
    profile_score = float(np.sum(weights * np.abs(np.log(predictions(runs, cluster, train) / measured)))
                          / np.sum(weights))
    most = min(MAX_FITTED, max(1, len(runs) // TRIALS_PER_PARAMETER), len(candidates))
    best: tuple[float, list[str], _Fit | None] = (profile_score, [], None)  # nothing moved: the profile itself
    for k in range(1, most + 1):
        for subset in itertools.combinations(candidates, k):
            fit = _fit(runs, cluster, train, list(subset))
            # each parameter must pay for itself: the error, charged MIN_GAIN per parameter, must beat the best
            if _score(fit, runs) / (1 - MIN_GAIN) ** k < best[0] / (1 - MIN_GAIN) ** len(best[1]):
                best = (_score(fit, runs), list(subset), fit)
    if best[2] is None:
        return None  # no parameter lowers the error enough: the profile predicts these trials as well as a fit
    chosen = best[1]
    fit = best[2]
    values = fit.values
    return FitReport(values=values, fitted=chosen, not_identified=idle, at_bound=fit.at_bound,
                     score_before=profile_score, score_after=best[0],
                     standard_errors=fit.standard_errors, before=_errors(runs, cluster, train),
                     after=_errors(runs, apply_parameters(cluster, values), train), converged=fit.converged,
                     message=fit.message)


class _Fit(BaseModel):
    values: dict[str, float]
    standard_errors: dict[str, float | None]
    at_bound: list[str]
    residuals: list[float]
    converged: bool
    message: str


def _score(fit: _Fit, runs: list[TrialRun]) -> float:
    """Weighted mean |log error| of a fit: what the subset choice minimises."""
    weights = np.array([r.weight for r in runs])
    return float(np.sum(np.abs(fit.residuals)) / np.sum(np.sqrt(weights)))


def _fit(runs: list[TrialRun], cluster: ClusterSpec, train: TrainSpec, chosen: list[str]) -> _Fit:
    """The package's robust least squares over `chosen` (compute, bandwidth and overhead as scale
    factors of the present values, the overlap as a value)."""
    start = {n: current_value(cluster, n) for n in chosen}

    def fit_name(name: str) -> str:  # a scale factor is its own name: the engine must not convert its unit
        return f"{name}.scale" if _group(name) in SCALE_BOUNDS else name

    params = []
    for name in chosen:
        group = _group(name)
        if group in SCALE_BOUNDS:
            lo, hi = SCALE_BOUNDS[group]
            if group == "compute":  # the value stays a fraction
                lo, hi = max(lo, EFFICIENCY_RANGE[0] / start[name]), min(hi, EFFICIENCY_RANGE[1] / start[name])
            params.append(FitParameter(name=fit_name(name), lower=lo, upper=hi, start=min(max(1.0, lo), hi)))
        else:
            # from mid-range when the profile sits on a bound (gloo profiles measure no overlap: 0), where
            # the search could not leave it
            x0 = start[name] if 0.0 < start[name] < 1.0 else 0.5
            params.append(FitParameter(name=name, lower=0.0, upper=1.0, start=x0))
    weights = np.sqrt(np.array([r.weight for r in runs]))
    measured = np.array([r.measured_step_s for r in runs])

    def absolute(x: dict[str, float]) -> dict[str, float]:
        return {n: x[fit_name(n)] * start[n] if _group(n) in SCALE_BOUNDS else x[n] for n in chosen}

    def residuals(x: dict[str, float]) -> np.ndarray:
        pred = predictions(runs, apply_parameters(cluster, absolute(x)), train)
        return weights * np.log(pred / measured)

    fit = fit_parameters(residuals, params, decimals=6)
    at_bound = [n for n, prm in zip(chosen, params)
                if min(abs(fit.values[prm.name] - prm.lower), abs(fit.values[prm.name] - prm.upper))
                <= 1e-6 * max(1.0, abs(prm.upper))]
    stderr = {n: (None if fit.standard_errors[fit_name(n)] is None else
                  fit.standard_errors[fit_name(n)] * (start[n] if _group(n) in SCALE_BOUNDS else 1.0)) for n in chosen}
    return _Fit(values=absolute(fit.values), standard_errors=stderr, at_bound=at_bound,
                residuals=list(fit.residuals), converged=fit.converged, message=fit.message)


def reserve_after_oom(cluster: ClusterSpec, estimate: Estimate) -> float:
    """The framework reserve (bytes) that makes the strategy of `estimate`, which ran out of memory
    though predicted to fit, no longer fit: the present reserve plus what the prediction left
    free, plus `OOM_MARGIN` of the GPU's memory."""
    gpu = cluster.gpu
    free = max(0.0, gpu.memory_bytes - estimate.peak_memory_bytes)  # the peak holds the present reserve
    return gpu.framework_reserve_bytes + free + OOM_MARGIN * gpu.memory_bytes


def calibrated_cluster(cluster: ClusterSpec, values: dict[str, float]) -> ClusterSpec:
    """`cluster` with the fitted and reserve values set (none: `cluster` itself)."""
    return apply_parameters(cluster, values) if values else cluster
