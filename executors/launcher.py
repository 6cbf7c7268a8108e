"""Launch one run with torchrun, enforce its wall-clock limit, fold its results (no torch).

Each run is `python -m torch.distributed.run --standalone --nproc_per_node=N -m
executors.worker --config run.json --out DIR`, started with list arguments in a
new session. On timeout the launcher sends SIGTERM to torchrun's process group
(torchrun then stops its workers), waits `KILL_GRACE_S`, and sends SIGKILL to
that group and to every worker that recorded its pid in DIR (torchrun starts
each worker in a session of its own, so killing torchrun alone can orphan them).

Outcomes are decided from the per-rank JSON files first and the exit status
second: ranks write their results before teardown, so a run whose processes
abort at shutdown after writing complete results is still `ok`.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from executors.parity import grad_norm_error, parity_errors
from executors.results import ParityCheck, ParityReference, RankResult, RunConfig, RunResult

KILL_GRACE_S = 5.0
STDERR_TAIL_LINES = 30
WORKER_MODULE = "executors.worker"


def torchrun_command(nproc: int, config_path: Path, out_dir: Path, *, standalone: bool = True,
                     extra_args: list[str] | None = None, worker_args: list[str] | None = None) -> list[str]:
    """The torchrun argument list of one run. `standalone=False` with `extra_args`
    (e.g. `--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=host:29500`) gives the
    multi-node form that a Slurm script runs on every node."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if standalone:
        cmd.append("--standalone")
    cmd += [f"--nproc_per_node={nproc}", *(extra_args or []),
            "-m", WORKER_MODULE, "--config", str(config_path), "--out", str(out_dir), *(worker_args or [])]
    return cmd


def reference_command(config_path: Path, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", WORKER_MODULE, "--reference", "--config", str(config_path), "--out", str(out_dir)]


@dataclass
class ProcessOutcome:
    return_code: int | None
    timed_out: bool
    wall_s: float
    stderr_tail: str


def worker_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else root
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # the worker sets torch's thread count itself
    return env


#: Errors that follow another rank's failure (its peers lose their connections);
#: a rank reporting one of these is not the root cause.
SECONDARY_ERRORS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                    "remote worker crashing", "nccl communicator was aborted", "timed out")
ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b:?")


def tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """The exception lines of the log (at most 8, first seen first), then its last `lines` lines."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if ln.strip()]
    errors: list[str] = []
    for ln in kept:
        if ERROR_LINE.match(ln) and ln not in errors and len(errors) < 8:
            errors.append(ln)
    head = errors + ["..."] if errors else []
    return "\n".join(head + kept[-lines:])


def root_cause(errors: list[RankResult]) -> RankResult | None:
    """The failed rank whose error is not a consequence of another rank's failure."""
    primary = [r for r in errors if r.error and not any(m in r.error.lower() for m in SECONDARY_ERRORS)]
    return (primary or [r for r in errors if r.error] or [None])[0]


def _is_our_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return WORKER_MODULE in cmdline


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_run(proc: subprocess.Popen, pid_dir: Path | None) -> None:
    """Stop torchrun's process group and every worker that recorded its pid in `pid_dir`."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    for pid_file in sorted(pid_dir.glob("rank*.pid")) if pid_dir else []:
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if _is_our_worker(pid):
            _signal_group(pid, signal.SIGKILL)  # each worker leads its own session and group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def run_process(cmd: list[str], timeout_s: float, log_dir: Path, env: dict[str, str],
                pid_dir: Path | None = None) -> ProcessOutcome:
    """Run `cmd` (no shell) with stdout/stderr in `log_dir`; kill its whole tree at `timeout_s`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stderr_path = log_dir / "stderr.txt"
    start = time.perf_counter()
    with open(log_dir / "stdout.txt", "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        timed_out = False
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_run(proc, pid_dir)
            rc = None
    return ProcessOutcome(rc, timed_out, time.perf_counter() - start, tail(stderr_path))


def read_ranks(out_dir: Path) -> list[RankResult]:
    ranks = []
    for path in sorted(out_dir.glob("rank*.json")):
        try:
            ranks.append(RankResult.model_validate_json(path.read_text()))
        except ValueError:
            continue  # a rank killed while writing leaves no usable file
    return sorted(ranks, key=lambda r: r.rank)


def parity_check(cfg: RunConfig, ranks: list[RankResult]) -> ParityCheck | None:
    measured = next((r.losses for r in ranks if len(r.losses) >= cfg.parity_steps), None)
    if cfg.reference_losses is None or measured is None:
        return None
    loss_err, update_err = parity_errors(measured[: cfg.parity_steps], cfg.reference_losses)
    norms = next((r.grad_sq_norms for r in ranks if r.grad_sq_norms), None)
    grad_err = grad_norm_error(norms, cfg.reference_grad_sq_norms)
    return ParityCheck(reference=cfg.reference_losses, measured=measured[: cfg.parity_steps],
                       max_rel_error=loss_err, rtol=cfg.parity_rtol, update_rel_error=update_err,
                       update_rtol=cfg.update_rtol, grad_rel_error=grad_err, grad_rtol=cfg.grad_rtol,
                       passed=(loss_err <= cfg.parity_rtol and update_err <= cfg.update_rtol
                               and (grad_err is None or grad_err <= cfg.grad_rtol)))


def fold(cfg: RunConfig, ranks: list[RankResult], proc: ProcessOutcome) -> RunResult:
    """One RunResult from the per-rank files and the process outcome."""
    result = RunResult(label=cfg.label, strategy=cfg.strategy, outcome="crashed", ranks=ranks,
                       return_code=proc.return_code, wall_s=proc.wall_s, notes=list(cfg.notes),
                       parity=parity_check(cfg, ranks))
    errors = [r for r in ranks if r.status != "ok"]
    complete = len(ranks) == cfg.num_gpus and not errors
    if proc.timed_out:
        result.outcome = "timeout"
        result.reason = f"killed at the wall-clock limit ({cfg.timeout_s:.0f} s)"
    elif any(r.status == "oom" for r in ranks):
        result.outcome = "oom"
        result.reason = next(r.error for r in ranks if r.status == "oom")
    elif any(r.status == "wrong" for r in ranks):
        result.outcome = "wrong"
        result.reason = next(r.error for r in ranks if r.status == "wrong")
    elif complete:
        result.outcome = "ok"
        if proc.return_code:
            result.notes.append(f"processes exited with status {proc.return_code} after writing complete results "
                                "(teardown)")
    else:
        failed = root_cause(errors)
        status = ("started outside meshplan" if proc.return_code is None
                  else f"exited with status {proc.return_code}")
        result.reason = (f"rank {failed.rank}: {failed.error}" if failed
                         else f"{status}; {len(ranks)}/{cfg.num_gpus} ranks wrote results")
    if result.outcome != "ok":
        result.stderr_tail = proc.stderr_tail
        return result
    per_step = [max(r.step_times_s[i] for r in ranks) for i in range(cfg.timed_steps)]
    result.step_times_s = per_step
    result.step_time_s = statistics.median(per_step)
    result.peak_memory_bytes = max(r.peak_memory_bytes for r in ranks)
    return result


def launch(cfg: RunConfig, run_dir: Path, command: list[str] | None = None) -> RunResult:
    """Write `cfg` to run_dir/run.json, run it under torchrun, fold the results."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(run_dir.glob("rank*.json")) + list(run_dir.glob("rank*.pid")):
        stale.unlink()
    config_path = run_dir / "run.json"
    config_path.write_text(cfg.model_dump_json(indent=1))
    cmd = command or torchrun_command(cfg.num_gpus, config_path, run_dir)
    proc = run_process(cmd, cfg.timeout_s, run_dir, worker_env(cfg.device), pid_dir=run_dir)
    return fold(cfg, read_ranks(run_dir), proc)


def launch_reference(cfg: RunConfig, run_dir: Path) -> tuple[ParityReference | None, str]:
    """Single-process parity steps for `cfg`'s model and data (losses and the SGD step size), or (None, why not)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "run.json"
    config_path.write_text(cfg.model_dump_json(indent=1))
    # Megatron-core needs its parallel state even on one GPU: its reference runs under torchrun.
    cmd = (torchrun_command(1, config_path, run_dir, worker_args=["--reference"]) if cfg.engine == "megatron"
           else reference_command(config_path, run_dir))
    proc = run_process(cmd, cfg.timeout_s, run_dir, worker_env(cfg.device))
    try:
        return ParityReference.model_validate_json((run_dir / "reference.json").read_text()), ""
    except (OSError, ValueError):
        why = "timed out" if proc.timed_out else f"exited with status {proc.return_code}"
        return None, f"reference run {why}: {proc.stderr_tail[-2000:]}"
