"""torchtitan TOML, parsed by torchtitan's own ConfigManager and ParallelDims when torchtitan 0.2.x
(the last release with TOML job files) and tyro are installed; otherwise checked against the
JobConfig fields torchtitan documents (torchtitan/config/job_config.py), and the test says which
(issue 3)."""

from __future__ import annotations

import tomllib

import pytest

import emit_checks
from emit_checks import check_torchtitan, import_torchtitan_config
from emit_plans import PUBLISHED, make_plan
from planner.emit import NotExpressibleError, emit, emit_data

LLAMA8 = ("llama3-8b", "dgx-h100", 16, 64, 4096)
LLAMA70 = ("llama3-70b", "dgx-h100", 64, 128, 8192)
#: What each check `check_torchtitan` may run is called in the report.
CHECKER_NAMES = {"torchtitan": "torchtitan ConfigManager",
                 "documented-fields": "documented JobConfig fields (torchtitan absent)"}
CHECKER = CHECKER_NAMES["torchtitan" if import_torchtitan_config() else "documented-fields"]


@pytest.mark.parametrize("question,strategy,precision", [
    (LLAMA8, dict(zero_stage=0), "bf16"),
    (LLAMA8, dict(zero_stage=3, recompute="full"), "bf16"),
    (LLAMA8, dict(tp=2, zero_stage=1, sequence_parallel=True, recompute="selective"), "fp8"),
    (LLAMA8, dict(tp=2, pp=2, zero_stage=0, recompute="full", recompute_num_layers=4), "bf16"),
    (LLAMA8, dict(cp=4, zero_stage=2), "bf16"),
    (LLAMA70, dict(tp=4, pp=4, cp=2, vpp=5, sequence_parallel=True, zero_stage=1), "bf16"),
    (("llama3.1-405b", "dgx-h100", 512, 256, 8192),
     dict(tp=8, pp=8, num_layers_in_first_stage=15, num_layers_in_last_stage=15, zero_stage=1), "bf16"),
    (LLAMA8, dict(tp=2, pp=4, vpp=2, stage_layers=[6, 10, 12, 4], zero_stage=1), "bf16"),
    (LLAMA8, dict(tp=2, pp=2, vpp=2, stage_layers=[10, 8, 6, 8], zero_stage=1), "bf16"),  # one count per virtual stage
    (("llama3.1-405b", "dgx-h100", 512, 256, 8192),
     dict(tp=8, pp=16, vpp=8, embedding_as_layer=True, loss_as_layer=True, zero_stage=1), "bf16"),
    (("llama3-8b", "dgx-h100", 24, 48, 4096), dict(tp=8, pp=3, embedding_as_layer=True, zero_stage=1), "bf16"),
])
def test_torchtitan_reads_the_plan(question, strategy, precision, tmp_path, monkeypatch):
    plan = make_plan(*question, strategy=strategy, precision=precision)
    text = emit(plan, "torchtitan")
    which = check_torchtitan(plan, text, tmp_path)
    assert which == ("torchtitan" if import_torchtitan_config() else "documented-fields")
    assert tomllib.loads(text) == emit_data(plan, "torchtitan")["config"]
    monkeypatch.setattr(emit_checks, "import_torchtitan_config", lambda: None)  # the fallback agrees
    assert check_torchtitan(plan, text, tmp_path) == "documented-fields"


def test_checker_in_use_is_reported(tmp_path, record_property, monkeypatch):
    """The checker this module reports (printed, and recorded in the test report as `torchtitan_checker`)
    is the one that runs, and it (and the fallback) refuses a field torchtitan's JobConfig does not have."""
    plan = make_plan(*LLAMA8, strategy=dict(zero_stage=0))
    text = emit(plan, "torchtitan")
    assert CHECKER_NAMES[check_torchtitan(plan, text, tmp_path)] == CHECKER
    record_property("torchtitan_checker", CHECKER)
    print(f"torchtitan TOML checked by: {CHECKER}")
    bad = text.replace("[parallelism]\n", "[parallelism]\nno_such_degree = 2\n", 1)
    assert bad != text
    with pytest.raises(Exception, match="no_such_degree"):
        check_torchtitan(plan, bad, tmp_path)
    monkeypatch.setattr(emit_checks, "import_torchtitan_config", lambda: None)
    with pytest.raises(AssertionError, match="parallelism.no_such_degree"):
        check_torchtitan(plan, bad, tmp_path)


def test_hsdp_degrees_and_schedule():
    doc = emit_data(make_plan(*LLAMA70, strategy=dict(tp=4, pp=4, cp=2, vpp=5, sequence_parallel=True,
                                                          zero_stage=1)), "torchtitan")["config"]
    par = doc["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (1, 2)
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B" and par["pipeline_parallel_layers_per_stage"] == 4
    assert doc["training"]["local_batch_size"] == 64 and par["pipeline_parallel_microbatch_size"] == 1
    ddp = emit_data(make_plan(*LLAMA8, strategy=dict(zero_stage=0)), "torchtitan")["config"]["parallelism"]
    assert (ddp["data_parallel_replicate_degree"], ddp["data_parallel_shard_degree"]) == (16, 1)


def test_uneven_pipeline_spells_out_module_names():
    plan = make_plan("llama3.1-405b", "dgx-h100", 512, 256, 8192,
                     strategy=dict(tp=8, pp=8, num_layers_in_first_stage=15, num_layers_in_last_stage=15, zero_stage=1))
    parts = emit_data(plan, "torchtitan")["config"]["parallelism"]["module_fqns_per_model_part"]
    assert parts[0][:2] == ["tok_embeddings", "layers.0"] and len(parts[0]) == 16
    assert parts[-1][-2:] == ["norm", "output"] and [len(p) for p in parts[1:-1]] == [16] * 6


def test_embedding_and_loss_as_layers_are_torchtitans_stage_weights():
    plan = make_plan("llama3.1-405b", "dgx-h100", 512, 256, 8192,
                     strategy=dict(tp=8, pp=16, vpp=8, embedding_as_layer=True, loss_as_layer=True, zero_stage=1))
    par = emit_data(plan, "torchtitan")["config"]["parallelism"]
    assert (par["pipeline_parallel_layers_per_stage"], par["pipeline_parallel_first_stage_less_layers"],
            par["pipeline_parallel_last_stage_less_layers"]) == (1, 1, 1)
    assert "module_fqns_per_model_part" not in par


def test_explicit_split_spells_out_module_names_per_virtual_stage():
    plan = make_plan(*LLAMA8, strategy=dict(tp=2, pp=4, vpp=2, stage_layers=[6, 10, 12, 4], zero_stage=1))
    parts = emit_data(plan, "torchtitan")["config"]["parallelism"]["module_fqns_per_model_part"]
    # virtual stage c·pp + r on rank r: each rank's layers split over its two chunks
    assert [sum(n.startswith("layers.") for n in p) for p in parts] == [3, 5, 6, 2, 3, 5, 6, 2]


def test_fp16_and_uneven_recompute_are_refused():
    with pytest.raises(NotExpressibleError, match="^not expressible in torchtitan: precision 'fp16'"):
        emit(PUBLISHED["gpt3-175b-1024xA100-tp8pp8"](), "torchtitan")
    plan = make_plan(*LLAMA8, strategy=dict(recompute="full", recompute_num_layers=3))
    with pytest.raises(NotExpressibleError, match=r"recompute_num_layers \(3\) of 32 layers per chunk"):
        emit(plan, "torchtitan")


@pytest.mark.parametrize("real", [True, False], ids=["torchtitan", "documented-fields"])
def test_both_checkers_reject_an_unknown_key(real, tmp_path, monkeypatch):
    if real and not import_torchtitan_config():
        pytest.skip("torchtitan 0.2.x with tyro is not installed")
    if not real:
        monkeypatch.setattr(emit_checks, "import_torchtitan_config", lambda: None)
    plan = make_plan(*LLAMA8, strategy=dict(tp=2, zero_stage=1))
    text = emit(plan, "torchtitan").replace("[parallelism]\n", "[parallelism]\nbogus_degree = 2\n")
    with pytest.raises((AssertionError, ValueError)):
        check_torchtitan(plan, text, tmp_path)


#: full recompute of k layers per chunk over even and uneven pipeline splits
RECOMPUTE_GRID = [
    dict(recompute="full"),
    dict(recompute="full", recompute_num_layers=8),
    dict(pp=2, recompute="full", recompute_num_layers=4),
    dict(pp=2, recompute="full", recompute_num_layers=16),
    dict(pp=4, vpp=2, recompute="full", recompute_num_layers=2),
    dict(pp=4, vpp=2, recompute="full"),
    dict(pp=4, num_layers_in_first_stage=4, num_layers_in_last_stage=4, recompute="full"),
    dict(pp=4, num_layers_in_first_stage=4, num_layers_in_last_stage=4, recompute="full", recompute_num_layers=2),
    dict(pp=4, num_layers_in_first_stage=6, num_layers_in_last_stage=6, recompute="full", recompute_num_layers=2),
    dict(pp=4, stage_layers=[7, 9, 10, 6], recompute="full", recompute_num_layers=1),
    dict(pp=2, embedding_as_layer=True, loss_as_layer=True, recompute="full", recompute_num_layers=3),
]


@pytest.mark.parametrize("strategy", RECOMPUTE_GRID, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_torchtitan_recomputes_the_planned_layers(strategy):
    """torchtitan's own apply_ac, applied rank by rank to each rank's chunks in order, wraps exactly the
    layers the plan recomputes in every chunk; a split it cannot match is refused."""
    if not import_torchtitan_config():
        pytest.skip("torchtitan 0.2.x with tyro is not installed")
    plan = make_plan(*LLAMA8, strategy=strategy)
    try:
        text = emit(plan, "torchtitan")
    except NotExpressibleError as exc:
        assert "recompute_num_layers" in exc.reason
        chunks = emit_checks.facts(plan).layers_per_chunk()
        assert len(set(chunks)) > 1 or chunks[0] % plan.strategy.recompute_num_layers
        return
    chunks = emit_checks.facts(plan).layers_per_chunk()
    k = plan.strategy.recompute_num_layers
    assert emit_checks.torchtitan_recomputed_layers(plan, text) == [n if k is None else k for n in chunks]


def test_flash2_is_noted_as_the_kernel_the_plan_was_timed_with():
    data = emit_data(make_plan(*LLAMA8, strategy=dict(zero_stage=3), attention_kernel="flash2"), "torchtitan")
    assert any("flash2" in n and "FlashAttention-2" in n for n in data["notes"])
    plain = emit_data(make_plan(*LLAMA8, strategy=dict(zero_stage=3)), "torchtitan")
    assert not any("flash2" in n for n in plain["notes"])


def test_a_plan_costed_with_a_fused_loss_is_noted():
    """torchtitan runs PyTorch's cross_entropy: a plan costed with the fused loss (megatron's default, or an explicit
    --cross-entropy-fusion) says so; one planned for torchtitan does not."""
    fused = emit_data(make_plan(*LLAMA8, strategy=dict(zero_stage=3), cross_entropy_fusion=True), "torchtitan")
    assert any(n.startswith("cross_entropy_fusion") for n in fused["notes"])
    own = emit_data(make_plan(*LLAMA8, strategy=dict(zero_stage=3), framework="torchtitan"), "torchtitan")
    assert not any(n.startswith("cross_entropy_fusion") for n in own["notes"])


def test_the_job_compiles_the_model_and_loss_as_the_plan_is_costed():
    """The cost model times element-wise work as fused kernels; torchtitan fuses it only under torch.compile
    (JobConfig.compile, default off in 0.2.x), so every emitted job enables it for the model and the loss."""
    sections = tomllib.loads(emit(make_plan(*LLAMA8, strategy=dict(zero_stage=3)), "torchtitan"))
    assert sections["compile"] == {"enable": True, "components": ["model", "loss"]}


def test_per_virtual_stage_split_gives_each_model_part_its_own_layers():
    """One count per virtual stage (pp 2 × vpp 2): rank 0 runs model parts 0 and 2 with 10 and 6
    layers, rank 1 parts 1 and 3 with 8 each; module names follow the layer order."""
    plan = make_plan(*LLAMA8, strategy=dict(tp=2, pp=2, vpp=2, stage_layers=[10, 8, 6, 8], zero_stage=1))
    parts = emit_data(plan, "torchtitan")["config"]["parallelism"]["module_fqns_per_model_part"]
    assert [sum(n.startswith("layers.") for n in p) for p in parts] == [10, 8, 6, 8]
    assert parts[0][:2] == ["tok_embeddings", "layers.0"] and parts[1][0] == "layers.10"
    assert parts[2][0] == "layers.18" and parts[3][-3:] == ["layers.31", "norm", "output"]


def test_an_empty_middle_model_part_is_refused():
    plan = make_plan(*LLAMA8, strategy=dict(tp=2, pp=2, vpp=2, stage_layers=[16, 0, 8, 8], zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"virtual stages \[1\] hold no module"):
        emit(plan, "torchtitan")


def test_flash1_is_noted_as_slower_than_what_the_job_runs():
    data = emit_data(make_plan(*LLAMA8, strategy=dict(zero_stage=3), attention_kernel="flash1", framework="torchtitan"),
                     "torchtitan")
    assert any(n.startswith("attention_kernel flash1") and "faster than planned" in n for n in data["notes"])


def test_interleaved_transfers_always_overlap_in_torchtitan():
    from planner.emit import NotExpressibleError, emit_data

    plan = make_plan("llama3-70b", "dgx-h100", 64, 128, 8192,
                     strategy=dict(tp=8, pp=4, vpp=2, zero_stage=1, overlap_p2p_comm=False))
    with pytest.raises(NotExpressibleError, match="overlap_p2p_comm off with vpp > 1"):
        emit_data(plan, "torchtitan")


def test_a_norm_epsilon_the_flavor_does_not_have_is_a_note():
    """torchtitan's llama3 flavors fix norm_eps at 1e-5 (the job file has no key for it): a llama3-8b spec with
    another epsilon says so; the preset itself (1e-5) does not."""
    from profiles import load_model

    llama = load_model("llama3-8b")
    strategy = dict(tp=2, zero_stage=3)
    own = emit_data(make_plan(llama, "dgx-h100", 8, 16, 2048, strategy=strategy), "torchtitan")["notes"]
    assert not any(n.startswith("norm epsilon") for n in own)
    other = llama.model_copy(update={"norm_epsilon": 1e-6})
    notes = emit_data(make_plan(other, "dgx-h100", 8, 16, 2048, strategy=strategy), "torchtitan")["notes"]
    assert any(n.startswith("norm epsilon") and "1e-06" in n and "1e-05" in n for n in notes), notes
