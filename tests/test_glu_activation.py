"""A gated MLP's activation (`ModelSpec.glu_activation`, `glu_linear_offset`, `glu_clamp`): SwiGLU (Llama, Qwen),
GeGLU (Gemma), gpt-oss's clamped quick-GEGLU with the linear branch offset by 1. Read from Hugging Face configs,
refused without a gated MLP, costed where megatron-core runs extra kernels (the clamp), and carried by the emitters
that can say it (Megatron-LM's --quick-geglu) or reported where the output would build another activation."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models.blocks import Micro, model_blocks
from planner.emit import emit, omissions
from planner.errors import SpecError
from planner.specs import ModelSpec
from planner.specs.hf import read_hf_config
from profiles import load_model
from tests.emit.emit_plans import make_plan

LLAMA = dict(model_type="llama", num_hidden_layers=4, hidden_size=1024, num_attention_heads=8,
             num_key_value_heads=8, intermediate_size=2816, vocab_size=32000, max_position_embeddings=4096)


def test_hugging_face_configs_say_the_gate_activation():
    assert read_hf_config(LLAMA).glu_activation == "silu"
    assert read_hf_config(LLAMA | {"hidden_act": "gelu"}).glu_activation == "gelu"
    gemma = read_hf_config("tests/fixtures/hf/gemma-2-27b.json")
    assert (gemma.glu_activation, gemma.glu_linear_offset, gemma.glu_clamp) == ("gelu_tanh", 0.0, None)
    # a Gemma config whose hidden_activation is null runs gelu_pytorch_tanh (transformers' GemmaMLP)
    plain = dict(LLAMA, model_type="gemma", hidden_act="gelu", hidden_activation=None)
    assert read_hf_config(plain).glu_activation == "gelu_tanh"
    oss = read_hf_config("tests/fixtures/hf/gpt-oss-120b.json")  # its hidden_act "silu" is not what runs
    assert (oss.glu_activation, oss.glu_linear_offset, oss.glu_clamp) == ("quick_gelu", 1.0, 7.0)
    assert load_model("gpt-oss-120b").glu_clamp == 7.0 and load_model("llama3-8b").glu_activation == "silu"


def test_an_unknown_activation_or_limit_is_refused_naming_the_field():
    with pytest.raises(SpecError, match="hidden_act 'relu6'"):
        read_hf_config(LLAMA | {"hidden_act": "relu6"})
    with pytest.raises(SpecError, match="swiglu_limit"):
        read_hf_config(dict(load_json("tests/fixtures/hf/gpt-oss-20b.json"), swiglu_limit="big"))


def load_json(path: str) -> dict:
    import json
    from pathlib import Path
    return json.loads(Path(path).read_text())


@pytest.mark.parametrize("field,value", [("glu_activation", "quick_gelu"), ("glu_linear_offset", 1.0),
                                         ("glu_clamp", 7.0)])
def test_a_gate_setting_without_a_gated_mlp_is_refused(field, value):
    base = load_model("gpt3-1.7b").model_dump()
    with pytest.raises(SpecError, match=f"{field}=.*gated_mlp is false"):
        ModelSpec.model_validate(base | {field: value})


def _moe(model: ModelSpec):
    return next(b for layer in model_blocks(model).all_kinds for b in layer.blocks if type(b).__name__ == "MoE")


def _micro(framework: str = "megatron") -> Micro:
    one = np.ones(1, dtype=int)
    return Micro(4096, one, one, one, np.zeros(1, dtype=bool), "bf16", "flash", ep=np.array([8]), etp=one,
                 framework=framework)


def test_megatron_cores_clamp_is_costed_as_three_kernels_and_one_kept_copy():
    oss = load_model("gpt-oss-120b")
    unclamped = ModelSpec.model_validate(oss.model_dump() | {"glu_clamp": None})
    x = _micro()
    with_clamp, without = _moe(oss), _moe(unclamped)
    routed = float(with_clamp.routed_tokens(x)[0])
    extra = with_clamp.elementwise(x).bytes - without.elementwise(x).bytes
    assert float(extra[0]) == pytest.approx(8 * 2 * routed * oss.expert_ffn)  # chunk views, two clamps, one cat
    assert with_clamp.elementwise(x).num_kernels - without.elementwise(x).num_kernels == 3
    kept = with_clamp.activations(x).routed - without.activations(x).routed
    assert float(kept[0]) == pytest.approx(routed * 2 * 2 * oss.expert_ffn)  # the clamped copy, 2f wide
    # under another framework meshplan has no code fact of where the clamp runs: nothing is added
    assert _moe(oss).clamp_elementwise(_micro("torchtitan")).num_kernels == 0


def test_the_clamp_slows_a_gpt_oss_step():
    from planner import evaluate

    oss = load_model("gpt-oss-120b")
    plain = ModelSpec.model_validate(oss.model_dump() | {"glu_clamp": None})
    kw = dict(cluster="gb300-nvl72", num_gpus=64, global_batch_size=1280, seq_len=4096,
              strategy=dict(dp=64, ep=64, micro_batch_size=4, zero_stage=1))
    assert evaluate(oss, **kw).step_time_s > evaluate(plain, **kw).step_time_s


def test_megatron_flags_say_quick_geglu_and_report_what_they_cannot():
    p = make_plan("gpt-oss-120b", "dgx-b200", 64, 512, 4096, dict(dp=64, ep=8, zero_stage=1))
    argv = emit(p, "megatron").split()
    assert "--quick-geglu" in argv and "--swiglu" not in argv
    dropped = omissions(p, "megatron")
    assert any("glu_linear_offset 1 and glu_clamp 7" in d for d in dropped)
    gemma = make_plan("gemma-2-27b", "dgx-h100", 16, 64, 4096, dict(dp=2, tp=8, zero_stage=1))
    assert "--swiglu" in emit(gemma, "megatron").split()
    assert any(d.startswith("GeGLU:") for d in omissions(gemma, "megatron"))
    llama = make_plan("llama3-8b", "dgx-h100", 8, 64, 4096, dict(dp=8, zero_stage=1))
    assert not any("GeGLU" in d or "glu_" in d for d in omissions(llama, "megatron"))


def test_megatron_bridge_leaves_the_activation_to_the_recipe():
    p = make_plan("gpt-oss-120b", "dgx-b200", 64, 512, 4096, dict(dp=64, ep=8, zero_stage=1))
    text = emit(p, "megatron-bridge")
    assert "model.gated_linear_unit=true" in text and "activation" not in text
    assert omissions(p, "megatron-bridge") == []


def test_the_executor_builds_the_clamped_offset_gate():
    torch = pytest.importorskip("torch")
    from executors.moe import MLP

    torch.manual_seed(0)
    mlp = MLP(8, 16, True, True, ("quick_gelu", 1.0, 7.0))
    x = 10 * torch.randn(4, 8)
    gate, up = mlp.w1(x).clamp(max=7.0), mlp.w3(x).clamp(-7.0, 7.0)
    expected = mlp.w2(gate * torch.sigmoid(1.702 * gate) * (up + 1.0))  # transformers GptOssExperts' formula
    assert torch.allclose(mlp(x), expected)
    silu = MLP(8, 16, True, False)
    assert torch.allclose(silu(x), silu.w2(torch.nn.functional.silu(silu.w1(x)) * silu.w3(x)))


def test_megatron_flags_refuse_a_dense_quick_geglu_mlp():
    """megatron-core 0.16's dense MLP raises on quick-GEGLU with the bias-activation fusion Megatron-LM turns on
    (MLP.forward: 'Only support fusion of gelu and swiglu'); only the grouped experts fuse it."""
    from planner.emit import NotExpressibleError

    dense = ModelSpec.model_validate(load_model("llama3-8b").model_dump() | {"name": "quick-dense",
                                                                            "glu_activation": "quick_gelu"})
    p = make_plan(dense, "dgx-h100", 8, 64, 4096, dict(dp=8, zero_stage=1))
    with pytest.raises(NotExpressibleError, match="quick-GEGLU in a dense MLP"):
        emit(p, "megatron")


def test_the_megatron_engine_refuses_a_gate_its_flags_cannot_build():
    from executors.validate import engine_config

    gemma = make_plan("gemma-2-27b", "dgx-h100", 16, 64, 4096, dict(dp=2, tp=8, sequence_parallel=True, zero_stage=1))
    config, why = engine_config("megatron", gemma.model, gemma.cluster, gemma.train, 16, gemma.strategy, gemma.estimate)
    assert config is None and why.startswith("GeGLU:")
    llama = make_plan("llama3-8b", "dgx-h100", 8, 64, 4096, dict(dp=8, zero_stage=1))
    config, why = engine_config("megatron", llama.model, llama.cluster, llama.train, 8, llama.strategy, llama.estimate)
    assert config is not None and why == ""
