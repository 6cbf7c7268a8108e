"""One trial's measurement: a short profiled run of one strategy, judged for a busy host.

A trial is `executors.validate.validate_strategies` on one strategy: the executor runs the
parity steps (checked against a single-process reference, computed once per process and
model), drops the warm-up steps, and times `timed_steps` steps; their median is the step time
and their spread is kept. The host's load average is read before and after
(`executors.host_load`). A run taken on a busy host, or whose steps spread wider than the
prediction's error band, is run once more; the faster of the two is kept (other processes
only ever add time). If the second is still flagged, the measurement counts `BUSY_WEIGHT`
in the calibration fit.
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from executors.host_load import cores_in_use, judge_load, sample_load, spread_too_wide, step_spread
from executors.results import ParityReference
from executors.validate import ValidateOptions, validate_strategies
from planner.specs import ClusterSpec, Estimate, ModelSpec, Strategy, TrainSpec

BUSY_WEIGHT = 0.25
"""Weight of a measurement still flagged after its repeat, in the calibration fit (its residual
counts sqrt(0.25) = half): a busy host inflates the step by an unknown amount, so such a trial
informs the fit less but is not thrown away (on a shared machine it may be all there is)."""


class Measurement(BaseModel):
    """What one trial measured (times in seconds, memory in bytes)."""

    model_config = ConfigDict(frozen=True)

    outcome: str  # ok, wrong, oom, timeout, crashed, unsupported (executors.results.Outcome)
    reason: str = ""
    step_s: float | None = None
    step_times_s: list[float] = []
    spread: float | None = None
    peak_memory_bytes: float | None = None
    load_before: float = 0.0
    load_after: float = 0.0
    busy: bool = False
    busy_reason: str = ""
    repeated: bool = False
    weight: float = 1.0
    wall_s: float = 0.0
    parity_max_rel_error: float | None = None


def _one(st: Strategy, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_gpus: int,
         options: ValidateOptions, label: str, references: dict[str, tuple[ParityReference | None, str]],
         on_event: Callable[[str, dict[str, Any]], None] | None, band: tuple[float, float] | None) -> Measurement:
    before = sample_load()
    report = validate_strategies([st], model, cluster, train, num_gpus, options, labels=[label], on_event=on_event,
                                 references=references)
    after = sample_load()
    run = report.runs[0]
    spread = step_spread(run.step_times_s)
    load = judge_load(before, after, cores_in_use(num_gpus))
    busy, why = load.busy, load.reason
    if run.outcome == "ok" and band is not None and spread_too_wide(spread, *band):
        busy = True
        why = "; ".join(filter(None, [why, f"its {len(run.step_times_s)} timed steps spread {100 * spread:.0f}%, "
                                           f"wider than the prediction's error band ({100 * band[0]:+.0f}% to "
                                           f"{100 * band[1]:+.0f}%)"]))
    parity = run.parity.max_rel_error if run.parity is not None else None
    return Measurement(outcome=run.outcome, reason=run.reason, step_s=run.step_time_s,
                       step_times_s=list(run.step_times_s), spread=spread, peak_memory_bytes=run.peak_memory_bytes,
                       load_before=before, load_after=after, busy=busy, busy_reason=why, wall_s=run.wall_s,
                       parity_max_rel_error=parity)


def band_of(estimate: Estimate | None) -> tuple[float, float] | None:
    """The prediction's error band as relative errors (low <= 0 <= high), None without one."""
    if estimate is None or estimate.step_time_s_low is None or estimate.step_time_s_high is None:
        return None
    return estimate.step_time_s_low / estimate.step_time_s - 1, estimate.step_time_s_high / estimate.step_time_s - 1


def measure(st: Strategy, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_gpus: int,
            options: ValidateOptions, label: str, references: dict[str, tuple[ParityReference | None, str]],
            estimate: Estimate | None = None,
            on_event: Callable[[str, dict[str, Any]], None] | None = None, repeat_busy: bool = True) -> Measurement:
    """Run `st` (module docstring), repeated once when the host was busy or the steps spread wider
    than `estimate`'s band (unless `repeat_busy` is False: then a flagged run is weighted down)."""
    band = band_of(estimate)
    first = _one(st, model, cluster, train, num_gpus, options, label, references, on_event, band)
    if first.outcome != "ok" or not first.busy:
        return first
    if not repeat_busy:
        return first.model_copy(update={"weight": BUSY_WEIGHT})
    second = _one(st, model, cluster, train, num_gpus, options, label + " (repeat)", references, on_event, band)
    if second.outcome != "ok":
        return first.model_copy(update={"repeated": True, "weight": BUSY_WEIGHT,
                                        "busy_reason": first.busy_reason + f"; the repeat ended {second.outcome}"})
    kept = min((first, second), key=lambda m: m.step_s)
    weight = BUSY_WEIGHT if second.busy else 1.0
    reason = first.busy_reason + ("; still flagged when repeated: " + second.busy_reason if second.busy
                                  else "; the repeat was quiet")
    return kept.model_copy(update={"repeated": True, "weight": weight, "busy": second.busy, "busy_reason": reason,
                                   "wall_s": first.wall_s + second.wall_s})
