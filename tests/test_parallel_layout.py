"""ParallelLayout (ranks, groups, stage splits, micro-batch rules) and the cost blocks.

Issue #7: one layout object for every stage split and rank order; cost blocks whose
parameters add up to the model; invalid splits give finite, non-negative terms with a
reason; the tied-embedding all-reduce runs between the first and last pipeline ranks.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace as S

import numpy as np
import pytest

from cost_models import StrategyArrays, evaluate_arrays
from cost_models.blocks import Block, model_blocks, padded_vocab
from cost_models.layout import ParallelLayout
from cost_models.params import num_params
from planner import Strategy, evaluate
from planner.api import make_inputs
from profiles import load_model


def strat(**kw) -> S:
    base = dict(tp=1, cp=1, dp=1, pp=1, vpp=1, ep=1, etp=1, num_layers_in_first_stage=None,
                num_layers_in_last_stage=None, embedding_as_layer=False, loss_as_layer=False, stage_layers=None)
    return S(**(base | kw))


@pytest.mark.parametrize("tp,cp,dp,pp", [(2, 1, 2, 4), (4, 2, 2, 2), (1, 4, 1, 2), (8, 1, 3, 1)])
def test_coordinates_round_trip_and_groups_are_strided_ranges(tp, cp, dp, pp):
    lay = ParallelLayout.of_strategy(strat(tp=tp, cp=cp, dp=dp, pp=pp), 8)
    world = tp * cp * dp * pp
    seen = set()
    for r in range(world):
        c = lay.coords(r)
        assert lay.rank(**c) == r
        seen.add(tuple(c[d] for d in ("tp", "cp", "dp", "pp")))
    assert len(seen) == world
    # Megatron's order: tp innermost, then cp, dp, pp.
    assert [int(lay.stride(d)[0]) for d in ("tp", "cp", "dp", "pp")] == [1, tp, tp * cp, tp * cp * dp]
    size, stride = lay.group("cp", "dp")
    assert (int(size[0]), int(stride[0])) == (cp * dp, tp)
    for stage in range(pp):
        ranks = lay.stage_ranks(stage)
        assert ranks == list(range(stage * tp * cp * dp, (stage + 1) * tp * cp * dp))


def test_groups_follow_another_rank_order():
    lay = ParallelLayout.of_strategy(strat(tp=2, cp=1, dp=4, pp=2), 8, rank_order="tp-cp-ep-pp-dp")
    assert int(lay.stride("pp")[0]) == 2 and int(lay.stride("dp")[0]) == 4
    # cp 1 leaves the ZeRO group the dp group: a strided range across the pipeline
    assert [int(v[0]) for v in lay.group("cp", "dp")] == [4, 4]
    assert lay.mesh_dims() == ("dp", "pp", "cp", "tp") and lay.coords(5) == {"tp": 1, "cp": 0, "pp": 0, "dp": 1}
    size, stride = lay.expert_group("edp")  # etp = ep = 1: the dp ranks, pp stages apart
    assert (int(size[0]), int(stride[0])) == (8, 2)
    refused = evaluate(model="llama3-8b", cluster="dgx-h100", num_gpus=16, global_batch_size=64, seq_len=4096,
                       strategy=Strategy(tp=2, pp=2, cp=2, rank_order="tp-cp-ep-pp-dp"))
    assert not refused.valid and refused.reasons == [
        "rank_order 'tp-cp-ep-pp-dp' (Megatron's --use-tp-pp-dp-mapping) needs cp 1 (is 2: with context parallelism "
        "the data-parallel group of this order is not a strided range of ranks, which the cost model does not price)"]


def test_candidates_keep_their_own_rank_orders():
    """Arrays of candidates mix orders: each candidate's strides follow its own."""
    from cost_models.arrays import StrategyArrays

    both = [Strategy(tp=2, pp=2, dp=2), Strategy(tp=2, pp=2, dp=2, rank_order="tp-cp-ep-pp-dp")]
    lay = ParallelLayout.of(StrategyArrays.from_strategies(both), 8)
    assert lay.stride("pp").tolist() == [4, 2] and lay.stride("dp").tolist() == [2, 4]
    assert [int(v) for v in lay.group("cp", "dp")[1]] == [2, 4]
    assert lay.distinct is None  # two layouts, not one


def test_embedding_group_spans_the_first_and_last_pipeline_ranks():
    lay = ParallelLayout.of_strategy(strat(tp=2, dp=2, pp=4), 8)
    size, stride = lay.embedding_group()
    assert (int(size[0]), int(stride[0])) == (2, 12)  # rank 0 and rank 12
    assert lay.coords(12)["pp"] == 3


@pytest.mark.parametrize("L,pp,vpp,first,last,expected", [
    (8, 4, 1, None, None, [2, 2, 2, 2]),
    (126, 8, 1, 15, 15, [15] + [16] * 6 + [15]),
    (10, 4, 1, 2, 2, [2, 3, 3, 2]),
    (12, 4, 2, 2, 2, [2, 4, 4, 2]),  # uneven with interleaving: each rank's count splits over its vpp chunks
])
def test_stage_splits(L, pp, vpp, first, last, expected):
    lay = ParallelLayout.of_strategy(strat(pp=pp, vpp=vpp, num_layers_in_first_stage=first,
                                           num_layers_in_last_stage=last), L)
    assert lay.layers_per_stage() == expected
    assert bool(lay.split_ok()[0])
    chunks = lay.layers_per_chunk()
    assert len(chunks) == pp * vpp and sum(chunks) == L
    assert [sum(chunks[r::pp]) for r in range(pp)] == expected  # virtual stage c·pp + r runs on rank r


def test_llama_405b_pp16_vpp8_with_embedding_and_loss_as_layers():
    # 126 layers + embedding + loss = 128 = 16·8 virtual stages of one layer; the first virtual
    # stage holds only the embedding, the last only the output layer and loss.
    lay = ParallelLayout.of_strategy(strat(pp=16, vpp=8, embedding_as_layer=True, loss_as_layer=True), 126)
    assert bool(lay.split_ok()[0])
    chunks = lay.layers_per_chunk()
    assert chunks[0] == 0 and chunks[-1] == 0 and set(chunks[1:-1]) == {1}
    assert lay.layers_per_stage()[0] == 7 and lay.layers_per_stage()[-1] == 7


@pytest.mark.parametrize("kw,L", [
    (dict(pp=4), 10),  # pp does not divide L
    (dict(pp=4, num_layers_in_first_stage=3, num_layers_in_last_stage=3), 10),  # 4 over 2 middle: ok? no: 2+2 = 4
    (dict(pp=4, vpp=2, num_layers_in_first_stage=3, num_layers_in_last_stage=3), 12),  # 3 not a multiple of vpp
    (dict(pp=2, stage_layers=[3, 4]), 8),  # does not sum to L
    (dict(pp=4, vpp=3, embedding_as_layer=True), 12),  # 13 over 12 virtual stages
])
def test_impossible_splits_are_refused_with_a_reason(kw, L):
    lay = ParallelLayout.of_strategy(strat(**kw), L)
    ok = bool(lay.split_ok()[0])
    if kw.get("num_layers_in_first_stage") == 3 and kw.get("vpp", 1) == 1:
        assert ok  # 10 - 3 - 3 = 4 layers split evenly over 2 middle stages
        return
    assert not ok
    assert str(L) in lay.split_message()


def test_explicit_split_reports_the_heaviest_stage_not_the_average():
    """Regression: an 8-layer model split [1, 2, 2, 3] binds on the last stage, whose parameters
    and activations are those of 3 layers (plus the head), not of the 2-layer average."""
    model, cluster, train = make_inputs(load_model("llama3-8b").model_copy(update={"num_layers": 8}), "dgx-h100",
                                        4, 16, 4096)
    split = Strategy(dp=1, pp=4, stage_layers=[1, 2, 2, 3], micro_batch_size=1).resolve(4)
    even = Strategy(dp=1, pp=4, micro_batch_size=1).resolve(4)
    costs = evaluate_arrays(model, cluster, train, StrategyArrays.from_strategies([split, even]))
    assert int(costs.binding_pipeline_rank[0]) == 3
    blocks = model_blocks(model)
    per_layer = blocks.layers[0][0].params_per_rank(np.array(1))
    head = blocks.head.params_per_rank(np.array(1))
    weights = costs.memory_bytes["params"][0] / 2  # bf16
    assert weights == pytest.approx(3 * per_layer + head)
    from cost_models.blocks import Micro
    from cost_models.memory import layer_activation_bytes

    one = np.array([1])
    x = Micro(4096, one, one, one, np.array([False]), "bf16", train.attention_kernel)
    per_layer_act = float(layer_activation_bytes(blocks, x, 0)[0])
    assert costs.memory_bytes["activations"][0] == pytest.approx(3 * per_layer_act)  # the last rank holds 1 micro-batch
    assert costs.time_s["compute"][0] > costs.time_s["compute"][1]  # the slowest stage sets the pace


def test_invalid_split_still_gets_finite_nonnegative_terms_and_a_reason():
    est = evaluate("llama3-8b", "dgx-h100", 8, 32, 4096, strategy=Strategy(
        pp=4, num_layers_in_first_stage=30, num_layers_in_last_stage=30, micro_batch_size=1))
    assert not est.fits and any("uneven pipeline" in r for r in est.reasons)
    assert all(v >= 0 and np.isfinite(v) for v in list(est.time_s.values()) + list(est.memory_bytes.values()))


def test_tied_embedding_sync_crosses_the_pipeline_not_the_data_parallel_group():
    """Issue #7 bug: with tied embeddings the gradient all-reduce runs between pipeline ranks 0
    and pp-1. With tp·cp·dp = 4 inside one 8-GPU node and pp = 16, those ranks are 60 apart
    and talk over the network, so the sync is slower than two ranks 4 apart would be."""
    from cost_models.comm import TierCommModel
    from cost_models.step import pipeline_comm, setup

    model, cluster, train = make_inputs("gpt3-22b", "dgx-a100-80gb", 64, 64, 2048)
    s = Strategy(dp=2, cp=2, pp=16, micro_batch_size=1).resolve(64)
    st = StrategyArrays.from_strategies([s])
    setup_ = setup(model, cluster, train, st)
    grads = padded_vocab(model.vocab_size, 1) * model.hidden_size * 4
    comm = TierCommModel(cluster)
    untied = pipeline_comm(setup(model.model_copy(update={"tie_embeddings": False}), cluster, train, st))
    tied_sync = float(pipeline_comm(setup_)[0] - untied[0])
    assert tied_sync == pytest.approx(float(comm.all_reduce_s(grads, 2, 60)))
    assert tied_sync > float(comm.all_reduce_s(grads, 2, 4))


def test_megatron_pads_the_vocabulary():
    model = load_model("llama3-8b")  # 128,256 tokens
    blocks = model_blocks(model)
    for tp in (1, 2, 8):
        per_rank = float(blocks.embedding.params_per_rank(np.array(tp)))
        assert per_rank * tp == padded_vocab(model.vocab_size, tp) * model.hidden_size
        assert padded_vocab(model.vocab_size, tp) % (128 * tp) == 0
    assert num_params(model) == pytest.approx(8.03e9, rel=0.01)  # unpadded, as published


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-70b", "llama2-7b"])
def test_blocks_follow_the_protocol_and_add_up_to_the_model(name):
    model = load_model(name)
    blocks = model_blocks(model)
    layer = blocks.layers[0][0]
    for block in layer.blocks + (blocks.embedding, blocks.head):
        assert isinstance(block, Block)
    total = sum(n * lk.params() for lk, n in blocks.layers) + blocks.embedding.params() + blocks.head.params()
    assert total == num_params(model)
    assert layer.params() == sum(b.params() for b in layer.blocks)


def test_gpt_layer_flops_are_korthikanti_eq7():
    from cost_models.blocks import Micro

    model = load_model("gpt3-175b")
    s, b, h = 2048, 1, model.hidden_size
    one = np.array([1])
    x = Micro(s, b * one, one, one, np.array([False]), "bf16", "flash")
    assert float(model_blocks(model).layers[0][0].forward_flop(x)[0]) == pytest.approx(24 * s * b * h * h * (1 + s / (6 * h)))


@pytest.mark.parametrize("pp,m", itertools.product([2, 4], [2, 3, 4, 8]))
def test_micro_batch_rules_of_megatron_and_torch_differ_as_documented(pp, m):
    lay = ParallelLayout.of_strategy(strat(pp=pp, vpp=2), 8)
    m_arr = np.array([m])
    assert bool(lay.megatron_schedule_ok(m_arr)[0]) == (m % pp == 0)
    assert bool(lay.torch_schedule_ok(m_arr)[0]) == (m % max(1, m // pp) == 0)


def test_llama_405b_published_layout_is_searchable_as_constraints():
    """Llama 3.1 405B's pp 16 × vpp 8 with the embedding and the loss counted as layers
    (126 + 2 = 128 virtual stages): enumerated, valid, and fitting on 2048 H100s."""
    from planner import plan

    result = plan("llama3.1-405b", "dgx-h100", 2048, 1024, 8192, top_k=1,
                  constraints={"tp": 8, "pp": 16, "vpp": 8, "embedding_as_layer": True, "loss_as_layer": True})
    assert result.plans, result.stats.rejected
    best = result.plans[0].strategy
    assert best.embedding_as_layer and best.loss_as_layer and best.stage_layers is None
    assert "layers" not in result.stats.rejected


def test_candidates_sharing_a_layout_are_costed_as_each_alone():
    """The step model times collectives once per distinct layout (and micro-batch shape) and spreads
    the result (`ParallelLayout.distinct`, `cost_models.step.spread`): a batch of candidates that share
    layouts, ZeRO-3 and explicit splits among them, gets each candidate's own terms."""
    model, cluster, train = make_inputs("qwen3-30b-a3b", "dgx-h100", 32, 256, 4096)
    picks = [Strategy(tp=2, pp=2, ep=8, sequence_parallel=True, zero_stage=z, micro_batch_size=b, recompute=rc)
             for z in (0, 1, 3) for b in (1, 2) for rc in ("none", "full")]
    picks += [Strategy(pp=4, stage_layers=[10, 12, 12, 14], ep=8, zero_stage=1, micro_batch_size=1),
              Strategy(pp=4, ep=8, zero_stage=1, micro_batch_size=1), Strategy(cp=2, ep=4, zero_stage=3),
              # deeper than any explicit split and uneven: its last rank must stay the last stage row
              Strategy(pp=8, num_layers_in_first_stage=5, num_layers_in_last_stage=7, ep=4, zero_stage=1,
                       micro_batch_size=1)]
    resolved = [s.resolve(32) for s in picks]
    batch = StrategyArrays.from_strategies(resolved)
    assert ParallelLayout.of(batch, model.num_layers).distinct is not None  # there is something to share
    together = evaluate_arrays(model, cluster, train, batch)
    for i, s in enumerate(resolved):
        alone = evaluate_arrays(model, cluster, train, StrategyArrays.from_strategies([s]))
        assert together.step_time_s[i] == pytest.approx(float(alone.step_time_s[0]), rel=1e-12)
        assert together.peak_memory_bytes[i] == pytest.approx(float(alone.peak_memory_bytes[0]), rel=1e-12)
        for k, v in alone.time_s.items():
            assert together.time_s[k][i] == pytest.approx(float(v[0]), rel=1e-12, abs=1e-15), (s, k)


def test_distinct_layouts_survive_wide_keys():
    """Many columns with large values are renumbered before the mixed-radix key could overflow."""
    n = 6
    big = np.array([1, 2**20, 1, 2**20, 3, 3])
    lay = ParallelLayout(8, big, big, big, np.ones(n, np.int64), np.ones(n, np.int64), big, big, np.zeros(n, np.int64),
                         np.zeros(n, np.int64), np.zeros(n, bool), np.zeros(n, bool),
                         stage_layers=np.array([[1, 7], [1, 7], [1, 7], [1, 7], [2, 6], [2, 6]]))
    first, index = lay.distinct
    assert len(first) == 3 and index[first].tolist() == [0, 1, 2]  # each group's first member is its own
    groups = {tuple(np.flatnonzero(index == g)) for g in range(3)}
    assert groups == {(0, 2), (1, 3), (4, 5)}


def test_an_explicit_split_in_the_batch_leaves_a_deeper_uneven_split_as_costed_alone():
    """With explicit splits among the candidates the stage rows widen to the deepest of them; every
    other candidate keeps its first rank in row 0 and its last in row -1 (its layer kinds per rank,
    dense first layers then MoE, are read from them)."""
    model, cluster, train = make_inputs("deepseek-v2-lite", "dgx-h100", 64, 256, 4096)
    explicit = Strategy(pp=4, stage_layers=[6, 7, 7, 7], ep=8, zero_stage=1, micro_batch_size=1).resolve(64)
    uneven = Strategy(pp=8, num_layers_in_first_stage=1, num_layers_in_last_stage=2, ep=8, zero_stage=1,
                      micro_batch_size=1).resolve(64)
    together = evaluate_arrays(model, cluster, train, StrategyArrays.from_strategies([explicit, uneven]))
    alone = evaluate_arrays(model, cluster, train, StrategyArrays.from_strategies([uneven]))
    assert together.step_time_s[1] == pytest.approx(float(alone.step_time_s[0]), rel=1e-12)
    assert together.peak_memory_bytes[1] == pytest.approx(float(alone.peak_memory_bytes[0]), rel=1e-12)
