"""Colossal-AI plugin kwargs, bound to the real plugin constructors' signatures (issue 3).

The plugins are not instantiated: their constructors need a torch.distributed
process group of the plan's world size.
"""

from __future__ import annotations

import ast
import json

import pytest

from emit_checks import check_colossalai
from emit_plans import PUBLISHED, make_plan
from planner.emit import NotExpressibleError, emit, emit_data
from planner.emit.colossalai import plugin_json, plugin_spec

pytest.importorskip("colossalai.booster.plugin")

LLAMA8 = ("llama3-8b", "dgx-h100", 16, 64, 4096)
LLAMA70 = ("llama3-70b", "dgx-h100", 64, 128, 8192)
LLAMA8_24 = ("llama3-8b", "dgx-h100", 24, 48, 4096)


@pytest.mark.parametrize("question,strategy,plugin", [
    (LLAMA8, dict(zero_stage=0), "HybridParallelPlugin"),
    (LLAMA8, dict(zero_stage=1), "LowLevelZeroPlugin"),
    (LLAMA8, dict(zero_stage=2, offload_optimizer=True), "LowLevelZeroPlugin"),
    (LLAMA8, dict(zero_stage=3, recompute="full"), "GeminiPlugin"),
    (LLAMA8, dict(tp=4, zero_stage=3, sequence_parallel=True), "GeminiPlugin"),
    (LLAMA8, dict(tp=2, pp=2, zero_stage=1, sequence_parallel=True, recompute="full", recompute_num_layers=2),
     "HybridParallelPlugin"),
    (LLAMA8, dict(tp=2, cp=2, zero_stage=2, recompute="selective"), "HybridParallelPlugin"),
    (LLAMA70, dict(tp=8, pp=8, vpp=2, zero_stage=1, sequence_parallel=True, recompute="full"), "HybridParallelPlugin"),
    (LLAMA70, dict(tp=8, pp=8, vpp=2, zero_stage=1, overlap_p2p_comm=False), "HybridParallelPlugin"),
    (("llama3.1-405b", "dgx-h100", 512, 256, 8192),
     dict(tp=8, pp=8, num_layers_in_first_stage=15, num_layers_in_last_stage=15, zero_stage=1), "HybridParallelPlugin"),
    (LLAMA8, dict(tp=2, pp=4, stage_layers=[7, 9, 10, 6], zero_stage=1, recompute="full"), "HybridParallelPlugin"),
    (LLAMA8_24, dict(tp=2, pp=3, embedding_as_layer=True, zero_stage=1), "HybridParallelPlugin"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_kwargs_bind_to_the_real_constructor(question, strategy, plugin):
    plan = make_plan(*question, strategy=strategy)
    spec = emit_data(plan, "colossalai")
    assert spec["plugin"] == plugin
    check_colossalai(plan, spec)
    assert json.loads(plugin_json(plan)) == spec


def test_published_llama_plan_uses_ring_attention_and_interleaving():
    plan = PUBLISHED["llama3-70b-64xH100-tp4pp4cp2vpp5"]
    with pytest.raises(NotExpressibleError, match="cp \\(2\\) > 1 with sequence_parallel"):
        plugin_spec(plan())
    no_sp = make_plan(*LLAMA70, strategy=dict(tp=4, pp=4, cp=2, vpp=5, zero_stage=1))
    spec = plugin_spec(no_sp)
    check_colossalai(no_sp, spec)
    kw = spec["kwargs"]
    assert (kw["sequence_parallelism_mode"], kw["sp_size"]) == ("ring_attn", 2)
    assert (kw["pp_style"], kw["num_model_chunks"], kw["num_microbatches"]) == ("interleaved", 5, 64)


def test_python_snippet_is_valid_python_with_the_same_kwargs():
    plan = make_plan(*LLAMA8, strategy=dict(tp=2, pp=2, zero_stage=1, recompute="full"))
    tree = ast.parse(emit(plan, "colossalai"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "HybridParallelPlugin"]
    assert len(calls) == 1
    assert {k.arg for k in calls[0].keywords} == set(plugin_spec(plan)["kwargs"])


@pytest.mark.parametrize("strategy,attention,reason", [
    (dict(pp=2, zero_stage=2), "flash", r"zero_stage 2 with pp \(2\) > 1"),
    (dict(pp=2, zero_stage=3), "flash", r"zero_stage 3 with pp \(2\) or cp \(1\) > 1"),
    (dict(tp=2, cp=2, sequence_parallel=True), "flash", r"cp \(2\) > 1 with sequence_parallel"),
    (dict(recompute="full", recompute_num_layers=4), "flash", r"recompute_num_layers \(4\) without pipeline"),
    (dict(recompute="selective"), "unfused", r"selective recompute with the unfused attention kernel"),
    (dict(pp=4, vpp=2, stage_layers=[6, 10, 12, 4]), "flash", r"stage_layers \[6, 10, 12, 4\] with vpp \(2\) > 1"),
    (dict(pp=2, vpp=2, stage_layers=[10, 8, 6, 8]), "flash", r"stage_layers \[10, 8, 6, 8\] with vpp \(2\) > 1"),
])
def test_what_colossalai_cannot_express_is_refused(strategy, attention, reason):
    plan = make_plan(*LLAMA8, strategy=strategy, attention_kernel=attention)
    with pytest.raises(NotExpressibleError, match="^not expressible in Colossal-AI: " + reason):
        emit(plan, "colossalai")


def test_split_with_one_chunk_per_stage_is_the_stage_managers_layer_counts():
    explicit = plugin_spec(make_plan(*LLAMA8, strategy=dict(tp=2, pp=4, stage_layers=[7, 9, 10, 6], zero_stage=1)))
    assert explicit["kwargs"]["num_layers_per_stage"] == [7, 9, 10, 6]
    # 32 layers + the embedding over 3 stages: 11 each, the first one short
    emb = plugin_spec(make_plan(*LLAMA8_24, strategy=dict(tp=2, pp=3, embedding_as_layer=True, zero_stage=1)))
    assert emb["kwargs"]["num_layers_per_stage"] == [10, 11, 11]


def test_embedding_as_layer_with_interleaving_is_refused():
    # 80 layers + the embedding = 81 over pp·vpp = 9 virtual stages: Colossal-AI's even split cannot say it
    plan = make_plan("llama3-70b", "dgx-h100", 24, 24, 4096, strategy=dict(tp=8, pp=3, vpp=3, embedding_as_layer=True))
    with pytest.raises(NotExpressibleError, match=r"^not expressible in Colossal-AI: embedding_as_layer with vpp \(3\)"):
        emit(plan, "colossalai")


def test_flash2_keeps_colossalais_flash_attention():
    """Colossal-AI's enable_flash_attention runs its ColoAttention (flash-attn 2 on CUDA): both fused kernels set it."""
    for kernel in ("flash", "flash2", "flash1"):
        spec = plugin_spec(make_plan(*LLAMA8, strategy=dict(tp=2, zero_stage=1), attention_kernel=kernel,
                                     framework="colossalai"))
        assert spec["kwargs"]["enable_flash_attention"] is True
        assert any("faster than planned" in n for n in spec["notes"]) == (kernel == "flash1")


@pytest.mark.parametrize("overlap", [True, False])
def test_interleaved_transfers_overlap_unless_the_plan_turns_it_off(overlap):
    plan = make_plan(*LLAMA70, strategy=dict(tp=8, pp=8, vpp=2, zero_stage=1, overlap_p2p_comm=overlap))
    kw = plugin_spec(plan)["kwargs"]
    assert kw.get("overlap_p2p", True) is overlap  # absent: the plugin's default, True
