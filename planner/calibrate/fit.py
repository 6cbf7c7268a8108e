"""Robust least squares over a few named physical parameters, and leave-one-set-out.

`fit_parameters` is the engine: any residual function of the parameter values, bounded
scipy least squares. `calibrate` applies it to measured runs (`MeasuredRun`): each run's
step time is predicted by the planner with the parameters set on its cluster, and the
residual is its log error log(predicted / measured) (or the relative error) under a
robust loss, so one run the model cannot describe does not drag the fit; a run's
residual is multiplied by sqrt(its weight), so a measurement trusted less counts less. Reported
errors are always relative (and unweighted), predicted / measured - 1 (< 0: the model is fast).
`leave_one_set_out` refits without each set and reports that set's errors under the
refit.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from pydantic import Field, model_validator
from scipy.optimize import least_squares

from planner.calibrate.runs import (
    MeasuredRun,
    apply_parameters,
    check_parameter,
    predict_run,
    resolve_cluster,
)
from planner.errors import SpecError
from planner.specs.base import Spec
from profiles.calibration_file import UNIT_SCALE

Loss = Literal["linear", "soft_l1", "huber", "cauchy", "arctan"]
ErrorKind = Literal["log", "relative"]
#: Decimals a fitted value keeps by default (the calibration profiles' precision).
DEFAULT_DECIMALS = 4
#: Default robust-loss scale: residuals (log errors) beyond about 5 % count less than quadratically.
DEFAULT_F_SCALE = 0.05
#: Relative finite-difference step of the Jacobian: large enough to step over the planner's
#: discrete choices' rounding, small against any parameter's range.
DEFAULT_DIFF_STEP = 1e-4


class FitParameter(Spec):
    """A named parameter to fit, its bounds and start. `calibrate` (FitSettings) takes numeric GpuSpec
    and ClusterSpec fields; the engine `fit_parameters` any name its residual function reads."""

    name: str = Field(min_length=1)
    lower: float
    upper: float
    start: float | None = Field(None, description="Where the search starts (default: mid-range).")

    @model_validator(mode="after")
    def _in_range(self) -> FitParameter:
        if not self.lower < self.upper:
            raise ValueError(f"{self.name}.lower: must be below upper (got {self.lower!r} >= {self.upper!r})")
        if self.start is not None and not self.lower <= self.start <= self.upper:
            raise ValueError(f"{self.name}.start: must lie in [{self.lower}, {self.upper}] (got {self.start!r})")
        return self

    @property
    def x0(self) -> float:
        return (self.lower + self.upper) / 2 if self.start is None else self.start


class FitSettings(Spec):
    """Which parameters to fit (with bounds), which to hold at stated values, and how."""

    parameters: tuple[FitParameter, ...] = Field(min_length=1)
    fixed: dict[str, float] = Field(default_factory=dict, description="Parameters held at these values.")
    loss: Loss = "soft_l1"
    f_scale: float = Field(DEFAULT_F_SCALE, gt=0, description="Residual size where the robust loss bends.")
    error: ErrorKind = "log"
    decimals: int = Field(DEFAULT_DECIMALS, ge=0, le=12, description="Decimals each fitted value is rounded to.")
    diff_step: float = Field(DEFAULT_DIFF_STEP, gt=0, lt=1)

    @model_validator(mode="after")
    def _names(self) -> FitSettings:
        names = [p.name for p in self.parameters]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"parameters: each parameter once (got {', '.join(twice)} more than once)")
        for name in [*names, *self.fixed]:
            check_parameter(name)
        both = sorted(set(names) & set(self.fixed))
        if both:
            raise ValueError(f"fixed: a parameter is fitted or fixed, not both (got {', '.join(both)})")
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parameters)


class Residual(Spec):
    """One fitted number after the fit: which row, its relative error, and where it comes from."""

    row: str
    error: float = Field(description="predicted / measured - 1")
    source: str = ""
    set_name: str | None = None
    measured_s: float | None = None
    predicted_s: float | None = None
    strategy: str = ""


class ParameterFit(Spec):
    """The engine's answer: every value (fitted, rounded, and fixed), the fitted ones' standard errors
    (None: the residuals do not identify the parameter, a singular Jacobian)."""

    values: dict[str, float]
    fitted: tuple[str, ...]
    standard_errors: dict[str, float | None]
    residuals: tuple[float, ...] = Field(description="The residual function at the rounded values.")
    converged: bool
    message: str


class CalibrationResult(Spec):
    """A fit on measured runs: the values, their standard errors, and every run's error under them."""

    values: dict[str, float]
    fitted: tuple[str, ...]
    standard_errors: dict[str, float | None]  # None: not identified by the runs
    residuals: tuple[Residual, ...]
    settings: FitSettings
    converged: bool
    message: str

    def summary(self) -> ErrorSummary:
        return ErrorSummary.of([r.error for r in self.residuals])


class ErrorSummary(Spec):
    """n, median and max |relative error|, and the signed mean (the bias)."""

    n: int
    median_abs: float | None  # None: no row
    max_abs: float | None
    mean_signed: float | None

    @classmethod
    def of(cls, errors: Sequence[float]) -> ErrorSummary:
        if not errors:
            return cls(n=0, median_abs=None, max_abs=None, mean_signed=None)
        return cls(n=len(errors), median_abs=statistics.median(abs(e) for e in errors),
                   max_abs=max(abs(e) for e in errors), mean_signed=statistics.fmean(errors))


class HeldOutSet(Spec):
    """One set held out: the values refitted on the other sets, and this set's errors under them."""

    set_name: str
    values: dict[str, float]
    summary: ErrorSummary
    residuals: tuple[Residual, ...]


def fit_parameters(residuals: Callable[[dict[str, float]], np.ndarray], parameters: Sequence[FitParameter],
                   fixed: dict[str, float] | None = None, loss: Loss = "soft_l1", f_scale: float = DEFAULT_F_SCALE,
                   decimals: int = DEFAULT_DECIMALS, diff_step: float = DEFAULT_DIFF_STEP) -> ParameterFit:
    """Bounded least squares of `residuals(values)` over `parameters` (the others at `fixed`).

    Standard errors come from the Jacobian at the optimum (linearised, scaled by the residual
    variance); a singular Jacobian (a parameter the residuals do not depend on) gives None. Each parameter
    is searched and rounded to `decimals` in its calibration file's unit (`profiles.calibration_file.UNIT_SCALE`:
    kernel_overhead_s in microseconds, bandwidths in GB/s, framework_reserve_bytes in GiB, any other name as
    it is), so a value in seconds or bytes/s neither rounds to nothing nor dwarfs a fraction beside it; the
    returned residuals are those of the rounded values (what a profile written from them gives)."""
    names = [p.name for p in parameters]
    held = dict(fixed or {})
    # searched and rounded in each parameter's file unit (microseconds, GB/s, GiB; 1 for a fraction)
    unit = np.array([UNIT_SCALE.get(n, 1.0) for n in names])

    def values_of(u) -> dict[str, float]:
        return held | dict(zip(names, (float(v) for v in np.asarray(u) * unit)))

    def fun(u) -> np.ndarray:
        return np.asarray(residuals(values_of(u)), dtype=float)

    lower = np.array([p.lower for p in parameters]) / unit
    upper = np.array([p.upper for p in parameters]) / unit
    result = least_squares(fun, x0=np.array([p.x0 for p in parameters]) / unit, bounds=(lower, upper), loss=loss,
                           f_scale=f_scale, diff_step=diff_step)
    dof = max(result.fun.size - len(names), 1)
    try:
        cov = np.linalg.inv(result.jac.T @ result.jac) * float(result.fun @ result.fun) / dof
        stderr = np.sqrt(np.diag(cov)) * unit
    except np.linalg.LinAlgError:
        stderr = np.full(len(names), np.inf)
    # rounding never leaves the bounds: clip after it
    u = np.clip(np.round(result.x, decimals), lower, upper)
    values = values_of(u)
    errors = {n: float(e) if np.isfinite(e) else None for n, e in zip(names, stderr)}
    return ParameterFit(values=values, fitted=tuple(names), standard_errors=errors,
                        residuals=tuple(float(v) for v in fun(u)), converged=bool(result.success),
                        message=str(result.message))


def _check_runs(runs: Sequence[MeasuredRun], what: str) -> None:
    if not runs:
        raise SpecError(f"{what}: at least one measured run is needed (got none)")
    for i, run in enumerate(runs):
        if not isinstance(run, MeasuredRun):
            raise SpecError(f"{what}[{i}]: must be a MeasuredRun (got {type(run).__name__})")
    labels = [r.label for r in runs]
    twice = sorted({n for n in labels if labels.count(n) > 1})
    if twice:
        raise SpecError(f"{what}: each run's label must be unique (got {', '.join(map(repr, twice))} twice)")


def run_residuals(runs: Sequence[MeasuredRun], values: dict[str, float]) -> tuple[Residual, ...]:
    """Every run predicted with `values` set on its cluster; a run with no fitting plan is refused."""
    out = []
    for run in runs:
        p = predict_run(run, apply_parameters(resolve_cluster(run), values))
        if p.step_s is None:
            raise SpecError(f"runs: run {run.label!r} has no plan that fits under its strategy fields "
                            f"({p.strategy}: {p.note})")
        out.append(Residual(row=run.label, error=p.step_s / run.step_s - 1, source=run.source, set_name=run.set_name,
                            measured_s=run.step_s, predicted_s=p.step_s, strategy=p.strategy))
    return tuple(out)


def calibrate(runs: Sequence[MeasuredRun], settings: FitSettings) -> CalibrationResult:
    """Fit `settings.parameters` on `runs` (module docstring); SpecError for bad input or a run
    the planner cannot place."""
    if not isinstance(settings, FitSettings):
        raise SpecError(f"settings: must be a FitSettings (got {type(settings).__name__})")
    _check_runs(runs, "runs")
    clusters = {id(r): resolve_cluster(r) for r in runs}
    runs = [r.model_copy(update={"cluster": clusters[id(r)]}) for r in runs]  # each preset loaded once

    weights = np.sqrt([r.weight for r in runs])

    def residuals(values: dict[str, float]) -> np.ndarray:
        errors = np.array([r.error for r in run_residuals(runs, values)])
        return weights * (np.log1p(errors) if settings.error == "log" else errors)

    fit = fit_parameters(residuals, settings.parameters, settings.fixed, settings.loss, settings.f_scale,
                         settings.decimals, settings.diff_step)
    return CalibrationResult(values=fit.values, fitted=fit.fitted, standard_errors=fit.standard_errors,
                             residuals=run_residuals(runs, fit.values), settings=settings, converged=fit.converged,
                             message=fit.message)


def leave_one_set_out(runs: Sequence[MeasuredRun], settings: FitSettings) -> tuple[HeldOutSet, ...]:
    """For each set (`MeasuredRun.set_name`), refit on the other sets and report its errors."""
    _check_runs(runs, "runs")
    unnamed = [r.label for r in runs if r.set_name is None]
    if unnamed:
        raise SpecError(f"runs.set_name: leave-one-set-out needs every run's set (run {unnamed[0]!r} has none)")
    sets = list(dict.fromkeys(r.set_name for r in runs))
    if len(sets) < 2:
        raise SpecError(f"runs.set_name: leave-one-set-out needs at least two sets (got {sets})")
    out = []
    for name in sets:
        refit = calibrate([r for r in runs if r.set_name != name], settings)
        held = run_residuals([r for r in runs if r.set_name == name], refit.values)
        out.append(HeldOutSet(set_name=name, values=refit.values, summary=ErrorSummary.of([r.error for r in held]),
                              residuals=held))
    return tuple(out)
