"""Framework deepspeed costs the element-wise work of Megatron-DeepSpeed's GPT (microsoft/Megatron-DeepSpeed at
f4157bea), not Megatron-core's fused kernels: an unfused rotary, K and V repeated to every query head for grouped
query attention, flash-attn's layout copies, and SwiGLU as two eager operators. Its norms are apex's fused kernels,
as Megatron-core's are."""

from __future__ import annotations

import numpy as np

from cost_models.blocks import MDS_ROTARY_KERNELS, DenseMLP, Micro, gated_activation, mds_rotary_bytes, model_blocks
from planner import Strategy, evaluate
from profiles import load_model


def micro(framework: str, tp: int = 1) -> Micro:
    one = np.ones(1, dtype=int)
    return Micro(4096, one, tp * one, one, np.zeros(1, dtype=bool), "bf16", "flash", framework=framework)


def test_attention_outside_its_gemms_as_megatron_deepspeed_runs_it():
    att = model_blocks(load_model("llama3-8b")).all_kinds[0].attention()  # 32 query heads, 8 KV heads of 128
    q, k = 4096, 1024
    for tp in (1, 2):
        e = att.elementwise(micro("deepspeed", tp))
        rotary = mds_rotary_bytes(2) * 4096 * (q + k) / tp
        repeat = 2 * 2 * 4096 * (k + q) / tp
        layout = 2 * 2 * 4096 * 4 * q / tp  # Q, repeated K and V, and the output
        assert float(e.bytes[0]) == rotary + repeat + layout
        assert int(e.num_kernels) == MDS_ROTARY_KERNELS + 2 + 4
        assert float(e.bytes[0]) > 5 * float(att.elementwise(micro("megatron", tp)).bytes[0])
    # the unfused core attention takes the [s, b] layout as it is: no layout copies
    unfused = Micro(4096, np.ones(1, dtype=int), np.ones(1, dtype=int), np.ones(1, dtype=int), np.zeros(1, dtype=bool),
                    "bf16", "unfused", framework="deepspeed")
    e = att.elementwise(unfused)
    assert int(e.num_kernels) == MDS_ROTARY_KERNELS + 2
    assert float(e.bytes[0]) == mds_rotary_bytes(2) * 4096 * (q + k) + 2 * 2 * 4096 * (k + q)
    # without grouped query attention nothing is repeated, and the copies are of the heads themselves
    mha = model_blocks(load_model("llama2-7b")).all_kinds[0].attention()
    e = mha.elementwise(micro("deepspeed"))
    assert int(e.num_kernels) == MDS_ROTARY_KERNELS + 4
    assert float(e.bytes[0]) == mds_rotary_bytes(2) * 4096 * 8192 + 2 * 2 * 4096 * 4 * 4096


def test_flash_keeps_the_repeated_keys_and_values():
    att = model_blocks(load_model("llama3-8b")).all_kinds[0].attention()
    kept = att.activations(micro("deepspeed")).split - att.activations(micro("megatron")).split
    assert float(np.ravel(kept)[0]) == 4096 * 2 * 2 * (4096 - 1024)  # K and V at 32 heads instead of 8


def test_swiglu_is_two_eager_operators_and_keeps_the_silu_output():
    assert gated_activation(True, micro("deepspeed")) == (10, 2)
    assert gated_activation(True, micro("megatron")) == (6, 1)
    assert gated_activation(False, micro("deepspeed")) == (4, 1)  # GELU unchanged
    mlp = next(b for b in model_blocks(load_model("llama3-8b")).all_kinds[0].blocks if isinstance(b, DenseMLP))
    kept = mlp.activations(micro("deepspeed")).split - mlp.activations(micro("megatron")).split
    assert float(np.ravel(kept)[0]) == 4096 * 2 * 14336


def test_a_deepspeed_step_of_a_gqa_rope_model_pays_for_them():
    args = dict(num_gpus=8, global_batch_size=32, seq_len=4096, strategy=Strategy(dp=8, zero_stage=2, micro_batch_size=1))
    ds, mg = (evaluate("llama3-8b", "dgx-h100", framework=f, **args) for f in ("deepspeed", "megatron"))
    assert ds.time_s["compute"] > 1.02 * mg.time_s["compute"]
    assert ds.memory_bytes["activations"] > mg.memory_bytes["activations"]
