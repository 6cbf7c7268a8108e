"""The JAX run of a TPU plan (executors.jax_run): its mesh and shardings on simulated XLA CPU devices, loss parity
with one device (and a doubled gradient caught), the step time reported as the run's own, and what it refuses."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from executor_fixtures import TINY
from executors.jax_run import (MAX_DEVICES, PARITY_RTOL, UPDATE_RTOL, parity_check, run_config, unsupported_reasons,
                               validate_jax, worker_env)
from executors.validate import ValidateOptions
from planner.errors import SpecError
from planner.specs import Plan, Strategy, TrainSpec
from profiles import load_cluster

#: TPUs train in bf16 (the v5p profile has no fp32 rate); the JAX run computes in float32 and says so.
TRAIN = TrainSpec(global_batch_size=8, seq_len=32, precision="bf16")
SMALL = TINY.model_copy(update={"num_layers": 2})
needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                               reason="jax is not installed (pip install 'meshplan[tpu]'; scripts/test.sh installs it)")


def _plan(strategy: Strategy, num_gpus: int = 8, cluster: str = "tpu-v5p-128", model=SMALL) -> Plan:
    from planner import evaluate

    st = strategy.resolve(num_gpus)
    c = load_cluster(cluster)
    est = evaluate(model, c, num_gpus, TRAIN.global_batch_size, TRAIN.seq_len, TRAIN.precision, strategy=st)
    return Plan(rank=1, strategy=st, estimate=est, model=model, cluster=c, train=TRAIN, num_gpus=num_gpus)


# ---- what runs, decided before anything starts (no jax) ----------------------------------------------------
def test_the_mesh_is_the_maxtext_emitters():
    mesh, reasons = unsupported_reasons(_plan(Strategy(tp=2, cp=2, zero_stage=3)))
    assert reasons == [] and mesh == {"fsdp": 2, "context": 2, "tensor": 2}
    mesh, reasons = unsupported_reasons(_plan(Strategy(zero_stage=1)))
    assert reasons == [] and mesh == {"data": 8}


@pytest.mark.parametrize("strategy,reason", [
    (Strategy(tp=2, pp=2), r"pp \(2\) > 1: the JAX run builds no pipeline"),
    (Strategy(zero_stage=2), r"no JAX mesh for this plan \(not expressible in MaxText: zero_stage 2"),
])
def test_what_the_run_cannot_lay_out_is_refused_with_the_reason(strategy, reason):
    import re

    _, reasons = unsupported_reasons(_plan(strategy))
    assert any(re.search(reason, r) for r in reasons), reasons


def test_more_devices_than_simulated_are_refused():
    _, reasons = unsupported_reasons(_plan(Strategy(zero_stage=3), num_gpus=16))
    assert reasons and f"> {MAX_DEVICES}" in reasons[0]


def test_a_plan_that_runs_nowhere_is_refused_before_anything_starts():
    with pytest.raises(SpecError, match=r"validate --engine jax: dp2 tp2 pp2 .*pp \(2\) > 1"):
        validate_jax([Strategy(tp=2, pp=2)], SMALL, load_cluster("tpu-v5p-128"), TRAIN, 8,
                     ValidateOptions(engine="jax"))


def test_the_run_config_holds_the_plans_micro_batches():
    plan = _plan(Strategy(dp=4, tp=2, zero_stage=3, micro_batch_size=1))
    cfg = run_config(plan, {"fsdp": 4, "tensor": 2}, ValidateOptions(engine="jax"))
    assert (cfg.num_microbatches, cfg.micro_rows, cfg.num_devices) == (2, 4, 8)


def test_the_worker_environment_simulates_the_devices_and_keeps_other_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=3")
    env = worker_env(8)
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"
    assert env["JAX_PLATFORMS"] == "cpu"


def test_parity_compares_the_losses_and_their_change():
    ok = parity_check([5.0, 4.95], [5.0, 4.95 * (1 + 1e-7)])
    assert ok.passed and ok.rtol == PARITY_RTOL and ok.update_rtol == UPDATE_RTOL
    doubled = parity_check([5.0, 4.95], [5.0, 4.90])  # the loss fell twice as far: the update is wrong
    assert not doubled.passed and doubled.update_rel_error == pytest.approx(1.0)


# ---- real runs (jax on simulated CPU devices) --------------------------------------------------------------
@pytest.mark.executor
@pytest.mark.slow
@needs_jax
def test_tpu_plans_run_with_loss_parity_and_their_own_step_time():
    strategies = [Strategy(zero_stage=3), Strategy(dp=2, tp=2, cp=2, zero_stage=3)]
    report = validate_jax(strategies, SMALL, load_cluster("tpu-v5p-128"), TRAIN, 8,
                          ValidateOptions(engine="jax", parity_steps=2, warmup_steps=1, timed_steps=2))
    assert report.engine == "jax" and [c.outcome for c in report.comparisons] == ["ok", "ok"]
    for c in report.comparisons:
        assert c.parity.passed and c.parity.max_rel_error <= PARITY_RTOL
        assert c.measured_step_time_s > 0 and c.predicted_step_time_s > 0
        assert c.step_time_error is None  # a CPU's time against a TPU's prediction is no error
        assert any("this run's own figure" in n and "TPU-v5p" in n for n in c.notes)
        assert any("JAX mesh" in n for n in c.notes)


@pytest.mark.executor
@pytest.mark.slow
@needs_jax
def test_a_doubled_gradient_fails_parity():
    report = validate_jax([Strategy(dp=4, tp=2, zero_stage=3)], SMALL, load_cluster("tpu-v5p-128"), TRAIN, 8,
                          ValidateOptions(engine="jax", timed_steps=1), grad_scale=2.0)
    c = report.comparisons[0]
    assert c.outcome == "wrong" and not c.parity.passed
    assert c.parity.update_rel_error > 100 * UPDATE_RTOL  # measured 0.76


@pytest.mark.executor
@pytest.mark.slow
@needs_jax
def test_meshplan_validate_engine_jax(tmp_path):
    import yaml

    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump(SMALL.model_dump(exclude_defaults=True)))
    proc = subprocess.run([sys.executable, "-m", "planner", "validate", "--engine", "jax", "--cluster", "tpu-v5p-128",
                           "--gpus", "8", "--model", str(model), "-b", "8", "-s", "32", "--top", "1",
                           "--steps", "1", "--format", "json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["engine"] == "jax" and report["comparisons"][0]["outcome"] == "ok"
    assert report["comparisons"][0]["parity"]["passed"]


def test_the_cli_refuses_jax_on_cuda_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "planner", "validate", "--engine", "jax", "--device", "cuda",
                           "--cluster", "tpu-v5p-128", "--gpus", "8", "--model", "llama3-8b", "-b", "8", "-s", "32"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--engine jax runs the plan's mesh on simulated CPU devices" in proc.stderr
    assert "Traceback" not in proc.stderr
