"""Memory of PyTorch-native training (framework torchtitan, which also costs LLM Foundry's Composer
FSDP runs): FSDP2's fp32 shards, torch's and flash-attn's cross entropy, the gathered output layer,
and torchtitan's published peaks (benchmarks/data/peak_memory.json). Megatron's terms stay as they were."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.peak_memory import DATA, MAX_UNDER, published_rows
from cost_models.memory import cross_entropy_bytes_per_logit
from cost_models.params import num_params
from tests.framework_defaults import evaluate
from profiles import load_model
from profiles.bundle import load_tables

GIB = 2**30
LLAMA_VOCAB = 128256


def _est(framework="torchtitan", fusion=False, model="llama3.1-8b", seq=4096, **strategy):
    s = {"dp": 8, "zero_stage": 3, "micro_batch_size": 1, "recompute": "full"} | strategy
    gpus = s["dp"] * s.get("tp", 1) * s.get("pp", 1)
    return evaluate(model, "dgx-h100", gpus, s["dp"] * s["micro_batch_size"], seq, "bf16", strategy=s,
                    framework=framework, cross_entropy_fusion=fusion)


def test_cross_entropy_bytes_by_implementation():
    assert cross_entropy_bytes_per_logit(2, "megatron", True, True) == 12  # Megatron: unchanged either way
    assert int(cross_entropy_bytes_per_logit(2, "pytorch", False, False)) == 12  # fp32 copy, log-softmax, grads
    assert int(cross_entropy_bytes_per_logit(2, "pytorch", False, True)) == 16  # loss_parallel's backward
    assert int(cross_entropy_bytes_per_logit(2, "pytorch", True, True)) == 4  # flash-attn: logits + their grad
    both = cross_entropy_bytes_per_logit(2, "pytorch", False, np.array([False, True]))
    assert both.tolist() == [12, 16]


def test_torchtitan_fused_loss_keeps_no_fp32_logits():
    tokens = 4096
    plain, fused = _est(fusion=False), _est(fusion=True)
    # the head's 16-bit inputs (norm input, output-layer input) are in both
    head_in = 2 * 2 * 4096 * tokens
    assert fused.memory_bytes["logits"] - head_in == pytest.approx(4 * tokens * LLAMA_VOCAB, rel=1e-9)
    assert plain.memory_bytes["logits"] - head_in == pytest.approx(12 * tokens * LLAMA_VOCAB, rel=1e-9)


def test_megatron_memory_ignores_fusion_and_keeps_its_terms():
    on, off = _est("megatron", True), _est("megatron", False)
    assert on.memory_bytes == off.memory_bytes
    m = on.memory_bytes
    params = num_params(load_model("llama3.1-8b"))
    assert m["params"] == pytest.approx(2 * params / 8, rel=0.01)  # the 16-bit shard stays for Megatron
    assert m["zero3_buffers"] < _est("torchtitan").memory_bytes["zero3_buffers"]


def test_fsdp2_keeps_one_fp32_shard_under_zero3_only():
    params = num_params(load_model("llama3.1-8b"))
    z3 = _est().memory_bytes
    assert z3["params"] == 0
    assert z3["params"] + z3["grads"] + z3["optimizer"] == pytest.approx(16 * params / 8, rel=0.01)
    z2 = _est(zero_stage=2).memory_bytes  # reshard_after_forward False: the gathered 16-bit weights stay
    assert z2["params"] == pytest.approx(2 * params, rel=0.01)


def test_loss_parallel_and_gathered_head_input_with_tp():
    tokens, h, tp = 4096, 4096, 2
    e = _est(dp=4, tp=tp, sequence_parallel=True).memory_bytes
    vocab = LLAMA_VOCAB / tp
    head_in = 2 * tokens * h / tp + 2 * tokens * h  # the norm's shard, the output layer's gathered input
    assert e["logits"] == pytest.approx(16 * tokens * vocab + head_in, rel=1e-3)
    mega = _est("megatron", dp=4, tp=tp, sequence_parallel=True).memory_bytes
    assert mega["logits"] == pytest.approx(12 * tokens * vocab + 2 * 2 * tokens * h / tp, rel=1e-3)


def test_the_output_layer_stays_gathered_under_zero3():
    h = 4096
    tt, mega = _est().memory_bytes, _est("megatron").memory_bytes
    assert tt["zero3_buffers"] - mega["zero3_buffers"] == pytest.approx(2 * (LLAMA_VOCAB * h + h), rel=1e-6)
    assert _est(zero_stage=2).memory_bytes["zero3_buffers"] == 0
    assert load_tables(None).framework("torchtitan").zero3_head_unsharded
    assert not load_tables(None).framework("megatron").zero3_head_unsharded


def test_published_torchtitan_peaks_within_ten_percent():
    """The rows whose strategy is the published run's (Table 2 and 4: full AC); within 10% and never
    under by more than MAX_UNDER."""
    rows = {r["table"]: r for r in published_rows(json.loads(DATA.read_text()))}
    for table in ("Table 2, FSDP 8, CP 1", "Table 4, 2D"):
        assert -MAX_UNDER <= rows[table]["error"] <= 0.10, (table, rows[table]["predicted_gib"])


def test_published_op_selective_peaks_within_ten_percent():
    """Tables 1 and 3 ran torchtitan's op-level selective AC (the data file's source: selective_ac_option
    'op'), which framework torchtitan costs as recompute selective."""
    data = json.loads(DATA.read_text())
    for row in data["rows"]:
        if row["table"] in ("Table 1, FSDP", "Table 3, FSDP"):
            row["strategy"] = row["strategy"] | {"recompute": "selective"}
    rows = {r["table"]: r for r in published_rows(data)}
    for table in ("Table 1, FSDP", "Table 3, FSDP"):
        assert -MAX_UNDER <= rows[table]["error"] <= 0.10, (table, rows[table]["predicted_gib"])


def test_torchtitan_is_costed_with_its_own_loss_unless_the_plan_says_otherwise():
    """torchtitan runs PyTorch's cross_entropy (profiles/frameworks/torchtitan.yaml cross_entropy_fusion false):
    a plan that does not name the loss is costed with it; an explicit --cross-entropy-fusion is kept (and the
    torchtitan emitter notes it); megatron keeps its fused default."""
    from tests.framework_defaults import evaluate
    from planner.api import make_inputs

    run = dict(model="llama3.1-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=16, seq_len=8192)
    assert make_inputs(**run, framework="torchtitan")[2].cross_entropy_fusion is False
    assert make_inputs(**run, framework="torchtitan", cross_entropy_fusion=True)[2].cross_entropy_fusion is True
    assert make_inputs(**run)[2].cross_entropy_fusion is True
    s = {"dp": 8, "zero_stage": 3, "micro_batch_size": 2, "recompute": "selective"}
    own = evaluate(**run, strategy=s, framework="torchtitan")
    unfused = evaluate(**run, strategy=s, framework="torchtitan", cross_entropy_fusion=False)
    assert own.peak_memory_bytes == unfused.peak_memory_bytes
