"""MoE, latent attention, sliding windows and optimizer offload in every emitter, checked by each
framework's own classes (issue 8). Plans are built from ModelSpec and Strategy directly
(tests/emit/emit_plans.py), not from the search."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
from emit_checks import (
    check_bridge,
    check_colossalai,
    check_deepspeed,
    check_megatron,
    check_torchtitan,
    megatron_configs,
)
from emit_plans import (
    ARCHITECTURES,
    DEEPSEEK_V3_LIKE,
    GEMMA2_LIKE,
    MIXTRAL_LIKE,
    make_plan,
)

from cost_models.params import num_active_params, num_params
from planner.emit import NotExpressibleError, emit, emit_data
from planner.emit.base import REGISTRY, EmitOptions
from planner.emit.megatron import (
    FLAGS,
    TRANSFORMER_CONFIG_FLAGS,
    expand_pattern,
    layer_pattern,
    megatron_args,
)

pytest.importorskip("megatron.core")

MIXTRAL = (MIXTRAL_LIKE, "dgx-h100", 64, 256, 4096)


def _pairs(argv: list[str]) -> dict[str, str]:
    return dict(zip(argv, argv[1:]))


def _megatron_eval(text: str) -> list[int]:
    """What Megatron-LM's `moe_freq_type` does with a list expression (arguments.py `_eval_pattern`):
    refuse any character but digits, `,[]()+*`, then evaluate it as Python."""
    assert not re.search(r"[^,\d\[\]\(\)\+\*]", text), text
    return eval(text, {"__builtins__": {}})  # noqa: S307 - the whitelisted grammar Megatron-LM evaluates


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architectures_build_megatron_core_configs(name):
    plan = ARCHITECTURES[name]()
    check_megatron(plan, megatron_args(plan))
    check_bridge(plan, emit_data(plan, "megatron-bridge")["overrides"])


def test_deepseek_v3_like_flags():
    plan = ARCHITECTURES["deepseek-v3-like-256xH100-pp8ep8"]()
    argv = megatron_args(plan)
    pairs = _pairs(argv)
    assert (pairs["--num-experts"], pairs["--moe-router-topk"], pairs["--moe-ffn-hidden-size"]) == ("256", "8", "2048")
    assert pairs["--moe-layer-freq"] == "([0]*3+[1]*58)"
    assert _megatron_eval(pairs["--moe-layer-freq"]) == [0] * 3 + [1] * 58
    assert pairs["--moe-shared-expert-intermediate-size"] == "2048" and "--moe-shared-expert-overlap" in argv
    assert (pairs["--expert-model-parallel-size"], pairs["--expert-tensor-parallel-size"]) == ("8", "1")
    assert pairs["--moe-token-dispatcher-type"] == "alltoall" and "--moe-grouped-gemm" in argv
    assert pairs["--moe-router-load-balancing-type"] == "aux_loss"  # ModelSpec names no other balancing
    assert pairs["--mtp-num-layers"] == "1" and "--multi-latent-attention" in argv
    assert (pairs["--q-lora-rank"], pairs["--kv-lora-rank"], pairs["--qk-head-dim"], pairs["--qk-pos-emb-head-dim"],
            pairs["--v-head-dim"]) == ("1536", "512", "128", "64", "128")
    assert "--group-query-attention" not in argv and "--window-size" not in argv
    tc = megatron_configs(argv)["transformer"]
    assert type(tc).__name__ == "MLATransformerConfig"
    # megatron-core builds the plan's split with MTP on the last stage: 7 + 6·8 + 6 layers
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    assert [get_num_layers_to_build(tc, pp_rank=r) for r in range(8)] == [7] + [8] * 6 + [6]


def test_mixtral_like_flags_with_etp():
    plan = ARCHITECTURES["mixtral-like-64xH100-tp4pp2ep4etp2"]()
    argv = megatron_args(plan)
    pairs = _pairs(argv)
    assert (pairs["--expert-model-parallel-size"], pairs["--expert-tensor-parallel-size"]) == ("4", "2")
    assert "--moe-layer-freq" not in argv and "--moe-shared-expert-intermediate-size" not in argv
    assert "--moe-shared-expert-overlap" not in argv and "--sequence-parallel" in argv
    par = megatron_configs(argv)["parallel"]
    assert (par.expert_model_parallel_size, par.expert_tensor_parallel_size) == (4, 2)


def test_etp_is_written_even_when_one():
    # Megatron-LM's default etp is tp: an MoE plan with tp 2 and etp 1 must say so.
    plan = make_plan(*MIXTRAL, strategy=dict(tp=2, ep=8, etp=1, sequence_parallel=True, zero_stage=1))
    pairs = _pairs(megatron_args(plan))
    assert pairs["--expert-tensor-parallel-size"] == "1"
    assert megatron_configs(megatron_args(plan))["transformer"].expert_tensor_parallel_size == 1


def test_gemma2_like_window_and_offload_flags():
    plan = ARCHITECTURES["gemma2-like-16xH100-tp2-offload"]()
    argv = megatron_args(plan)
    pairs = _pairs(argv)
    assert pairs["--window-size"] == "4095,0" and pairs["--window-attn-skip-freq"] == "2"
    for flag in ("--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--use-distributed-optimizer"):
        assert flag in argv
    assert pairs["--optimizer-offload-fraction"] == "1.0"
    overrides = emit_data(plan, "megatron-bridge")["overrides"]
    assert "model.window_size=[4095,0]" in overrides and "optimizer.optimizer_offload_fraction=1.0" in overrides
    assert "model.window_attn_skip_freq=2" in overrides


def test_explicit_global_layers_are_a_per_layer_list():
    model = GEMMA2_LIKE.model_copy(update={"global_attention_every": 0, "global_attention_layers": [5, 11, 17, 41]})
    plan = make_plan(model, "dgx-h100", 16, 64, 8192, strategy=dict(tp=2, sequence_parallel=True, zero_stage=1))
    argv = megatron_args(plan)
    pattern = _pairs(argv)["--window-attn-skip-freq"]
    assert _megatron_eval(pattern) == [int(local) for local in model.local_attention_mask()]
    check_megatron(plan, argv)  # megatron-core's is_layer_window_attention agrees layer by layer


def test_moe_every_other_layer_is_a_list_not_megatrons_integer():
    # ModelSpec's freq 2 makes layers 1, 3, 5, ... MoE; Megatron's integer 2 would make 0, 2, 4, ...
    model = MIXTRAL_LIKE.model_copy(update={"moe_layer_freq": 2})
    plan = make_plan(model, *MIXTRAL[1:], strategy=dict(ep=8, zero_stage=1))
    argv = megatron_args(plan)
    assert _pairs(argv)["--moe-layer-freq"] == "([0]+[1])*16"
    check_megatron(plan, argv)


@pytest.mark.parametrize("bits", [[0] * 3 + [1] * 58, [0, 1] * 24, [1] * 5, [0, 0, 1] * 4 + [1, 1],
                                  [1, 1, 0, 1, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0], [0] + [1, 1, 0] * 7])
def test_layer_patterns_read_back_as_megatron_reads_them(bits):
    text = layer_pattern(bits)
    assert _megatron_eval(text) == bits == expand_pattern(text)


@pytest.mark.parametrize("text", ["[0]*3+__import__", "([0]*3", "[0,]", "[0]*3)", "[a]"])
def test_expand_pattern_refuses_what_is_not_a_layer_pattern(text):
    with pytest.raises((ValueError, IndexError)):
        expand_pattern(text)


def test_generated_flags_are_megatron_core_transformer_config_fields():
    """Megatron-LM's parser makes these flags from TransformerConfig fields (argument_utils.py
    ArgumentGroupFactory): `--` + the field name with `-`; a bool field defaulting to False is a
    switch; Optional[int] an int; a Literal its choices."""
    from megatron.core.transformer import TransformerConfig

    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    literal = typing.get_type_hints(TransformerConfig)
    for dest in TRANSFORMER_CONFIG_FLAGS:
        flag, field = FLAGS[dest], fields[dest]
        assert flag.flag == "--" + dest.replace("_", "-")
        hint = literal[dest]  # the factory reads Optional[X] as X (argument_utils.py)
        if typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint):
            hint = typing.get_args(hint)[0]
        if hint is bool:
            assert field.default is False and flag.kind == "switch", dest
        else:
            assert flag.kind in ("int", "str"), dest
    assert "alltoall" in typing.get_args(literal["moe_token_dispatcher_type"])
    assert "learnable" in typing.get_args(literal["softmax_type"])


# ---- refusals: each framework's own rule ---------------------------------------------------------
@pytest.mark.parametrize("strategy,match", [
    (dict(ep=3, zero_stage=1), r"ep \(3\) must divide num_experts \(8\)"),
    # 64 GPUs over tp 4 · pp 8 leave dp 2: a stage has 8 ranks, the expert layers would need 4·4
    (dict(tp=4, pp=8, ep=4, etp=4, sequence_parallel=True, zero_stage=1),
     r"ep·etp \(4·4\) must divide tp·cp·dp \(4·1·2 = 8\)"),
])
def test_expert_layout_rules_refuse_for_every_backend(strategy, match):
    plan = make_plan(*MIXTRAL, strategy=strategy)
    for backend in ("megatron", "megatron-bridge", "torchtitan", "colossalai", "deepspeed"):
        with pytest.raises(NotExpressibleError, match=match):
            emit_data(plan, backend)


def test_megatron_refuses_moe_tensor_parallel_without_sequence_parallel():
    plan = make_plan(*MIXTRAL, strategy=dict(tp=2, ep=4, etp=2, zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"MoE with tp \(2\) > 1 and no sequence_parallel"):
        megatron_args(plan)


def test_megatron_refuses_biases_it_cannot_switch_apart():
    model = MIXTRAL_LIKE.model_copy(update={"moe_router_bias": True, "moe_expert_bias": True})
    plan = make_plan(model, *MIXTRAL[1:], strategy=dict(ep=8, zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"linear_bias=False, moe_expert_bias=True.*--disable-bias-linear"):
        megatron_args(plan)


def test_torchtitan_expert_rules():
    etp = make_plan(*MIXTRAL, strategy=dict(tp=4, ep=4, etp=2, sequence_parallel=True, zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"etp \(2\) with ep \(4\) > 1 must be 1 or tp \(4\)"):
        emit(etp, "torchtitan")
    no_ep = make_plan(*MIXTRAL, strategy=dict(tp=2, etp=1, sequence_parallel=True, zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"etp \(1\) with ep 1 must equal tp \(2\)"):
        emit(no_ep, "torchtitan")
    with pytest.raises(NotExpressibleError, match=r"^not expressible in torchtitan: offload_optimizer"):
        emit(ARCHITECTURES["gemma2-like-16xH100-tp2-offload"](), "torchtitan")
    with pytest.raises(NotExpressibleError, match=r"num_mtp_layers \(1\)"):
        emit(ARCHITECTURES["deepseek-v3-like-256xH100-pp8ep8"](), "torchtitan")


@pytest.mark.parametrize("strategy", [dict(tp=2, ep=4, etp=1, sequence_parallel=True, zero_stage=1),
                                      dict(tp=2, ep=4, etp=2, sequence_parallel=True, zero_stage=2),
                                      dict(ep=8, zero_stage=3), dict(tp=4, ep=2, etp=4, sequence_parallel=True)])
def test_torchtitan_reads_moe_plans(strategy, tmp_path):
    plan = make_plan(*MIXTRAL, strategy=strategy)
    text = emit(plan, "torchtitan")
    check_torchtitan(plan, text, tmp_path)
    par = emit_data(plan, "torchtitan")["config"]["parallelism"]
    assert (par["expert_parallel_degree"], par["expert_tensor_parallel_degree"]) == (plan.strategy.ep, plan.strategy.etp)
    assert par["data_parallel_replicate_degree"] == 1  # expert ranks come from dp_shard, never replication


def test_deepspeed_names_the_ep_size_it_cannot_put_in_its_config():
    plan = make_plan(*MIXTRAL, strategy=dict(ep=8, zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"deepspeed\.moe\.layer\.MoE\(ep_size=8, \.\.\.\), not in ds_config"):
        emit(plan, "deepspeed")
    etp = make_plan(*MIXTRAL, strategy=dict(etp=2, zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"etp \(2\) > 1"):
        emit(etp, "deepspeed")
    tp = make_plan(*MIXTRAL, strategy=dict(tp=2, pp=2, sequence_parallel=True, etp=2, zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"etp \(2\) > 1"):
        emit(tp, "megatron-deepspeed")


def test_deepspeed_runs_an_moe_model_on_data_parallelism_with_offload(deepspeed_comm):
    plan = make_plan(*MIXTRAL, strategy=dict(zero_stage=2, offload_optimizer=True))
    data = emit_data(plan, "deepspeed")
    check_deepspeed(plan, data["config"], data["megatron_deepspeed_args"])
    assert data["config"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize("strategy", [dict(tp=2, ep=4, etp=2, sequence_parallel=True, zero_stage=1),
                                      dict(pp=2, ep=8, zero_stage=1, offload_optimizer=True),
                                      dict(tp=2, pp=2, ep=2, etp=2, sequence_parallel=True, zero_stage=0)])
def test_colossalai_moe_plugin(strategy):
    pytest.importorskip("colossalai.booster.plugin")
    plan = make_plan(*MIXTRAL, strategy=strategy)
    spec = emit_data(plan, "colossalai")
    assert spec["plugin"] == "MoeHybridParallelPlugin" and spec["kwargs"]["ep_size"] == plan.strategy.ep
    check_colossalai(plan, spec)


@pytest.mark.parametrize("strategy,match", [
    (dict(tp=2, ep=4, etp=1, sequence_parallel=True, zero_stage=1), r"etp \(1\) must equal tp \(2\)"),
    (dict(tp=2, ep=4, etp=2, sequence_parallel=True, zero_stage=3), r"zero_stage 3 with an MoE model"),
])
def test_colossalai_moe_refusals(strategy, match):
    plan = make_plan(*MIXTRAL, strategy=strategy)
    with pytest.raises(NotExpressibleError, match=match):
        emit(plan, "colossalai")


def test_colossalai_draws_experts_from_data_parallel_ranks_only():
    # 64 experts, tp 2 · cp 2 · dp 16: Megatron puts ep 32 · etp 2 on the 64 ranks of the stage;
    # MoeHybridParallelPlugin needs ep to divide dp (16)
    model = MIXTRAL_LIKE.model_copy(update={"num_experts": 64})
    plan = make_plan(model, *MIXTRAL[1:], strategy=dict(tp=2, cp=2, ep=32, etp=2, zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"ep \(32\) must divide dp \(16\)"):
        emit(plan, "colossalai")


def test_colossalai_refuses_multi_token_prediction():
    with pytest.raises(NotExpressibleError, match=r"num_mtp_layers \(1\); Colossal-AI trains Hugging Face model code"):
        emit(ARCHITECTURES["deepseek-v3-like-256xH100-pp8ep8"](), "colossalai")


def test_deepseek_v3_like_matches_its_published_size():
    # DeepSeek-V3 technical report, abstract: 671B total parameters, 37B activated per token
    # (the 671B excludes the 14B multi-token-prediction module, Sec. 4.2).
    assert num_params(DEEPSEEK_V3_LIKE, include_mtp=False) / 1e9 == pytest.approx(671, rel=0.01)
    assert num_active_params(DEEPSEEK_V3_LIKE) / 1e9 == pytest.approx(37, rel=0.03)


def test_recompute_modules_reach_megatron_and_are_refused_elsewhere():
    """Megatron's --recompute-modules (DeepSeek-V3's RMSNorm, MLA up-projection and SwiGLU
    recompute), checked by megatron-core's own config; the other frameworks refuse them."""
    from planner.emit.megatron import megatron_args

    plan = make_plan(DEEPSEEK_V3_LIKE, "dgx-h100", 256, 1024, 4096,
                     strategy=dict(pp=8, ep=8, zero_stage=1, num_layers_in_first_stage=7, num_layers_in_last_stage=6,
                                   recompute="selective", recompute_modules=["layernorm", "mla_up_proj", "moe_act"]))
    argv = megatron_args(plan)
    i = argv.index("--recompute-modules")
    assert argv[i + 1:i + 4] == ["layernorm", "mla_up_proj", "moe_act"]
    check_megatron(plan, argv)
    assert megatron_configs(argv)["transformer"].recompute_modules == ["layernorm", "mla_up_proj", "moe_act"]
    dense = make_plan("llama3-8b", "dgx-h100", 8, 64, 4096,
                      strategy=dict(zero_stage=1, recompute="selective", recompute_modules=["layernorm", "mlp"]))
    for backend in ("torchtitan", "deepspeed", "colossalai"):
        with pytest.raises(NotExpressibleError, match="recompute_modules"):
            REGISTRY.get(backend).data(dense, EmitOptions())


def test_overlap_moe_comm_reaches_megatron_and_is_refused_elsewhere():
    """--overlap-moe-expert-parallel-comm with interleaving, checked by megatron-core's config (which
    forbids it beside --moe-shared-expert-overlap: the emitter drops that one)."""
    from planner.emit.megatron import megatron_args

    plan = make_plan(MIXTRAL_LIKE, "dgx-h100", 64, 256, 4096,
                     strategy=dict(tp=2, pp=2, vpp=2, ep=8, sequence_parallel=True, zero_stage=1,
                                   overlap_moe_comm=True))
    assert plan.estimate.valid, plan.estimate.reasons
    argv = megatron_args(plan)
    assert "--overlap-moe-expert-parallel-comm" in argv and "--moe-shared-expert-overlap" not in argv
    check_megatron(plan, argv)
    assert megatron_configs(argv)["transformer"].overlap_moe_expert_parallel_comm
    for backend in ("torchtitan", "colossalai"):
        with pytest.raises(NotExpressibleError, match="overlap_moe_comm"):
            REGISTRY.get(backend).data(plan, EmitOptions())


def test_the_routers_fp8_padding_is_written_when_the_plan_has_it():
    """--moe-router-padding-for-quantization: the router pads, so the plan was costed without the grouped MLP's
    padding copies; Megatron-Bridge overrides always carry the field (its gpt-oss and DeepSeek recipes set it)."""
    from planner.emit.megatron_bridge import bridge_overrides

    kwargs = dict(strategy=dict(ep=8, micro_batch_size=4, zero_stage=1), precision="fp8", fp8_recipe="mxfp8",
                  moe_dispatcher="hybridep", fp8_param_gather=True)  # what Bridge's MXFP8 recipe sets
    on = make_plan("qwen3-30b-a3b", "gb200-nvl72", 8, 512, 4096, moe_router_padding_for_quantization=True, **kwargs)
    off = make_plan("qwen3-30b-a3b", "gb200-nvl72", 8, 512, 4096, **kwargs)
    assert "--moe-router-padding-for-quantization" in megatron_args(on)
    assert "--moe-router-padding-for-quantization" not in megatron_args(off)
    assert "model.moe_router_padding_for_quantization=true" in bridge_overrides(on)
    assert "model.moe_router_padding_for_quantization=false" in bridge_overrides(off)
