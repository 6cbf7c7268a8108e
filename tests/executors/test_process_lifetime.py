"""No process of a run outlives meshplan or the launcher of its ranks, a run's folder is locked, and the launch
commands meshplan prints or writes survive any folder name.

Regression tests of an outside security review: `kill -9` of torchrun during `validate` left
both workers running ~11 s; `kill -9` of meshplan during `profile` left torchrun and its
workers running ~56 s and the temporary folder behind; two `validate --work-dir D` at once
both reported one run's results; a --prepare folder named `a dir;$(id)` split the printed
command and the generated script.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from executor_fixtures import TINY, TRAIN

from executors.launcher import (
    LOCK_FILE,
    alive,
    descendants,
    lifeline_command,
    locked_dir,
    remove_stale_dirs,
    work_folder,
    worker_env,
)
from executors.lifeline import ENV, PARENT_GONE_EXIT
from executors.validate import NODE_VARIABLE_ARGS, shell_line
from planner.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 5.0
"""The acceptance bound: no process of the run is left this long after the kill."""
START_TIMEOUT_S = 120
LOOPBACK_HEX = "0100007F"
"""127.0.0.1 as /proc/net/tcp writes it."""


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path / "tmp"), XDG_DATA_HOME=str(tmp_path / "data"))


def _cli(argv: list[str], tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "planner", *argv], cwd=tmp_path, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _run_cli(argv: list[str], tmp_path: Path, timeout: float = 120) -> tuple[int, str, str]:
    proc = _cli(argv, tmp_path)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _tiny_args(tmp_path: Path) -> list[str]:
    model_yaml = tmp_path / "tiny.yaml"
    model_yaml.write_text(yaml.safe_dump(TINY.model_dump()))
    return ["validate", "--model", str(model_yaml), "--cluster", "local-cpu", "--gpus", "2",
            "--global-batch-size", str(TRAIN.global_batch_size), "--seq-len", str(TRAIN.seq_len),
            "--precision", "fp32", "--device", "cpu", "--top", "1", "-C", "dp=2", "-C", "zero_stage=0"]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_worker(pid: int, module: str) -> bool:
    """`pid` runs `module` (the launcher's command line names the module too)."""
    cmdline = _cmdline(pid)
    return module in cmdline and "executors.local_run" not in cmdline


def _wait_for_workers(proc: subprocess.Popen, module: str, count: int = 2) -> list[int]:
    """meshplan's whole process tree (from /proc) once `count` processes running `module` are in it."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        tree = descendants(proc.pid)
        if sum(_is_worker(p, module) for p in tree) >= count:
            time.sleep(0.5)  # past their start: the workers import torch and set up
            return descendants(proc.pid)
        time.sleep(0.2)
    proc.kill()
    out, err = proc.communicate(timeout=30)
    pytest.fail(f"the workers never started: {err[-3000:]}")


def _left_after(pids: list[int], seconds: float = GONE_WITHIN_S) -> list[int]:
    """The processes of `pids` still alive `seconds` after now (checked until they are all gone)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) of the TCP sockets `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                out.append(fields[1].split(":")[0])
    return out


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _launcher(tree: list[int]) -> int:
    """The process that started the ranks (executors.local_run, torchrun's stand-in on one machine)."""
    return next(p for p in tree if "executors.local_run" in _cmdline(p))


# ---- the lifeline, with plain Python processes (fast) -----------------------------------------
WORKER = """
import time
from executors.lifeline import bind_to_parent
bind_to_parent()
print("worker", flush=True)
time.sleep(600)
"""
TORCHRUN_LIKE = f"""
import subprocess, sys, time
# like torchrun: the worker runs in a session of its own and inherits the environment
w = subprocess.Popen([sys.executable, "-c", {WORKER!r}], start_new_session=True, stdout=sys.stdout)
time.sleep(600)
"""
MESHPLAN_LIKE = f"""
import subprocess, sys, time
from executors.launcher import lifeline_command
subprocess.Popen(lifeline_command([sys.executable, "-c", {TORCHRUN_LIKE!r}]), start_new_session=True,
                 stdout=sys.stdout)
time.sleep(600)
"""


def _tree_of_three(tmp_path: Path) -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen([sys.executable, "-c", MESHPLAN_LIKE], stdout=subprocess.PIPE, text=True,
                            env=_env(tmp_path), start_new_session=True)
    assert proc.stdout.readline().strip() == "worker"
    tree = descendants(proc.pid)
    assert len(tree) == 2
    launched = next(p for p in tree if _parent(p) == proc.pid)
    worker = next(p for p in tree if p != launched)
    return proc, launched, worker


def test_kill_9_of_the_parent_takes_the_launched_process_and_its_workers(tmp_path):
    proc, launched, worker = _tree_of_three(tmp_path)
    assert f"{ENV}={launched}".encode() in Path(f"/proc/{worker}/environ").read_bytes()
    proc.kill()
    proc.wait()
    assert _left_after([launched, worker]) == []


def test_kill_9_of_the_launched_process_takes_its_workers(tmp_path):
    proc, launched, worker = _tree_of_three(tmp_path)
    try:
        os.kill(launched, signal.SIGKILL)
        assert _left_after([worker]) == []
    finally:
        proc.kill()
        proc.wait()


def test_a_process_whose_parent_is_already_gone_exits_at_once(tmp_path):
    """The lifeline started for a parent pid that is not its parent (the parent died before the
    death signal was asked for) does not run the command."""
    marker = tmp_path / "ran"
    cmd = lifeline_command([sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    cmd[cmd.index("--") - 1] = "1"  # init is not our parent
    assert subprocess.run(cmd, timeout=60).returncode == PARENT_GONE_EXIT
    assert not marker.exists()


# ---- locks and stale temporary folders ---------------------------------------------------------
def test_a_locked_folder_refuses_a_second_holder_and_is_free_afterwards(tmp_path):
    work = tmp_path / "work"
    with locked_dir(work):
        assert (work / LOCK_FILE).read_text().strip() == str(os.getpid())
        with pytest.raises(SpecError, match=r"work_dir '.*work' is in use by another meshplan run \(pid \d+\)"):
            with locked_dir(work):
                pass
    assert not (work / LOCK_FILE).exists()
    with locked_dir(work):
        pass


def test_a_file_is_not_a_work_folder(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(SpecError, match="must be a folder; it is a file"):
        with locked_dir(path):
            pass


HOLD_LOCK = """
import sys, time
from pathlib import Path
from executors.launcher import locked_dir
with locked_dir(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_stale_temporary_folders_are_removed_and_live_or_kept_ones_stay(tmp_path):
    root = tmp_path / "tmp"
    dead, live, kept = root / "meshplan-profile-dead", root / "meshplan-profile-live", root / "meshplan-profile-kept"
    kept.mkdir(parents=True)  # no lock file: kept with --keep (or being set up)
    holders = {}
    for folder in (dead, live):
        holders[folder] = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE,
                                           text=True, env=_env(tmp_path))
        assert holders[folder].stdout.readline().strip() == "locked"
    holders[dead].kill()  # like kill -9 of meshplan: its finally never runs
    holders[dead].wait()
    try:
        assert (dead / LOCK_FILE).exists()
        assert remove_stale_dirs(root, "meshplan-profile-") == [dead]
        assert not dead.exists() and live.is_dir() and kept.is_dir()
    finally:
        holders[live].kill()
        holders[live].wait()


@pytest.mark.parametrize("keep", [False, True])
def test_a_temporary_work_folder_is_locked_while_used_and_removed_or_kept_unlocked(tmp_path, monkeypatch, keep):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / "meshplan-tune-old"
    stale.mkdir()
    (stale / LOCK_FILE).write_text("1\n")  # a lock file nobody holds: its run was killed
    with work_folder(None, "meshplan-tune-", keep=keep) as folder:
        assert not stale.exists()
        assert folder.parent == tmp_path and folder.name.startswith("meshplan-tune-")
        with pytest.raises(SpecError, match="in use by another meshplan run"):
            with locked_dir(folder):
                pass
    assert folder.is_dir() == keep
    assert not (folder / LOCK_FILE).exists()
    assert remove_stale_dirs(tmp_path, "meshplan-tune-") == []  # a kept folder is not stale


def test_local_cpu_ranks_listen_on_loopback(monkeypatch):
    if not Path("/sys/class/net/lo").exists():
        pytest.skip("no loopback interface named lo")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert worker_env("cpu")["GLOO_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in worker_env("cuda")


# ---- real runs: kill -9 of meshplan or the launcher of the ranks ------------------------------------------------
@pytest.mark.executor
def test_kill_9_of_meshplan_during_validate_leaves_no_process(tmp_path):
    """Also: the run's store and the workers' gloo sockets listen on loopback only (executors.local_run;
    GLOO_SOCKET_IFNAME, worker_env): torchrun's stores listened on every interface."""
    pytest.importorskip("torch")
    proc = _cli([*_tiny_args(tmp_path), "--steps", "10000", "--timeout", "300"], tmp_path)
    tree = _wait_for_workers(proc, "executors.worker")
    assert len(tree) >= 3  # the launcher and two workers
    workers = [p for p in tree if _is_worker(p, "executors.worker")]
    assert len(workers) == 2
    listeners = [*workers, _launcher(tree)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(_listening(p) for p in listeners) and time.monotonic() < deadline:
        time.sleep(0.2)  # gloo listens once the process group is up
    addresses = [addr for p in listeners for addr in _listening(p)]
    assert addresses and all(addr == LOOPBACK_HEX for addr in addresses), addresses
    proc.kill()
    proc.communicate(timeout=30)
    assert _left_after(tree) == []


@pytest.mark.executor
@pytest.mark.slow
def test_kill_9_of_the_launcher_during_validate_leaves_no_worker_and_reports_the_crash(tmp_path):
    pytest.importorskip("torch")
    proc = _cli([*_tiny_args(tmp_path), "--steps", "10000", "--timeout", "300"], tmp_path)
    tree = _wait_for_workers(proc, "executors.worker")
    os.kill(_launcher(tree), signal.SIGKILL)
    assert _left_after(tree) == []
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "crashed" in err, err[-3000:]


@pytest.mark.executor
@pytest.mark.slow
def test_kill_9_of_meshplan_during_profile_leaves_no_process_and_the_folder_is_removed_later(tmp_path):
    pytest.importorskip("torch")
    proc = _cli(["profile", "--quick", "--nproc", "2", "--device", "cpu", "--output", str(tmp_path / "profiles")],
                tmp_path)
    tree = _wait_for_workers(proc, "executors.profile_worker")
    proc.kill()
    proc.communicate(timeout=30)
    assert _left_after(tree) == []
    left = list((tmp_path / "tmp").glob("meshplan-profile-*"))
    assert len(left) == 1 and (left[0] / LOCK_FILE).exists()  # nobody could remove it
    assert remove_stale_dirs(tmp_path / "tmp", "meshplan-profile-") == left  # what the next profile run does


@pytest.mark.executor
def test_two_runs_on_one_work_folder_the_second_is_refused(tmp_path):
    pytest.importorskip("torch")
    work = tmp_path / "work"
    first = _cli([*_tiny_args(tmp_path), "--steps", "10000", "--timeout", "300", "--work-dir", str(work)], tmp_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (work / LOCK_FILE).exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (work / LOCK_FILE).exists(), first.communicate(timeout=30)
        code, out, err = _run_cli([*_tiny_args(tmp_path), "--work-dir", str(work)], tmp_path)
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and str(work) in lines[0] and "in use by another meshplan run" in lines[0]
        assert f"pid {first.pid}" in lines[0]
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)


# ---- one-line refusals -----------------------------------------------------------------------
def _one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_work_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x")
    line = _one_line_error(*_run_cli([*_tiny_args(tmp_path), "--work-dir", str(path)], tmp_path))
    assert "--work-dir" in line and str(path) in line and "is a file" in line


def test_collect_of_a_missing_folder_is_refused(tmp_path):
    line = _one_line_error(*_run_cli(["validate", "--collect", str(tmp_path / "missing"), "--cluster", "local-cpu"],
                                     tmp_path))
    assert "--collect" in line and "missing" in line and "is not a folder" in line


@pytest.mark.parametrize("flag, bound", [("--steps", "10000"), ("--parity-steps", "1000"), ("--warmup", "10000")])
def test_step_counts_have_an_upper_bound(tmp_path, flag, bound):
    line = _one_line_error(*_run_cli([*_tiny_args(tmp_path), flag, str(10**9)], tmp_path))
    assert line.startswith(f"error: {flag} ") and str(10**9) in line and f"less than or equal to {bound}" in line


def test_an_engine_that_cannot_run_on_this_device_is_refused_up_front(tmp_path):
    code, out, err = _run_cli([*_tiny_args(tmp_path), "--engine", "megatron"], tmp_path)
    line = _one_line_error(code, out, err)
    assert "engine 'megatron' needs CUDA (device is cpu)" in line
    assert not any((tmp_path / "tmp").iterdir())  # nothing started


def test_device_cuda_without_cuda_is_refused_up_front(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    args = [a if a != "cpu" else "cuda" for a in _tiny_args(tmp_path)]
    line = _one_line_error(*_run_cli(args, tmp_path))
    assert line == "error: --device cuda: torch has no CUDA device here"
    line = _one_line_error(*_run_cli(["profile", "--quick", "--device", "cuda", "--output",
                                      str(tmp_path / "profiles")], tmp_path))
    assert line == "error: --device cuda: torch has no CUDA device here"


# ---- quoting --------------------------------------------------------------------------------
@pytest.mark.executor
def test_prepare_folder_with_shell_characters_round_trips(tmp_path):
    pytest.importorskip("torch")
    prepared = tmp_path / "a dir;$(touch pwned) 'q\" `x`"
    code, out, err = _run_cli([*_tiny_args(tmp_path), "--prepare", str(prepared)], tmp_path, timeout=300)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("# ")
    run_dir = prepared / lines[0][2:]
    cmd = shlex.split(lines[1])
    assert cmd[cmd.index("--config") + 1] == str(run_dir / "run.json") and cmd[cmd.index("--out") + 1] == str(run_dir)
    script = run_dir / "launch-torchrun.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    words = shlex.split(script.read_text().replace("\\\n", " "), comments=True)
    assert str(run_dir / "run.json") in words and str(run_dir) in words
    assert not (tmp_path / "pwned").exists()


def test_printed_commands_quote_every_argument_but_the_node_variables():
    line = shell_line(["python", "--out", "a dir;$(id)", *NODE_VARIABLE_ARGS])
    assert line == "python --out 'a dir;$(id)' " + " ".join(NODE_VARIABLE_ARGS)
    assert shlex.split(line)[2] == "a dir;$(id)"
