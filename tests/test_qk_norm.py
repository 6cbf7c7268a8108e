"""Query/key norms (`ModelSpec.qk_norm`): Qwen3 and Gemma 3 normalise each head's query and key, OLMo 2 all
query heads together and all key heads together. They are read from Hugging Face configs, costed as two norm
kernels of their own, counted as parameters, and carried by the emitters that can build them (Megatron's
--qk-layernorm) or refused / reported where the output would build the model without them."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models.blocks import (
    EAGER_RMSNORM_KERNELS,
    Micro,
    eager_rmsnorm_bytes,
    model_blocks,
)
from cost_models.params import num_params
from planner import Strategy
from tests.framework_defaults import evaluate, plan
from planner.emit import NotExpressibleError, emit, emit_data, omissions
from planner.errors import SpecError
from planner.specs import ModelSpec
from planner.specs.hf import read_hf_config
from profiles import load_model

QWEN3_8B = dict(model_type="qwen3", num_hidden_layers=36, hidden_size=4096, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                max_position_embeddings=40960, rope_theta=1000000, tie_word_embeddings=False)
OLMO2_7B = dict(model_type="olmo2", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                num_key_value_heads=32, intermediate_size=11008, vocab_size=100352, max_position_embeddings=4096,
                rope_theta=500000, tie_word_embeddings=False)


def micro(eager: bool = False, tp: int = 1) -> Micro:
    one = np.ones(1, dtype=int)
    return Micro(4096, one, tp * one, one, np.zeros(1, dtype=bool), "bf16", "flash", eager=eager)


def attention(model: ModelSpec):
    return model_blocks(model).all_kinds[0].attention()


def test_hugging_face_families_carry_their_query_key_norms():
    assert read_hf_config(QWEN3_8B).qk_norm == "per_head"
    assert read_hf_config(OLMO2_7B).qk_norm == "full"
    assert read_hf_config(OLMO2_7B | {"model_type": "olmo"}).qk_norm == "none"
    assert read_hf_config(QWEN3_8B | {"model_type": "llama"}).qk_norm == "none"
    assert read_hf_config("tests/fixtures/hf/qwen3-30b-a3b.json").qk_norm == "per_head"
    assert load_model("qwen3-30b-a3b").qk_norm == load_model("qwen3-235b-a22b").qk_norm == "per_head"


def test_latent_attention_refuses_query_key_norms():
    dsv2 = load_model("deepseek-v2-lite").model_dump()
    with pytest.raises(SpecError, match="qk_norm 'per_head' .* multi-head latent attention"):
        ModelSpec(**dsv2 | {"qk_norm": "per_head"})


def test_norm_weights_are_parameters_and_per_head_ones_are_whole_on_every_tp_rank():
    qwen = read_hf_config(QWEN3_8B)
    plain = qwen.model_copy(update={"qk_norm": "none"})
    assert num_params(qwen) - num_params(plain) == 36 * 2 * 128  # one head's width, for Q and for K
    olmo = read_hf_config(OLMO2_7B)
    assert num_params(olmo) - num_params(olmo.model_copy(update={"qk_norm": "none"})) == 32 * (4096 + 4096)
    tp = np.array([1, 4])
    per_head, none = attention(qwen).params_per_rank(tp), attention(plain).params_per_rank(tp)
    assert (per_head - none).tolist() == [256, 256]  # replicated, not split
    full, olmo_none = attention(olmo).params_per_rank(tp), attention(olmo.model_copy(update={"qk_norm": "none"}))
    assert (full - olmo_none.params_per_rank(tp)).tolist() == [8192, 2048]  # split with the heads


@pytest.mark.parametrize("eager", [False, True])
def test_two_norm_kernels_over_q_and_k(eager):
    qwen = read_hf_config(QWEN3_8B)
    att, plain = attention(qwen), attention(qwen.model_copy(update={"qk_norm": "none"}))
    for tp in (1, 2):
        x = micro(eager, tp)
        extra_bytes = float(att.elementwise(x).bytes[0] - plain.elementwise(x).bytes[0])
        extra_kernels = int(np.asarray(att.elementwise(x).num_kernels) - np.asarray(plain.elementwise(x).num_kernels))
        qk = 4096 * (32 * 128 + 8 * 128) / tp
        per_element = eager_rmsnorm_bytes(2) if eager else 2 * 2  # fused: read and write 16 bits
        assert extra_bytes == per_element * qk
        assert extra_kernels == (2 * EAGER_RMSNORM_KERNELS if eager else 2)
    # the norms keep their inputs for backward: Q and K once more
    kept = att.activations(micro()).split - plain.activations(micro()).split
    assert float(np.ravel(kept)[0]) == 2 * 4096 * (32 * 128 + 8 * 128)


def test_a_qwen3_step_pays_for_its_norms():
    args = dict(cluster="dgx-b200", num_gpus=8, global_batch_size=64, seq_len=4096,
                strategy=Strategy(dp=1, ep=8, micro_batch_size=1))
    qwen = load_model("qwen3-30b-a3b")
    normed, plain = (evaluate(model=m, **args) for m in (qwen, qwen.model_copy(update={"qk_norm": "none"})))
    assert normed.time_s["compute"] > plain.time_s["compute"]
    assert normed.memory_bytes["activations"] > plain.memory_bytes["activations"]


def _plan(model: ModelSpec, **constraints):
    return plan(model=model, cluster="dgx-h100", num_gpus=8, global_batch_size=32, seq_len=4096, top_k=1,
                constraints=constraints).plans[0]


def test_megatron_builds_per_head_norms_and_says_it_cannot_build_whole_width_ones():
    qwen = _plan(read_hf_config(QWEN3_8B), tp=2)
    assert "--qk-layernorm" in emit_data(qwen, "megatron")["args"]
    assert not [r for r in omissions(qwen, "megatron") if "query/key" in r]
    assert "model.qk_layernorm=true" in emit_data(qwen, "megatron-bridge")["overrides"]
    llama = _plan(load_model("llama3-8b"), tp=2)
    assert "--qk-layernorm" not in emit_data(llama, "megatron")["args"]
    assert "model.qk_layernorm=false" in emit_data(llama, "megatron-bridge")["overrides"]
    olmo = _plan(read_hf_config(OLMO2_7B), tp=2)
    assert "--qk-layernorm" not in emit_data(olmo, "megatron")["args"]
    for backend in ("megatron", "megatron-bridge"):
        said = [r for r in omissions(olmo, backend) if r.startswith("query/key norms: model")]
        assert said and "qk_norm full" in said[0], backend


def test_megatron_deepspeed_refuses_query_key_norms_with_model_parallelism():
    qwen = _plan(read_hf_config(QWEN3_8B), tp=2)
    with pytest.raises(NotExpressibleError, match=r"query/key norms \(qk_norm per_head\) with tp \(2\)"):
        emit(qwen, "megatron-deepspeed")
    alone = _plan(read_hf_config(QWEN3_8B), tp=1, pp=1)  # the JSON alone: the model code's own norms
    assert emit(alone, "deepspeed")


def test_deepspeed_framework_does_not_rank_what_its_flags_cannot_build():
    """The framework's cannot_run rules agree with the emitter: no tp or pp with query/key norms."""
    ranked = plan(model=read_hf_config(QWEN3_8B), cluster="dgx-h100", num_gpus=16, global_batch_size=64,
                  seq_len=4096, top_k=50, framework="deepspeed").plans
    assert ranked and all(p.strategy.tp == 1 and p.strategy.pp == 1 for p in ranked)
    assert all(emit(p, "deepspeed") for p in ranked[:5])


def test_torchtitan_notes_name_the_norms():
    notes = emit_data(_plan(read_hf_config(QWEN3_8B), tp=2), "torchtitan")["notes"]
    assert any("query/key norms" in n and "qwen3" in n for n in notes)
    notes = emit_data(_plan(read_hf_config(OLMO2_7B), tp=2), "torchtitan")["notes"]
    assert any("none of torchtitan's models has them" in n for n in notes)
