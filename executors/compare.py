"""Prediction next to measurement (no torch).

Step time: the plan's `Estimate.step_time_s` against the median timed step of
the slowest rank. Memory: the estimate's peak minus its runtime terms
(`cost_models.memory.RUNTIME_TERMS`: the flat `framework_reserve`, or the CUDA
context, NCCL buffers and allocator slack; the worker measures allocated tensors
above its baseline) against the largest per-rank peak. Errors are signed, relative to
the measurement: (predicted - measured) / measured.

Ranks are compared among the plans that ran `ok`: the predicted rank orders
them by predicted step time, the measured rank by measured step time.

Host load: a run measured while other processes competed for its cores
(`executors.host_load`) is flagged `busy`; its step time is inflated by them, so its
error overstates the model's. The median step-time error is given over every ok run
and, apart, over the ok runs taken on a quiet host.
"""

from __future__ import annotations

import statistics

from pydantic import BaseModel, ConfigDict, Field

from cost_models.finetune import adapter_params
from cost_models.memory import RUNTIME_TERMS
from executors.host_load import HostLoad, spread_too_wide, step_spread
from executors.results import Outcome, ParityCheck, RunResult
from planner.show import plots
from planner.show.html import html_table, lines_html
from planner.show.labels import validation_table
from planner.specs import Estimate, ModelSpec, Strategy, TrainSpec


class PlanComparison(BaseModel):
    """One validated plan: what was predicted, what was measured."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(description="Run label.")
    strategy: Strategy = Field(description="The strategy.")
    outcome: Outcome = Field(description="Run outcome (see executors.results.Outcome).")
    reason: str = Field("", description="Why the outcome is not ok.")
    predicted_step_time_s: float | None = Field(None, description="Estimate.step_time_s, seconds.")
    measured_step_time_s: float | None = Field(None, description="Median timed step of the slowest rank, seconds.")
    step_time_error: float | None = Field(None, description="(predicted - measured) / measured.")
    predicted_memory_bytes: float | None = Field(None, description="Estimate peak minus its runtime terms, bytes.")
    measured_memory_bytes: float | None = Field(None, description="Largest per-rank training peak, bytes.")
    memory_error: float | None = Field(None, description="(predicted - measured) / measured.")
    predicted_fits: bool | None = Field(None, description="Estimate.fits.")
    predicted_rank: int | None = Field(None, description="Rank by predicted step time among the plans that ran ok.")
    measured_rank: int | None = Field(None, description="Rank by measured step time among the plans that ran ok.")
    parity: ParityCheck | None = Field(None, description="Loss parity against the single-process reference.")
    time_s: dict[str, float] = Field(default_factory=dict, description="Predicted step-time breakdown, seconds.")
    notes: list[str] = Field(default_factory=list, description="Deviations of the run from the plan.")
    step_spread: float | None = Field(None, description="(max - min) / median of the timed steps (each the slowest "
                                      "rank's); None with fewer than 2 timed steps.")
    step_spread_exceeds_band: bool | None = Field(
        None, description="The step spread is wider than the prediction's error band (Estimate.step_time_s_low .. "
        "step_time_s_high as relative errors): the run's own steps disagree by more than the prediction claims to "
        "be right. None without a spread or a band.")
    measured_trainable_params: int | None = Field(
        None, description="Parameter elements the run trained (requires_grad, whole model; under finetune lora "
        "the adapters peft added): RankResult.num_trainable_params of its ranks. None when no rank reported.")
    predicted_trainable_params: int | None = Field(
        None, description="Finetune lora / qlora: the planner's adapter parameter count (cost_models.finetune."
        "adapter_params); None for other plans.")
    busy: bool = Field(False, description="Measured while other processes competed for the run's cores "
                       "(host_load.reason says how): its step time is inflated by them.")
    host_load: HostLoad | None = Field(None, description="The host's load around the run; None when it was not "
                                       "launched here.")


class HostSummary(BaseModel):
    """The host's load over the runs of one validation."""

    model_config = ConfigDict(extra="forbid")

    cpu_count: int = Field(description="Logical cores of the host.")
    max_load: float = Field(description="Highest 1-minute load average sampled before or after a run.")
    num_runs_sampled: int = Field(description="Runs launched here, with the load sampled around them.")
    num_busy_runs: int = Field(description="Of those, runs taken while other processes competed for their cores.")


class ValidationReport(BaseModel):
    """Every validated plan, and how well the prediction ranked them."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSpec = Field(description="The model that was run (before per-plan untying).")
    cluster: str = Field(description="Cluster profile the predictions used.")
    train: TrainSpec = Field(description="Batch, sequence, precision, optimizer.")
    num_gpus: int = Field(description="Ranks per run.")
    device: str = Field(description="cpu (gloo) or cuda (NCCL).")
    engine: str = Field(description="torch, megatron or deepspeed.")
    comparisons: list[PlanComparison] = Field(description="In the order the plans were given.")
    median_abs_step_time_error: float | None = Field(None, description="Median |step_time_error| over ok runs.")
    median_abs_step_time_error_quiet: float | None = Field(
        None, description="Median |step_time_error| over the ok runs not taken on a busy host (None when there is "
        "none, or the load was not sampled: runs collected with --collect).")
    median_abs_memory_error: float | None = Field(None, description="Median |memory_error| over ok runs.")
    measured_best: str | None = Field(None, description="Label of the fastest measured plan.")
    measured_best_predicted_rank: int | None = Field(None, description="Its rank by prediction among the ok plans.")
    measured_best_in_predicted_top2: bool | None = Field(None, description="measured_best_predicted_rank <= 2.")
    runs: list[RunResult] = Field(default_factory=list, description="The raw run results.")
    host: HostSummary | None = Field(None, description="The host's load over the runs; None when no run was "
                                     "launched here.")

    def _repr_html_(self) -> str:
        """The runs' table as a notebook shows it: the cells `meshplan validate` prints (planner.show.labels)."""
        lines = [f"median |step-time error| {100 * self.median_abs_step_time_error:.1f}%"
                 if self.median_abs_step_time_error is not None else "no run finished ok"]
        lines += [f"#{i} {c.outcome}: {c.reason}" for i, c in enumerate(self.comparisons, start=1) if c.outcome != "ok"]
        return html_table(validation_table(self)) + lines_html(lines)

    def plot(self, path: str | None = None):
        """Predicted against measured step time of every run that finished ok (planner.show.plots); a matplotlib
        Figure, also written to `path` (.png or .svg)."""
        pairs = [(c.label, c.predicted_step_time_s, c.measured_step_time_s) for c in self.comparisons
                 if c.outcome == "ok"]
        err = self.median_abs_step_time_error
        title = (f"{self.model.name}: {self.num_gpus} ranks on {self.cluster} ({self.device}, {self.engine})"
                 + (f"; median |error| {100 * err:.1f}%" if err is not None else ""))
        return plots.predicted_vs_measured(pairs, title=title, path=path)


def _rel(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or meas <= 0:
        return None
    return (pred - meas) / meas


def predicted_adapter_params(model: ModelSpec, train: TrainSpec) -> int | None:
    """The planner's count of adapter parameter elements for a finetune lora / qlora plan
    (cost_models.finetune.adapter_params, what peft's get_nb_trainable_parameters reports); None for
    other plans, whose runs train every parameter."""
    return adapter_params(model, train) if train.adapters else None


def measured_trainable_params(run: RunResult) -> int | None:
    """What the run's ranks counted as trainable (they all build the same model; the first that reported)."""
    counts = [r.num_trainable_params for r in run.ranks if r.num_trainable_params]
    return counts[0] if counts else None


def compare_one(run: RunResult, estimate: Estimate | None, predicted_trainable: int | None = None) -> PlanComparison:
    """`predicted_trainable`: the planner's trainable parameter count to set beside the run's
    (predicted_adapter_params for LoRA plans)."""
    c = PlanComparison(label=run.label, strategy=run.strategy, outcome=run.outcome, reason=run.reason,
                       measured_step_time_s=run.step_time_s, measured_memory_bytes=run.peak_memory_bytes,
                       parity=run.parity, notes=run.notes, host_load=run.host_load,
                       busy=run.host_load is not None and run.host_load.busy,
                       measured_trainable_params=measured_trainable_params(run),
                       predicted_trainable_params=predicted_trainable)
    if run.outcome == "ok":
        c.step_spread = step_spread(run.step_times_s)
    if estimate is not None:
        c.predicted_step_time_s = estimate.step_time_s
        c.predicted_memory_bytes = estimate.peak_memory_bytes - sum(estimate.memory_bytes.get(t, 0.0) for t in RUNTIME_TERMS)
        c.predicted_fits = estimate.fits
        c.time_s = dict(estimate.time_s)
    if run.outcome == "ok":
        c.step_time_error = _rel(c.predicted_step_time_s, c.measured_step_time_s)
        c.memory_error = _rel(c.predicted_memory_bytes, c.measured_memory_bytes)
        band = error_band(estimate)
        if band is not None and c.step_spread is not None:
            c.step_spread_exceeds_band = spread_too_wide(c.step_spread, *band)
    return c


def error_band(estimate: Estimate | None) -> tuple[float, float] | None:
    """The estimate's step-time band as signed relative errors (predicted - measured) / measured:
    a run at step_time_s_high is p / high - 1 off, one at step_time_s_low p / low - 1."""
    if estimate is None or not estimate.step_time_s_low or not estimate.step_time_s_high:
        return None
    p = estimate.step_time_s
    # sorted: an Estimate's edges may pass its point by a rounding tolerance
    edges = sorted((p / estimate.step_time_s_high - 1, p / estimate.step_time_s_low - 1))
    return edges[0], edges[1]


def rank_and_summarise(comparisons: list[PlanComparison]) -> dict:
    """Fill predicted/measured ranks in place; return the report's summary fields."""
    ok = [c for c in comparisons if c.outcome == "ok" and c.predicted_step_time_s is not None]
    for i, c in enumerate(sorted(ok, key=lambda c: c.predicted_step_time_s), start=1):
        c.predicted_rank = i
    for i, c in enumerate(sorted(ok, key=lambda c: c.measured_step_time_s), start=1):
        c.measured_rank = i
    step_errs = [abs(c.step_time_error) for c in ok if c.step_time_error is not None]
    quiet_errs = [abs(c.step_time_error) for c in ok
                  if c.step_time_error is not None and c.host_load is not None and not c.busy]
    mem_errs = [abs(c.memory_error) for c in ok if c.memory_error is not None]
    best = next((c for c in ok if c.measured_rank == 1), None)
    return {
        "median_abs_step_time_error": statistics.median(step_errs) if step_errs else None,
        "median_abs_step_time_error_quiet": statistics.median(quiet_errs) if quiet_errs else None,
        "median_abs_memory_error": statistics.median(mem_errs) if mem_errs else None,
        "measured_best": best.label if best else None,
        "measured_best_predicted_rank": best.predicted_rank if best else None,
        "measured_best_in_predicted_top2": (best.predicted_rank <= 2) if best else None,
        "host": host_summary(comparisons),
    }


def host_summary(comparisons: list[PlanComparison]) -> HostSummary | None:
    """The load over the runs whose load was sampled; None when there is none."""
    loads = [c.host_load for c in comparisons if c.host_load is not None]
    if not loads:
        return None
    return HostSummary(cpu_count=max(h.cpu_count for h in loads),
                       max_load=max(max(h.load_before, h.load_after) for h in loads),
                       num_runs_sampled=len(loads), num_busy_runs=sum(h.busy for h in loads))
