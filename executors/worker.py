"""Worker entry point: one short profiled run on every rank (imports torch).

    torchrun --standalone --nproc_per_node=N -m executors.worker --config run.json --out DIR
    python -m executors.worker --reference --config run.json --out DIR

Runs under any torchrun (single node, multi-node rendezvous, Slurm `srun
torchrun ...`): it reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE
from the environment. Order of a run:

1. init the process group (gloo on cpu, nccl on cuda) and read the memory
   baseline; build the mesh and the parallel model; reset the memory peak;
2. run `parity_steps` plain-SGD steps on one batch and compare their global
   losses with the single-process reference (`--reference` computes it and
   the SGD step size, see executors.parity); a mismatch ends the run with
   status "wrong" — it is never timed;
3. `warmup_steps` untimed steps, then `timed_steps` steps, each started after a
   barrier and timed on every rank (both with the plan's optimizer);
4. write `DIR/rank<r>.json` (a RankResult), then tear down. FSDP processes
   sometimes abort at shutdown; the result is already on disk by then.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from executors.launcher import PROGRESS_FILE
from executors.lifeline import bind_to_parent
from executors.parity import parity_failure
from executors.timing import run_timed_steps
from executors.results import RankResult, RunConfig, is_oom, write_json_atomic


def progress_writer(out: Path, rank: int, total_steps: int):
    """on_step(i) for rank 0: writes out/progress.json ({"step": i + 1, "total": total_steps}),
    which the launcher reads to show progress; a no-op on the other ranks."""
    def on_step(index: int) -> None:
        if rank == 0:
            write_json_atomic(out / PROGRESS_FILE, json.dumps({"step": index + 1, "total": total_steps}))

    return on_step


def _threads(cfg: RunConfig, local_world: int) -> int:
    return cfg.num_threads or max(1, (os.cpu_count() or 1) // local_world)


def run_reference(cfg: RunConfig, out: Path) -> None:
    import torch

    from executors.runner import reference

    torch.set_num_threads(_threads(cfg, 1))
    write_json_atomic(out / "reference.json", reference(cfg).model_dump_json())


def _inject_fault(cfg: RunConfig, rank: int, world: int) -> None:
    """hang, crash and oom, on rank 1 after the parity steps (gradient faults act in the optimizer
    or in the gradient reductions)."""
    if cfg.fault not in ("hang", "crash", "oom") or rank != min(1, world - 1):
        return
    if cfg.fault == "hang":
        time.sleep(10**6)
    if cfg.fault == "crash":
        raise RuntimeError("injected crash (RunConfig.fault='crash')")
    if cfg.fault == "oom":
        raise MemoryError("injected out of memory (RunConfig.fault='oom')")


def run_rank(cfg: RunConfig, out: Path) -> int:
    import torch
    import torch.distributed as dist

    from executors.memory import MemoryMeter
    from executors.parallelize import build_mesh, mesh_coords

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    if world != cfg.num_gpus:
        raise SystemExit(f"WORLD_SIZE ({world}) must equal the plan's num_gpus ({cfg.num_gpus})")
    if cfg.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(_threads(cfg, local_world))
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    from executors.runner import Runner

    meter = MemoryMeter(cfg.device)
    result = RankResult(rank=rank, status="ok")
    exit_code = 0
    try:
        mesh = build_mesh(cfg, cfg.device)
        result.coords = {k: v for k, v in mesh_coords(mesh).items() if k in ("pp", "dp", "cp", "tp")}
        gc.collect()
        meter.start()
        result.baseline_memory_bytes = meter.baseline_bytes
        runner = Runner(cfg, mesh, mesh_coords(mesh), device)
        result.num_params_local = runner.num_params_local
        result.num_trainable_params = runner.num_trainable_params
        gc.collect()
        meter.model_built()
        on_step = progress_writer(out, rank, cfg.parity_steps + cfg.warmup_steps + cfg.timed_steps)
        for step in range(cfg.parity_steps):
            result.losses.append(runner.global_loss(runner.step(step)))
            on_step(step)
        result.grad_sq_norms = runner.first_grad_sq_norms
        if cfg.reference_losses is not None:
            failure = parity_failure(cfg, result.losses, result.grad_sq_norms)
            if failure:
                result.status, result.error = "wrong", failure
                return 0
        _inject_fault(cfg, rank, world)
        result.step_times_s = run_timed_steps(runner.step, cfg.parity_steps, cfg.warmup_steps, cfg.timed_steps,
                                              lambda: _sync(cfg), after_warmup=meter.stop, on_step=on_step)
        result.peak_memory_bytes, result.reserved_memory_bytes = meter.peak()
    except Exception as exc:  # reported in the rank's JSON, then re-raised through the exit code
        result.status = "oom" if is_oom(exc) else "error"
        result.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        meter.abandon()
        exit_code = 1
    finally:
        write_json_atomic(out / f"rank{rank}.json", result.model_dump_json())
    return close_group(exit_code)


def close_group(exit_code: int) -> int:
    """After a rank wrote its result: a rank that succeeded waits for the others and leaves the group (one
    that failed exits at once, and the launcher sees its exit code)."""
    import torch.distributed as dist

    if exit_code == 0:
        dist.barrier()
        dist.destroy_process_group()
    return exit_code


def _sync(cfg: RunConfig) -> None:
    if cfg.device == "cuda":
        import torch

        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    bind_to_parent()  # started by meshplan's torchrun: die with it
    parser = argparse.ArgumentParser(prog="python -m executors.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="RunConfig JSON written by the launcher")
    parser.add_argument("--out", required=True, type=Path, help="directory for rank<r>.json results")
    parser.add_argument("--reference", action="store_true", help="compute the single-process reference losses")
    # Launch scripts emitted for a framework append that framework's flags; they are not ours.
    args, _ignored = parser.parse_known_args(argv)
    cfg = RunConfig.model_validate_json(args.config.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reference and cfg.engine == "megatron":
        from executors.megatron_worker import run_rank as run_megatron

        return run_megatron(cfg, args.out, reference=True)
    if args.reference:
        run_reference(cfg, args.out)
        return 0
    if cfg.engine == "megatron":
        from executors.megatron_worker import run_rank as run_megatron

        return run_megatron(cfg, args.out)
    if cfg.engine == "deepspeed":
        from executors.deepspeed_worker import run_rank as run_deepspeed

        return run_deepspeed(cfg, args.out)
    return run_rank(cfg, args.out)


if __name__ == "__main__":
    sys.exit(main())
