"""Megatron-core's grouped MLP under FP8 pads each expert's rows to the quantised GEMMs' alignment with a copy
(Transformer Engine's Fp8Padding / Fp8Unpadding) unless the router pads the routing map
(--moe-router-padding-for-quantization)."""

import pytest

from cost_models.blocks import MoE, Micro
from tests.framework_defaults import evaluate
from planner.errors import SpecError
from planner.specs import TrainSpec

QWEN = dict(model="qwen3-30b-a3b", cluster="dgx-b200", num_gpus=8, global_batch_size=512, seq_len=4096,
            precision="fp8", fp8_recipe="mxfp8", moe_load_imbalance=1.0,
            strategy=dict(ep=8, micro_batch_size=4, zero_stage=1, recompute="none"))


def test_the_padding_copies_cost_time_unless_the_router_pads():
    copied = evaluate(**QWEN)
    padded = evaluate(**QWEN, moe_router_padding_for_quantization=True)
    assert copied.step_time_s > padded.step_time_s
    # the same layout in BF16 copies nothing (megatron-core pads for quantised GEMMs only)
    import numpy as np

    moe = MoE(2048, 128, 8, 768, True, 0, 0, False, False)
    x = Micro(4096, np.array([4]), np.array([1]), np.ones(1), np.zeros(1, bool), "bf16", "flash",
              ep=np.array([8]), etp=np.array([1]))
    assert float(moe.quantization_padding(x).bytes) == 0.0
    from dataclasses import replace

    fp8 = replace(x, precision="fp8", fp8_recipe="mxfp8")
    routed = 4 * 4096 * 8
    assert float(moe.quantization_padding(fp8).bytes[0]) == pytest.approx(2 * 2 * 2 * routed * 2048 + 2 * 4 * routed)
    assert float(moe.quantization_padding(replace(fp8, framework="torchtitan")).bytes) == 0.0
    # HybridEP's dispatch writes the rows at the alignment itself
    assert float(moe.quantization_padding(replace(fp8, moe_dispatcher="hybridep")).bytes) == 0.0
    hybrid = evaluate(**QWEN, moe_dispatcher="hybridep")
    assert hybrid.step_time_s == pytest.approx(
        evaluate(**QWEN, moe_dispatcher="hybridep", moe_router_padding_for_quantization=True).step_time_s)


@pytest.mark.parametrize("kwargs,rule", [(dict(precision="bf16"), "needs precision 'fp8'"),
                                         (dict(precision="fp8", framework="torchtitan"), "framework 'torchtitan'")])
def test_router_padding_is_refused_where_megatron_has_none(kwargs, rule):
    with pytest.raises(SpecError, match="moe_router_padding_for_quantization") as err:
        TrainSpec(global_batch_size=8, seq_len=4096, moe_router_padding_for_quantization=True, **kwargs)
    assert rule in str(err.value)

