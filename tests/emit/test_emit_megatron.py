"""Megatron-LM flags and Megatron-Bridge overrides, checked by megatron-core's own config classes (issue 3)."""

from __future__ import annotations

import subprocess

import pytest

from emit_checks import check_bridge, check_megatron, megatron_configs
from emit_plans import PUBLISHED, make_plan
from planner.emit import NotExpressibleError, emit_data
from planner.emit import EmitOptions, get_emitter
from planner.emit.megatron import FLAGS, layout_stages, megatron_args, parse_args, pipeline_layout, settings, to_args

pytest.importorskip("megatron.core")

LLAMA = ("llama3-70b", "dgx-h100", 64, 128, 8192)
EDGE_CASES = {
    "uneven-first-last": ("llama3.1-405b", "dgx-h100", 512, 256, 8192,
                          dict(tp=8, pp=8, num_layers_in_first_stage=15, num_layers_in_last_stage=15,
                               sequence_parallel=True, zero_stage=1, recompute="selective")),
    "uneven-vpp": ("llama3-8b", "dgx-h100", 32, 128, 4096,
                   dict(tp=2, pp=4, vpp=2, num_layers_in_first_stage=6, num_layers_in_last_stage=6,
                        micro_batch_size=1)),
    "explicit-split": ("llama3-8b", "dgx-h100", 32, 128, 4096,
                       dict(tp=2, pp=4, stage_layers=[7, 9, 10, 6], micro_batch_size=1)),
    "explicit-split-vpp": ("llama3-8b", "dgx-h100", 32, 128, 4096,
                           dict(tp=2, pp=4, vpp=2, stage_layers=[6, 10, 12, 4], micro_batch_size=1)),
    # Llama 3 405B (126 layers) on pp 16 with vpp 8, embedding and loss each counted as a layer
    # (Llama 3 paper, Sec. 3.3.2): one layer per virtual stage, none on the first and the last.
    "embedding-loss-as-layer": ("llama3.1-405b", "dgx-h100", 512, 256, 8192,
                                dict(tp=8, pp=16, vpp=8, embedding_as_layer=True, loss_as_layer=True,
                                     sequence_parallel=True, zero_stage=1)),
    "embedding-as-layer-vpp": ("llama3-70b", "dgx-h100", 24, 24, 4096,
                               dict(tp=8, pp=3, vpp=3, embedding_as_layer=True, sequence_parallel=True)),
    # DeepSeek-V3 (61 layers + MTP) on Megatron-Bridge's pp 4 × vp 4 layout, one count per virtual stage
    # (recipes/deepseek/h100/deepseek_v3.py, _get_deepseek_v3_pipeline_layout; Megatron-Bridge@067f987df):
    # rank 3 holds chunks of 4, 4, 4 and 1 layers, the MTP layer and the loss in its last.
    "deepseek-v3-bridge-layout": ("deepseek-v3", "gb200-nvl72", 256, 4096, 4096,
                                  dict(pp=4, vpp=4, ep=64, stage_layers=[4] * 15 + [1], zero_stage=1,
                                       recompute="full", micro_batch_size=1)),
    # an empty middle virtual stage (megatron-core builds it: `pretty_repr`'s "(empty stage)")
    "empty-virtual-stage": ("llama3-8b", "dgx-h100", 32, 128, 4096,
                            dict(tp=2, pp=4, vpp=2, stage_layers=[4, 4, 4, 4, 0, 4, 4, 8], micro_batch_size=1)),
    "fsdp-zero3-cp": LLAMA + (dict(cp=4, zero_stage=3, recompute="full", recompute_num_layers=2),),
    "zero2-tp": LLAMA + (dict(tp=8, zero_stage=2, sequence_parallel=True),),
    "offload": LLAMA + (dict(tp=8, pp=2, zero_stage=1, offload_optimizer=True),),
    "activation-offload": LLAMA + (dict(tp=8, sequence_parallel=True, zero_stage=1, offload_activation_layers=40),),
    "no-overlap": LLAMA + (dict(tp=8, pp=4, zero_stage=1, overlap_grad_reduce=False, overlap_param_gather=False),),
    # Llama 3's placement ([TP, CP, PP, DP], Llama 3 paper Sec. 3.3.2): Megatron's --use-tp-pp-dp-mapping
    "tp-pp-dp-mapping": LLAMA + (dict(tp=4, pp=4, zero_stage=1, sequence_parallel=True, rank_order="tp-cp-ep-pp-dp"),),
}


def edge_plan(name: str, **train):
    *question, strategy = EDGE_CASES[name]
    return make_plan(*question, strategy=strategy, **train)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_plans_build_megatron_core_configs(name):
    plan = PUBLISHED[name]()
    check_megatron(plan, megatron_args(plan))
    if (plan.train.precision == "fp16") == (plan.train.grad_precision == "fp16"):
        check_bridge(plan, emit_data(plan, "megatron-bridge")["overrides"])
    else:  # the recipe's own gradient reduction precision would win over the plan's
        with pytest.raises(NotExpressibleError, match="mixed-precision recipe sets ddp.grad_reduce_in_fp32"):
            emit_data(plan, "megatron-bridge")


@pytest.mark.parametrize("precision,grads,recipe", [
    ("bf16", "fp32", "bf16_mixed"), ("fp8", "fp32", "bf16_with_fp8_delayed_scaling_mixed"),
    ("fp16", "fp16", "fp16_mixed"), ("bf16", "bf16", None), ("fp16", "fp32", None)])
def test_bridge_precision_recipe_keeps_the_planned_gradient_reduction(precision, grads, recipe):
    fp8 = {"fp8_param_gather": True} if precision == "fp8" else {}  # what the FP8 recipe sets (below)
    plan = make_plan(*LLAMA, strategy=dict(tp=8, pp=2, zero_stage=1), precision=precision, grad_precision=grads,
                     **fp8)
    if recipe is None:
        with pytest.raises(NotExpressibleError, match=rf"grad_precision '{grads}' with precision '{precision}'"):
            emit_data(plan, "megatron-bridge")
    else:
        assert f"mixed_precision={recipe}" in emit_data(plan, "megatron-bridge")["overrides"]


def test_bridge_megatron_fsdp_uses_the_fsdp_checkpoint_format():
    for zero, expected in ((1, False), (2, True), (3, True)):
        lines = emit_data(make_plan(*LLAMA, strategy=dict(tp=8, zero_stage=zero)), "megatron-bridge")["overrides"]
        assert ("checkpoint.ckpt_format=fsdp_dtensor" in lines) == expected


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases_build_megatron_core_configs(name):
    plan = edge_plan(name)
    check_megatron(plan, megatron_args(plan))
    check_bridge(plan, emit_data(plan, "megatron-bridge")["overrides"])
    check_bridge(plan, emit_data(plan, "megatron-bridge", EmitOptions(bridge_version="0.3"))["overrides"], "0.3")


@pytest.mark.parametrize("precision,grads", [("fp8", "fp32"), ("fp16", "fp32"), ("fp16", "fp16"), ("bf16", "bf16")])
def test_precision_flags(precision, grads):
    plan = make_plan(*LLAMA, strategy=dict(tp=8, pp=2, zero_stage=1), precision=precision, grad_precision=grads)
    argv = megatron_args(plan)
    check_megatron(plan, argv)
    if precision == "fp8":
        assert argv[argv.index("--fp8-format") + 1] == "hybrid" and "--bf16" in argv
        assert megatron_configs(argv)["transformer"].fp8_recipe == "delayed"


def test_fp8_param_gather_is_written_and_megatron_core_builds_it():
    plan = make_plan(*LLAMA, strategy=dict(tp=8, pp=2, zero_stage=1), precision="fp8", fp8_param_gather=True)
    argv = megatron_args(plan)
    assert "--fp8-param-gather" in argv and "--reuse-grad-buf-for-mxfp8-param-ag" not in argv
    check_megatron(plan, argv)  # TransformerConfig(fp8_param=True), DistributedDataParallelConfig(fp8_param_gather=True)
    assert "--fp8-param-gather" not in megatron_args(make_plan(*LLAMA, strategy=dict(tp=8, pp=2, zero_stage=1),
                                                                 precision="fp8"))


def test_transformer_engines_cross_entropy_is_written_and_megatron_core_builds_it():
    """A plan costed with Transformer Engine's cross-entropy asks Megatron for it; megatron-core's own default
    (native) is left unwritten."""
    te = make_plan(*LLAMA, strategy=dict(tp=8, pp=2, zero_stage=1), cross_entropy_fusion_impl="te")
    argv = megatron_args(te)
    assert argv[argv.index("--cross-entropy-fusion-impl") + 1] == "te" and "--cross-entropy-loss-fusion" in argv
    check_megatron(te, argv)  # TransformerConfig(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    native = megatron_args(make_plan(*LLAMA, strategy=dict(tp=8, pp=2, zero_stage=1)))
    assert "--cross-entropy-loss-fusion" in native and "--cross-entropy-fusion-impl" not in native


@pytest.mark.parametrize("zero,reuse", [(1, True), (2, False), (3, False)])
def test_mxfp8_parameters_reuse_the_gradient_buffer_on_the_distributed_optimizer(zero, reuse):
    """megatron-core's OptimizerConfig warns of "significant" extra memory for mxfp8 without the flag;
    Megatron-LM turns it off under Megatron-FSDP."""
    plan = make_plan("llama3-70b", "dgx-b200", 64, 128, 8192, strategy=dict(tp=8, zero_stage=zero,
                                                                             sequence_parallel=True),
                     precision="fp8", fp8_recipe="mxfp8", fp8_param_gather=True)
    argv = megatron_args(plan)
    assert ("--reuse-grad-buf-for-mxfp8-param-ag" in argv) == reuse
    check_megatron(plan, argv)


@pytest.mark.parametrize("strategy,fp8_recipe,reason", [
    (dict(tp=8, zero_stage=0), "delayed", "fp8_param_gather with zero_stage 0"),
    (dict(tp=8, zero_stage=1, offload_optimizer=True), "tensorwise", "fp8_param_gather with offload_optimizer")])
def test_fp8_param_gather_without_what_megatron_lm_needs_is_refused(strategy, fp8_recipe, reason):
    plan = make_plan(*LLAMA, strategy=strategy, precision="fp8", fp8_recipe=fp8_recipe, fp8_param_gather=True)
    with pytest.raises(NotExpressibleError, match=rf"^not expressible in Megatron-LM: {reason}"):
        megatron_args(plan)


@pytest.mark.parametrize("fp8_recipe,param_gather,recipe", [
    ("delayed", True, "bf16_with_fp8_delayed_scaling_mixed"), ("delayed", False, None),
    ("blockwise", False, "bf16_with_fp8_subchannel_scaling_mixed"), ("blockwise", True, None),
    ("tensorwise", True, None)])
def test_bridge_fp8_recipe_carries_the_planned_fp8_parameters(fp8_recipe, param_gather, recipe):
    """Megatron-Bridge's FP8 recipes set fp8_param_gather over any override (mixed_precision.py)."""
    plan = make_plan(*LLAMA, strategy=dict(tp=8, pp=2, zero_stage=1), precision="fp8", fp8_recipe=fp8_recipe,
                     fp8_param_gather=param_gather)
    if recipe is None:
        with pytest.raises(NotExpressibleError, match=rf"fp8_(param_gather {param_gather}|recipe 'tensorwise')"):
            emit_data(plan, "megatron-bridge")
    else:
        lines = emit_data(plan, "megatron-bridge")["overrides"]
        assert f"mixed_precision={recipe}" in lines
        check_bridge(plan, lines)


def test_unrepresentable_grad_precision_is_refused():
    plan = make_plan(*LLAMA, strategy=dict(tp=8, pp=2), grad_precision="fp16")
    with pytest.raises(NotExpressibleError, match=r"^not expressible in Megatron-LM: grad_precision 'fp16'"):
        megatron_args(plan)


@pytest.mark.parametrize("name", ["uneven-first-last", "explicit-split-vpp", "embedding-loss-as-layer",
                                  "activation-offload"])
def test_flags_round_trip_through_the_mapping_table(name):
    plan = edge_plan(name)
    values = settings(plan)
    assert parse_args(to_args(values)) == {k: v for k, v in values.items()}
    assert len({f.flag for f in FLAGS.values()}) == len(FLAGS)  # one destination per flag


def test_model_shape_flags_for_gqa_swiglu_rmsnorm_rope():
    argv = megatron_args(make_plan(*LLAMA, strategy=dict(tp=8, pp=4, zero_stage=1)))
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--num-query-groups"] == "8" and "--group-query-attention" in argv
    assert "--swiglu" in argv and pairs["--normalization"] == "RMSNorm"
    assert pairs["--position-embedding-type"] == "rope" and "--untie-embeddings-and-output-weights" in argv
    assert "--disable-bias-linear" in argv


def test_gpt3_shape_flags():
    argv = megatron_args(PUBLISHED["gpt3-175b-1024xA100-tp8pp8"]())
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--position-embedding-type"] == "learned_absolute" and pairs["--max-position-embeddings"] == "2048"
    assert pairs["--attention-dropout"] == "0.1" and "--disable-bias-linear" not in argv and "--swiglu" not in argv
    assert "--fp16" in argv and "--accumulate-allreduce-grads-in-fp32" in argv


# ---- what megatron-core accepts but is wrong: our own checks (issue 3) ----------------------------
def test_kv_heads_not_divisible_by_tp_is_refused_though_megatron_core_accepts_it():
    # llama3-70b has 8 KV heads; megatron-core takes tp=16 (it replicates KV heads when tp is a
    # multiple of them), but the planner's memory and FLOP model shards them, so the flags would not
    # run the plan that was scored.
    plan = make_plan(*LLAMA, strategy=dict(tp=16, pp=1, cp=1, zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"tp \(16\) must divide num_kv_heads \(8\)"):
        megatron_args(plan)
    values = dict(settings(make_plan(*LLAMA, strategy=dict(tp=8, pp=1, zero_stage=1))), tensor_model_parallel_size=16)
    assert megatron_configs(to_args(values))["transformer"].num_query_groups == 8  # megatron-core accepted it


def test_layers_not_divisible_by_pp_vpp_is_refused_though_megatron_core_accepts_it():
    plan = make_plan(*LLAMA, strategy=dict(tp=8, pp=8, vpp=3, zero_stage=1))  # 80 layers, 8·3 = 24
    with pytest.raises(NotExpressibleError, match=r"pp·vpp \(8·3\) must divide num_layers \(80\)"):
        megatron_args(plan)
    good = settings(make_plan(*LLAMA, strategy=dict(tp=8, pp=8, vpp=2, zero_stage=1)))
    bad = to_args(dict(good, num_virtual_stages_per_pipeline_rank=3))
    assert megatron_configs(bad)["transformer"].virtual_pipeline_model_parallel_size == 3  # accepted


def test_experts_not_divisible_by_ep_is_refused():
    # ModelSpec has no experts yet: any ep > 1 is refused before megatron-core (which would raise
    # "num_moe_experts must be non None to use expert-parallel") sees it.
    plan = make_plan(*LLAMA, strategy=dict(tp=8, pp=1, zero_stage=1))
    bad = plan.model_copy(update={"strategy": plan.strategy.model_copy(update={"ep": 2})})
    with pytest.raises(NotExpressibleError, match=r"ep \(2\) and etp \(1\) must be 1: model llama3-70b is dense"):
        megatron_args(bad)


def test_bridge_overrides_use_megatron_core_field_names():
    overrides = emit_data(edge_plan("uneven-first-last"), "megatron-bridge")["overrides"]
    assert "model.num_layers_in_first_pipeline_stage=15" in overrides
    assert "model.sequence_parallel=true" in overrides and "mixed_precision=bf16_mixed" in overrides
    assert "train.global_batch_size=256" in overrides


# ---- the stage split (issue 7) --------------------------------------------------------------------
def test_explicit_split_is_a_pipeline_layout_that_fixes_vpp():
    argv = megatron_args(edge_plan("explicit-split-vpp"))
    pairs = dict(zip(argv, argv[1:]))
    # schedule order c·pp + r: rank r's layers split evenly over its two chunks
    assert pairs["--pipeline-model-parallel-layout"] == "Et*3|t*5|t*6|t*2|t*3|t*5|t*6|t*2L"
    assert "--num-virtual-stages-per-pipeline-rank" not in argv  # Megatron-LM allows one of the two
    layout = megatron_configs(argv)["transformer"].pipeline_model_parallel_layout
    assert layout.virtual_pipeline_model_parallel_size == 2
    from megatron.core.transformer.enums import LayerType

    per_rank = [sum(chunk.count(LayerType.decoder) for chunk in rank) for rank in layout.layout]
    assert per_rank == [6, 10, 12, 4]  # stage_layers


def test_embedding_and_loss_as_layers_are_megatrons_split_flags():
    argv = megatron_args(edge_plan("embedding-loss-as-layer"))
    assert "--account-for-embedding-in-pipeline-split" in argv and "--account-for-loss-in-pipeline-split" in argv
    assert "--pipeline-model-parallel-layout" not in argv
    assert not any(a.startswith("--account-for") for a in megatron_args(make_plan(*LLAMA, strategy=dict(tp=8, pp=4))))


@pytest.mark.parametrize("counts,text", [([3] + [4] * 30 + [3], "Et*3|(t*4|)*30,t*3L"), ([1, 2, 2, 3], "Et|t*2|t*2|t*3L"),
                                         ([0, 2, 2, 1], "E|t*2|t*2|tL"), ([2] * 8, "Et*2|(t*2|)*6,t*2L")])
def test_pipeline_layout_strings_parse_to_the_same_counts_in_megatron_core(counts, text):
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    assert pipeline_layout(counts) == text
    parsed = PipelineParallelLayerLayout.parse_str_to_list(text)
    assert [stage.count(LayerType.decoder) for stage in parsed] == counts
    assert parsed[0][0] == LayerType.embedding and parsed[-1][-1] == LayerType.loss
    assert len(layout_stages(text)) == PipelineParallelLayerLayout.get_num_stages_from_str(text)


def test_bridge_quotes_the_layout_for_hydra_and_bash(tmp_path):
    plan = edge_plan("explicit-split")
    overrides = emit_data(plan, "megatron-bridge")["overrides"]
    assert 'model.pipeline_model_parallel_layout="Et*7|t*9|t*10|t*6L"' in overrides
    script = tmp_path / "o.sh"
    script.write_text(get_emitter("megatron-bridge").render(plan, EmitOptions()) + 'printf "%s\\n" "${OVERRIDES[@]}"\n')
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.splitlines() == overrides  # bash hands every override over intact


@pytest.mark.parametrize("kernel,backend", [("flash", "auto"), ("flash2", "flash"), ("unfused", "unfused")])
def test_attention_backend_is_the_kernel_the_plan_is_timed_with(kernel, backend):
    """flash is timed as cuDNN on Hopper and Blackwell: `auto` (Transformer Engine prefers its cuDNN FusedAttention
    there); flash2 is the flash-attn package (`flash`: NVTE_FLASH_ATTN=1, NVTE_FUSED_ATTN=0)."""
    plan = make_plan(*LLAMA, strategy=dict(tp=8, pp=2, zero_stage=1), attention_kernel=kernel)
    argv = megatron_args(plan)
    assert argv[argv.index("--attention-backend") + 1] == backend
    check_megatron(plan, argv)


def test_flashattention_v1_has_no_megatron_backend():
    """Transformer Engine has no FlashAttention v1 backend: a plan timed with it is refused, as the framework's
    cannot_run rule refuses it in planning."""
    plan = make_plan(*LLAMA, strategy=dict(tp=8, pp=2, zero_stage=1), attention_kernel="flash1", framework="torchtitan")
    with pytest.raises(NotExpressibleError, match=r"attention_kernel 'flash1'.*FlashAttention v1"):
        megatron_args(plan)


# ---- uneven interleaved layouts: one count per virtual stage ----------------------------------------
def test_deepseek_v3_bridge_layout_is_bridges_own_string_and_megatron_core_reads_it_back():
    """The plan's pp 4 × vp 4 layout is written as Megatron-Bridge's GB300 recipe spells it
    (perf_recipes/deepseek/gb300/deepseek_v3.py: "Et*4|(t*4|)*14tmL"; commas are cosmetic) and
    megatron-core's own `PipelineParallelLayerLayout` puts 4, 4, 4, 1 layers and the MTP layer on rank 3."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    plan = edge_plan("deepseek-v3-bridge-layout")
    argv = megatron_args(plan)
    text = dict(zip(argv, argv[1:]))["--pipeline-model-parallel-layout"]
    assert text.replace(",", "") == "Et*4|(t*4|)*14tmL"
    layout = PipelineParallelLayerLayout(text, 4)
    assert layout.virtual_pipeline_model_parallel_size == 4
    assert layout.validate_layer_layout(num_layers=61, mtp_num_layers=1) is False  # MTP on the last rank
    assert [chunk.count(LayerType.decoder) for chunk in layout.layout[3]] == [4, 4, 4, 1]
    assert layout.layout[3][-1][-2:] == [LayerType.mtp, LayerType.loss]
    assert [sum(c.count(LayerType.decoder) for c in rank) for rank in layout.layout] == [16, 16, 16, 13]
    assert "--num-virtual-stages-per-pipeline-rank" not in argv
    overrides = emit_data(plan, "megatron-bridge")["overrides"]
    assert f'model.pipeline_model_parallel_layout="{text}"' in overrides


def test_empty_virtual_stage_is_an_empty_megatron_stage():
    argv = megatron_args(edge_plan("empty-virtual-stage"))
    text = dict(zip(argv, argv[1:]))["--pipeline-model-parallel-layout"]
    assert layout_stages(text)[4] == ""


# ---- activation offloading -------------------------------------------------------------------------
def test_activation_offload_is_megatron_lms_cpu_offloading_num_layers():
    """Megatron-LM core_r0.16 generates `--cpu-offloading-num-layers` from TransformerConfig and has no
    `--cpu-offloading` switch (arguments.py excludes that field; validate_args sets it when N > 0), so
    only the count is written; megatron-core then offloads the activations, not the weights, of 40 layers."""
    plan = edge_plan("activation-offload")
    argv = megatron_args(plan)
    assert argv[argv.index("--cpu-offloading-num-layers") + 1] == "40" and "--cpu-offloading" not in argv
    tc = megatron_configs(argv)["transformer"]
    assert (tc.cpu_offloading, tc.cpu_offloading_num_layers) == (True, 40)
    assert tc.cpu_offloading_activations and not tc.cpu_offloading_weights
    assert "model.cpu_offloading_num_layers=40" in emit_data(plan, "megatron-bridge")["overrides"]
    off = megatron_args(make_plan(*LLAMA, strategy=dict(tp=8, sequence_parallel=True, zero_stage=1)))
    assert "--cpu-offloading-num-layers" not in off
    assert not megatron_configs(off)["transformer"].cpu_offloading


@pytest.mark.parametrize("update,base,reason,core_error", [
    # Strategy's own validator refuses pp > 1 and recomputation with offloading; a plan edited past it still
    # meets the emitter's refusal, which is megatron-core's rule (TransformerConfig.__post_init__)
    (dict(offload_activation_layers=80), dict(tp=8, zero_stage=1),
     r"offload_activation_layers \(80\) must be below num_layers \(80\)", "only for layers less than 80"),
    (dict(offload_activation_layers=20), dict(tp=8, pp=2, zero_stage=1),
     r"offload_activation_layers \(20\) with pp \(2\)", "no support for Pipeline parallelism"),
    (dict(offload_activation_layers=20), dict(tp=8, zero_stage=1, recompute="selective"),
     r"offload_activation_layers \(20\) with pp \(1\) and recompute 'selective'", "recomputation is enabled"),
])
def test_activation_offload_megatron_core_refuses_is_refused(update, base, reason, core_error):
    good = make_plan(*LLAMA, strategy=base)
    bad = good.model_copy(update={"strategy": good.strategy.model_copy(update=update)})
    for backend in ("megatron", "megatron-bridge"):
        with pytest.raises(NotExpressibleError, match=reason):
            emit_data(bad, backend)
    flags = to_args(dict(settings(good), cpu_offloading_num_layers=update["offload_activation_layers"]))
    with pytest.raises(ValueError, match=core_error):  # megatron-core would have refused the flags
        megatron_configs(flags)


@pytest.mark.parametrize("vpp,overlap,flag,core", [(4, True, False, True), (4, False, True, False),
                                                   (1, True, False, False), (1, False, False, False)])
def test_p2p_overlap_is_megatrons_default_for_interleaving_and_its_flag_turns_it_off(vpp, overlap, flag, core):
    """Megatron-LM overlaps an interleaved schedule's transfers unless --no-overlap-p2p-communication, and
    turns the overlap off itself without interleaving; megatron-core then batches the transfers."""
    plan = make_plan(*LLAMA, strategy=dict(tp=2, pp=4, vpp=vpp, zero_stage=1, overlap_p2p_comm=overlap))
    argv = megatron_args(plan)
    assert ("--no-overlap-p2p-communication" in argv) is flag
    check_megatron(plan, argv)
    config = megatron_configs(argv)["parallel"]
    assert config.overlap_p2p_comm is core and config.batch_p2p_comm is (not core)
    bridge = get_emitter("megatron-bridge").render(plan, EmitOptions())
    assert f"model.overlap_p2p_comm={str(core).lower()}" in bridge
    assert f"model.batch_p2p_comm={str(not core).lower()}" in bridge


@pytest.mark.parametrize("model,cluster,gpus,strategy", [
    ("gpt-oss-120b", "dgx-b200", 64, dict(dp=64, ep=8, zero_stage=1)),
    ("gemma-2-27b", "dgx-h100", 16, dict(dp=2, tp=8, sequence_parallel=True, zero_stage=1))])
def test_the_gate_activation_reaches_megatron_core(model, cluster, gpus, strategy):
    """gpt-oss's --quick-geglu builds megatron-core's quick_gelu gate (its offset and clamp are reported as dropped);
    Gemma's GeGLU, which has no flag, builds SwiGLU and is reported."""
    plan = make_plan(model, cluster, gpus, 64, 4096, strategy)
    check_megatron(plan, megatron_args(plan))


# ---- the model's norm epsilon --------------------------------------------------------------------
QWEN2_SMALL = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
               "num_key_value_heads": 2, "intermediate_size": 2816, "vocab_size": 151936, "rms_norm_eps": 1e-6,
               "rope_theta": 1000000.0, "max_position_embeddings": 32768}


def test_a_qwen2_norm_epsilon_reaches_megatron_core_and_bridge():
    """A Qwen2 config.json's rms_norm_eps (1e-6) is --norm-epsilon and megatron-core's layernorm_epsilon, not
    Megatron's default 1e-5 applied silently."""
    from planner.specs.hf import read_hf_config

    plan = make_plan(read_hf_config(QWEN2_SMALL), "dgx-h100", 8, 16, 2048, strategy=dict(tp=2))
    argv = megatron_args(plan)
    assert dict(zip(argv, argv[1:]))["--norm-epsilon"] == "1e-06"
    assert megatron_configs(argv)["transformer"].layernorm_epsilon == 1e-6
    assert "model.layernorm_epsilon=1e-06" in emit_data(plan, "megatron-bridge")["overrides"]


def test_megatrons_default_norm_epsilon_is_written_too():
    argv = megatron_args(make_plan(*LLAMA, strategy=dict(tp=8, pp=4, zero_stage=1)))
    assert dict(zip(argv, argv[1:]))["--norm-epsilon"] == "1e-05"
    assert megatron_configs(argv)["transformer"].layernorm_epsilon == 1e-5


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_rank_order_is_megatrons_mapping_and_megatron_core_builds_the_same_groups(order):
    """The emitted switch gives megatron-core's RankGenerator the plan's order, and its tensor, pipeline and
    data-parallel groups are the ones the cost model priced (ParallelLayout)."""
    from megatron.core.parallel_state import RankGenerator

    from cost_models.layout import ParallelLayout

    p = make_plan(*LLAMA, strategy=dict(tp=4, pp=4, zero_stage=1, sequence_parallel=True, rank_order=order))
    args = megatron_args(p)
    assert ("--use-tp-pp-dp-mapping" in args) == (order != "tp-cp-ep-dp-pp")
    emitted_order = megatron_configs(args)["initialize"]["order"]
    assert emitted_order == order
    s = p.strategy
    gen = RankGenerator(tp=s.tp, ep=1, dp=s.dp, pp=s.pp, cp=s.cp, order=emitted_order)
    lay = ParallelLayout.of_strategy(s, p.model.num_layers)
    for dim in ("tp", "pp", "dp"):
        size, stride = int(getattr(lay, dim)[0]), int(lay.stride(dim)[0])
        ours = sorted(sorted(lay.rank(**{**lay.coords(r), dim: i}) for i in range(size)) for r in range(64)
                      if lay.coords(r)[dim] == 0)
        assert sorted(sorted(g) for g in gen.get_ranks(dim)) == ours, dim
        assert all(g[1] - g[0] == stride for g in gen.get_ranks(dim) if len(g) > 1), dim
    bridge = emit_data(p, "megatron-bridge")
    text = str(bridge)
    assert ("dist.use_tp_pp_dp_mapping" in text) == (order != "tp-cp-ep-dp-pp")


@pytest.mark.parametrize("backend", ["deepspeed", "torchtitan", "colossalai"])
def test_other_frameworks_refuse_megatrons_tp_pp_dp_mapping(backend):
    p = make_plan(*LLAMA, strategy=dict(tp=4, pp=4, zero_stage=1, sequence_parallel=True, rank_order="tp-cp-ep-pp-dp"))
    with pytest.raises(NotExpressibleError, match="rank_order 'tp-cp-ep-pp-dp'.*only"):
        emit_data(p, backend)
