"""Host operations of Megatron-core's layers, counted on the installed code (benchmarks/host_ops.py),
and the cost model's MoE host floor that uses the counts (cost_models/elementwise.py, issue #9)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cost_models.arrays import StrategyArrays
from cost_models.blocks import model_blocks
from cost_models.compute import layer_times
from cost_models.elementwise import (EXPERT_KERNELS, ROUTING_KERNELS, MoeHostOps, elementwise_model,
                                     synced_forward_s)
from cost_models.step import micro_of
from planner import Strategy
from planner.specs import TrainSpec
from profiles import load_cluster, load_model

#: A small layer: the counts are the code's structure, not its sizes.
SMALL = dict(seq_len=16, batch=2, hidden=128, ffn=256, moe_ffn=32, heads=4, groups=2)


@pytest.fixture(scope="module")
def host_ops():
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from benchmarks import host_ops

    yield host_ops
    host_ops.release_model_parallel()  # leave no process group to the tests after these


@pytest.fixture(scope="module")
def moe_counts(host_ops):
    return {e: host_ops.count_layer(e, **SMALL) for e in (8, 16)}


def test_expert_ops_grow_with_local_experts(host_ops, moe_counts):
    few, many = moe_counts[8], moe_counts[16]
    for attr in ("fwd_ops", "bwd_ops"):
        assert many.total(("experts",), attr) > few.total(("experts",), attr) > 0
        assert many.total(many.sections, attr) > few.total(few.sections, attr)


def test_router_and_dispatcher_ops_do_not_grow_with_local_experts(host_ops, moe_counts):
    few, many = moe_counts[8], moe_counts[16]
    for attr in ("fwd_ops", "bwd_ops"):
        assert few.total(host_ops.ROUTING_SECTIONS, attr) == many.total(host_ops.ROUTING_SECTIONS, attr) > 10
    # the backward of the sort by local expert slices one view per expert chunk: views do grow
    assert many.total(host_ops.ROUTING_SECTIONS, "bwd_views") > few.total(host_ops.ROUTING_SECTIONS, "bwd_views")


def test_counts_do_not_depend_on_tokens_or_routing(host_ops, moe_counts):
    other = host_ops.count_layer(8, **(SMALL | dict(seq_len=32, seed=1)))
    assert other.sections == moe_counts[8].sections


def test_dropless_dispatcher_waits_once_per_forward(moe_counts):
    c = moe_counts[8]
    # ep 1 without permute fusion: copies at the first permutation, the wait before the second
    assert c.sync_point == "before_permutation_2"
    assert set(c.d2h_copies) == {"dispatch_preprocess"} and c.host_waits == ["dispatch_postprocess"]


def test_moe_layer_issues_more_ops_than_dense(host_ops, moe_counts):
    dense = host_ops.count_layer(None, **SMALL)
    attention = (*host_ops.ATTENTION_SECTIONS, "layer_glue")
    assert dense.total(attention, "fwd_ops") == moe_counts[8].total(attention, "fwd_ops")
    assert moe_counts[8].total(host_ops.ROUTING_SECTIONS, "fwd_ops") > dense.total(("mlp",), "fwd_ops")


@pytest.mark.slow
@pytest.mark.executor
def test_tables_hold_the_counted_ops(host_ops):
    """The shipped tables' moe_host_ops are what the script counts with expert parallelism (2 ranks)."""
    c = host_ops.count_layer_ep(2, 8, **SMALL)
    ops = elementwise_model(load_cluster("dgx-h100").gpu).moe_host_ops
    assert c.sync_point == "before_ep_alltoall" and c.host_waits == ["token_dispatch"]
    assert ops.forward_before_sync == c.total(host_ops.BEFORE_SYNC, "fwd_ops") + len(c.d2h_copies)
    assert ops.forward_after_sync == c.total(host_ops.AFTER_SYNC, "fwd_ops")
    assert ops.backward == c.total(host_ops.ROUTING_SECTIONS, "bwd_ops")


# ---- the cost model -----------------------------------------------------------------------------

@pytest.mark.parametrize("gpu", ["dgx-h100", "dgx-b200", "gb200-nvl72"])
def test_moe_host_floor_uses_the_tables_counts(gpu):
    table = elementwise_model(load_cluster(gpu).gpu)
    ops, h = table.moe_host_ops, table.host_per_kernel_s
    assert ops.forward_before_sync > ROUTING_KERNELS
    tiny = np.array(1e-9)  # a GPU that is never the bound
    kernels, experts = np.array(30), 16
    fwd, bwd = table.moe_host_floor(tiny, tiny, kernels, experts, tiny / 2)
    counted = kernels - ROUTING_KERNELS + ops.forward_before_sync + ops.forward_after_sync
    g = table.host_per_expert_gemm_s
    assert float(fwd) == pytest.approx(counted * h + experts * (table.host_per_expert_fwd_s + 2 * g), rel=1e-6)
    assert float(bwd) == pytest.approx((table.backward_kernels_per_forward * (kernels - ROUTING_KERNELS)
                                        + ops.backward) * h + experts * (table.host_per_expert_bwd_s + 4 * g))
    more = dataclasses.replace(table, moe_host_ops=MoeHostOps(ops.forward_before_sync + 10,
                                                              ops.forward_after_sync, ops.backward + 20))
    fwd2, bwd2 = more.moe_host_floor(tiny, tiny, kernels, experts, tiny / 2)
    assert float(fwd2 - fwd) == pytest.approx(10 * h) and float(bwd2 - bwd) == pytest.approx(20 * h)


@pytest.mark.parametrize("gpu", ["dgx-h100", "dgx-b200", "gb200-nvl72"])
def test_grouped_linear_pays_each_local_experts_gemm_calls_on_the_host(gpu):
    """Transformer Engine's grouped linear issues one cuBLASLt GEMM per local expert (PR 3134's multi-stream
    loop): two per expert in the forward, four in the backward, each `host_per_expert_gemm_s` on the host. Only
    Megatron-core's layer (TE GroupedLinear) pays them; the framework-neutral floor keeps the set-up alone."""
    table = elementwise_model(load_cluster(gpu).gpu)
    g = table.host_per_expert_gemm_s
    assert g > table.host_per_kernel_s  # a cuBLASLt call with its descriptors costs more than one plain op
    tiny, kernels = np.array(1e-9), np.array(30)
    few = table.moe_host_floor(tiny, tiny, kernels, 2, tiny / 2)
    many = table.moe_host_floor(tiny, tiny, kernels, 16, tiny / 2)
    assert float(many[0] - few[0]) == pytest.approx(14 * (table.host_per_expert_fwd_s + 2 * g))
    assert float(many[1] - few[1]) == pytest.approx(14 * (table.host_per_expert_bwd_s + 4 * g))
    neutral_few, neutral_many = (table.host_floor(tiny, tiny, kernels, e) for e in (2, 16))
    assert float(neutral_many[0] - neutral_few[0]) == pytest.approx(14 * table.host_per_expert_fwd_s)
    without = dataclasses.replace(table, host_per_expert_gemm_s=0.0).moe_host_floor(tiny, tiny, kernels, 16, tiny / 2)
    assert float(many[0]) > float(without[0]) and float(many[1]) > float(without[1])


def test_wait_adds_the_host_time_after_it_to_the_gpu_time_before_it():
    table = elementwise_model(load_cluster("dgx-h100").gpu)
    ops, h, experts = table.moe_host_ops, table.host_per_kernel_s, 16
    host_after = ((ops.forward_after_sync + EXPERT_KERNELS) * h
                  + experts * (table.host_per_expert_fwd_s + 2 * table.host_per_expert_gemm_s))
    gpu_before, gpu_after = np.array(2e-3), np.array(1e-5)  # attention GPU-bound, experts host-bound
    fwd, _ = table.moe_host_floor(gpu_before + gpu_after, np.array(1.0), np.array(30), experts, gpu_after)
    assert float(fwd) == pytest.approx(float(gpu_before + host_after))
    layer_wise, _ = table.host_floor(gpu_before + gpu_after, np.array(1.0), np.array(30), experts)
    assert float(fwd) > float(layer_wise)


def test_synced_forward_is_never_below_the_layer_wise_max():
    rng = np.random.default_rng(0)
    g1, g2, h1, h2 = rng.uniform(0, 1, (4, 1000))
    assert np.all(synced_forward_s(g1, g2, h1, h2) >= np.maximum(g1 + g2, h1 + h2) - 1e-12)
    assert np.all(synced_forward_s(g1, g2, h1, h2) <= g1 + g2 + h1 + h2 + 1e-12)


def _layers(framework: str, dispatcher: str = "alltoall", name: str = "qwen3-30b-a3b"):
    model = load_model(name)
    st = StrategyArrays.from_strategies([Strategy(tp=1, dp=8, ep=8, micro_batch_size=1)])
    x = dataclasses.replace(micro_of(TrainSpec(global_batch_size=64, seq_len=256), st),
                            framework=framework, moe_dispatcher=dispatcher)
    blocks = model_blocks(model)
    return layer_times(blocks, x, load_cluster("dgx-h100").gpu), blocks


def test_only_megatrons_moe_layers_take_the_counted_host_ops_and_the_wait():
    megatron, blocks = _layers("megatron")
    torchtitan, _ = _layers("torchtitan")
    deepep, _ = _layers("megatron", "deepep")
    moe = [i for i, layer in enumerate(blocks.all_kinds) if layer.moe()]
    assert moe
    for i in moe:  # Qwen3-30B-A3B, 1 x 256 tokens and 16 local experts: host-bound
        assert megatron.fwd_s[i, 0] > deepep.fwd_s[i, 0] > torchtitan.fwd_s[i, 0]  # counted ops; the wait
        # no wait in the backward: what Megatron's layers add there is TE's per-expert GEMM calls
        assert megatron.bwd_s[i, 0] > deepep.bwd_s[i, 0] > torchtitan.bwd_s[i, 0]
    dense_megatron, _ = _layers("megatron", name="llama3-8b")
    dense_torchtitan, _ = _layers("torchtitan", name="llama3-8b")  # dense layers: the same host floor
    assert np.array_equal(dense_megatron.fwd_s, dense_torchtitan.fwd_s)
    assert np.array_equal(dense_megatron.bwd_s, dense_torchtitan.bwd_s)


def test_uncounted_dispatchers_keep_the_idealised_host_total():
    table = elementwise_model(load_cluster("dgx-h100").gpu)
    tiny, kernels, experts = np.array(1e-9), np.array(30), 16
    synced = table.moe_host_floor(tiny, tiny, kernels, experts, tiny / 2, counted=False)
    plain = table.host_floor(tiny, tiny, kernels, experts)
    g = table.host_per_expert_gemm_s  # the grouped linear's GEMM calls come on top, in either dispatcher
    assert float(synced[0]) == pytest.approx(float(plain[0]) + experts * 2 * g)
    assert float(synced[1]) == pytest.approx(float(plain[1]) + experts * 4 * g)
