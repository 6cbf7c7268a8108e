"""validate and profile in a user's hands: the host-memory refusal, temporary directories,
the whole process tree stopped on Ctrl-C / SIGTERM, and profiles kept out of meshplan's own files.

Regression tests of issue 10 (part 5): the README's validate example exhausted a 24 GiB
machine without a word, Ctrl-C left torchrun and its workers running, /tmp/meshplan-* piled
up, and `meshplan profile` overwrote the shipped profiles.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from executor_fixtures import TINY, TRAIN

from cost_models.params import num_params
from executors.footprint import (
    FP32_BYTES,
    HOST_OVERHEAD_FACTOR,
    LAUNCHER_BYTES,
    RANK_BASELINE_BYTES,
    host_budget_bytes,
    run_footprint,
)
from executors.launcher import alive, descendants, kill_run
from executors.profiler import check_output_dir, protected_dir, write_profiles
from planner.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]


def _cli(argv: list[str], tmp_path: Path, **popen) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path / "tmp"), XDG_DATA_HOME=str(tmp_path / "data"))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "planner", *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **popen)


def _tiny_args(tmp_path: Path) -> list[str]:
    model_yaml = tmp_path / "tiny.yaml"
    model_yaml.write_text(yaml.safe_dump(TINY.model_dump()))
    return ["validate", "--model", str(model_yaml), "--cluster", "local-cpu", "--gpus", "2",
            "--global-batch-size", str(TRAIN.global_batch_size), "--seq-len", str(TRAIN.seq_len),
            "--precision", "fp32", "--device", "cpu", "--top", "1"]


def _our_processes(marker: str) -> list[int]:
    """Processes whose command line names `marker` (the run's temporary directory)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and alive(int(entry.name)):
                out.append(int(entry.name))
    return out


# ---- host memory -------------------------------------------------------------------------
def test_footprint_adds_baselines_and_the_larger_of_build_and_training():
    fp = run_footprint("x", TINY, None, 2)
    build = FP32_BYTES * num_params(TINY)
    assert fp.build_bytes == build and fp.training_bytes == pytest.approx(18 * num_params(TINY))
    assert fp.total_bytes == pytest.approx(LAUNCHER_BYTES + 2 * (RANK_BASELINE_BYTES + HOST_OVERHEAD_FACTOR * 18 * num_params(TINY)))
    assert run_footprint("x", TINY, None, 8, tp=2, pp=4).training_bytes < build  # 18 B / 8 < 4 B: the build binds


def test_budget_is_the_given_limit_or_a_share_of_memavailable():
    assert host_budget_bytes(2.0)[0] == 2 * 2**30
    budget, rule = host_budget_bytes()
    assert budget is None or (0 < budget and "MemAvailable" in rule)


def test_readme_validate_example_is_refused_up_front_on_a_24_gib_machine(tmp_path):
    """llama3-8b, 8 ranks, 4 layers: every rank builds ~7 GiB of fp32 weights; with the budget of a
    24 GiB machine (80 %) nothing starts and one line says why (exit 2, no temporary directory)."""
    proc = _cli(["validate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "-b", "64", "-s", "4096",
                 "--top", "3", "--num-layers", "4", "--device", "cpu", "--max-host-memory", str(24 * 0.8)], tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "not started" in lines[0] and "GiB of host memory" in lines[0]
    assert "exceeds the 19.2 GiB" in lines[0] and "--max-host-memory" in lines[0]
    assert out == "" and not any((tmp_path / "tmp").iterdir())


def test_small_limit_refuses_the_tiny_model_and_names_both_numbers(tmp_path):
    proc = _cli([*_tiny_args(tmp_path), "--max-host-memory", "0.01"], tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "not started" in err and "exceeds the 0.0 GiB" in err
    assert not any((tmp_path / "tmp").iterdir())


# ---- temporary directories ----------------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True])
def test_work_dir_is_removed_unless_kept(tmp_path, keep):
    """A plan the cpu executor cannot run (cp 2) launches nothing, but the run directory is made;
    it is gone afterwards, or kept and named with --keep."""
    args = [*_tiny_args(tmp_path), "-C", "cp=2", "--format", "json"] + (["--keep"] if keep else [])
    proc = _cli(args, tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err  # no plan could run
    assert "no plan could run here" in err
    assert '"unsupported"' in out and "run files kept" not in out  # stdout stays JSON
    left = list((tmp_path / "tmp").glob("meshplan-validate-*"))
    if keep:
        assert len(left) == 1 and f"run files kept in {left[0]}" in err
    else:
        assert left == []


# ---- stopping the process tree ------------------------------------------------------------
SPAWNER = """
import subprocess, sys, time
# like torchrun: a child in a session of its own, which killing our group alone would orphan
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("ready", flush=True)
time.sleep(600)
"""


def test_kill_run_stops_children_in_their_own_sessions():
    proc = subprocess.Popen([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    tree = [proc.pid, *descendants(proc.pid)]
    assert len(tree) == 2
    kill_run(proc, None, grace_s=1.0)
    assert proc.returncode is not None
    assert not any(alive(p) for p in tree)


@pytest.mark.executor
@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_signal_mid_run_leaves_no_process_and_no_temporary_folder(tmp_path, sig):
    pytest.importorskip("torch")
    proc = _cli([*_tiny_args(tmp_path), "--steps", "10000", "--timeout", "120"], tmp_path)
    deadline = time.monotonic() + 90
    pid_files: list[Path] = []
    while time.monotonic() < deadline and len(pid_files) < 2 and proc.poll() is None:
        time.sleep(0.2)
        pid_files = list((tmp_path / "tmp").glob("meshplan-validate-*/00-*/rank*.pid"))
    assert len(pid_files) == 2, proc.communicate(timeout=30)
    run_dir = str(pid_files[0].parent.parent)
    tree = descendants(proc.pid)
    assert len(_our_processes(run_dir)) >= 3  # torchrun and both workers name the run directory
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert f"interrupted by {sig.name}" in err and "temporary run files removed" in err
    assert not any(alive(p) for p in tree)
    assert _our_processes(run_dir) == []
    assert list((tmp_path / "tmp").iterdir()) == []


# ---- profiles stay out of meshplan's own files ---------------------------------------------
def test_profile_refuses_the_package_and_the_checkout(tmp_path):
    from profiles import PROFILES_DIR

    assert protected_dir(PROFILES_DIR) is not None
    assert protected_dir(PROFILES_DIR / "gpus") is not None
    assert protected_dir(tmp_path / "mine") is None
    with pytest.raises(SpecError, match="inside meshplan's own files"):
        check_output_dir(PROFILES_DIR)
    if (ROOT / "pyproject.toml").exists():  # a checkout: anywhere in it is refused
        with pytest.raises(SpecError, match="inside meshplan's own files"):
            check_output_dir(ROOT / "my-profiles")


def test_profile_command_refuses_before_measuring(tmp_path):
    from profiles import PROFILES_DIR

    proc = _cli(["profile", "--output", str(PROFILES_DIR), "--quick"], tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and err.count("\n") == 1 and "inside meshplan's own files" in err
    assert not (PROFILES_DIR / "kernels" / "gemm" / "local-cpu.yaml").exists()


def test_profile_written_to_the_user_directory_loads_by_name(tmp_path, monkeypatch):
    from test_profile import synthetic_raw

    from profiles import load_cluster, search_dirs, user_profiles_dir

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("MESHPLAN_PROFILES", raising=False)
    root = user_profiles_dir()
    assert root == tmp_path / "data" / "meshplan" / "profiles" and root not in search_dirs()
    root.mkdir(parents=True)
    assert search_dirs()[0] == root
    write_profiles(synthetic_raw(), "box-user", root)
    assert load_cluster("box-user").gpu.peak("fp32") == pytest.approx(50e9)
