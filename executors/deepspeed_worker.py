"""DeepSpeed executor: `deepspeed.initialize` with the emitted JSON config (CUDA only).

Used for `RunConfig.engine == "deepspeed"`. The model is the executor's own
transformer (executors.model), so the parity reference is the ordinary
single-process reference; the config is the DeepSpeed emitter's
(`planner.emit.deepspeed.ds_config`, carried in `RunConfig.engine_config`)
with gradient clipping switched off (the reference does not clip). The
optimizer is the torch engine's (`executors.optim.make_optimizer`: plain SGD
for the parity steps on batch 0, then fused Adam), handed to
`deepspeed.initialize` as a client optimizer, so DeepSpeed's ZeRO wrappers
shard and reduce the parity steps as they do the timed ones. DeepSpeed alone
runs data parallelism and ZeRO 0-3; tp/pp plans need Megatron-DeepSpeed and
are refused before launch (`executors.validate.engine_reasons`).

Not exercised in CI (no GPU there): tests carrying the `gpu` marker run it
where CUDA is present.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from executors.parity import batch_index, parity_failure
from executors.timing import run_timed_steps
from executors.results import RankResult, RunConfig, is_oom, write_json_atomic


def runtime_config(cfg: RunConfig) -> dict[str, Any]:
    """The emitted config as run: no clipping, no pipeline section, and the client optimizer
    (an Adam subclass, which DeepSpeed's ZeRO accepts only with zero_allow_untested_optimizer)."""
    config = dict(cfg.engine_config or {})
    config.pop("optimizer", None)
    config["zero_allow_untested_optimizer"] = True
    config["gradient_clipping"] = 0.0
    config.pop("pipeline", None)
    return config


def run_rank(cfg: RunConfig, out: Path) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    from executors.memory import MemoryMeter
    from executors.model import build_model, loss_fn, synthetic_batch
    from executors.optim import make_optimizer

    if cfg.engine_config is None:
        raise SystemExit("engine 'deepspeed' needs RunConfig.engine_config (the emitter's DeepSpeed JSON)")
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl")
    meter = MemoryMeter("cuda")
    meter.start()
    model = build_model(cfg.model, cfg.train.seq_len, cfg.seed).cuda()  # on its device before the optimizer sees it
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(cfg, list(model.parameters())),
                                           config=runtime_config(cfg))
    meter.model_built()
    dp, dp_rank = dist.get_world_size(), dist.get_rank()
    rows = cfg.train.global_batch_size // dp
    mbs = cfg.strategy.micro_batch_size

    def step(i: int) -> float:
        tokens, targets = synthetic_batch(cfg.model, cfg.train.global_batch_size, cfg.train.seq_len, cfg.seed,
                                          batch_index(cfg, i))
        x = tokens[dp_rank * rows: (dp_rank + 1) * rows].to(engine.device)
        y = targets[dp_rank * rows: (dp_rank + 1) * rows].to(engine.device)
        total = 0.0
        for j in range(rows // mbs):
            loss = loss_fn(engine(x[j * mbs:(j + 1) * mbs]), y[j * mbs:(j + 1) * mbs])
            engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
            engine.step()  # updates only at the accumulation boundary
            total += float(loss.detach()) / (rows // mbs)
        t = torch.tensor([total], device=engine.device, dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0]) / dp

    result = RankResult(rank=rank, status="ok")
    try:
        result.losses = [step(i) for i in range(cfg.parity_steps)]
        failure = parity_failure(cfg, result.losses) if cfg.reference_losses else ""
        if failure:
            result.status, result.error = "wrong", failure
            return 0
        result.step_times_s = run_timed_steps(step, cfg.parity_steps, cfg.warmup_steps, cfg.timed_steps,
                                              torch.cuda.synchronize)
        result.peak_memory_bytes, result.reserved_memory_bytes = meter.peak()
    except Exception as exc:  # reported in the rank's JSON and through the exit status
        result.status = "oom" if is_oom(exc) else "error"
        result.error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        write_json_atomic(out / f"rank{rank}.json", result.model_dump_json())
    dist.destroy_process_group()
    return 0
