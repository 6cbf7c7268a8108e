"""Rotary embeddings: fused into the QKV epilogue, except YaRN under megatron-core, whose unfused rotary
runs its own kernels (`cost_models.blocks.unfused_rotary_bytes`)."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models.blocks import UNFUSED_ROTARY_KERNELS, Attention, LatentAttention, Micro, model_blocks
from planner import Strategy
from tests.framework_defaults import evaluate
from profiles import load_model


def micro(framework: str = "megatron", eager: bool = False, tp: int = 1) -> Micro:
    one = np.ones(1, dtype=int)
    return Micro(4096, 4 * one, tp * one, one, np.zeros(1, dtype=bool), "bf16", "flash", framework=framework,
                 eager=eager)


def attention(name: str, **update) -> Attention | LatentAttention:
    return model_blocks(load_model(name).model_copy(update=update)).all_kinds[0].attention()


def test_yarn_under_megatron_runs_the_unfused_rotary():
    # gpt-oss: 64 query heads and 8 key/value heads of 64; 16384 tokens; 24 bytes per element of Q and K
    att = attention("gpt-oss-120b")
    assert att.yarn and att.rope
    ew = att.elementwise(micro())
    assert float(ew.bytes[0]) == 24 * 16384 * (64 * 64 + 8 * 64)
    assert ew.num_kernels == UNFUSED_ROTARY_KERNELS == 24
    half = att.elementwise(micro(tp=2))  # Q and K split over tp
    assert float(half.bytes[0]) == float(ew.bytes[0]) / 2


@pytest.mark.parametrize("case", ["plain rope", "torchtitan compiled"])
def test_rotary_stays_in_the_qkv_epilogue_otherwise(case):
    att = attention("gpt-oss-120b", rope_scaling="none") if case == "plain rope" else attention("gpt-oss-120b")
    x = micro() if case == "plain rope" else micro(framework="torchtitan")
    ew = att.elementwise(x)
    assert float(ew.bytes[0]) == 2 * 2 * 16384 * (64 * 64 + 8 * 64) and ew.num_kernels == 0


def test_yarn_costs_time_for_gpt_oss_and_nothing_for_latent_attention():
    """The unfused rotary makes a gpt-oss step slower under Megatron; DeepSeek's multi-latent attention applies
    its YaRN rotary fused (megatron-core's MLA rope kernels), so its estimate does not change."""
    st = Strategy(dp=1, ep=8, micro_batch_size=1)
    args = dict(cluster="dgx-b200", num_gpus=8, global_batch_size=64, seq_len=4096, strategy=st)
    oss = load_model("gpt-oss-20b")
    yarn, plain = (evaluate(model=m, **args).time_s["compute"]
                   for m in (oss, oss.model_copy(update={"rope_scaling": "none"})))
    assert yarn > plain * 1.005
    dsv2 = load_model("deepseek-v2-lite")
    assert dsv2.rope_scaling == "yarn" and isinstance(attention("deepseek-v2-lite"), LatentAttention)
    a, b = (evaluate(model=m, **{**args, "strategy": Strategy(dp=8, micro_batch_size=1)}).step_time_s
            for m in (dsv2, dsv2.model_copy(update={"rope_scaling": "none"})))
    assert a == b


def test_megatron_flags_say_they_drop_yarn_for_standard_attention_only():
    """Megatron-LM 0.16's pretrain_gpt.py has no yarn position embedding for standard attention: its flags
    would run plain RoPE, and the text says so; multi-latent attention takes YaRN by default (--rope-type)."""
    from tests.framework_defaults import plan
    from planner.emit import omissions

    args = dict(cluster="dgx-b200", num_gpus=8, global_batch_size=64, seq_len=4096, top_k=1)
    oss = plan(model="gpt-oss-20b", constraints={"ep": 8}, **args).plans[0]
    assert [r for r in omissions(oss, "megatron") if r.startswith("YaRN rotary scaling: model gpt-oss-20b's")]
    plain = oss.model_copy(update={"model": oss.model.model_copy(update={"rope_scaling": "none"})})
    assert not [r for r in omissions(plain, "megatron") if "YaRN" in r]
    dsv2 = plan(model="deepseek-v2-lite", **args).plans[0]
    assert dsv2.model.rope_scaling == "yarn" and not [r for r in omissions(dsv2, "megatron") if "YaRN" in r]
    assert not [r for r in omissions(oss, "megatron-bridge") if "YaRN" in r]  # the recipe sets YaRN itself
