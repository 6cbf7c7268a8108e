"""Published end-to-end runs on H100, H200, B200 and GB200 (benchmarks/data/*.json).

Every file names its source exactly; every row is either a case the planner
predicts or a refusal with its reason, never dropped; the loader keeps what
`nemo_h100_fp8` always returned.
"""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.accuracy import RunError, by_generation
from benchmarks.validation import (
    GENERATIONS,
    OTHER_DATA_FILES,
    PUBLIC_SETS,
    ROOT,
    _public_case,
    generation,
    nemo_h100_fp8,
    predict,
    public_runs,
    public_set_path,
)
from cost_models.params import num_params
from profiles import PROFILES_DIR

DATA = ROOT / "benchmarks" / "data"


def test_every_data_file_is_a_registered_set():
    stems = {p.stem for p in DATA.glob("*.json")}
    assert stems - OTHER_DATA_FILES == set(PUBLIC_SETS)


@pytest.mark.parametrize("name", list(PUBLIC_SETS))
def test_source_is_exact(name):
    src = json.loads(public_set_path(name).read_text())["source"]
    assert src.get("what") and src.get("not_stated") and "rows_left_out" in src
    if "repo" in src:
        assert src.get("path") and re.fullmatch(r"[0-9a-f]{40}", src.get("commit", ""))
    else:
        assert src.get("url") and src.get("table") and src.get("date")


@pytest.mark.parametrize("name", list(PUBLIC_SETS))
def test_every_row_is_a_case_or_a_refusal_on_known_presets(name):
    data = json.loads(public_set_path(name).read_text())
    runs = public_runs(name)
    assert len(runs.cases) + len(runs.refused) == len(data["rows"]) > 0
    defaults = PUBLIC_SETS[name][1]
    for row in data["rows"]:
        assert (PROFILES_DIR / "models" / f"{row['model']}.yaml").is_file(), row["model"]
        cluster = row.get("cluster", defaults.get("cluster"))
        assert (PROFILES_DIR / "clusters" / f"{cluster}.yaml").is_file(), cluster
        assert generation(cluster) in {"H100-H200", "B200", "GB200", "GB300"}
        assert row["tokens_per_s_per_gpu"] > 0
    assert all(r.reason for r in runs.refused)
    labels = [c.label for c in runs.cases] + [r.label for r in runs.refused]
    assert len(set(labels)) == len(labels), "labels must tell rows apart"


@pytest.mark.parametrize("name", list(PUBLIC_SETS))
def test_every_case_predicts_or_says_why(name):
    for case in public_runs(name).cases:
        p = predict(case)
        assert p.predicted_step_s is not None or p.note, case.label
        if p.predicted_step_s is not None:
            assert p.predicted_step_s > 0


def test_nemo_h100_fp8_is_unchanged():
    cases = {c.label: c for c in nemo_h100_fp8()}
    assert len(cases) == 5
    c = cases["llama3-70b n64 tp4 pp4 cp2 vp5"]
    assert c.table == "NeMo DGX-H100 FP8" and c.cluster == "dgx-h100"
    assert c.measured_step_s == pytest.approx(128 * 8192 / (64 * 1533))
    assert c.train_options == {"precision": "fp8", "grad_precision": "fp32", "attention_kernel": "flash"}
    assert {k: c.constraints[k] for k in ("tp", "pp", "cp", "vpp", "micro_batch_size", "sequence_parallel",
                                          "zero_stage")} == {"tp": 4, "pp": 4, "cp": 2, "vpp": 5, "micro_batch_size": 1,
                                                             "sequence_parallel": True, "zero_stage": [0, 1]}


ROW = {"model": "llama3-8b", "cluster": "dgx-h100", "num_gpus": 8, "precision": "fp8", "global_batch_size": 128,
       "micro_batch_size": 1, "seq_len": 8192, "fsdp": 8, "tp": 1, "pp": 1, "cp": 1, "vp": 1, "ep": 1, "ga": 16,
       "tokens_per_s_per_gpu": 14451}


def test_row_fields_become_constraints():
    case = _public_case(ROW, "t", None, legacy=False)
    assert case.constraints["zero_stage"] == 3 and case.constraints["ep"] == 1
    assert case.constraints["offload_optimizer"] is False
    assert case.measured_step_s == pytest.approx(128 * 8192 / (8 * 14451))
    moe = _public_case(ROW | {"model": "qwen3-30b-a3b", "ep": 8, "fsdp": 0}, "t", 1.0, legacy=False)
    assert moe.constraints["zero_stage"] == [0, 1] and moe.constraints["ep"] == 8
    assert moe.train_options["moe_load_imbalance"] == 1.0
    assert "moe_load_imbalance" not in case.train_options  # dense rows keep the profile's value


def test_gradient_precision_is_the_rows_or_its_sets():
    """FP32 gradients unless said otherwise; Megatron-Bridge's performance recipes reduce in BF16."""
    assert _public_case(ROW, "t", None, legacy=False).train_options["grad_precision"] == "fp32"
    assert _public_case(ROW | {"grad_precision": "bf16"}, "t", None, legacy=False).train_options["grad_precision"] == "bf16"
    bridge = public_runs("mbridge_26_04")
    assert bridge.cases and all(c.train_options["grad_precision"] == "bf16" for c in bridge.cases)
    assert all(c.train_options["grad_precision"] == "fp32" for c in public_runs("torchtitan_h100").cases)


@pytest.mark.parametrize("change,reason", [({"ga": 2}, "GA"), ({"tp": 3}, "divide"), ({"fsdp": 4}, "fsdp"),
                                           ({"precision": "nvfp4"}, "precision"),
                                           ({"activation_checkpointing": "selective op"}, "framework torchtitan"),
                                           ({"activation_checkpointing": "selective layer"}, "not modelled"),
                                           ({"zero_stage": 2}, "zero_stage"), ({"fsdp": 0, "zero_stage": 3}, "zero_stage"),
                                           ({"activation_checkpointing": "full", "recompute_modules": ["mlp"]},
                                            "both say what is recomputed"),
                                           ({"attn_impl": "torch"}, "attn_impl 'torch'"),
                                           ({"grad_precision": "fp8"}, "grad_precision 'fp8'"),
                                           ({"recipe_disagrees": "vp 5 in the recipe"}, "disagrees with its recipe: vp 5"),
                                           ({"unmodelled": "a fused grouped MLP"}, "not modelled: a fused grouped MLP"),
                                           ({"fp8_recipe_preset": "FP8-XX"}, "fp8_recipe_preset 'FP8-XX'")])
def test_inconsistent_or_unmodelled_rows_are_refused_with_the_reason(change, reason):
    out = _public_case(ROW | change, "t", None, legacy=False)
    assert reason in out.reason and out.measured_step_s > 0


def test_a_recipe_the_table_does_not_name_is_its_presets():
    """A table's plain "FP8" takes the recipe of the release's preset (`fp8_recipe_preset`); a recipe the table
    names wins over it; with neither the default (delayed) stays."""
    def recipe(**row):
        return _public_case(ROW | row, "t", None, legacy=False).train_options.get("fp8_recipe")

    assert recipe(fp8_recipe="FP8 (recipe not stated)", fp8_recipe_preset="FP8-CS") == "tensorwise"
    assert recipe(fp8_recipe="FP8-MX", fp8_recipe_preset="FP8-CS", cluster="dgx-b200") == "mxfp8"
    assert recipe(fp8_recipe="FP8 (recipe not stated)") is None
    # Megatron-Bridge 26.02 .. 26.06 offer no delayed scaling: every plain FP8 row there runs current scaling
    for name in ("mbridge_26_02", "mbridge_26_02_01", "mbridge_26_04", "mbridge_26_04_01", "mbridge_26_06"):
        plain = [c for c in public_runs(name).cases if c.train_options["precision"] == "fp8" and " fp8 " in c.label]
        assert plain and all(c.train_options["fp8_recipe"] == "tensorwise" for c in plain), name
    # 25.09's scripts defaulted to delayed scaling (--fp8_recipe ds): its plain rows keep the default
    assert all("fp8_recipe" not in c.train_options for c in public_runs("mbridge_25_09").cases if " fp8 " in c.label)


def test_a_refused_row_keeps_its_model_kind():
    """A refused row of a mixture-of-experts model still counts among the MoE rows of the accuracy report
    (n of N), and a dense one among the dense rows."""
    moe = ROW | {"model": "qwen3-30b-a3b", "ep": 8, "fsdp": 0, "ga": 2, "unmodelled": "a fused grouped MLP"}
    assert _public_case(moe, "t", None, legacy=False).moe is True
    assert _public_case(ROW | {"unmodelled": "x"}, "t", None, legacy=False).moe is False


def test_a_recipes_recompute_modules_are_its_selective_recompute():
    """A row's recompute_modules (the recipe's --recompute-modules) fix selective recompute of those modules;
    an empty list means the recipe recomputes nothing; without the field recomputation is searched."""
    mods = _public_case(ROW | {"recompute_modules": ["layernorm", "mlp"]}, "t", None, legacy=False).constraints
    assert mods["recompute"] == "selective" and mods["recompute_modules"] == ["layernorm", "mlp"]
    assert _public_case(ROW | {"recompute_modules": []}, "t", None, legacy=False).constraints["recompute"] == "none"
    assert "recompute" not in _public_case(ROW, "t", None, legacy=False).constraints


def test_llm_foundrys_attn_impl_names_the_kernel_each_row_is_timed_with():
    """attn_impl 'triton' (the Triton FlashAttention kernel of flash-attn 1.x's era) is timed as FlashAttention v1,
    'flash2' as FlashAttention-2; every LLM Foundry case carries its row's kernel."""
    assert _public_case(ROW | {"attn_impl": "triton"}, "t", None, legacy=False).train_options["attention_kernel"] == "flash1"
    assert _public_case(ROW | {"attn_impl": "flash2"}, "t", None, legacy=False).train_options["attention_kernel"] == "flash2"
    rows = json.loads(public_set_path("llmfoundry_h100").read_text())["rows"]
    kernels = [c.train_options["attention_kernel"] for c in public_runs("llmfoundry_h100").cases]
    assert kernels == [{"triton": "flash1", "flash2": "flash2"}[r["attn_impl"]] for r in rows]
    assert kernels.count("flash1") == 65


def test_shard_grad_op_rows_are_zero_stage_2():
    case = _public_case({k: v for k, v in ROW.items() if k != "fsdp"} | {"zero_stage": 2}, "t", None, legacy=False)
    assert case.constraints["zero_stage"] == 2 and " zero2" in case.label


def test_llmfoundry_presets_reproduce_the_published_parameter_counts():
    # LLM Foundry's NumParams column grows with SeqLen: MPT as its pretrain yamls build it has a learned
    # position table of max_seq_len rows (no ALiBi), which each row's model_overrides sets to SeqLen.
    rows = json.loads(public_set_path("llmfoundry_h100").read_text())["rows"]
    cases = public_runs("llmfoundry_h100").cases
    assert len(cases) == len(rows)
    assert [num_params(c.model) for c in cases] == [r["num_params"] for r in rows]
    assert {r["model"] for r in rows} == {f"mpt-{s}" for s in ("760m", "1b", "3b", "7b", "13b", "30b", "70b")}


def test_torchtitans_op_level_policy_is_its_selective_recompute():
    case = _public_case(ROW | {"activation_checkpointing": "selective op", "framework": "torchtitan"}, "t", None,
                        legacy=False)
    assert case.constraints["recompute"] == "selective" and case.train_options["framework"] == "torchtitan"


def test_published_ga_mismatch_is_reported():
    # Megatron-Bridge 25.11 DGX-H100 GPT-OSS 120B: PP 4 on 64 GPUs gives DP 16, so GBS 512 / (MBS 4 x 16) = 8, not
    # GA 2; DGX-GB300 Qwen3-235B: PP 4 on 256 GPUs gives DP 64, so GBS 8192 / (MBS 2 x 64) = 64, not GA 32.
    refused = {r.label.split()[0]: r.reason for r in public_runs("mbridge_25_11").refused}
    assert set(refused) == {"gpt-oss-120b", "qwen3-235b-a22b"}
    assert "GA (2)" in refused["gpt-oss-120b"] and "GA (32)" in refused["qwen3-235b-a22b"]


def test_generations_cover_every_gpu_preset_but_the_cpu():
    gpus = {p.stem for p in (PROFILES_DIR / "gpus").glob("*.yaml")} - {"local-cpu"}
    assert gpus <= set(GENERATIONS)


def test_by_generation_groups_rows_and_skips_fitted_tables():
    a = RunError("a", 1.0, 0.9, generation="B200")
    b = RunError("b", 1.0, None, note="refused", generation="B200")
    c = RunError("c", 1.0, 1.1)
    groups = by_generation([("x", "held out", [a, b, c]), ("fit", "fitted", [RunError("d", 1.0, 2.0)])])
    assert groups["B200"] == [a, b] and groups["A100"] == [c] and groups["GB200"] == []


def test_bridge_rows_run_te_loss_and_hybridep_on_32_sms():
    """Megatron-Bridge's performance scripts compute the loss with Transformer Engine's cross-entropy and run
    HybridEP on 32 SMs; rows of other dispatchers set no SM count, other sets keep megatron-core's loss."""
    for name in ("mbridge_25_11", "mbridge_26_04_01", "mbridge_skills"):
        cases = public_runs(name).cases
        assert all(c.train_options["cross_entropy_fusion_impl"] == "te" for c in cases), name
        for c in cases:
            dispatcher = c.train_options.get("moe_dispatcher", "alltoall")
            assert c.train_options.get("moe_flex_num_sms") == (32 if dispatcher == "hybridep" else None), c.label
    assert all("cross_entropy_fusion_impl" not in c.train_options for c in public_runs("nemo_h100_fp8").cases)
