"""Fit a GPU's calibrated parameters on one paper's published timings; judge them on the others.

Three GpuSpec fields can be fitted, nothing per row:

  gemm_efficiency      fraction of dense peak a GEMM reaches
  hbm_efficiency       fraction of HBM bandwidth element-wise kernels reach
  backward_gemm_ratio  a layer's backward GEMM time over its forward GEMM time
                       (the FLOP ratio is 2: input and weight gradients)

A fit minimises the relative errors of its rows (scipy least squares, bounded
as `BOUNDS`, by planner.calibrate.fit_parameters); the kernel overhead, link bandwidths and efficiencies and the
overlap stay as the GPU and cluster profiles give them.

Calibration holds out whole papers (leave-one-paper-out). `FITS` names one fit
per paper, each on that paper's rows only:

- "korthikanti-table4": Korthikanti et al. 2022 Table 4, the forward and
  backward times of one 22B layer (tp 8, five recompute / SP settings). Its
  SP / non-SP pairs separate the element-wise (HBM) share from the GEMMs
  (weakly: the profile's standard_errors show it), and its backward column
  the backward GEMM ratio, so all three are fitted.
- "sc21": Narayanan et al. SC'21 Table 1 (10 runs) and Table 2's six PTD runs,
  end to end. Step times cannot separate the GEMM rate from the backward
  ratio or the element-wise share (a fit of all three on them is
  ill-conditioned), so only gemm_efficiency is fitted; hbm_efficiency and
  backward_gemm_ratio are held at stated values (`held`).

`lopo` predicts every A100 table under each fit: the other paper's rows are
the honest test of a fit, the same paper's unfitted rows (Korthikanti Table 5
for the Table 4 fit) share its cluster and software, and torchtitan's FSDP2
runs come from neither. `SHIPPED` is the fit written to the profiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import numpy as np

from benchmarks.validation import (
    MEGATRON_2022,
    LayerCase,
    StepCase,
    korthikanti_table4,
    korthikanti_table5,
    predict,
    sc21_table1,
    sc21_table2,
    torchtitan_fsdp2,
)
from cost_models import StrategyArrays
from cost_models.comm import TierCommModel
from cost_models.blocks import model_blocks
from cost_models.step import per_layer_times
from planner.calibrate import (CalibrationResult, ErrorSummary, FitParameter, FitSettings, Residual, apply_parameters,
                               fit_parameters)
from planner.specs import ClusterSpec, GpuSpec, Strategy, TrainSpec
from profiles import load_cluster

#: Search bounds of each fitted parameter. A backward GEMM does twice the forward's FLOPs,
#: so a time ratio below 1 would mean it runs at over twice the forward's efficiency.
BOUNDS = {"gemm_efficiency": (0.2, 1.0), "hbm_efficiency": (0.2, 1.0), "backward_gemm_ratio": (1.0, 4.0)}
#: Decimals the profiles keep of a fitted parameter.
PARAMETER_DECIMALS = 4
#: Where the least-squares search starts (not a prior: the optimum does not depend on it).
START = {"gemm_efficiency": 0.7, "hbm_efficiency": 0.8, "backward_gemm_ratio": 2.0}


@lru_cache(maxsize=None)
def base_cluster(name: str) -> ClusterSpec:
    """A cluster preset as shipped (loaded once; every fitted field is replaced before use)."""
    return load_cluster(name)


def with_parameters(cluster: ClusterSpec, params: dict[str, float]) -> ClusterSpec:
    """`cluster` with GPU fields (the calibrated ones, `kernel_overhead_s`) and cluster
    fields (`comm_overlap`) replaced by `params` (planner.calibrate.apply_parameters)."""
    return apply_parameters(cluster, params)


def predict_layer(case: LayerCase, cluster: ClusterSpec, train_options: dict) -> tuple[float, float]:
    """Predicted (forward_s, backward_s) of one layer, recompute included in backward."""
    strategy = Strategy(dp=1, tp=case.tp, micro_batch_size=case.micro_batch_size, sequence_parallel=case.sequence_parallel,
                        recompute=case.recompute)
    st = StrategyArrays.from_strategies([strategy])
    train = TrainSpec(global_batch_size=case.micro_batch_size, seq_len=case.seq_len, **train_options)
    pl = per_layer_times(case.model, train, cluster.gpu, TierCommModel(cluster), st, cluster.comm_overlap)
    blocks = model_blocks(case.model)  # the average layer (these models have one kind)
    return float(pl.mean("fwd_s", blocks)[0]), float(pl.mean("bwd_s", blocks)[0])


# ---- errors and their summary ----------------------------------------------
@dataclass(frozen=True)
class RowError:
    """One compared number: a row (or a row's forward / backward column) and the relative error."""

    label: str
    measured_s: float
    predicted_s: float | None  # None: no strategy under the paper's constraints fits
    strategy: str = ""
    note: str = ""

    @property
    def error(self) -> float | None:
        return None if self.predicted_s is None else self.predicted_s / self.measured_s - 1


@dataclass(frozen=True)
class Summary:
    """Relative errors of one table: how many, how large, and which way."""

    n: int  # rows predicted
    n_rows: int  # rows in the table (n < n_rows: some rows had no fitting strategy)
    median_abs: float
    max_abs: float
    mean: float  # signed: < 0 the model is fast (predicts short steps), > 0 slow

    @classmethod
    def of(cls, rows: list[RowError]) -> "Summary":
        s = ErrorSummary.of([r.error for r in rows if r.error is not None])
        if not s.n:
            return cls(0, len(rows), float("nan"), float("nan"), float("nan"))
        return cls(s.n, len(rows), s.median_abs, s.max_abs, s.mean_signed)

    def line(self) -> str:
        count = f"{self.n}" if self.n == self.n_rows else f"{self.n} of {self.n_rows}"
        if self.n == 0:
            return f"n {count:>7s}  no row predicted"
        return (f"n {count:>7s}  median |err| {self.median_abs:6.1%}  max |err| {self.max_abs:6.1%}  "
                f"mean (bias) {self.mean:+6.1%}")


# ---- tables ------------------------------------------------------------------
@dataclass(frozen=True)
class Table:
    """A set of published A100 rows from one source, compared one way."""

    name: str
    paper: str  # whole papers are held out: a fit never sees another paper's rows
    rows: Callable[[], list]  # LayerCase or StepCase loader
    kind: str = "step"  # "step": step time; "forward" / "backward": Korthikanti Table 4 per-layer columns


KORTHIKANTI = "Korthikanti et al. 2022"
SC21 = "Narayanan et al. SC'21"
TORCHTITAN = "torchtitan docs (FSDP2)"


def sc21_ptd() -> list[StepCase]:
    """SC'21 Table 2's PTD-P rows (Megatron's own 3D parallelism)."""
    return [c for c in sc21_table2() if c.constraints["zero_stage"] == 0]


def sc21_zero3() -> list[StepCase]:
    """SC'21 Table 2's ZeRO-3 rows, predicted as DeepSpeed ZeRO-3 (profiles/frameworks/zero3.yaml)."""
    from dataclasses import replace

    return [replace(c, train_options=c.train_options | {"zero3_impl": "deepspeed"})
            for c in sc21_table2() if c.constraints["zero_stage"] == 3]


A100_TABLES = (
    Table("Korthikanti Table 4 forward", KORTHIKANTI, korthikanti_table4, "forward"),
    Table("Korthikanti Table 4 backward", KORTHIKANTI, korthikanti_table4, "backward"),
    Table("Korthikanti Table 5", KORTHIKANTI, korthikanti_table5),
    Table("SC'21 Table 1", SC21, sc21_table1),
    Table("SC'21 Table 2 PTD", SC21, sc21_ptd),
    Table("torchtitan FSDP2", TORCHTITAN, torchtitan_fsdp2),
)


def table_errors(table: Table, params: dict[str, float]) -> list[RowError]:
    """Every row of `table` predicted with the GPU's calibrated fields set to `params`."""
    if table.kind in ("forward", "backward"):
        cluster = with_parameters(base_cluster("dgx-a100-80gb"), params)
        out = []
        for case in table.rows():
            f, b = predict_layer(case, cluster, MEGATRON_2022)
            measured, predicted = (case.forward_s, f) if table.kind == "forward" else (case.backward_s, b)
            out.append(RowError(case.label, measured, predicted))
        return out
    out = []
    for case in table.rows():
        p = predict(case, with_parameters(base_cluster(case.cluster), params))
        out.append(RowError(case.label, case.measured_step_s, p.predicted_step_s, p.strategy, p.note))
    return out


# ---- fits --------------------------------------------------------------------
@dataclass(frozen=True)
class FitSpec:
    """Which rows (of one paper) a fit uses, which parameters it fits, and what it holds."""

    key: str
    label: str  # a few words: which rows
    paper: str
    fitted_on: str  # one sentence: the rows, for the profile's `fitted_on`
    parameters: tuple[str, ...]
    tables: tuple[Table, ...]  # the rows fitted (all from `paper`)
    held: dict[str, float] = field(default_factory=dict)  # parameters not fitted, at these values
    held_because: str = ""


FITS = {
    "korthikanti-table4": FitSpec(
        key="korthikanti-table4", label="Korthikanti Table 4", paper=KORTHIKANTI,
        fitted_on="Korthikanti et al. 2022 Table 4: forward and backward time of one layer of the 22B model "
                  "(tp 8, s 2048, micro-batch 4; no recompute, SP, full, selective, selective + SP): 5 rows, "
                  "10 numbers; A100-SXM4-80GB on Selene",
        parameters=("gemm_efficiency", "hbm_efficiency", "backward_gemm_ratio"),
        tables=(A100_TABLES[0], A100_TABLES[1]),
    ),
    "sc21": FitSpec(
        key="sc21", label="SC'21 Table 1 + Table 2 PTD", paper=SC21,
        fitted_on="Narayanan et al. SC'21 Table 1 (10 runs, 1.7B-1T) and Table 2's 6 PTD runs (175B, 530B), "
                  "end-to-end step times; A100-SXM4-80GB on Selene",
        parameters=("gemm_efficiency",),
        tables=(A100_TABLES[3], A100_TABLES[4]),
        held={"hbm_efficiency": GpuSpec.model_fields["hbm_efficiency"].default, "backward_gemm_ratio": 2.0},
        held_because="step times do not separate them from the GEMM rate: hbm_efficiency at the GpuSpec "
                     "default (assumed), backward_gemm_ratio at the FLOP ratio 2",
    ),
}
SHIPPED = "korthikanti-table4"
SHIPPED_BECAUSE = (
    "Korthikanti Table 4 is the most kernel-level data in the set: per-layer times measure what the three "
    "parameters describe, without pipeline, schedule or data-parallel terms, and identify all three; end-to-end "
    "step times identify one overall compute rate only. leave_one_paper_out shows how each fit does on the paper "
    "it did not see.")


@dataclass(frozen=True)
class Fit:
    spec: FitSpec
    residuals: dict[str, list[RowError]]  # by fitted table
    result: CalibrationResult  # the package's typed result (written as the calibration profile)

    @property
    def params(self) -> dict[str, float]:
        """Every parameter's value, fitted and held."""
        return self.result.values

    @property
    def standard_errors(self) -> dict[str, float | None]:
        """The fitted parameters' standard errors, from the Jacobian at the optimum."""
        return self.result.standard_errors


def fit(spec: FitSpec, fixed: dict[str, float] | None = None) -> Fit:
    """Least squares on the relative errors of `spec`'s rows (all of one paper), by the package's
    engine (planner.calibrate.fit_parameters) with the plain quadratic loss.

    `fixed` overrides profile values that are not fitted (`kernel_overhead_s`,
    `comm_overlap`), for sensitivity studies; the shipped fit uses none."""
    names = spec.parameters
    if set(names) | set(spec.held) != set(BOUNDS):
        raise ValueError(f"fit {spec.key!r} must fit or hold each of {sorted(BOUNDS)}")

    def residuals(params: dict[str, float]) -> np.ndarray:
        rows = [r for t in spec.tables for r in table_errors(t, params)]
        unfit = [f"{r.label}: {r.note}" for r in rows if r.error is None]
        if unfit:
            raise ValueError(f"fit {spec.key!r}: calibration rows with no fitting strategy: {'; '.join(unfit)}")
        return np.array([r.error for r in rows])

    settings = FitSettings(
        parameters=tuple(FitParameter(name=n, lower=BOUNDS[n][0], upper=BOUNDS[n][1], start=START[n]) for n in names),
        fixed=(fixed or {}) | spec.held, loss="linear", error="relative", decimals=PARAMETER_DECIMALS)
    result = fit_parameters(residuals, settings.parameters, settings.fixed, settings.loss, settings.f_scale,
                            settings.decimals, settings.diff_step)
    # Rounded as the profiles store them, so the residuals and the LOPO table are those of the shipped file.
    tables = {t.name: table_errors(t, result.values) for t in spec.tables}
    calibration = CalibrationResult(
        values=result.values, fitted=result.fitted, standard_errors=result.standard_errors,
        residuals=tuple(Residual(row=f"{table}: {r.label}", error=r.error, source=spec.paper, measured_s=r.measured_s,
                                 predicted_s=r.predicted_s) for table, rows in tables.items() for r in rows),
        settings=settings, converged=result.converged, message=result.message)
    return Fit(spec=spec, residuals=tables, result=calibration)


def lopo(fits: list[Fit], tables=A100_TABLES) -> dict[str, dict[str, Summary]]:
    """Summary of every table under every fit: {fit key: {table name: Summary}}."""
    return {f.spec.key: {t.name: Summary.of(table_errors(t, f.params)) for t in tables} for f in fits}


def role(spec: FitSpec, table: Table) -> str:
    """How `table` relates to the fit: its own rows, the same paper's unfitted rows, or held out."""
    if table in spec.tables:
        return "fitted"
    return "same paper" if table.paper == spec.paper else "held out"
