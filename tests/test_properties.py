"""Property tests (hypothesis) over random models, clusters and strategies.

Filters are `assume()`, never an early return, and each property is run through
`run_counted`, which fails unless enough examples got past the filters (and says
how many did), so a property that filters everything out cannot pass unseen.
"""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as hs

from cost_models import StrategyArrays, evaluate_arrays
from cost_models.blocks import model_blocks, padded_vocab
from cost_models.layout import ParallelLayout
from cost_models.memory import model_state_bytes, stage_params
from cost_models.params import num_params
from planner import ModelSpec, TrainSpec, evaluate, plan
from planner.rules import Context, check
from planner.search import evaluate_one
from planner.space import enumerate_space
from planner.specs import Strategy
from profiles import load_cluster

CLUSTERS = ["dgx-a100-80gb", "dgx-h100", "gb200-nvl72"]


@hs.composite
def models(draw):
    heads = draw(hs.sampled_from([4, 8, 16, 32]))
    kv = draw(hs.sampled_from([d for d in (1, 2, 4, 8, 16, 32) if heads % d == 0]))
    head_dim = draw(hs.sampled_from([32, 64, 128]))
    hidden = heads * head_dim
    return ModelSpec(
        name="random", num_layers=draw(hs.integers(1, 48)), hidden_size=hidden, num_attention_heads=heads,
        num_kv_heads=kv, ffn_hidden_size=draw(hs.sampled_from([2, 3, 4])) * hidden,
        gated_mlp=draw(hs.booleans()), vocab_size=draw(hs.integers(1000, 130000)),
        tie_embeddings=draw(hs.booleans()), position_embedding=draw(hs.sampled_from(["rope", "learned"])),
        norm=draw(hs.sampled_from(["rmsnorm", "layernorm"])), linear_bias=draw(hs.booleans()),
        dropout=draw(hs.booleans()),
    )


@hs.composite
def questions(draw):
    model = draw(models())
    num_gpus = 2 ** draw(hs.integers(0, 6))
    cluster = load_cluster(draw(hs.sampled_from(CLUSTERS)))
    precisions = [p for p in ("bf16", "fp16", "fp8") if p in cluster.gpu.peak_flop_per_s]
    train = TrainSpec(global_batch_size=num_gpus * draw(hs.sampled_from([1, 2, 4, 8])),
                      seq_len=draw(hs.sampled_from([512, 1024, 2048, 4096])),
                      precision=draw(hs.sampled_from(precisions)),
                      attention_kernel=draw(hs.sampled_from(["flash", "unfused"])))
    return model, cluster, train, num_gpus


def _valid_space(model, train, num_gpus, cluster):
    space = enumerate_space(model, train, num_gpus, {})
    valid, _ = check(Context(model, train, num_gpus, cluster), space)
    return space.take(valid)


SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def counted(fn):
    """Count the examples of a property that got past its assume() filters."""
    @functools.wraps(fn)
    def body(*args, **kwargs):
        fn(*args, **kwargs)
        body.ran += 1
    body.ran = 0
    return body


def run_counted(prop, minimum: int) -> int:
    """Run a @given(...)@counted property; fail unless at least `minimum` examples ran."""
    inner = prop.hypothesis.inner_test
    inner.ran = 0
    prop()
    print(f"{prop.__name__}: {inner.ran} examples ran")
    assert inner.ran >= minimum, f"{prop.__name__}: only {inner.ran} examples passed the filters (need {minimum})"
    return inner.ran


@SETTINGS
@given(questions())
@counted
def prop_every_cost_term_is_finite_and_non_negative(q):
    model, cluster, train, n = q
    st = _valid_space(model, train, n, cluster)
    assume(len(st) > 0)
    costs = evaluate_arrays(model, cluster, train, st)
    for name, arr in list(costs.time_s.items()) + list(costs.memory_bytes.items()):
        assert np.all(np.isfinite(arr)) and np.all(arr >= 0), name
    assert np.all(costs.step_time_s > 0)
    assert np.allclose(costs.step_time_s, sum(costs.time_s.values()))
    assert np.allclose(costs.peak_memory_bytes, sum(costs.memory_bytes.values()))
    assert np.all(costs.hardware_flop_per_step >= costs.model_flop_per_step)


def test_every_cost_term_is_finite_and_non_negative():
    run_counted(prop_every_cost_term_is_finite_and_non_negative, 20)


@SETTINGS
@given(questions())
@counted
def prop_tp1_has_no_tp_communication(q):
    model, cluster, train, n = q
    st = _valid_space(model, train, n, cluster)
    assume(len(st) > 0)
    costs = evaluate_arrays(model, cluster, train, st)
    tp1 = st.tp == 1
    assert np.all(costs.time_s["tp_comm"][tp1] == 0)
    assert np.all(costs.time_s["cp_comm"][st.cp == 1] == 0)
    assert np.all(costs.time_s["pp_comm"][st.pp == 1] == 0)
    assert np.all(costs.time_s["pp_bubble"][st.pp == 1] == 0)
    single = (st.dp * st.cp) == 1
    assert np.all(costs.time_s["dp_comm"][single] == 0)


def test_tp1_has_no_tp_communication():
    run_counted(prop_tp1_has_no_tp_communication, 20)


def _layout(model, tp, pp):
    one, zero = np.ones(1, dtype=int), np.zeros(1, dtype=int)
    return ParallelLayout(num_layers=model.num_layers, tp=np.array([tp]), cp=one, dp=one, pp=np.array([pp]), vpp=one,
                          ep=one, etp=one, first=zero, last=zero, embedding_as_layer=np.array([False]),
                          loss_as_layer=np.array([False]))


def _max_weight_bytes(model, tp, pp, zero, shard):
    lay = _layout(model, tp, pp)
    zero, shard = np.array([zero]), np.array([shard])
    params = stage_params(model_blocks(model), lay)
    return float(model_state_bytes(params, zero, shard, np.array([False]), "bf16", "fp32", "adam")["params"].max())


@SETTINGS
@given(models(), hs.sampled_from([1, 2, 4, 8]), hs.sampled_from([1, 2, 4, 8]))
@counted
def prop_weight_bytes_never_grow_with_tp_pp_or_zero(model, tp, pp):
    assume(model.num_attention_heads % (2 * tp) == 0 and model.num_layers % (2 * pp) == 0)
    base = _max_weight_bytes(model, tp, pp, 0, 8)
    assert _max_weight_bytes(model, 2 * tp, pp, 0, 8) <= base
    assert _max_weight_bytes(model, tp, 2 * pp, 0, 8) <= base
    for zero in (1, 2, 3):
        assert _max_weight_bytes(model, tp, pp, zero, 8) <= base


def test_weight_bytes_never_grow_with_tp_pp_or_zero():
    run_counted(prop_weight_bytes_never_grow_with_tp_pp_or_zero, 10)


@SETTINGS
@given(models(), hs.sampled_from([1, 2, 3, 4, 6, 8]))
@counted
def prop_stage_shards_sum_to_the_model(model, pp):
    assume(model.num_layers % pp == 0)
    first, middle, last = stage_params(model_blocks(model), _layout(model, 1, pp))[:, 0]
    total = first + last + max(pp - 2, 0) * middle if pp > 1 else first
    padding = (int(padded_vocab(model.vocab_size, 1)) - model.vocab_size) * model.hidden_size  # Megatron's padding
    matrices = 1 + (pp > 1 or not model.tie_embeddings)  # embedding, and the output layer or its tied copy
    tied_copy = model.vocab_size * model.hidden_size if (model.tie_embeddings and pp > 1) else 0
    assert total == num_params(model) + tied_copy + matrices * padding


def test_stage_shards_sum_to_the_model():
    run_counted(prop_stage_shards_sum_to_the_model, 15)


#: One candidate in this many is also evaluated alone in the differential test below (all 12,236 took
#: four minutes of the suite; the batch-against-alone equality is also tested per term in
#: tests/test_parallel_layout.py).
ALONE_STRIDE = 8


def test_search_agrees_with_one_by_one_evaluation():
    """Differential: the vectorised search's best equals the best of every candidate (the whole space
    scored in one batch, the rules applied), and evaluate() of one candidate alone agrees with that batch
    on every ALONE_STRIDE-th candidate and on the 20 fastest."""
    model = ModelSpec(name="small", num_layers=8, hidden_size=1024, num_attention_heads=16, num_kv_heads=4,
                      ffn_hidden_size=2816, gated_mlp=True, vocab_size=32000, tie_embeddings=False)
    cluster = load_cluster("dgx-h100")
    # CUDA graphs given (off): the search's graph twins (planner.knobs) are other candidates than the space's
    result = plan(model, cluster, num_gpus=16, global_batch_size=32, seq_len=2048, top_k=5, cuda_graph_impl="none")
    train = result.train  # the settings the planner chose (planner.knobs): a dense model's are the same for all
    assert train.global_batch_size == 32 and train.seq_len == 2048
    space = enumerate_space(model, train, 16, {})
    valid, _ = check(Context(model, train, 16, cluster), space)
    costs = evaluate_arrays(model, cluster, train, space)
    usable = np.where(valid & costs.fits, costs.step_time_s, np.inf)
    best_time = float(usable.min())
    assert np.isfinite(best_time)
    assert result.plans[0].estimate.step_time_s == best_time
    fastest = np.argsort(usable, kind="stable")[:20]
    for i in sorted(set(range(0, len(space), ALONE_STRIDE)) | set(fastest.tolist())):
        est = evaluate_one(model, cluster, train, Strategy(**space.row(i)))
        assert est.fits == bool(valid[i] and costs.fits[i]), space.row(i)
        assert est.step_time_s == float(costs.step_time_s[i]), space.row(i)
    again = evaluate(model, cluster, 16, 32, 2048, strategy=result.plans[0].strategy, cuda_graph_impl="none")
    assert again.step_time_s == result.plans[0].estimate.step_time_s
    # Offloaded twins are scored only for plans that do not fit without offload (here every plan
    # fits); the loop above went over the offloaded ones too and found none faster.
    assert result.stats.num_valid == result.stats.num_feasible
    assert result.stats.num_candidates == len(enumerate_space(model, train, 16, {"offload_optimizer": False}))
    assert result.stats.num_candidates == result.stats.num_valid + sum(
        v for k, v in result.stats.rejected.items() if not k.startswith("memory"))
    assert result.stats.num_valid == result.stats.num_feasible + sum(
        v for k, v in result.stats.rejected.items() if k.startswith("memory"))


def test_strategy_arrays_round_trip():
    s = Strategy(dp=2, tp=4, pp=2, vpp=2, sequence_parallel=True, zero_stage=1, micro_batch_size=2,
                 recompute="full", recompute_num_layers=3)
    st = StrategyArrays.from_strategies([s])
    assert Strategy(**st.row(0)) == s


@settings(max_examples=150, deadline=None)
@given(tp=hs.sampled_from([1, 2, 3, 4, 8, 16]), pp=hs.sampled_from([1, 2, 3, 5, 8, 64, 128]),
       cp=hs.sampled_from([1, 2, 3, 4]), vpp=hs.sampled_from([1, 2, 3, 7]), zero=hs.integers(0, 3),
       mbs=hs.sampled_from([1, 2, 3, 64]), recompute=hs.sampled_from(["none", "selective", "full"]),
       rcl=hs.sampled_from([None, 1, 5, 100]), first=hs.sampled_from([None, 1, 7, 40]),
       last=hs.sampled_from([None, 1, 7, 40]), sp=hs.booleans(), split=hs.sampled_from(["plain", "explicit", "emb"]))
@counted
def prop_evaluate_never_crashes_on_any_strategy(tp, pp, cp, vpp, zero, mbs, recompute, rcl, first, last, sp, split):
    """Any Strategy that constructs gets an Estimate, possibly with reasons: evaluate() promises
    fits=False with reasons for an invalid strategy, so no SpecError may escape it (the cost
    model's "non-positive step time" error included), and every term is finite and >= 0."""
    from pydantic import ValidationError

    from planner import SpecError

    explicit = split == "explicit" and pp > 1
    try:
        strategy = Strategy(tp=tp, pp=pp, cp=cp, vpp=vpp, zero_stage=zero, micro_batch_size=mbs, recompute=recompute,
                            recompute_num_layers=rcl if recompute == "full" else None,
                            num_layers_in_first_stage=first if pp > 1 and split == "plain" else None,
                            num_layers_in_last_stage=last if pp > 1 and split == "plain" else None,
                            stage_layers=[32 // pp + (i < 32 % pp) for i in range(pp)] if explicit else None,
                            embedding_as_layer=split == "emb", loss_as_layer=split == "emb",
                            sequence_parallel=sp and tp > 1)
    except (ValidationError, SpecError):
        assume(False)
        return
    num_gpus = tp * pp * cp * 2
    est = evaluate("llama3-8b", "dgx-h100", num_gpus, 64, 4096, strategy=strategy)
    assert np.isfinite(est.step_time_s) and est.step_time_s > 0
    assert est.fits == (not est.reasons)
    for name, value in list(est.time_s.items()) + list(est.memory_bytes.items()):
        assert np.isfinite(value) and value >= 0, (name, value)


def test_evaluate_never_crashes_on_any_strategy():
    run_counted(prop_evaluate_never_crashes_on_any_strategy, 75)


def test_comm_overlap_and_gather_scatter_efficiency():
    """comm_overlap = 1 hides DP communication behind backward; 0 exposes all of it.
    A lower all-gather/reduce-scatter efficiency slows only the collectives that use them."""
    base = load_cluster("dgx-h100")
    serial = base.model_copy(update={"comm_overlap": 0.0})
    q = dict(model="llama3-8b", num_gpus=64, global_batch_size=64, seq_len=4096)
    ddp = Strategy(dp=64, micro_batch_size=1, recompute="full")
    fast, slow = evaluate(cluster=base, strategy=ddp, **q), evaluate(cluster=serial, strategy=ddp, **q)
    assert slow.time_s["dp_comm"] > fast.time_s["dp_comm"]
    no_overlap = evaluate(cluster=base, strategy=ddp.model_copy(update={"overlap_grad_reduce": False}), **q)
    assert slow.time_s["dp_comm"] == no_overlap.time_s["dp_comm"]
    tier = base.inter_node.model_copy(update={"gather_scatter_efficiency": 0.2})
    gloo_like = base.model_copy(update={"inter_node": tier, "comm_overlap": 0.0})
    z3 = Strategy(dp=64, zero_stage=3, micro_batch_size=1, recompute="full")
    assert (evaluate(cluster=gloo_like, strategy=z3, **q).time_s["dp_comm"]
            > evaluate(cluster=serial, strategy=z3, **q).time_s["dp_comm"])
    assert (evaluate(cluster=gloo_like, strategy=ddp, **q).time_s["dp_comm"]
            == evaluate(cluster=serial, strategy=ddp, **q).time_s["dp_comm"])  # all-reduce unaffected
