"""An fp32 plan (what a CPU run trains in) is rendered or refused as not expressible by every
backend; no backend fails on it any other way."""

from __future__ import annotations

import pytest

from planner import plan
from planner.emit import REGISTRY, NotExpressibleError, emit


@pytest.fixture(scope="module")
def fp32_plan():
    return plan(model="tests/fixtures/tune/gpt-tiny.yaml", cluster="local-cpu", num_gpus=2, global_batch_size=4,
                seq_len=32, precision="fp32", top_k=1).plans[0]


@pytest.mark.parametrize("backend", REGISTRY.names())
def test_every_backend_renders_or_refuses_fp32(fp32_plan, backend):
    try:
        assert emit(fp32_plan, backend).strip()
    except NotExpressibleError as exc:
        assert "fp32" in str(exc) or "not expressible" in str(exc)


def test_megatron_bridge_refuses_fp32_naming_it(fp32_plan):
    with pytest.raises(NotExpressibleError, match="precision 'fp32'"):
        emit(fp32_plan, "megatron-bridge")


def test_colossalai_takes_fp32_without_zero_and_refuses_it_with_gemini():
    common = dict(model="tests/fixtures/tune/gpt-tiny.yaml", cluster="local-cpu", num_gpus=2, global_batch_size=4,
                  seq_len=32, precision="fp32", top_k=1)
    low = plan(constraints={"tp": 1, "pp": 1, "zero_stage": 1}, **common).plans[0]
    assert "precision='fp32'" in emit(low, "colossalai")
    gemini = plan(constraints={"zero_stage": 3, "pp": 1}, **common).plans[0]
    with pytest.raises(NotExpressibleError, match="runs ZeRO only in fp16 or bf16"):
        emit(gemini, "colossalai")
