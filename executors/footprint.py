"""Host memory a local validate run needs, estimated before it starts (no torch).

A local run is torchrun (its agent process) plus one process per rank, all on this
machine; every rank builds the model on the host in fp32 before sharding it, then
trains its shard. The single-process reference run (parity) comes before the runs,
one at a time, so the peak is the largest of them, not their sum.

    rank      = RANK_BASELINE_BYTES + HOST_OVERHEAD_FACTOR x max(build, training)
    build     = 4 B x num_params          the fp32 full model each rank draws its seeded
                                          weights from (executors.model.build_model)
    training  = params + grads + optimizer + activations + logits + communication buffers
                of the plan's own prediction (`planner.evaluate` on the executed model) at
                zero_stage 0, without the CUDA-only terms (context, NCCL buffers, allocator
                slack, reserve)
    run       = LAUNCHER_BYTES + num_gpus x rank
    reference = RANK_BASELINE_BYTES + HOST_OVERHEAD_FACTOR x (8 B x num_params + the
                activations and logits of one 4-sequence chunk)   (fp32 weights and
                gradients, plain SGD: executors.runner.reference)

ZeRO is left out (zero_stage 0) because on the host it does not save what it saves on a GPU:
measured, a dp2 ZeRO-3 run of the 117M-parameter model below peaked at 6.4 GiB, the size of
its dp2 ZeRO-0 prediction, not of its ZeRO-3 one (2.9 GiB).

HOST_OVERHEAD_FACTOR covers what the prediction does not hold on a CPU host (glibc's cached
free memory, transient copies). Both constants are fitted on the peak resident memory
(anonymous pages summed over the process tree, file pages once, sampled every 50 ms) of real
runs on the 2-core CI machine, fp32, 2 ranks: "mid", 4 layers, hidden 1024, vocab 32000
(117M parameters), batch 4 x 128; "small", 4 layers, hidden 256, vocab 4096 (3.4M), batch 8 x 128:

    run                     estimate (MiB)   measured peak (MiB)   error
    mid reference           2392             1832                  +31 %
    mid tp2                 4128             3360                  +23 %
    mid dp2 ZeRO-3          7097             6556                  +8 %
    small reference          573              459                  +25 %
    small dp2               1337             1122                  +19 %

The estimate errs on the safe side by 8-31 %.

Without a prediction the training term is 18 B per parameter over tp·pp (fp32 weight, fp32
gradient, Adam's two fp32 moments and a bf16 autocast copy) and no activations.

The budget is MemAvailable (/proc/meminfo) x HOST_MEMORY_SHARE unless given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cost_models.params import num_params

GIB = 2**30
MIB = 2**20

RANK_BASELINE_BYTES = 450 * MIB
"""Resident memory of one rank besides its model, measured on the 2-core CI machine (torch 2.13,
Python 3.11): 231 MiB (VmRSS: 152 MiB anonymous + 79 MiB file-backed) after `import torch`,
`init_process_group("gloo")` and importing the executor; while training, a rank of the
3.4M-parameter model below (under 30 MiB of model state) peaked at 450 MiB (autograd, gloo
buffers, the memory profiler's window), which is the figure used."""

LAUNCHER_BYTES = 230 * MIB
"""Resident memory of torchrun's agent process: measured the same way at 221 MiB (VmRSS)."""

HOST_OVERHEAD_FACTOR = 1.6
"""Measured peak / predicted bytes of the model-dependent part, rounded up (module docstring)."""

HOST_MEMORY_SHARE = 0.8
"""Share of MemAvailable a local run may plan to use; the rest stays for the OS, page cache
and whatever else runs on a shared machine."""

FP32_BYTES = 4
UNSHARDED_STATE_BYTES_PER_PARAM = 4 + 4 + 4 + 4 + 2  # weight, gradient, Adam m, Adam v, bf16 copy
TRAINING_TERMS = ("params", "adapters", "grads", "optimizer", "dequant_buffer", "activations", "recompute_working",
                  "embedding_activations",
                  "logits", "zero3_buffers", "comm_buffers")
REFERENCE_CHUNK_ROWS = 4


@dataclass(frozen=True)
class Footprint:
    """Host memory of one local process tree, bytes."""

    label: str
    num_ranks: int
    per_rank_bytes: float
    total_bytes: float
    build_bytes: float
    training_bytes: float

    def describe(self) -> str:
        what = "build" if self.build_bytes >= self.training_bytes else "training"
        return (f"{self.label}: about {self.total_bytes / GIB:.1f} GiB of host memory ({self.num_ranks} x "
                f"{self.per_rank_bytes / GIB:.2f} GiB per process, bound by the {what} term)")


def training_bytes(estimate, num_params: int, tp: int = 1, pp: int = 1) -> float:
    """The training term of one rank: the prediction's host-side terms, or 18 B/param over tp·pp."""
    if estimate is not None:
        return float(sum(estimate.memory_bytes.get(k, 0.0) for k in TRAINING_TERMS))
    return UNSHARDED_STATE_BYTES_PER_PARAM * num_params / (tp * pp)


def run_footprint(label: str, model, estimate, num_gpus: int, tp: int = 1, pp: int = 1) -> Footprint:
    """Host memory of one torchrun run of `num_gpus` local ranks."""
    build = FP32_BYTES * num_params(model)
    train = training_bytes(estimate, num_params(model), tp, pp)
    per_rank = RANK_BASELINE_BYTES + HOST_OVERHEAD_FACTOR * max(build, train)
    return Footprint(label, num_gpus, per_rank, LAUNCHER_BYTES + num_gpus * per_rank, build, train)


def reference_footprint(model, chunk_estimate) -> Footprint:
    """Host memory of the single-process reference run; `chunk_estimate` is the prediction of a
    one-rank run at a micro-batch of REFERENCE_CHUNK_ROWS (its activations and logits), or None."""
    build = FP32_BYTES * num_params(model)
    acts = 0.0 if chunk_estimate is None else sum(
        chunk_estimate.memory_bytes.get(k, 0.0) for k in ("activations", "embedding_activations", "logits"))
    train = 2 * FP32_BYTES * num_params(model) + acts
    per = RANK_BASELINE_BYTES + HOST_OVERHEAD_FACTOR * max(build, train)
    return Footprint("reference run", 1, per, per, build, train)


def available_bytes() -> float | None:
    """MemAvailable from /proc/meminfo, bytes (None where there is no /proc/meminfo)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_budget_bytes(limit_gib: float | None = None) -> tuple[float | None, str]:
    """(bytes a local run may use, how that was decided)."""
    if limit_gib is not None:
        return limit_gib * GIB, f"--max-host-memory {limit_gib:g} GiB"
    avail = available_bytes()
    if avail is None:
        return None, "unknown (no /proc/meminfo)"
    return avail * HOST_MEMORY_SHARE, f"{HOST_MEMORY_SHARE:.0%} of MemAvailable {avail / GIB:.1f} GiB"


def refusal(footprint: Footprint, budget_bytes: float, budget_rule: str) -> str:
    """One sentence: why `footprint` is not started."""
    return (f"not started: {footprint.describe()} exceeds the {budget_bytes / GIB:.1f} GiB this machine allows "
            f"({budget_rule}); use fewer --num-layers or --gpus, a smaller model, or --max-host-memory")
