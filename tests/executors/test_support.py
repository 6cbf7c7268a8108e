"""What the torch executor refuses before launching, and the model it builds (no torch)."""

from __future__ import annotations

import subprocess
import sys

from executors.support import executed_model, stage_layer_counts, unsupported_reasons
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


def test_stage_layer_counts_even_and_uneven():
    assert stage_layer_counts(8, Strategy(dp=1, pp=2, vpp=2)) == [2, 2, 2, 2]
    assert stage_layer_counts(8, Strategy(dp=1, pp=4, num_layers_in_first_stage=1, num_layers_in_last_stage=1)) == [1, 3, 3, 1]


def test_executed_model_notes_each_deviation():
    model, notes = executed_model(TINY.model_copy(update={"dropout": True}), Strategy(dp=1, pp=2), num_layers=2)
    assert model.num_layers == 2 and not model.tie_embeddings and not model.dropout
    assert model.hidden_size == TINY.hidden_size
    assert len(notes) == 3
    same, none = executed_model(TINY, Strategy(dp=2))
    assert same == TINY and none == []
