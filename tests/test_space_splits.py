"""The search space (issue #8, part 4 and expert parallelism): uneven pipeline splits with
interleaving, embedding and loss as layers, ep/etp for mixture-of-experts models, offload,
constraints, and the per-head rule check agreeing with checking every candidate."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from cost_models.layout import ParallelLayout
from planner.api import make_inputs
from planner.rules import Context, check, first_failure_counts
from planner.space import SHAVES, _pipeline_key, _pipeline_splits, enumerate_space, normalise_constraints, search_space
from planner.specs import ModelSpec, TrainSpec


def splits(L: int, pp: int, constraints: dict | None = None) -> list[tuple]:
    return list(_pipeline_splits(L, pp, _pipeline_key(normalise_constraints(constraints or {}))))


def per_stage(L: int, pp: int, split: tuple) -> list[int]:
    vpp, first, last, explicit, emb, loss, _ = split
    one = np.ones(1, np.int64)
    lay = ParallelLayout(num_layers=L, tp=one, cp=one, dp=one, pp=np.array([pp]), vpp=np.array([vpp]), ep=one,
                         etp=one, first=np.array([first]), last=np.array([last]), embedding_as_layer=np.array([emb]),
                         loss_as_layer=np.array([loss]),
                         stage_layers=np.array([explicit], dtype=np.int64) if explicit else None)
    return lay.layers_per_stage() if bool(lay.split_ok()[0]) else []


def test_the_published_405b_layout_is_enumerated():
    # Llama 3.1 405B, 126 layers on pp 16 with vpp 8, embedding and loss counted as layers (Llama 3 paper Sec. 3.3.2;
    # NeMo's Llama 3.1 405B recipe sets both account-for flags).
    found = [s for s in splits(126, 16) if s[0] == 8 and s[4] and s[5]]
    assert len(found) == 1
    assert per_stage(126, 16, found[0]) == [7] + [8] * 14 + [7]
    # and pp 8 × vpp 8 (126 + 2 = 128 = 8 · 8 · 2)
    assert any(s[0] == 8 and s[4] and s[5] for s in splits(126, 8))
    # the plain uneven split of the paper (first and last one layer short) at vpp 1
    assert any(s[:3] == (1, 7, 7) for s in splits(126, 16))


def test_shaved_first_and_last_ranks_combine_with_interleaving():
    # 126 layers, pp 4, vpp 2: (30, 32, 32, 32) and (32, 32, 32, 30); vpp 3: (30, 33, 33, 30).
    got = {(s[0], tuple(per_stage(126, 4, s))) for s in splits(126, 4) if s[1] or s[2]}
    assert (2, (30, 32, 32, 32)) in got and (2, (32, 32, 32, 30)) in got
    assert (3, (30, 33, 33, 30)) in got
    # Every rank's layers stay a multiple of its vpp.
    for v, counts in got:
        assert all(c % v == 0 for c in counts), (v, counts)


def test_shaves_are_bounded_and_splits_are_unique():
    for L, pp in [(126, 16), (61, 16), (80, 4), (94, 8), (32, 2)]:
        out = splits(L, pp)
        chunks = [tuple(per_stage(L, pp, s)) + (s[0],) for s in out]
        assert len(chunks) == len(set(chunks)), (L, pp)
        for s in out:
            vpp, first, last = s[:3]
            counts = per_stage(L, pp, s)
            if (first or last) and pp > 2 and len(counts) > 2:
                middle = counts[1]
                assert 0 <= middle - counts[0] <= max(a for a, _ in SHAVES) * vpp or L % pp, (L, pp, s)


def test_deepseek_v3_61_layers_get_uneven_splits_without_empty_stages():
    # 61 layers on pp 16: middle ranks 4, the ends 2 and 3 (61 = 2 + 14·4 + 3), a deficit of 3 beyond the one-layer
    # shaves, so the fallback splits: the ends share the rest, or the first rank full and the last the remainder
    # (Megatron-Bridge's pp 16 layout, 15·4 + 1; on pp 4: 14 + 16 + 16 + 15 and 16 + 16 + 16 + 13). Asked for vpp 4,
    # pp 4 gets Megatron-Bridge's interleaved recipe layout, 4 chunks of 4 layers per rank but the last virtual
    # stage's 1 (16 + 16 + 16 + 13).
    assert {tuple(per_stage(61, 16, s)) for s in splits(61, 16)} == {(2,) + (4,) * 14 + (3,), (4,) * 15 + (1,)}
    assert {tuple(per_stage(61, 4, s)) for s in splits(61, 4)} == {(14, 16, 16, 15), (16, 16, 16, 13)}
    assert {s[3] for s in splits(61, 4, {"vpp": 4})} == {(4,) * 15 + (1,)}
    assert {tuple(per_stage(61, 4, s)) for s in splits(61, 4, {"vpp": 4})} == {(16, 16, 16, 13)}
    # pp 32 cannot hold 61 layers with equal middle ranks: one impossible split, rejected by the rules.
    assert all(not per_stage(61, 32, s) for s in splits(61, 32))


@settings(max_examples=60, deadline=None)
@given(L=hs.integers(2, 130), pp=hs.sampled_from([1, 2, 3, 4, 6, 8, 16, 32]))
def test_every_valid_enumerated_split_sums_to_the_layers(L, pp):
    if pp > L:
        return
    for s in splits(L, pp):
        counts = per_stage(L, pp, s)
        if counts:  # a split the layout accepts
            assert sum(counts) == L and len(counts) == pp
            assert all(c >= 0 for c in counts)
            assert all(c % s[0] == 0 for c in counts) or s[3] or s[4] or s[5]  # explicit: per virtual stage


def test_constraints_on_the_split_still_rule():
    assert [s[:6] for s in splits(126, 16, {"num_layers_in_first_stage": 7, "num_layers_in_last_stage": 7,
                                            "vpp": 1})] == [(1, 7, 7, (), False, False)]
    explicit = [6] + [8] * 14 + [8]
    assert {s[3] for s in splits(126, 16, {"stage_layers": explicit})} == {tuple(explicit)}
    assert all(not (s[4] or s[5]) for s in splits(126, 16, {"embedding_as_layer": False, "loss_as_layer": False}))
    assert all(s[4] and s[5] for s in splits(126, 16, {"embedding_as_layer": True, "loss_as_layer": True}))
    assert {s[0] for s in splits(126, 16, {"vpp": [2, 4]})} <= {2, 4}


def moe_model(**kw) -> ModelSpec:
    base = dict(name="tiny-moe", num_layers=8, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                gated_mlp=True, vocab_size=32000, num_experts=12, moe_top_k=2, moe_ffn_hidden_size=512)
    return ModelSpec(**(base | kw))


def test_moe_space_respects_expert_divisibility_and_needs_sequence_parallel():
    model, cluster, train = make_inputs(moe_model(), "dgx-h100", 16, 64, 2048)
    st = enumerate_space(model, train, 16, {}, cluster)
    assert set(np.unique(st.ep)) > {1}
    assert np.all(12 % st.ep == 0)
    assert np.all((st.tp * st.cp * st.dp) % (st.etp * st.ep) == 0)
    assert np.all((st.etp == 1) | (st.etp == st.tp))
    assert np.all(st.sequence_parallel[st.tp > 1])
    assert np.all(st.zero_stage[st.offload_optimizer] >= 1) and st.offload_optimizer.any()
    # A dense model keeps ep = etp = 1.
    dense, _, train = make_inputs("llama3-8b", "dgx-h100", 16, 64, 2048)
    st = enumerate_space(dense, train, 16, {}, cluster)
    assert np.all(st.ep == 1) and np.all(st.etp == 1)


def test_moe_constraints_replace_the_expert_choices():
    model, cluster, train = make_inputs(moe_model(), "dgx-h100", 16, 64, 2048)
    st = enumerate_space(model, train, 16, {"ep": 4, "etp": [1, 2]}, cluster)
    assert set(np.unique(st.ep)) == {4} and set(np.unique(st.etp)) <= {1, 2}


QUESTIONS = [
    ("llama3-8b", 16, 64, 4096, {}),
    ("llama3.1-405b", 1024, 512, 8192, {"tp": 8}),
    ("gpt3-1.7b", 8, 32, 2048, {"embedding_as_layer": [False, True], "overlap_grad_reduce": [False, True]}),
    (None, 16, 64, 2048, {}),  # the small MoE model
    # rules that read the recompute choice: the overlapped all-to-all forbids full recompute
    (None, 16, 64, 2048, {"overlap_moe_comm": [False, True], "pp": [1, 2]}),
    (None, 16, 64, 2048, {"recompute_modules": [["moe_act"], ["layernorm"]]}),
]


@pytest.mark.parametrize("name,gpus,batch,seq,cons", QUESTIONS)
def test_per_head_check_matches_checking_every_candidate(name, gpus, batch, seq, cons):
    model, cluster, train = make_inputs(name or moe_model(), "dgx-h100", gpus, batch, seq)
    fast = search_space(model, train, gpus, cons, cluster)
    space = enumerate_space(model, train, gpus, cons, cluster)
    valid, failures = check(Context(model, train, gpus, cluster), space)
    assert fast.num_candidates == len(space)
    assert fast.rejected == first_failure_counts(failures)
    slow = space.take(valid)
    for name_ in type(slow).names():
        assert np.array_equal(getattr(fast.valid, name_), getattr(slow, name_)), name_


def test_constrained_recompute_layers_are_checked_per_candidate():
    model, cluster, train = make_inputs("llama3-8b", "dgx-h100", 8, 32, 4096)
    fast = search_space(model, train, 8, {"pp": 4, "recompute": "full", "recompute_num_layers": [2, 9]}, cluster)
    assert fast.rejected.get("recompute_layers", 0) > 0  # 9 > the 8 layers of a pp-4 stage
    assert np.all(fast.valid.recompute_num_layers <= 8)


def test_tp_stays_in_the_nvlink_domain_unless_constrained():
    model, cluster, train = make_inputs(ModelSpec(name="wide", num_layers=8, hidden_size=4096, num_attention_heads=64,
                                                  ffn_hidden_size=8192, vocab_size=32000), "dgx-h100", 64, 64, 2048)
    assert TrainSpec is not None
    st = enumerate_space(model, train, 64, {}, cluster)
    assert st.tp.max() == cluster.domain_size == 8
    st = enumerate_space(model, train, 64, {"tp": 16}, cluster)
    assert set(np.unique(st.tp)) == {16}


def test_constrained_vpp_without_a_split_is_refused_not_answered_with_vpp_1():
    """DeepSeek-V3's 61 layers have no split for pp 4 x vpp 3 (12 virtual stages: not even, no short last
    stage): `-C vpp=3` gets no plan and the rule that refused it, not plans with vpp 1 (the uneven vpp-1
    fallback serves only where vpp 1 is allowed). vpp 4 has the recipe's layout, the last stage short."""
    from planner.api import plan

    args = dict(model="deepseek-v3", cluster="gb200-nvl72", num_gpus=256, global_batch_size=4096, seq_len=4096,
                top_k=3, headroom=0.0)
    cons = {"tp": 1, "pp": 4, "ep": 64, "micro_batch_size": 1, "zero_stage": 1}
    refused = plan(**args, constraints=cons | {"vpp": 3})
    assert not refused.plans and not refused.closest
    assert any(r.rule == "layers" for r in refused.rejections)
    recipe = plan(**args, constraints=cons | {"vpp": 4})
    assert recipe.plans and all(p.strategy.stage_layers == [4] * 15 + [1] for p in recipe.plans)
    free = plan(**args, constraints=cons)
    assert free.plans and all(p.strategy.vpp == 1 for p in free.plans)  # the fallback where vpp is free
