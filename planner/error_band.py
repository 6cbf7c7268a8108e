"""Error bands: how far a real run may be from a prediction, from the residuals of the GPU's profile.

A GPU's profile carries `step_time_residuals` (planner.specs.hardware.StepTimeResiduals): the
signed relative step-time errors e = predicted / measured - 1 of published end-to-end runs that
no fit used, summarised as an interval [error_low, error_high] with error_low <= 0 <= error_high
(`python -m benchmarks.residuals --write` computes it). The band of a predicted step time p:

    step_time_s_low  = p / (1 + error_high)     the run is faster than predicted by at most this
    step_time_s_high = p / (1 + error_low)      the run is slower than predicted by at most this

Throughput and MFU are proportional to 1 / step time, so their low edge comes from the high step
time. The band contains the point estimate by construction (error_low <= 0 <= error_high).

A GPU whose rows include enough of both kinds also carries a `dense` and a `moe` sub-band, each
from its own rows of that kind (`python -m benchmarks.residuals`): a plan takes the sub-band of its model's kind (the
model errs differently on mixture-of-experts runs), else the GPU's band of all rows.

The interval from n rows is a distribution-free prediction interval from order statistics
(Hahn & Meeker, Statistical Intervals, 1991, Sec. 5.4): with the errors sorted, x_(j) .. x_(n+1-j)
holds the error of one more run like them with probability (n + 1 - 2j) / (n + 1). j is the largest
that keeps that at least TARGET_COVERAGE, and at least 1 (the full range: few rows give a band of
lower coverage, and `coverage` says so). The rows' own in-sample fit residuals are never used.

A GPU without end-to-end runs of its own gets the band of the GPUs that have them, widened
(`widened`): both edges times WIDEN_FACTOR, and at least WIDEN_FLOOR either way. A GPU whose
profile has no residuals at all gets +-NO_RESIDUALS_ERROR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.specs.hardware import GpuSpec, StepTimeResiduals

#: The band's nominal coverage: about 4 in 5 real runs inside it.
TARGET_COVERAGE = 0.8
#: How much wider a GPU's band is when none of its own end-to-end runs checked the model. Estimate:
#: on the one GPU where a fit carried over from another GPU could be checked end to end (the A100 fit
#: on NeMo's DGX-H100 FP8 runs, `python -m benchmarks.accuracy`, before any H100-specific data),
#: the largest |error| was 24.5 %, about twice the A100 fit's largest on the A100 runs it did not see (11.3 %).
WIDEN_FACTOR = 2.0
#: Least half-width of a widened band, either way. Estimate: the same carried-over check's bias was
#: -12.1 % with errors up to -24.5 %; a GPU the model has never been checked on can be off by 20 %.
WIDEN_FLOOR = 0.20
#: Fewest rows of one model kind (dense or MoE) on a GPU that get a band of their own, and fewest
#: rows of any kind for a GPU's own band (with fewer it is banded as a GPU without runs). Estimate: with
#: five rows the order-statistic interval is the full range at a nominal coverage of 4 in 6; fewer
#: rows say too little, and the GPU's band of all rows is used.
MIN_KIND_ROWS = 5
#: Half-width of the band of a GPU whose profile has no residuals at all (a GPU file without a
#: calibration file): twice the widened floor, as nothing ties its constants to any measured run.
NO_RESIDUALS_ERROR = 2 * WIDEN_FLOOR


@dataclass(frozen=True)
class Interval:
    """A prediction interval of signed relative errors from n rows."""

    error_low: float
    error_high: float
    coverage: float
    n: int


def interval(errors: list[float], target: float = TARGET_COVERAGE) -> Interval:
    """The order-statistic prediction interval of `errors`, widened to contain 0.

    >>> i = interval([-0.10, -0.05, -0.02, 0.01, 0.04])
    >>> (i.error_low, i.error_high, round(i.coverage, 3))
    (-0.1, 0.04, 0.667)
    >>> interval([0.02, 0.03]).error_low
    0.0
    """
    xs = sorted(float(e) for e in errors)
    n = len(xs)
    if n == 0:
        raise ValueError("an interval needs at least one error")
    j = max(1, math.floor((1 - target) / 2 * (n + 1) + 1e-9))  # 1e-9: 0.1 * 30 is 2.9999... in floating point
    lo, hi = xs[j - 1], xs[n - j]
    return Interval(min(lo, 0.0), max(hi, 0.0), (n + 1 - 2 * j) / (n + 1), n)


def summarise(errors: list[float], tables: list[str], basis: str) -> StepTimeResiduals:
    """StepTimeResiduals of one GPU's own end-to-end rows (signed relative errors)."""
    iv = interval(errors)
    return StepTimeResiduals(
        end_to_end=True, n=iv.n, tables=tables, error_low=round(iv.error_low, 4), error_high=round(iv.error_high, 4),
        coverage=round(iv.coverage, 3), median_abs=round(_median([abs(e) for e in errors]), 4),
        mean_signed=round(sum(errors) / len(errors), 4), max_abs=round(max(abs(e) for e in errors), 4), basis=basis)


def widened(reference: StepTimeResiduals, reference_name: str, factor: float = WIDEN_FACTOR) -> StepTimeResiduals:
    """The band for a GPU with no end-to-end check: `reference`'s edges widened WIDEN_FACTOR times on
    the ratio scale (measured / predicted step time, so a fast edge of -50 % becomes -75 %, never
    -100 %), at least WIDEN_FLOOR either way; never narrower than the reference.

    >>> ref = StepTimeResiduals(end_to_end=True, n=29, error_low=-0.09, error_high=0.05, basis="x")
    >>> w = widened(ref, "a100-80gb")
    >>> (w.error_low, w.error_high, w.end_to_end)
    (-0.2, 0.2, False)
    """
    low = min((1 + reference.error_low) ** factor - 1, -WIDEN_FLOOR)
    high = max((1 + reference.error_high) ** factor - 1, WIDEN_FLOOR)
    basis = (f"no end-to-end check on this GPU: the band of {reference_name} (n={reference.n}) widened x{factor:g} on the ratio scale, "
             f"at least +-{WIDEN_FLOOR:.0%}")
    return StepTimeResiduals(end_to_end=False, n=reference.n, tables=list(reference.tables),
                             error_low=round(low, 4), error_high=round(high, 4), basis=basis)


def errors_of(gpu: GpuSpec, moe: bool | None = None) -> tuple[float, float, str]:
    """(error_low, error_high, basis) of `gpu`'s band; for a plan of a dense (`moe=False`) or a
    mixture-of-experts model (`moe=True`) the sub-band of that kind where the profile has one."""
    r = gpu.step_time_residuals
    if r is None:
        return (-NO_RESIDUALS_ERROR, NO_RESIDUALS_ERROR,
                f"no residuals in this GPU's profile: +-{NO_RESIDUALS_ERROR:.0%} (estimate)")
    sub = None if moe is None else (r.moe if moe else r.dense)
    if sub is not None:
        return sub.error_low, sub.error_high, band_basis(sub, "MoE" if moe else "dense")
    return r.error_low, r.error_high, band_basis(r)


def band_basis(r: StepTimeResiduals, kind: str = "") -> str:
    """One short line for a table or the JSON: where the band comes from."""
    if not r.end_to_end:
        return r.basis
    sets = ", ".join(t.split(" (")[0] for t in r.tables) or "published runs"
    of = f"{kind} runs of " if kind else ""
    return f"end-to-end residuals of {of}{sets} (n={r.n}, ~{r.coverage or TARGET_COVERAGE:.0%} band)"


def band_fields(step_time_s: float, tokens_per_s_per_gpu: float, mfu: float, gpu: GpuSpec,
                moe: bool | None = None) -> dict[str, float | str]:
    """The Estimate's band fields for one prediction on `gpu` (of a MoE model when `moe`)."""
    low, high, basis = errors_of(gpu, moe)
    # measured = predicted / (1 + e); no run beats the dense peak, so the fast edge stops at MFU 1
    step_low = max(step_time_s / (1.0 + high), step_time_s * min(mfu, 1.0))
    step_high = step_time_s / (1.0 + low)
    # rates scale as 1 / step; min and max keep the point inside its band where an edge is the point
    # itself (a residual of exactly 0), which the division can miss by a rounding
    slow, fast = step_time_s / step_high, step_time_s / step_low
    return {
        "step_time_s_low": min(step_low, step_time_s),
        "step_time_s_high": max(step_high, step_time_s),
        "tokens_per_s_per_gpu_low": min(tokens_per_s_per_gpu * slow, tokens_per_s_per_gpu),
        "tokens_per_s_per_gpu_high": max(tokens_per_s_per_gpu * fast, tokens_per_s_per_gpu),
        "mfu_low": min(mfu * slow, mfu),
        "mfu_high": max(mfu * fast, mfu),
        "band_basis": basis,
    }


def overlaps_best(step_time_s_low: list[float], step_time_s_high: list[float]) -> list[bool]:
    """Per plan (best first): whether its step-time band overlaps the best plan's (the best itself
    included): the model cannot tell it from the best, so a real run should decide.

    >>> overlaps_best([0.9, 1.0, 1.3], [1.2, 1.4, 1.6])
    [True, True, False]
    """
    if not step_time_s_low:
        return []
    lo0, hi0 = step_time_s_low[0], step_time_s_high[0]
    return [lo <= hi0 and lo0 <= hi for lo, hi in zip(step_time_s_low, step_time_s_high)]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
