"""Launch one run on this machine, enforce its wall-clock limit, fold its results (no torch).

Each run is `python -m executors.local_run --nproc=N -m executors.worker --config
run.json --out DIR` (torchrun's one-machine launch, with its store on 127.0.0.1
only), started with list arguments in a new session, so a Ctrl-C in the terminal
reaches only meshplan, which then ends the run itself. Stopping a run (`kill_run`:
at its wall-clock limit, or on SIGINT / SIGTERM to meshplan while it waits) first
lists every descendant of the launcher (/proc, by parent pid) and every worker that
recorded its pid in DIR, sends SIGTERM to all of those process groups and processes
at once, waits at most the grace period for them to exit, sends SIGKILL to whatever
is left and reaps the launcher. While a run is waited on, SIGINT and SIGTERM raise
`Interrupted` in meshplan (`signals_raise`), after the run's processes are gone.
Runs across machines (`validate --prepare`) print torchrun commands instead
(`torchrun_command`).

Dying with meshplan: every run is started through `executors.lifeline`, so a
`kill -9` of meshplan kills the launcher (parent-death signal), and each worker binds
itself to the launcher the same way (`kill -9` of the launcher kills its workers); once
the launcher has exited, any worker that recorded its pid and still runs is killed too.
`locked_dir` holds a lock on a run's folder for the run's lifetime (a second run on
the same folder is refused), and `remove_stale_dirs` removes the temporary folders
of runs that were killed before they could remove them.

Outcomes are decided from the per-rank JSON files first and the exit status
second: ranks write their results before teardown, so a run whose processes
abort at shutdown after writing complete results is still `ok`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from executors.parity import grad_norm_error, parity_errors
from executors.results import ParityCheck, ParityReference, RankResult, RunConfig, RunResult
from planner.errors import SpecError
from planner.specs.files import read_text

KILL_GRACE_S = 5.0
"""Grace between SIGTERM and SIGKILL when a run reaches its wall-clock limit."""
INTERRUPT_GRACE_S = 2.0
"""Grace between SIGTERM and SIGKILL when the user interrupts (Ctrl-C, SIGTERM to meshplan)."""
POLL_S = 0.5
"""How often a waiting launcher reads the run's progress file."""
PROGRESS_FILE = "progress.json"
STDERR_TAIL_LINES = 30
WORKER_MODULE = "executors.worker"
WORKER_MODULES = (WORKER_MODULE, "executors.autoshard_worker")
"""The modules whose processes a run's pid files may name (`recorded_workers` kills only those)."""
LIFELINE = Path(__file__).resolve().with_name("lifeline.py")
LOCK_FILE = ".meshplan.lock"
"""A run's lock in its folder (`locked_dir`): held while the run lasts, removed after it."""
LOCK_TRIES = 3
LOOPBACK = "lo"
"""The loopback interface the gloo ranks of a local cpu run listen on (GLOO_SOCKET_IFNAME). The run's
store listens on 127.0.0.1 too (`executors.local_run`; torchrun's stores would listen on every interface
whatever its flags: torch's TCPStore server binds the any-address, checked with `ss -ltnp`, torch 2.13)."""


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


def local_command(nproc: int, module: str, args: list[str]) -> list[str]:
    """`nproc` ranks of `python -m module args` on this machine (`executors.local_run`: torchrun's
    environment, its store on 127.0.0.1 only)."""
    return [sys.executable, "-m", "executors.local_run", f"--nproc={nproc}", "-m", module, *args]


def run_command(nproc: int, config_path: Path, out_dir: Path, worker_args: list[str] | None = None) -> list[str]:
    """The command of one run on this machine: `nproc` worker ranks through `local_command`."""
    return local_command(nproc, WORKER_MODULE, ["--config", str(config_path), "--out", str(out_dir),
                                                *(worker_args or [])])


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
        if Path(f"/sys/class/net/{LOOPBACK}").exists():  # every rank is on this machine: gloo listens on loopback
            env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK)
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


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while meshplan ran; the run's processes are already stopped."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process ended by it."""
        return 128 + self.signum


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM raise `Interrupted` (main thread only; elsewhere
    the handlers stay as they are). The previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM are ignored while the block runs (cleanup must not be cut short)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _is_our_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(module in cmdline for module in WORKER_MODULES)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid` from /proc/<pid>/stat, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1])


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        st = _stat(int(entry.name))
        if st is not None:
            children.setdefault(st[1], []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, []))
    return out


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_processes(proc: subprocess.Popen, pid_dir: Path | None) -> list[int]:
    """torchrun, its descendants, and the workers that recorded their pid in `pid_dir`."""
    pids = [proc.pid, *descendants(proc.pid)]
    return pids + [pid for pid in recorded_workers(pid_dir) if pid not in pids]


def _send(proc: subprocess.Popen, pids: list[int], sig: int) -> None:
    groups = {proc.pid}
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    groups.discard(os.getpgrp())  # never meshplan's own group
    for pgid in groups:
        _signal_group(pgid, sig)
    for pid in pids:
        if pid != os.getpid():
            _signal_pid(pid, sig)


def _wait_gone(proc: subprocess.Popen, pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        proc.poll()  # reaps torchrun once it has exited
        if not any(alive(p) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def kill_run(proc: subprocess.Popen, pid_dir: Path | None, grace_s: float = KILL_GRACE_S) -> None:
    """Stop torchrun and every process of its run: SIGTERM to all of their process groups and
    to each process at once, at most `grace_s` to exit, then SIGKILL to what is left (listed
    again, so a worker started meanwhile is not missed); torchrun is reaped before this returns,
    and the workers (reparented and reaped by init) are waited for up to `grace_s` more."""
    pids = run_processes(proc, pid_dir)
    _send(proc, pids, signal.SIGTERM)
    if not _wait_gone(proc, pids, grace_s):
        pids = list(dict.fromkeys(pids + run_processes(proc, pid_dir)))
        _send(proc, [p for p in pids if alive(p)], signal.SIGKILL)
    proc.wait()
    _wait_gone(proc, pids, grace_s)


def lifeline_command(cmd: list[str]) -> list[str]:
    """`cmd` started through executors/lifeline.py: it dies when this process does (and its
    workers when it does, see executors.lifeline)."""
    return [sys.executable, "-I", str(LIFELINE), str(os.getpid()), "--", *cmd]


def recorded_workers(pid_dir: Path | None) -> list[int]:
    """The living workers that recorded their pid in `pid_dir` (rank*.pid)."""
    out = []
    for pid_file in sorted(pid_dir.glob("rank*.pid")) if pid_dir else []:
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if alive(pid) and _is_our_worker(pid):
            out.append(pid)
    return out


def kill_leftovers(pid_dir: Path | None, grace_s: float = INTERRUPT_GRACE_S) -> None:
    """SIGKILL the workers of `pid_dir` that outlive their torchrun, and wait up to `grace_s`
    for them to go (they are reparented and reaped by init)."""
    pids = recorded_workers(pid_dir)
    for pid in pids:
        _signal_pid(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _lock_holder(fd: int) -> str:
    try:
        return os.pread(fd, 64, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _take_lock(folder: Path, field: str) -> int:
    """A descriptor holding the lock of `folder` (see `locked_dir`)."""
    lock = folder / LOCK_FILE
    for _ in range(LOCK_TRIES):
        # a new lock file appears already locked and holding our pid (made aside, then linked in)
        aside = folder / f"{LOCK_FILE}.{os.getpid()}"
        fd = os.open(aside, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        try:
            os.link(aside, lock)
            return fd
        except FileExistsError:
            os.close(fd)
        finally:
            aside.unlink(missing_ok=True)
        try:  # a lock file is there: another run's, or one a killed run left
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            continue
        if not _try_lock(fd):
            holder = _lock_holder(fd)
            os.close(fd)
            raise SpecError(f"{field} {str(folder)!r} is in use by another meshplan run"
                            + (f" (pid {holder})" if holder.isdigit() else "")
                            + "; wait for it to finish or choose another folder")
        if _same_file(fd, lock):  # the holder died; the lock is ours now
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # removed or replaced meanwhile: try again
    raise SpecError(f"{field} {str(folder)!r}: could not take its lock file {LOCK_FILE} "
                    f"in {LOCK_TRIES} tries (other runs start and stop there)")


def check_folder(folder: Path | None, field: str) -> None:
    """SpecError when `folder` exists and is not a folder (a run's files go inside it)."""
    if folder is not None and folder.exists() and not folder.is_dir():
        raise SpecError(f"{field} {str(folder)!r} must be a folder; it is a file")


@contextlib.contextmanager
def locked_dir(folder: Path, field: str = "work_dir") -> Iterator[Path]:
    """Create `folder` if needed and hold its lock file (fcntl.flock on folder/.meshplan.lock)
    while the block runs: another run on the same folder gets a SpecError naming `field` and
    the folder at once. The kernel drops the lock when the holder dies, even by SIGKILL; the
    lock file is removed when the block ends."""
    check_folder(folder, field)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"{field} {str(folder)!r} cannot be created: {exc.strerror}") from None
    fd = _take_lock(folder, field)
    try:
        yield folder
    finally:
        if _same_file(fd, folder / LOCK_FILE):
            (folder / LOCK_FILE).unlink(missing_ok=True)
        os.close(fd)


@contextlib.contextmanager
def work_folder(given: Path | None, prefix: str, keep: bool = False, field: str = "work_dir") -> Iterator[Path]:
    """The folder a command's runs go to, locked while the block runs (`locked_dir`): `given`, or
    a new temporary folder `<tmp>/<prefix>*`, removed when the block ends (also on an exception)
    unless `keep`. Before a temporary folder is made, the ones killed runs left are removed
    (`remove_stale_dirs`)."""
    if given is not None:
        with locked_dir(given, field) as folder:
            yield folder
        return
    remove_stale_dirs(Path(tempfile.gettempdir()), prefix)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        with locked_dir(folder, field):
            yield folder
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def remove_stale_dirs(parent: Path, prefix: str) -> list[Path]:
    """Remove the folders `parent/<prefix>*` whose lock file no living run holds (the run was
    killed before it could remove its temporary folder); the removed folders. A folder with
    no lock file (being set up, or kept with --keep) is left alone."""
    removed = []
    for folder in sorted(parent.glob(prefix + "*")) if parent.is_dir() else []:
        try:
            fd = os.open(folder / LOCK_FILE, os.O_RDWR)
        except OSError:
            continue
        try:
            if _try_lock(fd) and _same_file(fd, folder / LOCK_FILE):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        finally:
            os.close(fd)
    return removed


def read_progress(log_dir: Path) -> dict | None:
    """The run's progress file (written by rank 0 after every step), or None."""
    try:
        return json.loads((log_dir / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None


def run_process(cmd: list[str], timeout_s: float, log_dir: Path, env: dict[str, str],
                pid_dir: Path | None = None,
                on_progress: Callable[[dict], None] | None = None) -> ProcessOutcome:
    """Run `cmd` (no shell, its own session, dying with this process: `lifeline_command`) with
    stdout/stderr in `log_dir`; kill its whole tree at `timeout_s`, or on SIGINT / SIGTERM (then
    `Interrupted` is raised once the run's processes are gone), and kill the workers recorded in
    `pid_dir` that outlive it. `on_progress` gets the run's progress file each time it changes.
    Call it from a thread that lives until it returns: the parent-death signal follows the thread."""
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / PROGRESS_FILE).unlink(missing_ok=True)
    # torchrun's own log folders (torchelastic_*) and torch's caches go to the run's folder:
    # a run killed before it cleans up leaves nothing in the system's temporary directory.
    env = dict(env, TMPDIR=str(log_dir / "tmp"))
    (log_dir / "tmp").mkdir(exist_ok=True)
    stderr_path = log_dir / "stderr.txt"
    start = time.perf_counter()
    with signals_raise(), open(log_dir / "stdout.txt", "wb") as out, open(stderr_path, "wb") as err:
        proc = None
        try:
            proc = subprocess.Popen(lifeline_command(cmd), stdout=out, stderr=err, env=env,
                                    start_new_session=True)
            rc, timed_out = _wait(proc, start + timeout_s, log_dir, on_progress)
            with signals_held():
                if timed_out:
                    kill_run(proc, pid_dir)
                else:  # torchrun is gone (killed, perhaps); no worker may outlive it
                    kill_leftovers(pid_dir)
        except Interrupted:
            if proc is not None:
                with signals_held():
                    kill_run(proc, pid_dir or log_dir, INTERRUPT_GRACE_S)
            raise
    return ProcessOutcome(rc, timed_out, time.perf_counter() - start, tail(stderr_path))


def _wait(proc: subprocess.Popen, deadline: float, log_dir: Path,
          on_progress: Callable[[dict], None] | None) -> tuple[int | None, bool]:
    """(exit status, timed out) of `proc`, polling its progress file meanwhile."""
    seen = None
    while True:
        try:
            return proc.wait(timeout=max(0.0, min(POLL_S, deadline - time.perf_counter()))), False
        except subprocess.TimeoutExpired:
            pass
        if on_progress is not None:
            progress = read_progress(log_dir)
            if progress is not None and progress != seen:
                seen = progress
                on_progress(progress)
        if time.perf_counter() >= deadline:
            return None, True


def read_ranks(out_dir: Path) -> list[RankResult]:
    ranks = []
    for path in sorted(out_dir.glob("rank*.json")):
        try:
            ranks.append(RankResult.model_validate_json(read_text(path, "rank result")))
        except (SpecError, ValueError):
            continue  # a rank killed while writing (or anything but a result file) leaves no usable file
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


def launch(cfg: RunConfig, run_dir: Path, command: list[str] | None = None,
           on_progress: Callable[[dict], None] | None = None) -> RunResult:
    """Write `cfg` to run_dir/run.json, run it under torchrun, fold the results."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(run_dir.glob("rank*.json")) + list(run_dir.glob("rank*.pid")):
        stale.unlink()
    config_path = run_dir / "run.json"
    config_path.write_text(cfg.model_dump_json(indent=1))
    cmd = command or run_command(cfg.num_gpus, config_path, run_dir)
    proc = run_process(cmd, cfg.timeout_s, run_dir, worker_env(cfg.device), pid_dir=run_dir,
                       on_progress=on_progress)
    return fold(cfg, read_ranks(run_dir), proc)


def launch_reference(cfg: RunConfig, run_dir: Path) -> tuple[ParityReference | None, str]:
    """Single-process parity steps for `cfg`'s model and data (losses and the SGD step size), or (None, why not)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "run.json"
    config_path.write_text(cfg.model_dump_json(indent=1))
    # Megatron-core needs its parallel state even on one GPU: its reference runs as a one-rank run.
    cmd = (run_command(1, config_path, run_dir, worker_args=["--reference"]) if cfg.engine == "megatron"
           else reference_command(config_path, run_dir))
    proc = run_process(cmd, cfg.timeout_s, run_dir, worker_env(cfg.device), pid_dir=run_dir)
    try:
        return ParityReference.model_validate_json((run_dir / "reference.json").read_text()), ""
    except (OSError, ValueError):
        why = "timed out" if proc.timed_out else f"exited with status {proc.return_code}"
        return None, f"reference run {why}: {proc.stderr_tail[-2000:]}"
