"""What an executor run is asked to do and what it reports (pydantic v2, no torch).

`RunConfig` is written to a JSON file by the launcher and read by every rank of
the worker (`python -m executors.worker --config run.json --out DIR`); each rank
writes one `RankResult` to `DIR/rank<r>.json` before it tears down its process
group; the launcher folds those into one `RunResult` per plan.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from executors.host_load import HostLoad
from planner.errors import SpecError
from planner.specs import ModelSpec, Strategy, TrainSpec

Outcome = Literal["ok", "wrong", "oom", "timeout", "crashed", "unsupported"]
"""ok: ran, passed loss parity, timed. wrong: ran but failed loss parity (never
reported as fast). oom: out of memory. timeout: killed at the wall-clock limit.
crashed: exited with an error (stderr tail kept). unsupported: this executor
cannot run the strategy (the reason says why); nothing was launched."""

Engine = Literal["torch", "megatron", "deepspeed", "jax"]
"""torch, megatron, deepspeed: torchrun workers (executors.validate); jax: the plan's JAX mesh on simulated
XLA CPU devices (executors.jax_run), never a RunConfig's."""
Fault = Literal["none", "hang", "crash", "oom", "grad_x2", "expert_grad_edp_mean", "expert_grad_dense"]

GRADIENT_FAULTS = {"grad_x2": 2.0}
"""Gradient faults -> the factor every gradient is multiplied by, on every rank, before
each parity step's update (a run that is really wrong, which loss parity must catch)."""


class ParityReference(BaseModel):
    """The single-process reference of the parity steps (`reference.json`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    losses: list[float] = Field(description="Loss of each parity step (plain SGD on batch 0).")
    learning_rate: float = Field(
        gt=0, description="Plain-SGD step size the reference chose from its step-1 gradient "
        "(executors.parity.parity_learning_rate); every parallel run of the same model takes it."
    )
    grad_sq_norms: dict[str, float] | None = Field(
        None, description="MoE models: squared L2 norm of the step-1 gradient per parameter group (dense, "
        "experts; executors.parity.GRAD_GROUPS), which the expert-parallel runs must reproduce."
    )


class RunConfig(BaseModel):
    """One short profiled run of one strategy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str = Field(description="Short name of the run, used for file names and tables.")
    model: ModelSpec = Field(description="The model actually built (after any layer reduction and untying).")
    train: TrainSpec = Field(description="Global batch, sequence length, precision, optimizer.")
    strategy: Strategy = Field(description="The resolved strategy (dp is an integer).")
    num_gpus: int = Field(gt=0, description="World size: dp·tp·cp·pp ranks.")
    seed: int = Field(1234, description="Seed of the weights and of the synthetic token batches.")
    parity_steps: int = Field(
        2, ge=1, description="Leading plain-SGD steps on one batch whose losses must equal the single-process "
        "reference (step 1 checks the forward pass, step 2 also the gradients and the update; executors.parity)."
    )
    warmup_steps: int = Field(
        1, ge=1, description="Untimed steps after the parity steps, at least 1: the parity steps are plain SGD, so "
        "the plan's optimizer allocates its states (Adam's two moments) in the first step after them, and the CPU "
        "memory window (executors.memory) closes after the warm-up."
    )
    timed_steps: int = Field(3, ge=1, description="Timed optimizer steps; the reported step time is their median.")
    learning_rate: float = Field(1e-3, gt=0, description="Learning rate of the plan's optimizer (the steps after "
                                 "the parity steps).")
    parity_learning_rate: float | None = Field(
        None, gt=0, description="Step size of the plain-SGD parity steps, from the reference "
        "(ParityReference.learning_rate); None = learning_rate, allowed only without reference_losses."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu runs on gloo, cuda on NCCL.")
    engine: Engine = Field("torch", description="torch: PyTorch parallel APIs; megatron: Megatron-core GPTModel; "
                           "deepspeed: deepspeed.initialize (both CUDA only).")
    engine_config: dict[str, Any] | None = Field(
        None, description="megatron: the emitter's megatron-core kwargs (planner.emit.megatron.core_config_kwargs); "
        "deepspeed: the emitter's DeepSpeed JSON (planner.emit.deepspeed.ds_config); None for torch."
    )
    hsdp_replicate: int = Field(
        1, ge=1, description="With zero_stage >= 2: split dp into hsdp_replicate replicas of dp/hsdp_replicate "
        "shards each (HSDP on a 2-D mesh); 1 = plain FSDP over all of dp."
    )
    num_threads: int | None = Field(None, ge=1, description="CPU threads per rank; None = cores / local ranks.")
    reference_losses: list[float] | None = Field(
        None, description="Single-process reference losses of the first parity_steps steps; None = no parity check."
    )
    parity_rtol: float = Field(
        1e-5, gt=0, description="Relative tolerance on each parity step's loss; fp32: 1e-5 (largest measured over "
        "the ten test plans 4.3e-8), bf16/fp16: 1e-3 (measured 1.1e-5); executors.validate.PARITY_TOLERANCES."
    )
    update_rtol: float = Field(
        1e-3, gt=0, description="Relative tolerance on the loss change from step 1 to each later parity step, "
        "which isolates the gradients and the update (a gradient c times too large changes it by c - 1; one "
        "wrong for one weight shows here long before it moves the loss); fp32: 1e-3 (largest measured over the "
        "ten test plans 8.7e-6), bf16/fp16: 0.1 (measured 1.3e-3); doubled gradients measured 0.94."
    )
    reference_grad_sq_norms: dict[str, float] | None = Field(
        None, description="The reference's step-1 squared gradient norm per parameter group "
        "(ParityReference.grad_sq_norms); checked where the run can compute its own (executors.parity)."
    )
    grad_rtol: float = Field(
        1e-4, gt=0, description="Relative tolerance on each group's step-1 squared gradient norm; fp32: 1e-4, "
        "bf16/fp16: 1e-2 (executors.validate.PARITY_TOLERANCES)."
    )
    timeout_s: float = Field(300.0, gt=0, description="Wall-clock limit of the whole run, seconds.")
    fault: Fault = Field("none", description="Test hook: hang, crash, oom make rank 1 hang, crash or report OOM "
                         "after the parity steps; grad_x2 doubles every gradient on every rank before each parity "
                         "step's update (see GRADIENT_FAULTS); expert_grad_edp_mean and expert_grad_dense reduce the routed "
                         "experts' gradients wrongly in an expert-parallel run (executors.parallelize."
                         "EXPERT_GRAD_FAULTS).")
    notes: list[str] = Field(default_factory=list, description="Deviations of the run from the plan, in words.")

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.reference_losses is not None:
            if self.parity_learning_rate is None:
                raise SpecError("reference_losses need parity_learning_rate (the reference's step size; "
                                "see RunConfig.with_reference)")
            if len(self.reference_losses) != self.parity_steps:
                raise SpecError(f"reference_losses ({len(self.reference_losses)} losses) must hold parity_steps "
                                f"({self.parity_steps}) losses")
        return self

    def with_reference(self, reference: ParityReference) -> "RunConfig":
        """This run checked against `reference` (its losses and its step size)."""
        return self.model_validate(self.model_dump() | {"reference_losses": reference.losses,
                                                        "parity_learning_rate": reference.learning_rate,
                                                        "reference_grad_sq_norms": reference.grad_sq_norms})


class RankResult(BaseModel):
    """What one rank measured (written before teardown)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(description="Global rank.")
    coords: dict[str, int] = Field(default_factory=dict, description="Index of this rank on each mesh axis (pp, dp, cp, tp).")
    status: Literal["ok", "wrong", "oom", "error"] = Field(description="How this rank ended.")
    losses: list[float] = Field(default_factory=list, description="Global-batch loss of each step (all steps run).")
    step_times_s: list[float] = Field(default_factory=list, description="Wall time of each timed step on this rank, seconds.")
    peak_memory_bytes: float = Field(0.0, description="Peak memory of training on this rank above the pre-model baseline, bytes "
                                     "(CPU: peak RSS growth; CUDA: max_memory_allocated).")
    reserved_memory_bytes: float = Field(0.0, description="CUDA: max_memory_reserved; CPU: same as peak_memory_bytes.")
    baseline_memory_bytes: float = Field(0.0, description="Memory in use before the model was built (runtime, libraries), bytes.")
    num_params_local: int = Field(0, description="Parameter elements stored on this rank.")
    num_trainable_params: int = Field(
        0, description="Parameter elements of the whole built model that train (requires_grad), counted before "
        "sharding: every parameter, or under finetune lora the adapters (executors.lora).")
    grad_sq_norms: dict[str, float] | None = Field(
        None, description="Squared norm of the reduced step-1 gradient per parameter group, over all ranks "
        "(MoE runs whose layout allows it; executors.runner.Runner.grad_sq_norms).")
    error: str = Field("", description="Error message when status is not ok.")


class ParityCheck(BaseModel):
    """Leading-step losses against the single-process reference."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reference: list[float] = Field(description="Reference losses.")
    measured: list[float] = Field(description="Losses of the parallel run.")
    max_rel_error: float = Field(description="Largest |measured - reference| / |reference| over the parity steps.")
    rtol: float = Field(description="Tolerance on max_rel_error.")
    update_rel_error: float = Field(0.0, description="Largest relative error of the loss change since step 1.")
    update_rtol: float = Field(0.0, description="Tolerance on update_rel_error.")
    grad_rel_error: float | None = Field(None, description="Largest relative error of a parameter group's "
                                         "step-1 squared gradient norm (None: not checked).")
    grad_rtol: float = Field(0.0, description="Tolerance on grad_rel_error.")
    passed: bool = Field(description="Every checked error within its tolerance.")


class RunResult(BaseModel):
    """One plan's run, folded over its ranks."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(description="The run's label.")
    strategy: Strategy = Field(description="The strategy that was run.")
    outcome: Outcome = Field(description="ok, wrong, oom, timeout, crashed or unsupported.")
    reason: str = Field("", description="Why the outcome is not ok, in words.")
    step_time_s: float | None = Field(None, description="Median over timed steps of the slowest rank's step time, seconds.")
    step_times_s: list[float] = Field(default_factory=list, description="Per timed step, the slowest rank's time, seconds.")
    peak_memory_bytes: float | None = Field(None, description="Largest per-rank peak memory, bytes.")
    parity: ParityCheck | None = Field(None, description="Loss parity against the reference, when checked.")
    ranks: list[RankResult] = Field(default_factory=list, description="Per-rank results that were written.")
    return_code: int | None = Field(None, description="Launcher exit status (None when killed or not launched).")
    stderr_tail: str = Field("", description="Last lines of the run's stderr when it did not end ok.")
    wall_s: float = Field(0.0, description="Wall time of the whole launch, seconds.")
    notes: list[str] = Field(default_factory=list, description="Deviations of the run from the plan.")
    host_load: HostLoad | None = Field(None, description="The host's load around the launch and whether other work "
                                       "competed for the run's cores (executors.host_load); None when the run was "
                                       "not launched here (unsupported, or started outside meshplan).")


#: Messages by which torch, the CUDA caching allocator and the host report running out of memory.
OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_oom(exc: BaseException) -> bool:
    """Whether a rank's exception was a failed allocation (its result is then `oom`, not `error`)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return any(marker in str(exc).lower() for marker in OOM_MARKERS)


def write_json_atomic(path: Path, text: str) -> None:
    """Write a rank's result file whole or not at all (a temp file beside it, then a rename), so the
    launcher never reads half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
