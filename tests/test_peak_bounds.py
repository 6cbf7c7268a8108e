"""No prediction beats the hardware: on every GPU preset with kernel tables, every ranked plan's
hardware FLOP rate stays below the dense peak of its precision, and the error band's fast edge
below MFU 1 (the issue's property: no prediction exceeds the achievable peak)."""

from __future__ import annotations

import pytest

from planner import plan
from profiles import load_cluster

CASES = [("llama3-8b", 8, 64, 8192), ("llama3-70b", 64, 128, 8192), ("qwen3-30b-a3b", 16, 256, 4096)]


@pytest.mark.parametrize("cluster", ["dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72", "gb300-nvl72"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_no_plan_beats_the_dense_peak(cluster, precision):
    peak = load_cluster(cluster).gpu.peak(precision)
    for model, gpus, batch, seq in CASES:
        result = plan(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=batch, seq_len=seq,
                      precision=precision, top_k=25)
        for p in result.plans:
            e = p.estimate
            assert e.hardware_tflops_per_gpu * 1e12 < peak, (model, p.strategy.short())
            assert 0 < e.mfu < 1 and e.mfu_high <= 1 + 1e-9, (model, p.strategy.short())
            assert e.step_time_s_low <= e.step_time_s <= e.step_time_s_high
