"""The memory terms beyond model states and activations: the loss, NCCL buffers, CUDA context
and allocator slack, and published peak-memory rows (benchmarks/data/peak_memory.json)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.peak_memory import DATA, MAX_UNDER, published_rows
from cost_models.memory import (MIB, OUTSIDE_ALLOCATOR_TERMS, cross_entropy_bytes_per_logit,
                                nccl_buffer_bytes)
from tests.framework_defaults import evaluate
from planner.errors import SpecError
from profiles import load_model
from profiles.bundle import load_tables

GIB = 2**30


def _est(cluster="dgx-h100", model="llama3.1-8b", vocab=None, **strategy):
    m = load_model(model)
    if vocab is not None:
        m = m.model_copy(update={"vocab_size": vocab})
    s = {"dp": 8, "zero_stage": 3, "micro_batch_size": 1, "recompute": "full"} | strategy
    gpus = s["dp"] * s.get("tp", 1) * s.get("pp", 1)
    return evaluate(m, cluster, gpus, s["dp"] * s["micro_batch_size"] * 4, 4096, "bf16", strategy=s)


def test_cross_entropy_peak_is_three_fp32_copies():
    assert cross_entropy_bytes_per_logit(2) == 12  # backward: saved log-softmax + two fp32 gradients
    assert cross_entropy_bytes_per_logit(4) == 12


def test_bigger_vocab_bigger_logits_term():
    small, big = _est(vocab=32000), _est(vocab=128256)
    assert big.memory_bytes["logits"] > 3.5 * small.memory_bytes["logits"]


def test_logits_term_scales_with_tokens_and_tp():
    one, two = _est(micro_batch_size=1), _est(micro_batch_size=2)
    assert two.memory_bytes["logits"] == pytest.approx(2 * one.memory_bytes["logits"], rel=1e-9)
    tp1, tp2 = _est(dp=4, tp=1), _est(dp=4, tp=2)
    assert tp2.memory_bytes["logits"] < 0.6 * tp1.memory_bytes["logits"]


def test_h100_runtime_terms_replace_the_flat_reserve():
    e = _est()
    table = load_tables("h100-sxm").memory
    assert e.memory_bytes["framework_reserve"] == 0
    assert e.memory_bytes["cuda_context"] == table.cuda_context_bytes > 0
    assert e.memory_bytes["nccl_buffers"] > 0 and e.memory_bytes["allocator_slack"] > 0
    tensors = e.peak_memory_bytes - sum(e.memory_bytes[t] for t in ("framework_reserve", "cuda_context",
                                                                     "nccl_buffers", "allocator_slack"))
    assert e.memory_bytes["allocator_slack"] == pytest.approx(table.allocator_slack_fraction * tensors, rel=1e-9)


def test_a100_keeps_its_calibrated_flat_reserve():
    e = _est(cluster="dgx-a100-80gb")
    assert load_tables("a100-80gb").memory is None
    assert e.memory_bytes["framework_reserve"] == 2 * GIB
    assert all(e.memory_bytes[t] == 0 for t in ("cuda_context", "nccl_buffers", "allocator_slack"))


def test_nccl_buffers_count_connections():
    table = load_tables("h100-sxm").memory
    per = table.nccl_channels * table.nccl_connection_bytes
    assert per == 32 * 12 * MIB

    def st(**kw):
        from types import SimpleNamespace
        d = dict(dp=1, tp=1, pp=1, cp=1, ep=1) | kw
        return SimpleNamespace(**{k: np.array([v]) for k, v in d.items()})

    assert nccl_buffer_bytes(st(), table)[0] == 0  # one rank: no communicator
    assert nccl_buffer_bytes(st(dp=64), table)[0] == 2 * per  # one ring, whatever its size
    assert nccl_buffer_bytes(st(dp=8, tp=8), table)[0] == 4 * per
    assert nccl_buffer_bytes(st(dp=8, tp=8, pp=4), table)[0] == 6 * per  # + previous and next stage
    assert nccl_buffer_bytes(st(dp=8, ep=8), table)[0] == 2 * per + 7 * per  # all-to-all: every other rank
    # the flex dispatchers (DeepEP, HybridEP) exchange tokens through their own buffers: no all-to-all peers
    assert nccl_buffer_bytes(st(dp=8, ep=8), table, alltoall=False)[0] == 2 * per


def test_a_bad_memory_table_is_refused(tmp_path, monkeypatch):
    (tmp_path / "kernels" / "memory").mkdir(parents=True)
    (tmp_path / "kernels" / "memory" / "bad.yaml").write_text(
        "kind: public\ngpu: x\nsource: test\ncuda_context_mib: -1\nnccl_connection_mib: 1\nnccl_channels: 1\n"
        "allocator_slack_fraction: 0\n")
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    with pytest.raises(SpecError, match="cuda_context_mib must be a number >= 0"):
        load_tables("bad").memory


ROWS = published_rows(json.loads(DATA.read_text()))
#: rows under-predicted by more than MAX_UNDER, with why (reported, not tuned away)
KNOWN_UNDER: dict[str, str] = {}  # Table 4 (about -18% before torch's loss_parallel was costed) is now within


@pytest.mark.parametrize("row", ROWS, ids=[r["table"] for r in ROWS])
def test_published_peak_is_not_under_predicted(row):
    if row["table"] in KNOWN_UNDER:
        pytest.xfail(KNOWN_UNDER[row["table"]])
    assert row["error"] >= -MAX_UNDER, (row["table"], row["predicted_gib"], row["measured_gib"])


def test_terms_outside_the_allocator_are_named():
    assert set(OUTSIDE_ALLOCATOR_TERMS) == {"framework_reserve", "cuda_context", "nccl_buffers", "dispatcher_buffers"}


def test_flex_dispatchers_own_buffers():
    """DeepEP's buffer is its recommended config's token chunks per channel and peer, whatever the batch;
    HybridEP's holds the whole expert group's tokens (the worst case of one rank receiving all of them), so it
    grows with the micro-batch and the group; the all-to-all dispatcher has none (NCCL's are `nccl_buffers`)."""
    from cost_models.memory import dispatcher_buffer_bytes
    from planner import Strategy
    from tests.framework_defaults import evaluate

    one = np.array([4096])
    deepep = dispatcher_buffer_bytes("deepep", one, 7168, 256, np.array([8]), np.array([8]))
    assert float(deepep[0]) == 10 * 8 * (256 * (2 * 7168 + 128 * 16 + 8) + 5 * 4)  # 20 SMs: 10 channels
    assert float(dispatcher_buffer_bytes("deepep", 4 * one, 7168, 256, np.array([8]), np.array([8]))[0]) == deepep[0]
    assert dispatcher_buffer_bytes("deepep", one, 7168, 256, np.array([8]), np.array([8]), sms=32)[0] > deepep[0]
    across = dispatcher_buffer_bytes("deepep", one, 7168, 256, np.array([32]), np.array([8]))
    assert across[0] > deepep[0]  # 288-token NVLink chunks and the RDMA chunks of 4 nodes
    hybrid = dispatcher_buffer_bytes("hybridep", one, 7168, 256, np.array([64]), np.array([64]))
    assert float(hybrid[0]) == 4096 * 64 * (2 * 7168 + 4 * 4 * 64 + 4 * 56)
    assert float(dispatcher_buffer_bytes("hybridep", 2 * one, 7168, 256, np.array([64]), np.array([64]))[0]) == 2 * hybrid[0]
    nodes = dispatcher_buffer_bytes("hybridep", one, 7168, 256, np.array([64]), np.array([8]))
    intra = 4096 * 64 * (2 * 7168 + 4 * 4 * 8 + 4 * 56)
    assert nodes[0] > intra  # RDMA staging across 8 domains
    assert not dispatcher_buffer_bytes("alltoall", one, 7168, 256, np.array([8]), np.array([8])).any()
    args = dict(num_gpus=64, global_batch_size=256, seq_len=4096, precision="bf16",
                strategy=Strategy(ep=8, pp=2, micro_batch_size=1))
    terms = {d: evaluate("qwen3-30b-a3b", "dgx-b200", moe_dispatcher=d, **args).memory_bytes["dispatcher_buffers"]
             for d in ("alltoall", "deepep", "hybridep")}
    assert terms["alltoall"] == 0 < terms["deepep"] and terms["hybridep"] > 0


def test_a_stage_of_dense_layers_only_has_no_dispatcher_buffers():
    """megatron-core allocates the flex dispatcher's buffer at its first call: a pipeline stage holding only
    DeepSeek-V3's three dense layers never makes one."""
    from cost_models.step import setup, stage_memory
    from planner.api import make_inputs
    from planner.space import StrategyArrays
    from planner.specs import Strategy

    st = Strategy(pp=4, ep=64, stage_layers=[3, 20, 20, 18], micro_batch_size=1, zero_stage=1).resolve(256)
    m, c, t = make_inputs("deepseek-v3", "gb200-nvl72", 256, 4096, 4096, "bf16", moe_dispatcher="hybridep")
    mem = stage_memory(setup(m, c, t, StrategyArrays.from_strategies([st])))["dispatcher_buffers"]
    rows = mem[:, 0]
    assert rows[0] == 0 and (rows[1:] > 3 * 2**30).all()
