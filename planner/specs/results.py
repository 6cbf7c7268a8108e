"""Estimate, Plan and PlanResult: what the cost model and the search return.

`--format json` prints `PlanResult.model_dump(mode="json")`; field names are the
public contract (DESIGN.md) and are never renamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from planner.errors import SpecError
from planner.show import plots
from planner.show.compare import Comparison, compare_estimates
from planner.show.html import html_table, lines_html
from planner.show.labels import plan_table, stats_lines
from planner.show.labels import plans_shown

from planner.specs.hardware import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.strategy import Strategy
from planner.specs.train import TrainSpec

#: Rounding slack when checking that a band contains its point estimate (relative).
BAND_TOLERANCE = 1e-9
#: Default memory safety margin of `plan()`: the share of each GPU's memory a plan must leave free.
#: Estimate: PyTorch's caching-allocator fragmentation and the CUDA context and NCCL buffers, which the
#: memory model does not itemise, take a few GiB of an 80 GiB GPU in Megatron-LM runs.
DEFAULT_HEADROOM = 0.05


class GroupLink(BaseModel):
    """Where one parallel dimension's groups sit on the cluster's fabric: the link tier their collectives
    cross and the bus bandwidth each group gets there with every group of the dimension running at once
    (cost_models.placement)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dim: str = Field(description="The dimension: tp, cp, dp (the data-parallel / ZeRO group, dp·cp), pp, ep, edp.")
    size: int = Field(description="Ranks in one group.")
    stride: int = Field(description="Rank distance between neighbours of a group (from the rank order).")
    collective: str = Field(description="What the group runs: all_reduce, all_gather / reduce_scatter, "
                            "all_to_all or send_recv.")
    tier: str = Field(description="The link the traffic crosses: the NVLink tier's name inside one domain, else "
                      "the scale-out tier's across the highest fabric level the group spans (e.g. 'roce-400g "
                      "across pod').")
    level: str | None = Field(description="The highest fabric level the group spans (None: inside one NVLink domain).")
    bus_bw_bytes_per_s: float = Field(description="Bus bandwidth one group gets (a send/recv: one transfer's "
                                      "rate), bytes/s, at the tiers' efficiencies (large messages).")
    limited_by: str = Field(description="What sets that bandwidth: nvlink, or the fabric level whose share is "
                            "the smallest.")
    shares_bytes_per_s: dict[str, float] = Field(default_factory=dict, description="Per crossed fabric level, the "
                                                 "bandwidth one group gets there.")


class StageEstimate(BaseModel):
    """One pipeline rank of a plan: its layers, one micro-batch's time there and its memory
    (cost_models.step.stage_breakdown). The schedule and memory-per-stage pictures draw these."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pipeline_rank: int = Field(description="0 = the first stage.")
    layers: int = Field(description="Transformer layers on the rank (all its virtual chunks).")
    forward_s: float = Field(description="One micro-batch's forward through the rank's layers, seconds (all "
                             "chunks; exposed TP/CP/EP exchanges and the output layer included).")
    backward_s: float = Field(description="One micro-batch's backward there, seconds (recomputation included).")
    memory_bytes: dict[str, float] = Field(description="Peak-memory breakdown of one rank of this stage, bytes.")
    peak_memory_bytes: float = Field(description="Peak memory of one rank of this stage, bytes.")


class Estimate(BaseModel):
    """What the cost model predicts for one strategy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_time_s: float = Field(description="Seconds per optimizer step.")
    tokens_per_s: float = Field(description="Training tokens per second, whole job.")
    tokens_per_s_per_gpu: float = Field(description="Training tokens per second per GPU.")
    model_tflops_per_gpu: float = Field(description="Model TFLOP/s per GPU (6·N·T-style count, recompute excluded).")
    hardware_tflops_per_gpu: float = Field(description="Hardware TFLOP/s per GPU (recompute included).")
    mfu: float = Field(description="Model FLOPs utilisation: model FLOP/s ÷ dense peak (0..1).")
    peak_memory_bytes: float = Field(description="Peak memory of the most-loaded rank, bytes.")
    memory_capacity_bytes: float = Field(description="Usable memory per GPU, bytes (HBM capacity).")
    memory_bytes: dict[str, float] = Field(description="Peak-memory breakdown of the most-loaded rank, bytes per term.")
    time_s: dict[str, float] = Field(description="Step-time breakdown, seconds per term (exposed time only).")
    binding_stage: str = Field(description="Pipeline stage that binds memory: first, middle or last.")
    binding_pipeline_rank: int = Field(0, description="Pipeline rank (0 = first stage) of the stage that binds memory.")
    binding_memory_term: str = Field(description="Largest term of the memory breakdown.")
    num_microbatches: int = Field(description="Micro-batches per step per pipeline.")
    bubble_fraction: float = Field(description="Pipeline bubble ÷ ideal compute time: (pp-1)/(vpp·m).")
    comm_hidden_fraction: float = Field(
        0.0, description="Share of the step's communication the prediction assumes hidden behind compute (0..1); "
        "near 1 the prediction rests on overlap that real runs may not reach.")
    fits: bool = Field(description="The strategy is valid and its peak memory fits in the GPU's memory.")
    valid: bool = Field(True, description="The strategy breaks no rule (degrees, split, batch, experts); a valid "
                        "strategy may still not fit.")
    reasons: list[str] = Field(default_factory=list, description="Why the strategy is invalid or does not fit; empty when it does.")
    settings: dict[str, Any] = Field(
        default_factory=dict, description="Training settings the planner chose for this plan because the input left "
        "them free (planner.knobs: gradient precision, FP8 parameter gather, dispatcher, ...), with their values; "
        "empty when every one was given.")
    # ---- error band (planner.error_band): where a real run may land, from the GPU profile's residuals ----
    step_time_s_low: float | None = Field(
        None, description="Fast edge of the step-time band, seconds (<= step_time_s); None only for an Estimate "
        "built by hand.")
    step_time_s_high: float | None = Field(None, description="Slow edge of the step-time band, seconds (>= step_time_s).")
    tokens_per_s_per_gpu_low: float | None = Field(
        None, description="Low edge of the tokens/s/GPU band (from step_time_s_high).")
    tokens_per_s_per_gpu_high: float | None = Field(
        None, description="High edge of the tokens/s/GPU band (from step_time_s_low).")
    mfu_low: float | None = Field(None, description="Low edge of the MFU band (from step_time_s_high).")
    mfu_high: float | None = Field(None, description="High edge of the MFU band (from step_time_s_low).")
    band_basis: str = Field("", description="Where the band comes from: the published end-to-end runs whose "
                            "residuals set it, or the rule that widened it for a GPU without such runs.")
    finetune: dict[str, float] = Field(
        default_factory=dict, description="Adapter plans (TrainSpec.finetune lora or qlora): what the frozen base and "
        "the adapters cost in one step on one rank (cost_models.step.adapter_breakdown): trainable_params, "
        "layers_without_backward (below the lowest adapted layer), base_forward_s, input_gradients_s (the frozen "
        "layers' backward), weight_gradients_skipped_s (what full training would add), adapters_s, "
        "dequantisation_s; empty otherwise.")
    stages: list[StageEstimate] = Field(default_factory=list, description="Per pipeline rank, first to last: layers, "
                                        "one micro-batch's forward and backward time, memory (`evaluate`, `explain` "
                                        "and each ranked plan fill it; empty in a file written before it existed).")
    groups: list[GroupLink] = Field(default_factory=list, description="Per parallel dimension of more than one "
                                    "rank, the link its groups cross and the bandwidth they get (`evaluate` and "
                                    "`explain` fill it; the ranked plans of `plan` leave it empty).")

    @model_validator(mode="after")
    def _band_contains_point(self) -> "Estimate":
        for name, point in (("step_time_s", self.step_time_s), ("tokens_per_s_per_gpu", self.tokens_per_s_per_gpu),
                            ("mfu", self.mfu)):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if (low is None) != (high is None):
                raise ValueError(f"{name}_low and {name}_high must be given together")
            if low is not None and not (low <= point * (1 + BAND_TOLERANCE) and point <= high * (1 + BAND_TOLERANCE)):
                raise ValueError(f"the band {name}_low ({low}) .. {name}_high ({high}) must contain {name} ({point})")
        return self


class Folded(BaseModel):
    """Near-duplicates shown as one plan row: the same layout, with knobs that change the step time by
    less than planner.ranking.FOLD_FRACTION. The row's `strategy` is one concrete member."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_plans: int = Field(description="Plans folded into the row, the shown one included.")
    zero_stages: list[int] = Field(description="ZeRO stages among them, ascending.")
    recompute_num_layers: list[int | None] = Field(
        description="Recomputed layers per chunk among them (None = all, or no full recompute), ascending.")
    step_time_s_min: float = Field(description="Fastest predicted step among them, seconds.")
    step_time_s_max: float = Field(description="Slowest predicted step among them, seconds.")
    peak_memory_bytes_min: float = Field(description="Lowest peak memory among them, bytes.")

    def zero_label(self) -> str:
        """`1-2` for stages 1 and 2, `0,2` for 0 and 2, `1` for one stage."""
        z = self.zero_stages
        if len(z) > 1 and z == list(range(z[0], z[-1] + 1)):
            return f"{z[0]}-{z[-1]}"
        return ",".join(map(str, z))

    def layers_label(self) -> str:
        """`1..6` for a range of recomputed layer counts; empty when there is none."""
        n = [v for v in self.recompute_num_layers if v is not None]
        if len(self.recompute_num_layers) < 2 or not n:
            return ""
        top = "all" if None in self.recompute_num_layers else str(n[-1])
        return f"{n[0]}..{top}"


class Rejection(BaseModel):
    """How many candidates one rule rejected, with the rule's message for one of them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rule: str = Field(description="The rule's key (planner.rules.RULES).")
    count: int = Field(description="Candidates it rejected (each counted under the first rule it breaks).")
    example: str = Field(description="The rule's message for one rejected candidate.")


class Plan(BaseModel):
    """A ranked strategy with its estimate and the inputs it was made for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(description="1 = fastest feasible strategy.")
    strategy: Strategy = Field(description="The parallel layout.")
    estimate: Estimate = Field(description="The cost model's prediction.")
    model: ModelSpec = Field(description="The model the plan is for.")
    cluster: ClusterSpec = Field(description="The cluster the plan is for.")
    train: TrainSpec = Field(description="Batch, sequence and precision the plan is for.")
    num_gpus: int = Field(description="GPUs the plan uses.")
    folded: Folded | None = Field(
        None, description="Near-duplicates folded into this row (same layout, ZeRO stage or recomputed layer count "
        "changing nothing within planner.ranking.FOLD_FRACTION); None when the row stands alone.")


    def compare(self, other: "Plan", a: str | None = None, b: str | None = None) -> Comparison:
        """This plan (A) against `other` (B): both breakdowns side by side and, in words, what the slower one
        loses to term by term (planner.show.compare). Labels default to the plans' ranks (`#1`, `#3`), or A and B
        where the ranks are equal."""
        if not isinstance(other, Plan):
            raise SpecError(f"compare takes another Plan (got {type(other).__name__})")
        same = self.rank == other.rank
        return compare_estimates(self.estimate, other.estimate, a or ("A" if same else f"#{self.rank}"),
                                 b or ("B" if same else f"#{other.rank}"), self.strategy, other.strategy)

    def plot_memory(self, path: str | None = None, headroom: float = DEFAULT_HEADROOM):
        """Memory by term on each pipeline rank, with the GPU's capacity and the limit `plan` keeps
        (planner.show.plots.memory_stages); a matplotlib Figure, also written to `path` (.png or .svg)."""
        return plots.memory_stages(self, headroom=headroom, path=path)

    def plot_schedule(self, path: str | None = None, max_microbatches: int | None = None):
        """The pipeline schedule (1F1B or interleaved) from the per-rank times, the bubble visible
        (planner.show.plots.schedule); a matplotlib Figure, also written to `path` (.png or .svg)."""
        return plots.schedule(self, max_microbatches=max_microbatches, path=path)


class SearchStats(BaseModel):
    """How the search went."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_candidates: int = Field(description="Strategies enumerated and evaluated.")
    num_valid: int = Field(description="Strategies passing the divisibility and support rules.")
    num_feasible: int = Field(description="Valid strategies that fit in memory.")
    rejected: dict[str, int] = Field(description="Rejected candidates counted by reason.")
    search_time_s: float = Field(description="Wall time of enumeration, evaluation and ranking, seconds.")


#: The reason code of a candidate that fits (`Candidates.reason`).
FITS = 0


@dataclass(frozen=True, eq=False)
class Candidates:
    """Every valid candidate one search scored, as arrays (one entry per candidate): what a scatter of speed
    against memory, the rejections by reason and their nearest misses need. Held by the `PlanResult` the search
    returns (`PlanResult.candidates`), never written to its JSON: a search may score millions.

    A candidate over the memory limit is not timed (its `step_time_s` is infinite): the search scores the time
    of those that fit only, and its memory says why it does not."""

    #: The candidates' Strategy fields as columns (cost_models.arrays.StrategyArrays: `.row(i)`, `.tp`, ...).
    strategies: Any
    step_time_s: np.ndarray
    peak_memory_bytes: np.ndarray
    #: Training-settings variant of each candidate: `trains[variant[i]]` is its TrainSpec (planner.knobs).
    variant: np.ndarray
    trains: list
    time_s: dict[str, np.ndarray]
    memory_bytes: dict[str, np.ndarray]
    model_flop_per_step: np.ndarray
    #: Index into `reason_labels`: FITS (0) for a plan that fits under the limit, else why it does not (the keys
    #: of SearchStats.rejected, e.g. "memory (activations largest)").
    reason: np.ndarray
    reason_labels: tuple[str, ...]
    #: Host memory of each candidate's offloaded optimizer per GPU (0 without offload), and the host's per GPU.
    host_memory_bytes: np.ndarray
    host_capacity_bytes: float
    memory_limit_bytes: float
    memory_capacity_bytes: float
    peak_flop_per_s: float
    num_gpus: int
    tokens_per_step: int
    #: The constraints the search ran under (as given to `plan`).
    constraints: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.step_time_s)

    @property
    def fits(self) -> np.ndarray:
        return self.reason == FITS

    @property
    def tokens_per_s_per_gpu(self) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.where(np.isfinite(self.step_time_s), self.tokens_per_step / self.step_time_s / self.num_gpus, 0.0)

    @property
    def mfu(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(np.isfinite(self.step_time_s), self.model_flop_per_step / self.step_time_s
                            / self.num_gpus / self.peak_flop_per_s, 0.0)

    def term(self, name: str, memory: bool = False) -> np.ndarray:
        """One time (or memory) term of every candidate, as a full-length array."""
        source = self.memory_bytes if memory else self.time_s
        return np.broadcast_to(source[name], (len(self),))

    def strategy(self, i: int):
        """Candidate i as a Strategy."""
        return Strategy(**self.strategies.row(int(i)))

    def pareto(self) -> np.ndarray:
        """Indices of the fitting candidates no other fitting one beats on both speed and memory (faster and no
        more memory, or less memory and no slower), by ascending peak memory."""
        idx = np.flatnonzero(self.fits)
        if not len(idx):
            return idx
        order = idx[np.lexsort((self.step_time_s[idx], self.peak_memory_bytes[idx]))]
        best = np.minimum.accumulate(self.step_time_s[order])
        keep = np.concatenate([[True], self.step_time_s[order][1:] < best[:-1]])
        return order[keep]


class PlanResult(BaseModel):
    """The ranked plans for one (model, cluster, GPU count, training) question."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plans: list[Plan] = Field(description="Best first; at most top_k.")
    closest: list[Plan] = Field(
        default_factory=list, description="When nothing fits: the valid strategies that came closest to fitting."
    )
    worth_a_real_run: list[int] = Field(
        default_factory=list, description="Ranks of the plans whose step-time band overlaps the best plan's (rank 1 "
        "included): the cost model cannot order them, so short real runs (`meshplan tune`, which runs them first, "
        "or `meshplan validate`) should.")
    stats: SearchStats = Field(description="Counts and timing of the search.")
    model: ModelSpec = Field(description="The model planned for.")
    cluster: ClusterSpec = Field(description="The cluster planned for.")
    train: TrainSpec = Field(description="Batch, sequence and precision planned for.")
    num_gpus: int = Field(description="GPUs in the job.")
    headroom: float = Field(DEFAULT_HEADROOM, description="Memory safety margin the plans keep free: a plan fits "
                            "when its peak memory is at most capacity * (1 - headroom).")
    min_gpus_to_fit: int | None = Field(
        None, description="When nothing fits: the smallest GPU count tried (`min_gpus_searched`) at which a plan "
        "fits; None when something fits, or none of the counts tried does.")
    min_gpus_searched: list[int] = Field(
        default_factory=list, description="When nothing fits: the GPU counts tried for `min_gpus_to_fit`, ascending.")
    advice: list[str] = Field(
        default_factory=list, description="When nothing fits: what would make a plan fit, from the closest plan's "
        "memory breakdown (the term that binds and the knobs that shrink it and are not at their limit).")
    rejections: list[Rejection] = Field(
        default_factory=list, description="When no strategy is valid: every rule that rejected candidates, with "
        "counts, most first.")
    _candidates: Candidates | None = PrivateAttr(default=None)

    @property
    def candidates(self) -> Candidates:
        """Every valid candidate the search scored (`Candidates`); kept by the search that made this result, not
        by its JSON: a result read back from a file refuses, as does one whose search found no valid candidate."""
        if self._candidates is None:
            raise SpecError("this result holds no candidate table: every candidate's figures are kept only by the "
                            "search that made it (plan()), not in its JSON; run the search again")
        return self._candidates

    @property
    def has_candidates(self) -> bool:
        return self._candidates is not None

    def plan_at(self, rank: int = 1) -> Plan:
        """The ranked plan of this rank (the closest candidate of this rank when nothing fits)."""
        shown = plans_shown(self)
        for p in shown:
            if p.rank == rank:
                return p
        which = "ranked plans" if self.plans else "closest candidates"
        ranks = ", ".join(str(p.rank) for p in shown) or "none"
        raise SpecError(f"rank ({rank!r}) names no plan: the {which} have ranks {ranks}")

    def plot_pareto(self, path: str | None = None):
        """Tokens/s/GPU against peak memory for every fitting candidate, the Pareto front, the memory limit and
        the ranked plans (planner.show.plots.pareto); needs the candidate table (not kept in JSON)."""
        return plots.pareto(self, path=path)

    def plot_breakdown(self, top: int = 5, path: str | None = None):
        """Stacked bars of the first `top` plans' step-time terms (planner.show.plots.breakdown)."""
        return plots.breakdown(self, top=top, path=path)

    def plot_memory(self, rank: int = 1, path: str | None = None):
        """Memory by term per pipeline rank of plan `rank`, with this search's limit."""
        return plots.memory_stages(self.plan_at(rank), headroom=self.headroom, path=path)

    def plot_schedule(self, rank: int = 1, path: str | None = None, max_microbatches: int | None = None):
        """The pipeline schedule of plan `rank` (planner.show.plots.schedule)."""
        return plots.schedule(self.plan_at(rank), max_microbatches=max_microbatches, path=path)

    def _repr_html_(self) -> str:
        """The ranked table (or the closest candidates) with its legend, as a notebook shows a result: the cells
        the CLI prints (planner.show.labels)."""
        from_question = f"{self.model.name} on {self.num_gpus} x {self.cluster.gpu.name} ({self.cluster.name})"
        return (lines_html([from_question]) + html_table(plan_table(self, wide=True))
                + lines_html(stats_lines(self)))

    def __eq__(self, other: object) -> bool:
        """Equal fields (the candidate table, which JSON does not keep, is not compared)."""
        if not isinstance(other, PlanResult):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = BaseModel.__hash__
