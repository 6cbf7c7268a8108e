"""Capacity planning results: how many GPUs, how long, what it costs (planner.capacity, planner.goodput).

Units are SI: seconds, bytes, bytes/s, joules; rates per GPU-hour where the field says so.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from planner.specs.results import Plan


class Goodput(BaseModel):
    """The share of wall time a job spends on useful training when it checkpoints at the optimal interval and
    restarts after each failure (planner.goodput: Daly 2006's expected wall time under exponential failures)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_gpus: int = Field(description="GPUs in the job.")
    failure_rate_per_gpu_hour: float = Field(description="Job-interrupting failures per GPU-hour (lambda).")
    mtbf_s: float = Field(description="Mean time between failures of the whole job, seconds: 1 / (lambda x GPUs).")
    checkpoint_bytes: float = Field(description="Bytes one checkpoint saves: parameters x (16-bit weight + fp32 "
                                    "master + optimizer moments), the model state to resume from.")
    checkpoint_bw_bytes_per_s: float = Field(description="Write bandwidth of one checkpoint, bytes/s: per-node "
                                             "bandwidth x nodes, capped by the aggregate storage bandwidth if given.")
    checkpoint_s: float = Field(description="Seconds to write one checkpoint (delta).")
    restart_s: float = Field(description="Seconds from a failure to training again: the restart itself plus "
                             "reading the checkpoint back (at the write bandwidth).")
    interval_s: float = Field(description="Optimal compute time between checkpoints, seconds (Daly 2006's "
                              "higher-order estimate; Young 1974's sqrt(2 delta M) to first order).")
    young_interval_s: float = Field(description="Young 1974's first-order optimum sqrt(2 delta M), seconds.")
    fraction: float = Field(description="Goodput: useful time / expected wall time at interval_s (0..1).")


class CapacityRow(BaseModel):
    """One GPU count: its best plan and what training the token budget on it takes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_gpus: int = Field(description="GPUs in the job.")
    num_nodes: int = Field(description="Nodes the job occupies (GPUs / gpus_per_node, rounded up).")
    plan: Plan | None = Field(description="The best plan at this size (plan()'s rank 1); None when nothing fits "
                              "or no strategy is valid (`reason` says which).")
    reason: str | None = Field(None, description="Why there is no plan at this size; None when there is one.")
    step_time_s: float | None = Field(None, description="Predicted seconds per optimizer step of the best plan.")
    tokens_per_s: float | None = Field(None, description="Predicted training tokens per second, whole job.")
    mfu: float | None = Field(None, description="Model FLOPs utilisation of the best plan (0..1).")
    goodput: Goodput | None = Field(None, description="Time lost to failures and checkpoints at this size.")
    time_to_train_s: float | None = Field(
        None, description="Ideal seconds to train the token budget: tokens / tokens_per_s (no failure, no "
        "checkpoint); None without a token budget.")
    time_to_train_goodput_s: float | None = Field(
        None, description="Expected wall seconds to train the token budget: time_to_train_s / goodput.")
    gpu_hours: float | None = Field(None, description="GPU-hours held for the expected wall time (GPUs x "
                                    "time_to_train_goodput_s / 3600).")
    cost: float | None = Field(None, description="gpu_hours x price per GPU-hour; None without a price.")
    energy_j: float | None = Field(
        None, description="GPU board energy, joules: board power x gpu_hours x PUE (the rated board power, an "
        "upper bound on the boards' draw; hosts, network and storage excluded unless the PUE adds them); None "
        "without a token budget or where the GPU has no published board power (`energy_note`).")
    energy_note: str | None = Field(None, description="Why energy_j is None for this GPU; None otherwise.")
    meets_deadline: bool | None = Field(None, description="Whether time_to_train_goodput_s is within the "
                                        "deadline; None without a deadline or a plan.")


class CapacityResult(BaseModel):
    """The capacity question (a model, a cluster, several GPU counts, a token budget) and one row per count."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="The model's name.")
    cluster: str = Field(description="The cluster's name.")
    gpu: str = Field(description="The cluster's GPU.")
    global_batch_size: int = Field(description="Sequences per optimizer step.")
    seq_len: int = Field(description="Tokens per sequence.")
    tokens: float | None = Field(None, description="Token budget to train; None: no time, cost or energy.")
    price_per_gpu_hour: float | None = Field(None, description="Price of one GPU-hour; None: no cost.")
    deadline_s: float | None = Field(None, description="Wall-time deadline, seconds; None: none.")
    pue: float = Field(description="Power usage effectiveness the board energy is multiplied by (1.0: boards only).")
    sizes_rule: str = Field(description="How the GPU counts were chosen from the --gpus text or list.")
    skipped: list[str] = Field(default_factory=list, description="GPU counts left out, each with why.")
    rows: list[CapacityRow] = Field(description="One row per GPU count, ascending.")
    chosen: int | None = Field(
        None, description="With a deadline: the GPU count of the cheapest row that meets it (lowest cost, or "
        "GPU-hours without a price; fewer GPUs on a tie); None when none meets it or there is no deadline.")

    def row(self, num_gpus: int) -> CapacityRow:
        """The row of `num_gpus` GPUs."""
        for r in self.rows:
            if r.num_gpus == num_gpus:
                return r
        raise KeyError(num_gpus)
