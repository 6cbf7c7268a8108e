"""The framework a plan runs on is costed as it runs (profiles/frameworks/<name>.yaml): per-micro-batch
gradient reductions and parameter gathers, its selective recompute policy, and only the strategies it
can run are ranked (the `cannot_run` rules agree with the emitters' NotExpressibleError)."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models.arrays import StrategyArrays
from cost_models.blocks import model_blocks
from cost_models.collectives import comm_model_for
from cost_models.memory import kind_activation_bytes
from cost_models.frameworks import cannot_run_masks
from cost_models.step import op_sac_gemms, op_sac_recompute_s, setup
from cost_models.units import DTYPE_BYTES, WEIGHT_BYTES
from tests.framework_defaults import evaluate, plan
from planner.api import make_inputs
from planner.errors import SpecError
from planner.specs import Strategy
from profiles.bundle import load_tables
from profiles.frameworks import FRAMEWORKS

BASE = dict(model="llama3-8b", cluster="dgx-h100", num_gpus=16, global_batch_size=64, seq_len=4096)
NO_OVERLAP = dict(overlap_grad_reduce=False, overlap_param_gather=False)


def _setup(strategy: Strategy, **train_options):
    model, cluster, train = make_inputs(precision="bf16", **BASE, **train_options)
    st = StrategyArrays.from_strategies([strategy.resolve(BASE["num_gpus"])])
    return setup(model, cluster, train, st, comm_model_for(cluster)), model, cluster, train


def test_every_framework_profile_loads_with_sources():
    for name in FRAMEWORKS:
        fw = load_tables(None).framework(name)
        assert fw.name == name and fw.selective_recompute in ("megatron_modules", "op_sac", "none")


def test_unknown_framework_is_a_spec_error():
    with pytest.raises(SpecError, match="framework"):
        evaluate(**BASE, strategy=Strategy(), framework="jax")


def test_per_microbatch_reduction_and_gather_lengthen_the_step_by_their_bytes_times_microbatches():
    """ZeRO-1 on dp 16, 4 micro-batches: Megatron reduces and gathers once per step, torchtitan (FSDP2
    without resharding, no pipeline) reduce-scatters after and all-gathers before every micro-batch."""
    strategy = Strategy(dp=16, zero_stage=1, micro_batch_size=1, **NO_OVERLAP)
    s, *_ = _setup(strategy)
    m = int(s.num_microbatches[0])
    assert m == 4
    shard, stride = s.lay.group("cp", "dp")
    params = float(s.params[0, 0])
    reduce_s = float(s.comm.gather_scatter_s(params * DTYPE_BYTES["fp32"], shard, stride)[0])
    gather_s = float(s.comm.gather_scatter_s(params * WEIGHT_BYTES["bf16"], shard, stride)[0])
    # the same loss for both (torchtitan's own is unfused): only the reductions and gathers differ
    megatron = evaluate(**BASE, strategy=strategy, framework="megatron", cross_entropy_fusion=True)
    titan = evaluate(**BASE, strategy=strategy, framework="torchtitan", cross_entropy_fusion=True)
    # Megatron: one reduction and one gather per step, whole (no overlap asked for)
    assert megatron.time_s["dp_comm"] == pytest.approx(reduce_s + gather_s, rel=1e-12)
    assert titan.time_s["dp_comm"] == pytest.approx(m * (reduce_s + gather_s), rel=1e-12)
    assert titan.step_time_s - megatron.step_time_s == pytest.approx((m - 1) * (reduce_s + gather_s), rel=1e-9)


def test_zero2_reduces_every_microbatch_in_megatron_fsdp_and_deepspeed_but_zero1_does_not():
    for zero, each in ((1, False), (2, True)):
        strategy = Strategy(dp=16, zero_stage=zero, micro_batch_size=1, **NO_OVERLAP)
        s, *_ = _setup(strategy)
        shard, stride = s.lay.group("cp", "dp")
        params = float(s.params[0, 0])
        reduce_s = float(s.comm.gather_scatter_s(params * DTYPE_BYTES["fp32"], shard, stride)[0])
        gather_s = float(s.comm.gather_scatter_s(params * WEIGHT_BYTES["bf16"], shard, stride)[0])
        expected = (4 if each else 1) * reduce_s + gather_s
        for fw in ("megatron", "deepspeed"):
            est = evaluate(**BASE, strategy=strategy, framework=fw)
            assert est.time_s["dp_comm"] == pytest.approx(expected, rel=1e-12), (fw, zero)


def test_overlapped_per_microbatch_reductions_hide_behind_the_next_forward_too():
    strategy = Strategy(dp=16, zero_stage=1, micro_batch_size=1)
    once = evaluate(**BASE, strategy=strategy, framework="megatron").time_s["dp_comm"]
    each = evaluate(**BASE, strategy=strategy, framework="torchtitan").time_s["dp_comm"]
    whole = evaluate(**BASE, strategy=Strategy(dp=16, zero_stage=1, micro_batch_size=1, **NO_OVERLAP),
                     framework="torchtitan").time_s["dp_comm"]
    assert once <= each <= whole


def test_with_pipeline_parallelism_torchtitan_reduces_once_per_step():
    """torch.distributed.pipelining turns gradient sync off until the last micro-batch."""
    strategy = Strategy(dp=8, pp=2, zero_stage=1, micro_batch_size=1, **NO_OVERLAP)
    megatron = evaluate(**BASE, strategy=strategy, framework="megatron")
    titan = evaluate(**BASE, strategy=strategy, framework="torchtitan")
    assert titan.time_s["dp_comm"] == pytest.approx(megatron.time_s["dp_comm"], rel=1e-12)


def test_op_sac_repeats_every_second_matmul_of_a_llama_layer():
    """wq wk wv wo w1 w3 w2: torchtitan's policy saves the 1st, 3rd, 5th, 7th and repeats wk, wo, w3."""
    s, model, *_ = _setup(Strategy(dp=16, micro_batch_size=1, recompute="selective"), framework="torchtitan")
    layer = model_blocks(model).all_kinds[0]
    n, h, q, k, f = 4096, model.hidden_size, model.q_width, model.kv_width, model.ffn_hidden_size
    flop = sum(float(np.asarray(g.flop).ravel()[0]) for g in op_sac_gemms(layer, s.x))
    assert flop == 2 * n * h * k + 2 * n * q * h + 2 * n * h * f


def test_torchtitan_selective_recompute_costs_its_op_policy_in_time_and_memory():
    strategy = Strategy(dp=16, micro_batch_size=1, recompute="selective")
    s, model, cluster, _ = _setup(strategy, framework="torchtitan")
    layer, L, m = model_blocks(model).all_kinds[0], model.num_layers, int(s.num_microbatches[0])
    titan = evaluate(**BASE, strategy=strategy, framework="torchtitan")
    per_layer = float(op_sac_recompute_s(layer, s.x, cluster.gpu)[0])  # tp 1: no all-gathers to repeat
    assert titan.time_s["recompute"] == pytest.approx(m * L * per_layer, rel=1e-9)
    # what the layer keeps: input, wq, wv, attention output + fp32 statistics, w1, w2 (tp 1, bf16)
    n, h, q, k, f, a = 4096, model.hidden_size, model.q_width, model.kv_width, model.ffn_hidden_size, \
        model.num_attention_heads
    kept = 2 * n * (h + q + k + q + f + h) + 4 * a * n
    assert float(kind_activation_bytes(layer, s.x, 1, 0, "op_sac")[0]) == pytest.approx(kept)
    assert titan.memory_bytes["activations"] == pytest.approx(L * kept)  # pp 1: one micro-batch in flight
    megatron = evaluate(**BASE, strategy=strategy, framework="megatron")
    assert titan.memory_bytes["activations"] < megatron.memory_bytes["activations"]
    assert titan.time_s["recompute"] != megatron.time_s["recompute"]


def test_colossalai_selective_with_flash_checkpoints_nothing():
    selective = evaluate(**BASE, strategy=Strategy(dp=16, micro_batch_size=1, recompute="selective"),
                         framework="colossalai")
    none = evaluate(**BASE, strategy=Strategy(dp=16, micro_batch_size=1), framework="colossalai")
    assert selective.time_s["recompute"] == 0.0
    assert selective.step_time_s == pytest.approx(none.step_time_s, rel=1e-12)
    assert selective.memory_bytes["activations"] == none.memory_bytes["activations"]


@pytest.mark.parametrize("framework, constraints, field", [
    ("deepspeed", {"cp": [1, 2], "pp": 1}, "cp"),
    ("deepspeed", {"vpp": [1, 2], "pp": 2}, "vpp"),
    ("colossalai", {"zero_stage": [1, 2], "pp": 2, "tp": 1}, "zero_stage"),
    # Megatron's activation offloading: no other framework runs it
    *((fw, {"offload_activation_layers": [None, 8], "pp": 1, "recompute": "none"}, "offload_activation_layers")
      for fw in ("torchtitan", "deepspeed", "colossalai")),
])
def test_a_strategy_the_framework_cannot_run_is_not_ranked(framework, constraints, field):
    ok = {"cp": lambda s: s.cp == 1, "vpp": lambda s: s.vpp == 1, "zero_stage": lambda s: s.zero_stage != 2,
          "offload_activation_layers": lambda s: s.offload_activation_layers is None}[field]
    everything = plan(**BASE, constraints=constraints, top_k=200)
    assert any(not ok(p.strategy) for p in everything.plans)  # Megatron runs them, and some rank
    result = plan(**BASE, constraints=constraints, top_k=200, framework=framework)
    assert result.plans and all(ok(p.strategy) for p in result.plans)
    assert result.stats.rejected.get("framework", 0) > 0


def test_evaluate_names_the_framework_that_cannot_run_it():
    est = evaluate(**BASE, strategy=Strategy(dp=8, cp=2), framework="deepspeed")
    assert not est.valid and not est.fits
    assert any("not expressible in deepspeed" in r and "cp > 1" in r for r in est.reasons)


def test_cannot_run_rules_agree_with_the_emitters():
    """Differential: for every plan Megatron ranks, a framework's rules refuse it exactly when that
    framework's emitter raises NotExpressibleError."""
    from planner.emit import NotExpressibleError, emit_data

    backend = {"torchtitan": "torchtitan", "deepspeed": "deepspeed", "colossalai": "colossalai"}
    plans = []
    for constraints, top in (({"pp": [1, 2]}, 40), ({"pp": 2, "vpp": [1, 2]}, 40), ({"cp": [1, 2], "pp": 1}, 40),
                             ({"recompute": "full", "recompute_num_layers": [1, 2, 3]}, 40),
                             # deep enough in the ranking to hold at least ten offloading plans
                             ({"pp": 1, "recompute": "none", "offload_activation_layers": [None, 4, 16]}, 80)):
        plans += plan(**BASE, constraints=constraints, top_k=top).plans
    assert len(plans) > 60
    assert sum(p.strategy.offload_activation_layers is not None for p in plans) >= 10
    checked = 0
    for p in plans:
        st = StrategyArrays.from_strategies([p.strategy])
        for fw, name in backend.items():
            refused = any(hit[0] for _, hit in cannot_run_masks(load_tables(None).framework(fw), p.model, p.train, st))
            try:
                emit_data(p, name)
                raised = False
            except NotExpressibleError:
                raised = True
            assert refused == raised, (fw, p.strategy.short())
            checked += 1
    assert checked == 3 * len(plans)


def test_a_framework_with_its_own_zero3_fixes_zero3_impl_and_refuses_a_contradiction():
    from planner import SpecError
    from tests.framework_defaults import plan

    q = dict(model="llama3-8b", cluster="dgx-h100", num_gpus=16, global_batch_size=64, seq_len=4096, top_k=1)
    assert plan(**q, framework="deepspeed").plans[0].train.zero3_impl == "deepspeed"
    assert plan(**q, framework="torchtitan").plans[0].train.zero3_impl == "fsdp2"
    assert plan(**q, framework="megatron", zero3_impl="deepspeed").plans[0].train.zero3_impl == "deepspeed"
    with pytest.raises(SpecError, match="contradicts framework 'torchtitan'"):
        plan(**q, framework="torchtitan", zero3_impl="deepspeed")
    with pytest.raises(SpecError, match="contradicts framework 'deepspeed'"):
        plan(**q, framework="deepspeed", zero3_impl="fsdp2")
