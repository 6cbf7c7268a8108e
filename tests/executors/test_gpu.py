"""GPU paths: the torch worker on NCCL with CUDA memory statistics, the Megatron-core
executor and the DeepSpeed executor. Skipped without CUDA (and without the
libraries); on a GPU machine they run one short plan each through the same
launcher and check loss parity and that CUDA memory was measured."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")

from executor_fixtures import TINY  # noqa: E402

from executors.validate import ValidateOptions, validate_strategies  # noqa: E402
from planner.specs import Strategy, TrainSpec  # noqa: E402
from profiles import load_cluster  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.executor,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BF16 = TrainSpec(global_batch_size=8, seq_len=64, precision="bf16")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _validate(strategies, engine: str, tmp_path, num_gpus: int):
    options = ValidateOptions(warmup_steps=1, timed_steps=2, device="cuda", engine=engine, work_dir=tmp_path,
                              timeout_s=600)
    return validate_strategies(strategies, TINY, load_cluster("dgx-h100"), BF16, num_gpus, options)


def _assert_ok(report):
    for c, run in zip(report.comparisons, report.runs):
        assert c.outcome == "ok", f"{c.label}: {c.reason}\n{run.stderr_tail}"
        assert c.parity.passed
        assert run.ranks[0].peak_memory_bytes > 0 and run.ranks[0].reserved_memory_bytes > 0


def test_torch_worker_on_nccl(tmp_path):
    n = min(_gpus(), 2)
    strategies = [Strategy(dp=n)] + ([Strategy(dp=1, tp=2, sequence_parallel=True), Strategy(dp=2, zero_stage=3),
                                      Strategy(dp=1, cp=2)] if n == 2 else [])
    _assert_ok(_validate(strategies, "torch", tmp_path, n))


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_megatron_core_executor(tmp_path):
    n = min(_gpus(), 2)
    strategies = [Strategy(dp=n)] + ([Strategy(dp=1, tp=2, sequence_parallel=True)] if n == 2 else [])
    _assert_ok(_validate(strategies, "megatron", tmp_path, n))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")
def test_deepspeed_executor(tmp_path):
    n = min(_gpus(), 2)
    _assert_ok(_validate([Strategy(dp=n, zero_stage=2 if n > 1 else 0)], "deepspeed", tmp_path, n))
