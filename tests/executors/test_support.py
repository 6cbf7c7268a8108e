"""What the torch executor refuses before launching, and the model it builds (no torch)."""

from __future__ import annotations

import subprocess
import sys

from executors.support import executed_model, unsupported_reasons
from planner.specs import Strategy

from executor_fixtures import TINY, TRAIN


def test_importing_the_executor_front_end_does_not_import_torch():
    code = ("import sys, executors, executors.compare, executors.launcher, executors.profiler, executors.validate, "
            "executors.support, planner.cli; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_supported_strategies_have_no_reasons():
    for st in (Strategy(dp=2), Strategy(dp=1, tp=2, sequence_parallel=True), Strategy(dp=1, pp=2),
               Strategy(dp=2, zero_stage=3), Strategy(dp=1, pp=2, vpp=2), Strategy(dp=2, tp=2, zero_stage=2)):
        assert unsupported_reasons(TINY, TRAIN, st) == [], st.short()


def test_context_parallel_on_cpu_is_unsupported_with_the_reason():
    reasons = unsupported_reasons(TINY, TRAIN, Strategy(dp=1, cp=2))
    assert any("cp (2)" in r and "cpu" in r for r in reasons)
    # on CUDA the torch context_parallel path is used
    assert not any("cpu" in r for r in unsupported_reasons(TINY, TRAIN, Strategy(dp=1, cp=2), device="cuda"))


def test_reasons_name_field_rule_and_value():
    reasons = unsupported_reasons(TINY, TRAIN, Strategy(dp=1, tp=8))
    assert any("tp (8) must divide num_attention_heads (4)" in r for r in reasons)
    reasons = unsupported_reasons(TINY, TRAIN, Strategy(dp=2, tp=2, zero_stage=1))
    assert any("zero_stage 1 with tp > 1" in r for r in reasons)
    reasons = unsupported_reasons(TINY, TRAIN, Strategy(dp=1, pp=2, micro_batch_size=8))
    assert any("num_microbatches (1) >= pp (2)" in r for r in reasons)
    assert any("ep (2)" in r for r in unsupported_reasons(TINY, TRAIN, Strategy(dp=1, ep=2)))
    assert any("hsdp_replicate (2)" in r for r in unsupported_reasons(TINY, TRAIN, Strategy(dp=2), hsdp_replicate=2))
    modules = Strategy(dp=2, recompute="selective", recompute_modules=["layernorm"])
    assert any("recompute_modules ['layernorm']" in r for r in unsupported_reasons(TINY, TRAIN, modules))


def test_every_stage_split_of_the_layout_is_supported():
    for st in (Strategy(dp=1, pp=2, vpp=2, num_layers_in_first_stage=2, num_layers_in_last_stage=2),
               Strategy(dp=1, pp=2, stage_layers=[1, 3]), Strategy(dp=1, pp=2, vpp=2, stage_layers=[2, 2]),
               Strategy(dp=1, pp=2, vpp=3, embedding_as_layer=True, loss_as_layer=True)):
        assert unsupported_reasons(TINY, TRAIN, st) == [], st.short()


def test_impossible_splits_give_the_layouts_reason():
    reasons = unsupported_reasons(TINY, TRAIN, Strategy(dp=1, pp=4, vpp=2))  # 4 layers, 8 chunks
    assert "pp·vpp (4·2) must divide num_layers (4)" in reasons
    reasons = unsupported_reasons(TINY, TRAIN, Strategy(dp=1, pp=2, vpp=2, stage_layers=[1, 3]))
    assert any(r.startswith("stage_layers [1, 3] must give each of the pp (2) stages") for r in reasons)


def test_pipeline_schedules_follow_torchs_rules_not_megatrons():
    train = TRAIN.model_copy(update={"global_batch_size": 6})
    # 6 micro-batches on pp 4 with vpp 2: Megatron needs a multiple of pp, torch a multiple of max(1, 6 // 4)
    assert unsupported_reasons(TINY.model_copy(update={"num_layers": 8}), train,
                               Strategy(dp=1, pp=4, vpp=2)) == []
    reasons = unsupported_reasons(TINY, train, Strategy(dp=1, pp=4, micro_batch_size=2))  # 3 < pp under 1F1B
    assert reasons == ["1F1B needs num_microbatches (3) >= pp (4) (torch.distributed.pipelining)"]
    reasons = unsupported_reasons(TINY.model_copy(update={"num_layers": 8}), TRAIN.model_copy(
        update={"global_batch_size": 9}), Strategy(dp=1, pp=4, vpp=2))  # 9 % max(1, 9 // 4) != 0
    assert any("multiple of max(1, num_microbatches // pp) (2)" in r for r in reasons)


def test_executed_model_notes_each_deviation():
    model, notes = executed_model(TINY.model_copy(update={"dropout": True}), Strategy(dp=1, pp=2), num_layers=2)
    assert model.num_layers == 2 and not model.tie_embeddings and not model.dropout
    assert model.hidden_size == TINY.hidden_size
    assert len(notes) == 3
    same, none = executed_model(TINY, Strategy(dp=2))
    assert same == TINY and none == []


def test_per_virtual_stage_splits_run_unless_a_middle_chunk_is_empty():
    assert unsupported_reasons(TINY, TRAIN, Strategy(dp=1, pp=2, vpp=2, stage_layers=[1, 1, 1, 1])) == []
    # the first chunk keeps the embedding, so it may hold no layer
    layers = TINY.num_layers
    assert unsupported_reasons(TINY, TRAIN, Strategy(dp=1, pp=2, vpp=2, stage_layers=[0, 1, layers - 2, 1])) == []
    reasons = unsupported_reasons(TINY, TRAIN, Strategy(dp=1, pp=2, vpp=2, stage_layers=[1, 0, layers - 2, 1]))
    assert any("virtual stages [1] hold no module" in r for r in reasons), reasons


def test_activation_offload_is_refused_with_the_field_on_every_device():
    """Megatron's activation offloading copies activations to the host on Transformer Engine's CUDA streams;
    the executor builds no such copies, so an offloading plan is never run as if it were the plain one."""
    st = Strategy(dp=2, offload_activation_layers=2)
    for device in ("cpu", "cuda"):
        reasons = unsupported_reasons(TINY, TRAIN, st, device=device)
        assert len(reasons) == 1 and reasons[0].startswith("offload_activation_layers (2) is not supported"), reasons
    assert unsupported_reasons(TINY, TRAIN, Strategy(dp=2)) == []


def test_validate_reports_an_offloading_plan_unsupported_and_launches_nothing(tmp_path):
    from executors.validate import ValidateOptions, validate_strategies
    from profiles import load_cluster

    options = ValidateOptions(device="cpu", work_dir=tmp_path)
    report = validate_strategies([Strategy(dp=2, offload_activation_layers=2)], TINY, load_cluster("dgx-h100"),
                                 TRAIN, 2, options)
    (run,) = report.runs
    assert run.outcome == "unsupported" and "offload_activation_layers (2)" in run.reason
    assert report.comparisons[0].outcome == "unsupported"
    assert list(tmp_path.iterdir()) == []  # no reference, no run directory


def test_query_key_norms_with_tensor_parallelism_are_refused():
    """Their weights are whole on every tp rank; the executor does not all-reduce their gradients over tp."""
    from planner.specs import ModelSpec

    spec = ModelSpec(name="qwen3-like", num_layers=2, hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                     ffn_hidden_size=96, vocab_size=300, qk_norm="per_head")
    assert not unsupported_reasons(spec, TRAIN, Strategy(dp=2, micro_batch_size=1))
    reasons = unsupported_reasons(spec, TRAIN, Strategy(dp=1, tp=2, micro_batch_size=1))
    assert any(r.startswith("qk_norm 'per_head' with tp (2) > 1") for r in reasons), reasons
