"""The megatron-bridge overrides for Megatron-Bridge 0.6.0 (`bridge_version="0.6"`, the default) name only
config paths that release accepts, set the sequence length where it reads it, and pick mixed-precision
recipes whose settings the emitter's refusal rules assume; the same for Megatron-Bridge's main branch at commit
067f987df (`bridge_version="main"`), whose Llama recipes nest the model's transformer fields (below).

Megatron-Bridge 0.6.0 cannot run here: its wheel needs Python 3.12 and a development megatron-core (0.19.0,
Megatron-LM main at the commit its 3rdparty/Megatron-LM submodule pins) that no package index carries, so the
0.3.1 path of tests/emit/test_emit_bridge_upstream.py (the real recipe, Hydra overrides and validate()) has
no 0.6.0 counterpart. Instead, tests/emit/data/megatron_bridge_0.6.0_fields.json records, for Megatron-Bridge
tag v0.6.0 (commit 51885cf132b2814188b6855c25a8588254274c2a, whose source matches the 0.6.0 wheel on PyPI) and
Megatron-LM commit cd4afffa648426a959dc7cb1e24b5ce7d0c3ff54, the field names of every ConfigContainer section
the emitter writes and the settings of every registered mixed-precision recipe. It was extracted from the two
repositories' source by tests/emit/bridge_fields_extract.py (its docstring says how: `git show` and `ast`, no
import, nothing copied); run against tag v0.3.1 the same extraction reproduces `dataclasses.fields()` of the
installed 0.3.1 exactly, section by section. Megatron-Bridge builds its override tree from
`dataclasses.fields()` (training/utils/omegaconf_utils.py) and Hydra refuses a key missing from it
("Could not override 'model.x'"), so a key outside the lists is one 0.6.0 would reject.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from emit_plans import ARCHITECTURES, PUBLISHED, make_plan

from planner.emit import EmitOptions, emit, emit_data
from planner.emit.base import BRIDGE_VERSIONS, DEFAULT_BRIDGE_VERSION, NotExpressibleError
from planner.emit.megatron_bridge import (FP8_MIXED_PRECISION, RECIPE_FAMILIES, RECIPE_GRAD_REDUCE_IN_FP32,
                                         bridge_overrides)
from planner.errors import SpecError

DATA = json.loads((Path(__file__).parent / "data" / "megatron_bridge_0.6.0_fields.json").read_text())
SECTIONS = {name: frozenset(section["fields"]) for name, section in DATA["sections"].items()}
RECIPES = DATA["mixed_precision_recipes"]

#: plans over the knobs the emitter maps: layouts, uneven and explicit splits, recompute, FSDP, offload, EP/ETP,
#: latent attention, windows, fp16 / fp8 recipes and the pipeline-outermost rank order
STRATEGIES = [
    ("llama3.1-8b", 16, 64, 4096, "bf16", dict(tp=2, pp=2, sequence_parallel=True, zero_stage=1,
                                               micro_batch_size=2), {}),
    ("llama3.1-8b", 32, 128, 8192, "bf16", dict(tp=2, pp=4, vpp=2, cp=2, sequence_parallel=True, zero_stage=1,
                                                 recompute="selective"), {}),
    ("llama3.1-8b", 16, 64, 8192, "bf16", dict(tp=2, pp=4, num_layers_in_first_stage=7, num_layers_in_last_stage=7,
                                                recompute="full", recompute_num_layers=2), {}),
    ("llama3.1-8b", 16, 64, 8192, "bf16", dict(pp=2, embedding_as_layer=True, loss_as_layer=True), {}),
    ("llama3.1-8b", 16, 64, 2048, "bf16", dict(tp=1, zero_stage=3, micro_batch_size=2), {}),
    ("llama3.1-8b", 8, 64, 8192, "bf16", dict(tp=2, sequence_parallel=True, zero_stage=1,
                                              offload_activation_layers=20), {}),
    ("llama3.1-8b", 8, 64, 4096, "bf16", dict(tp=2, sequence_parallel=True, zero_stage=1, offload_optimizer=True), {}),
    ("llama3.1-8b", 16, 64, 4096, "bf16", dict(tp=2, pp=2, zero_stage=1, rank_order="tp-cp-ep-pp-dp"), {}),
    ("llama3.1-8b", 16, 64, 8192, "fp8", dict(tp=4, sequence_parallel=True, zero_stage=1), {"fp8_param_gather": True}),
    ("llama3.1-8b", 16, 64, 8192, "fp8", dict(tp=4, sequence_parallel=True, zero_stage=1), {"fp8_recipe": "blockwise"}),
    ("gpt3-175b", 1024, 1536, 2048, "fp16", dict(tp=8, pp=8, recompute="full"), {"grad_precision": "fp16"}),
    ("deepseek-v2-lite", 32, 256, 4096, "bf16", dict(tp=2, ep=4, etp=2, sequence_parallel=True, cp=2,
                                                      zero_stage=1), {}),
]


def plans():
    out = [(name, build()) for name, build in {**PUBLISHED, **ARCHITECTURES}.items()]
    for model, gpus, gbs, seq, precision, strategy, train in STRATEGIES:
        out.append((f"{model} {precision} {strategy} {train}",
                    make_plan(model, "dgx-h100", gpus, gbs, seq, precision=precision, strategy=strategy, **train)))
    return out


def unknown_paths(overrides: list[str]) -> list[str]:
    """The override keys that are not a field of Megatron-Bridge 0.6.0's ConfigContainer section they name.
    `model` is the GPT provider the dense recipes hold, or the MLA provider of DeepSeek's recipes when the
    overrides turn latent attention on."""
    keys = [item.split("=", 1)[0] for item in overrides]
    mla = "model.multi_latent_attention=true" in overrides
    out = []
    for key in keys:
        section, _, field = key.rpartition(".")
        fields = SECTIONS.get("model[mla]" if section == "model" and mla else section)
        if fields is None or field not in fields:
            out.append(key)
    return out


def test_the_data_file_names_the_release_the_emitter_targets():
    assert DEFAULT_BRIDGE_VERSION == "0.6" and BRIDGE_VERSIONS["0.6"] == "0.6.0"
    assert DATA["megatron_bridge"] == {"repo": "NVIDIA-NeMo/Megatron-Bridge", "tag": "v0.6.0",
                                       "commit": "51885cf132b2814188b6855c25a8588254274c2a"}
    assert DATA["megatron_lm"]["commit"] == "cd4afffa648426a959dc7cb1e24b5ce7d0c3ff54"
    # the extraction reached megatron-core's dataclasses (ModelParallelConfig, TransformerConfig, DDP, optimizer)
    assert {"tensor_model_parallel_size", "num_layers", "seq_length", "cpu_offloading_num_layers"} <= SECTIONS["model"]
    assert {"q_lora_rank", "kv_lora_rank"} <= SECTIONS["model[mla]"] - SECTIONS["model"]
    assert "overlap_grad_reduce" in SECTIONS["ddp"] and "optimizer_offload_fraction" in SECTIONS["optimizer"]


def test_the_check_refuses_a_path_outside_the_release():
    """What the check catches: a nested transformer path (Megatron-Bridge's main branch after 0.6.0), a
    misspelt field, a section the container lacks, and the MLA fields without latent attention on."""
    assert unknown_paths(["model.transformer.tensor_model_parallel_size=4", "model.tensor_model_parallel_sizes=4",
                          "data.seq_length=4096", "model.q_lora_rank=512", "model.seq_length=4096",
                          "mixed_precision=bf16_mixed"]) == [
        "model.transformer.tensor_model_parallel_size", "model.tensor_model_parallel_sizes", "data.seq_length",
        "model.q_lora_rank"]


@pytest.mark.parametrize("name,plan", plans(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_override_is_a_path_of_the_release(name, plan):
    try:
        overrides = bridge_overrides(plan, "0.6")
    except NotExpressibleError:
        pytest.skip("refused for both releases alike (the refusals are tested elsewhere)")
    assert overrides == emit_data(plan, "megatron-bridge")["overrides"]  # 0.6 is the default
    assert unknown_paths(overrides) == []
    values = dict(item.split("=", 1) for item in overrides)
    # 0.6.0's GPTDatasetConfig.finalize() copies seq_length over sequence_length, and its run_recipe.py copies the
    # dataset's seq_length into model.seq_length: the plan's length goes into the dataset's seq_length field
    assert values["dataset.seq_length"] == values["model.seq_length"] == str(plan.train.seq_len)
    assert "dataset.sequence_length" not in values
    recipe = values["mixed_precision"]
    assert recipe in RECIPES
    assert RECIPES[recipe]["grad_reduce_in_fp32"] == (plan.train.grad_precision == "fp32")
    assert RECIPES[recipe]["fp8_param_gather"] == plan.train.fp8_param_gather
    if plan.train.precision == "fp8":
        assert RECIPES[recipe]["fp8"] is not None
        assert RECIPES[recipe]["fp8_recipe"] == plan.train.fp8_recipe
        assert not RECIPES[recipe].get("first_last_layers_bf16")
    else:
        assert RECIPES[recipe]["fp8"] is None


def test_the_grid_reaches_every_section_and_fp8():
    keys = {item.split("=", 1)[0] for _, plan in plans() for item in _expressible(plan)}
    assert {k.rpartition(".")[0] for k in keys} == {"model", "train", "dataset", "ddp", "optimizer", "checkpoint",
                                                    "dist", ""}
    recipes = {item.split("=", 1)[1] for _, plan in plans() for item in _expressible(plan)
               if item.startswith("mixed_precision=")}
    assert {"bf16_mixed", "fp16_mixed", "bf16_with_fp8_delayed_scaling_mixed",
            "bf16_with_fp8_subchannel_scaling_mixed"} <= recipes


def _expressible(plan) -> list[str]:
    try:
        return bridge_overrides(plan, "0.6")
    except NotExpressibleError:
        return []


def test_the_refusal_tables_are_the_release_recipes():
    """RECIPE_GRAD_REDUCE_IN_FP32 and FP8_MIXED_PRECISION are what 0.6.0's recipes set (MixedPrecisionConfig.setup
    writes them over any override), and the current-scaling recipe the emitter refuses keeps the first and last
    layers in bf16."""
    for recipe, fp32 in RECIPE_GRAD_REDUCE_IN_FP32.items():
        assert RECIPES[recipe]["grad_reduce_in_fp32"] is fp32, recipe
    for scaling, (recipe, param_gather) in FP8_MIXED_PRECISION.items():
        assert RECIPES[recipe]["fp8_recipe"] == scaling and RECIPES[recipe]["fp8_param_gather"] is param_gather
        assert RECIPES[recipe]["params_dtype"] == "torch.bfloat16"
    current = RECIPES["bf16_with_fp8_current_scaling_mixed"]
    assert current["fp8_recipe"] == "tensorwise" and current["first_last_layers_bf16"]


def test_the_releases_differ_only_in_the_dataset_sequence_key():
    for _, plan in plans():
        new, old = _expressible(plan), None
        if not new:
            continue
        old = bridge_overrides(plan, "0.3")
        assert [o.replace("dataset.sequence_length=", "dataset.seq_length=") for o in old] == new


def test_an_unknown_bridge_version_is_refused_naming_the_option():
    plan = PUBLISHED["llama3-70b-64xH100-tp4pp4cp2vpp5"]()
    with pytest.raises(SpecError, match=r"^bridge_version must be one of 0\.6 \(0\.6\.0\), 0\.3 \(0\.3\.1\), "
                                        r"main \(main@067f987df\) \(got '0\.5'\)$"):
        bridge_overrides(plan, "0.5")
    with pytest.raises(ValueError, match=r"bridge_version must be one of 0\.6 \(0\.6\.0\), 0\.3 \(0\.3\.1\)"):
        EmitOptions(bridge_version="0.6.1")
    text = emit(plan, "megatron-bridge", EmitOptions(bridge_version="0.3"))
    assert "# Megatron-Bridge 0.3.1: " in text and "dataset.sequence_length=8192" in text
    assert emit_data(plan, "megatron-bridge")["bridge_version"] == "0.6.0"


# Megatron-Bridge's main branch at 067f987df (bridge_version "main"), extracted the same way from that commit and
# the Megatron-LM commit it pins: its Llama recipes hold the nested BridgeGPTModelConfig (model[nested], with the
# TransformerConfig under model[nested].transformer), every other family a flat provider (recipe_model_forms).
MAIN = json.loads((Path(__file__).parent / "data" / "megatron_bridge_main_fields.json").read_text())
MAIN_SECTIONS = {name: frozenset(section["fields"]) for name, section in MAIN["sections"].items()}


def main_unknown_paths(overrides: list[str], nested: bool) -> list[str]:
    """The override keys main's ConfigContainer lacks: with a nested model, `model.<f>` must be a field of
    BridgeGPTModelConfig (not `transformer`, a whole config) and `model.transformer.<f>` one of its
    TransformerConfig; a flat model is the GPT or MLA provider, as on 0.6.0."""
    mla = any(item.endswith("multi_latent_attention=true") for item in overrides)
    out = []
    for key in (item.split("=", 1)[0] for item in overrides):
        section, _, field = key.rpartition(".")
        if section.startswith("model") and nested:
            section = {"model": "model[nested]", "model.transformer": "model[nested].transformer"}.get(section, "?")
        elif section == "model" and mla:
            section = "model[mla]"
        fields = MAIN_SECTIONS.get(section)
        if fields is None or field not in fields or field == "transformer":
            out.append(key)
    return out


def test_the_main_data_file_names_the_commit_and_the_nested_layout():
    assert BRIDGE_VERSIONS["main"] == "main@067f987df"
    assert MAIN["megatron_bridge"] == {"repo": "NVIDIA-NeMo/Megatron-Bridge", "branch": "main",
                                       "commit": "067f987df03b8355b03192d88d70f1709fedf51a"}
    assert MAIN["megatron_lm"]["commit"] == "2a75ac12c54ba6a42b34024756820bf819a2e25f"
    assert MAIN["sections"]["model[nested]"]["class"] == "megatron.bridge.models.gpt.model_config.BridgeGPTModelConfig"
    assert {"transformer", "seq_length", "position_embedding_type"} <= MAIN_SECTIONS["model[nested]"]
    assert "tensor_model_parallel_size" not in MAIN_SECTIONS["model[nested]"]
    assert "tensor_model_parallel_size" in MAIN_SECTIONS["model[nested].transformer"]
    # 0.6.0 has no nested model: its Llama recipes are flat
    assert "model[nested]" not in SECTIONS and set(DATA["recipe_model_forms"]["llama"]) == {"flat"}


def test_the_recipe_family_table_is_main_recipes():
    """RECIPE_FAMILIES says which families nest: it must be what main's recipes build (a change of a family's
    form upstream, once re-extracted, fails here)."""
    forms = MAIN["recipe_model_forms"]
    for prefix, (family, nested) in RECIPE_FAMILIES.items():
        assert forms[family] == (["nested"] if nested else ["flat"]), (prefix, family, forms[family])
    assert {family for family, f in forms.items() if "nested" in f} == {"llama"}


def test_main_check_refuses_flat_keys_on_a_nested_model():
    assert main_unknown_paths(["model.tensor_model_parallel_size=2", "model.transformer.seq_length=4096",
                               "model.transformer=null", "model.transformer.tensor_model_parallel_size=2",
                               "model.seq_length=4096"], nested=True) == [
        "model.tensor_model_parallel_size", "model.transformer.seq_length", "model.transformer"]
    assert main_unknown_paths(["model.transformer.tensor_model_parallel_size=2"], nested=False) == [
        "model.transformer.tensor_model_parallel_size"]


def _main(plan):
    try:
        return bridge_overrides(plan, "main")
    except NotExpressibleError:
        return None


@pytest.mark.parametrize("name,plan", plans(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_main_override_is_a_path_of_that_commit(name, plan):
    overrides = _main(plan)
    family = next((fam for prefix, fam in RECIPE_FAMILIES.items() if plan.model.name.startswith(prefix)), None)
    if overrides is None:
        if family is not None:
            assert not _expressible(plan), "main refuses a plan 0.6 takes, for a model of a known family"
        pytest.skip("refused (a model of no known recipe family, or for every version alike)")
    nested = MAIN["recipe_model_forms"][family[0]] == ["nested"]  # what the family's recipes build at that commit
    assert main_unknown_paths(overrides, nested) == []
    assert emit_data(plan, "megatron-bridge", EmitOptions(bridge_version="main"))["overrides"] == overrides
    # the same settings as 0.6.0's, the transformer fields moved under model.transformer where the recipe nests
    moved = [o.replace("model.transformer.", "model.", 1) for o in overrides]
    assert moved == _expressible(plan)
    assert any(o.startswith("model.transformer.") for o in overrides) == nested
    values = dict(item.split("=", 1) for item in overrides)
    assert values["dataset.seq_length"] == values["model.seq_length"] == str(plan.train.seq_len)


def test_main_covers_both_layouts_and_refuses_an_unknown_family():
    forms = {RECIPE_FAMILIES[next(p for p in RECIPE_FAMILIES if plan.model.name.startswith(p))][1]
             for _, plan in plans() if _main(plan) is not None}
    assert forms == {True, False}
    plan = ARCHITECTURES["mixtral-like-64xH100-tp4pp2ep4etp2"]()
    assert _expressible(plan)
    with pytest.raises(NotExpressibleError, match=r"model name 'mixtral-8x7b-like' with bridge_version main: its "
                                                  r"recipe's model layout cannot be told"):
        bridge_overrides(plan, "main")
    text = emit(PUBLISHED["llama3-70b-64xH100-tp4pp4cp2vpp5"](), "megatron-bridge",
                EmitOptions(bridge_version="main"))
    assert "# Megatron-Bridge main@067f987df: " in text
    assert "model.transformer.tensor_model_parallel_size=4" in text and "model.tensor_model_parallel_size" not in text


def test_main_keeps_the_release_refusal_rules():
    """main's mixed-precision recipes are 0.6.0's (the refusal tables hold), and its DDP config defaults to the
    Megatron-FSDP v1 path whose rules (fsdp_dtensor) the emitter follows."""
    assert MAIN["mixed_precision_recipes"] == RECIPES
    assert {"megatron_fsdp_version", "use_megatron_fsdp"} <= MAIN_SECTIONS["ddp"]
    assert "ckpt_format" in MAIN_SECTIONS["checkpoint"] and "use_tp_pp_dp_mapping" in MAIN_SECTIONS["dist"]
