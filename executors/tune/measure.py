"""One trial's measurement: a short profiled run of one strategy, judged for a busy host.

A trial is `executors.validate.validate_strategies` on one strategy: the executor runs the
parity steps (checked against a single-process reference, computed once per process and
model), drops the warm-up steps, and times `timed_steps` steps; their median is the step time
and their spread is kept. The host's load average is read around the run
(`executors.host_load`, as `meshplan validate` reads it). A run taken on a busy host, or whose steps spread wider than the
prediction's error band, is run once more; the faster of the two is kept (other processes
only ever add time). If the second is still flagged, the measurement counts `BUSY_WEIGHT`
in the calibration fit.
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from executors.results import ParityReference
from executors.validate import ValidateOptions, validate_strategies
from planner.specs import ClusterSpec, ModelSpec, Strategy, TrainSpec

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
         on_event: Callable[[str, dict[str, Any]], None] | None) -> Measurement:
    """One run; its host load and spread as validate judged them (`executors.compare`: the load
    sampled around the launch itself, this process's own earlier runs discounted)."""
    report = validate_strategies([st], model, cluster, train, num_gpus, options, labels=[label], on_event=on_event,
                                 references=references)
    run, c = report.runs[0], report.comparisons[0]
    load = c.host_load
    busy, why = c.busy, (load.reason if load is not None and load.busy else "")
    if run.outcome == "ok" and c.step_spread_exceeds_band:
        busy = True
        why = "; ".join(filter(None, [why, f"its {len(run.step_times_s)} timed steps spread "
                                           f"{100 * c.step_spread:.0f}%, wider than the prediction's error band"]))
    parity = run.parity.max_rel_error if run.parity is not None else None
    return Measurement(outcome=run.outcome, reason=run.reason, step_s=run.step_time_s,
                       step_times_s=list(run.step_times_s), spread=c.step_spread,
                       peak_memory_bytes=run.peak_memory_bytes,
                       load_before=load.load_before if load is not None else 0.0,
                       load_after=load.load_after if load is not None else 0.0, busy=busy, busy_reason=why,
                       wall_s=run.wall_s, parity_max_rel_error=parity)


def measure(st: Strategy, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_gpus: int,
            options: ValidateOptions, label: str, references: dict[str, tuple[ParityReference | None, str]],
            on_event: Callable[[str, dict[str, Any]], None] | None = None, repeat_busy: bool = True) -> Measurement:
    """Run `st` (module docstring), repeated once when the host was busy or the steps spread wider
    than its prediction's error band (unless `repeat_busy` is False: then a flagged run is weighted down)."""
    first = _one(st, model, cluster, train, num_gpus, options, label, references, on_event)
    if first.outcome != "ok" or not first.busy:
        return first
    if not repeat_busy:
        return first.model_copy(update={"weight": BUSY_WEIGHT})
    second = _one(st, model, cluster, train, num_gpus, options, label + " (repeat)", references, on_event)
    if second.outcome != "ok":
        return first.model_copy(update={"repeated": True, "weight": BUSY_WEIGHT,
                                        "busy_reason": first.busy_reason + f"; the repeat ended {second.outcome}"})
    kept = min((first, second), key=lambda m: m.step_s)
    weight = BUSY_WEIGHT if second.busy else 1.0
    reason = first.busy_reason + ("; still flagged when repeated: " + second.busy_reason if second.busy
                                  else "; the repeat was quiet")
    return kept.model_copy(update={"repeated": True, "weight": weight, "busy": second.busy, "busy_reason": reason,
                                   "wall_s": first.wall_s + second.wall_s})
