"""The multi-node path of `meshplan validate`: --prepare, the runs started by hand, --collect.

`--prepare DIR` computes the reference, writes each plan's run.json and the
emitters' launch scripts and prints the torchrun command of each run; here one
run is started with that printed command, one with the emitted
`launch-torchrun.sh` (the worker must ignore the framework flags it appends),
and one is never started; `--collect DIR` must fold the rank files into the
same report `meshplan validate` gives, and report the missing run.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")

from executor_fixtures import TINY, TRAIN  # noqa: E402

from executors.launcher import worker_env  # noqa: E402
from executors.results import RunConfig  # noqa: E402

pytestmark = pytest.mark.executor
RUN_TIMEOUT_S = 120


def _cli(argv: list[str]) -> tuple[int, str]:
    from planner.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def _torchrun_on_path(tmp_path: Path) -> dict[str, str]:
    """The worker environment with `torchrun` resolving to this interpreter's torch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "torchrun"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m torch.distributed.run "$@"\n')
    shim.chmod(0o755)
    env = worker_env("cpu")
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    return env


def test_prepare_run_by_hand_then_collect(tmp_path):
    model_yaml = tmp_path / "tiny.yaml"
    model_yaml.write_text(yaml.safe_dump(TINY.model_dump()))
    prepared = tmp_path / "prepared"
    code, text = _cli(["validate", "--model", str(model_yaml), "--cluster", "local-cpu", "--gpus", "2",
                       "--global-batch-size", str(TRAIN.global_batch_size), "--seq-len", str(TRAIN.seq_len),
                       "--precision", "fp32", "--top", "1", "-C", "dp=2", "-C", "zero_stage=0",
                       "--strategy", '{"dp": 2, "zero_stage": 1}',
                       "--strategy", '{"dp": 2, "zero_stage": 3, "micro_batch_size": 2}',
                       "--warmup", "1", "--steps", "1", "--device", "cpu", "--prepare", str(prepared)])
    assert code == 0, text
    lines = text.strip().splitlines()
    names, commands = [ln[2:] for ln in lines[0::2]], [shlex.split(ln) for ln in lines[1::2]]
    assert len(names) == len(commands) == 3 and all(ln.startswith("# ") for ln in lines[0::2])
    run_dirs = [prepared / name for name in names]
    for run_dir, cmd in zip(run_dirs, commands):
        cfg = RunConfig.model_validate_json((run_dir / "run.json").read_text())
        assert cfg.reference_losses and cfg.parity_learning_rate and cfg.device == "cpu"
        assert "--standalone" in cmd and "--nproc_per_node=2" in cmd and str(run_dir / "run.json") in cmd
        assert (run_dir / "launch-torchrun.sh").exists() and (run_dir / "launch-slurm.sbatch").exists()

    env = _torchrun_on_path(tmp_path)
    printed = subprocess.run(commands[0], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    assert printed.returncode == 0, printed.stderr[-3000:]
    emitted = subprocess.run(["bash", "launch-torchrun.sh"], env=env, cwd=run_dirs[1], capture_output=True,
                             text=True, timeout=RUN_TIMEOUT_S)
    assert emitted.returncode == 0, emitted.stderr[-3000:]
    # the third run is never started

    code, text = _cli(["validate", "--collect", str(prepared), "--cluster", "local-cpu", "--format", "json"])
    assert code == 1  # one run did not pass: the one never started
    report = json.loads(text)
    assert [c["label"] for c in report["comparisons"]] == [
        RunConfig.model_validate_json((d / "run.json").read_text()).label for d in run_dirs]
    ran, never = report["comparisons"][:2], report["comparisons"][2]
    for c in ran:
        assert c["outcome"] == "ok", c["reason"]
        assert c["parity"]["passed"] and c["parity"]["update_rtol"] > 0
        assert c["measured_step_time_s"] > 0 and c["predicted_step_time_s"] > 0
        assert c["measured_memory_bytes"] > 0
    assert never["outcome"] == "crashed"
    assert "started outside meshplan" in never["reason"] and "0/2 ranks wrote results" in never["reason"]
    assert [len(r["ranks"]) for r in report["runs"]] == [2, 2, 0]
    assert report["measured_best"] in {c["label"] for c in ran}
