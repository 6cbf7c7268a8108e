"""The cluster as a graph: generators, the fabric's levels, collectives priced over them, and placement.

The acceptance checks of the topology work: two-tier clusters keep their numbers; an oversubscribed pod
boundary costs what crosses it; the best plan's TP and placement follow the hardware (DGX H100 against
GB200 NVL72); Llama 3.1 405B's published 16,384-GPU layout is valid and priced on Meta's published fabric.
"""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest

from cost_models.collectives import comm_model_for
from cost_models.comm import TierCommModel
from planner import Strategy, evaluate, plan
from planner.errors import SpecError
from profiles import list_presets, load_cluster
from profiles.topology import build_graph, derive_fabric, fat_tree

GB = 1e9
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]
STRIDES = [1, 2, 4, 8, 16, 64, 256]
BYTES = [1e3, 1e6, 1e8, 4e9]


def _grid():
    n, d, b = (np.array(v, dtype=float) for v in zip(*itertools.product(SIZES, STRIDES, BYTES)))
    return n, d, b


NON_BLOCKING = [c for c in list_presets("clusters") if c != "local-cpu" and load_cluster(c).topology is not None
                and load_cluster(c).topology.kind == "fat-tree"
                and all(t.oversubscription == 1 for t in load_cluster(c).topology.levels)]


def test_the_non_blocking_presets_are_the_current_ones():
    assert {"dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72",
            "gb300-nvl72"} <= set(NON_BLOCKING)


@pytest.mark.parametrize("name", NON_BLOCKING)
def test_presets_in_graph_form_keep_the_two_tier_numbers(name):
    """Every preset's fabric is non-blocking above its NVLink domains, so pricing collectives over the graph's
    levels gives exactly what the two tiers alone gave (the model without a fabric: one level, the domain,
    at the inter_node rate)."""
    cluster = load_cluster(name)
    assert cluster.fabric is not None and cluster.levels[0].unit_gpus == cluster.domain_size
    two_tier = cluster.model_copy(update={"fabric": None, "topology": None})
    graph, tiers = comm_model_for(cluster), comm_model_for(two_tier)
    assert type(graph) is type(tiers)
    n, d, b = _grid()
    for op in ("all_reduce_s", "gather_scatter_s", "all_to_all_s"):
        np.testing.assert_allclose(getattr(graph, op)(b, n, d), getattr(tiers, op)(b, n, d), rtol=1e-12)
    np.testing.assert_allclose(graph.p2p_s(b, d, n * d), tiers.p2p_s(b, d, n * d), rtol=1e-12)


def test_the_two_tier_rule_is_min_of_nvlink_and_the_members_nics():
    """Without a fabric: busbw = min(NVLink, k · NIC) with k members per NVLink domain (the rule the model
    had before the graph), checked on DGX H100's tiers by hand."""
    cluster = load_cluster("dgx-h100").model_copy(update={"fabric": None, "topology": None})
    comm = TierCommModel(cluster)
    nv, nic = cluster.intra_node.bus_bw_bytes_per_s, cluster.inter_node.bus_bw_bytes_per_s
    for size, stride in ((8, 1), (16, 1), (16, 2), (64, 8), (4, 4)):
        k = min(max(8 // stride, 1), size)
        bw = nv if size * stride <= 8 else min(nv, k * nic)
        lat = cluster.intra_node.latency_s if size * stride <= 8 else cluster.inter_node.latency_s
        want = 2 * (size - 1) / size * 1e9 / bw + 2 * np.ceil(np.log2(size)) * lat
        assert float(comm.all_reduce_s(1e9, size, stride)) == pytest.approx(want, rel=1e-12)


def test_llama3_fabric_is_derived_from_its_graph():
    """Meta's 24K cluster (Llama 3 paper Sec. 3.3.1): racks of 16 GPUs at full bisection, 3,072-GPU pods, 1:7
    above them. The pod's egress per GPU is 400 Gb/s / 7, found by max-flow on the generated graph."""
    c = load_cluster("llama3-h100-24k")
    levels = {lv.name: lv for lv in c.levels}
    assert [lv.name for lv in c.levels] == ["nvlink-domain", "rack", "pod"]
    assert levels["nvlink-domain"].egress_bytes_per_s == pytest.approx(50 * GB)
    assert levels["rack"].unit_gpus == 16 and levels["rack"].egress_bytes_per_s == pytest.approx(50 * GB)
    assert levels["pod"].unit_gpus == 3072 and levels["pod"].egress_bytes_per_s == pytest.approx(50 * GB / 7)
    whole = build_graph(c, num_gpus=24576)
    assert sum(1 for _, d in whole.nodes(data=True) if d["kind"] == "gpu") == 24576
    assert derive_fabric(whole).levels == c.fabric.levels  # the two-pod graph stands for all eight


def test_an_oversubscribed_pod_boundary_costs_what_crosses_it():
    """On llama3-h100-24k a pipeline hop across pods shares the pod's 1:7 uplinks among the 1,024 ranks that
    cross together (stride 1024): 3,072 · 50/7 / 1,024 GB/s each, 2.33x slower than a NIC; an all-to-all
    across pods pays the full 7x on the bytes that leave the pod; rings cross the boundary once per channel
    and are not slowed (k members of each pod share its uplinks among 3,072 / k groups)."""
    comm = comm_model_for(load_cluster("llama3-h100-24k"))
    in_pod = float(comm.p2p_s(1e9, 1024, 1024 * 3))   # the pipeline stays in one pod
    across = float(comm.p2p_s(1e9, 1024, 1024 * 16))  # 16 stages of 1,024 ranks: 5.3 pods
    nic = comm.inter_bw
    assert in_pod == pytest.approx(1e9 / nic + comm.level_lat[1], rel=1e-9)
    assert across == pytest.approx(1e9 / min(nic, 0.9 * 50 * GB / 7 * 3072 / 1024) + comm.level_lat[2], rel=1e-9)
    a2a_in = float(comm.all_to_all_s(1e8, 64, 8))     # 64 ranks, one per server, inside a pod
    a2a_out = float(comm.all_to_all_s(1e8, 64, 3072))  # one per pod: every byte leaves its pod
    assert a2a_out / a2a_in > 6
    ring_in = float(comm.all_reduce_s(1e9, 128, 8))
    ring_out = float(comm.all_reduce_s(1e9, 128, 128))  # 24 members per pod
    assert ring_out == pytest.approx(ring_in, rel=0.01)


def test_sharp_switches_reduce_in_the_network():
    """A level whose switches reduce in the network: an all-reduce crossing it sends each byte once up and
    once down, the ring's 2(n-1)/n more than its share; reduce-scatter is unchanged."""
    base = load_cluster("dgx-h100")
    spec = base.topology.model_copy(update={"levels": [base.topology.levels[0].model_copy(update={"sharp": True})]})
    sharp = load_cluster(base.model_copy(update={"topology": spec, "fabric": None}))
    assert sharp.levels[0].sharp and not base.levels[0].sharp
    plain, reducing = comm_model_for(base), comm_model_for(sharp)
    n = 64
    t_plain = float(plain.all_reduce_s(1e9, n, 8)) - 2 * 6 * plain.inter_lat
    t_sharp = float(reducing.all_reduce_s(1e9, n, 8)) - 2 * 6 * reducing.inter_lat
    assert t_plain / t_sharp == pytest.approx(2 * (n - 1) / n, rel=1e-9)
    assert float(reducing.gather_scatter_s(1e9, n, 8)) == float(plain.gather_scatter_s(1e9, n, 8))


def _graph_of(name: str, gpus: int) -> nx.Graph:
    return fat_tree(load_cluster(name), gpus)


@pytest.mark.parametrize("damage,message", [
    (lambda g: g.add_edge("gpu0", "nvsw0", bw=0.0), r"edge 'gpu0' - 'nvsw0' has bandwidth 0\.0"),
    (lambda g: g.add_edge("gpu0", "nvsw0", bw=-5e9), r"edge 'gpu0' - 'nvsw0' has bandwidth -5000000000\.0"),
    (lambda g: g.add_node("stray", kind="switch", tier=1), r"not connected: node 'stray'"),
    (lambda g: g.add_node("gpu99", kind="gpu", rank=16), r"GPU node 'gpu99' \(rank 16\) has no link"),
    (lambda g: g.nodes["gpu3"].update(rank=1), r"GPU nodes 'gpu1' and 'gpu3' both have rank 1"),
    (lambda g: g.nodes["nic0"].update(kind="router"), r"node 'nic0' has kind 'router'"),
])
def test_bad_graphs_are_refused_naming_the_node_or_edge(damage, message):
    g = _graph_of("dgx-h100", 16)
    damage(g)
    with pytest.raises(SpecError, match=message):
        derive_fabric(g)


def test_units_that_differ_are_refused_naming_a_gpu():
    """One server with a NIC of half the others' rate is fine (the slowest unit sets the level), but a unit
    with fewer GPUs is not a level the rank arithmetic can place groups on."""
    g = _graph_of("dgx-h100", 32)
    g.remove_edge("gpu8", "nvsw1")  # gpu8 leaves its NVLink domain: domains of 7 and 1
    with pytest.raises(SpecError, match=r"nvlink-domain units differ in size .*GPU 'gpu8'"):
        derive_fabric(g)


def test_the_slowest_unit_sets_a_levels_egress():
    g = _graph_of("dgx-h100", 512)
    g.edges["nic9", "su0.rail1"]["bw"] = 25 * GB  # one NIC at half rate
    levels = derive_fabric(g).levels
    assert levels[0].egress_bytes_per_s == pytest.approx((7 * 50 + 25) * GB / 8)


def test_tp16_is_cheap_on_nvl72_and_not_on_dgx():
    """TP 16 spans two DGX H100 servers (its rings leave each server over the 8 members' NICs, 8 · 45 GB/s,
    no faster than the server's NVLink 4, and with the network's latency per hop) but sits in one NVL72
    NVLink domain at NVLink 5's 720 GB/s bus bandwidth: twice the bandwidth, and the TP time falls by a third or more.
    (512 GPUs: the launcher fills 64 GPUs of each rack, which 16 divides; tests/test_straddling_groups.py has
    the 576-GPU job whose racks hold 72 and some of whose TP groups straddle two.)"""
    q = dict(model="gpt3-175b", num_gpus=512, global_batch_size=1024, seq_len=2048)
    st = Strategy(tp=16, pp=4, sequence_parallel=True, zero_stage=1)
    dgx = evaluate(cluster="dgx-h100", strategy=st, **q)
    nvl = evaluate(cluster="gb200-nvl72", strategy=st, **q)
    tp_link = {e.dim: e for e in dgx.groups}["tp"], {e.dim: e for e in nvl.groups}["tp"]
    assert tp_link[0].level == "nvlink-domain" and tp_link[1].level is None
    assert tp_link[0].tier.startswith("ndr-infiniband across") and tp_link[1].tier == "nvlink5"
    assert tp_link[0].bus_bw_bytes_per_s == pytest.approx(8 * 45 * GB)
    assert tp_link[1].bus_bw_bytes_per_s == pytest.approx(2 * tp_link[0].bus_bw_bytes_per_s)
    assert dgx.time_s["tp_comm"] > 1.5 * nvl.time_s["tp_comm"]


def test_best_tp_and_placement_follow_the_hardware():
    """GPT-3 175B on 576 GPUs. On DGX H100 (8-GPU NVLink domains, 80 GB) the best plan keeps TP inside the
    server at 8 and pipelines the rest; on GB200 NVL72 (72-GPU domains, 186 GB) it drops the pipeline: its
    data-parallel (ZeRO) group has many members in each 72-GPU domain, so its collectives run at NVLink
    rate rather than one NIC per member, and the memory takes the weights without pipeline stages."""
    q = dict(model="gpt3-175b", num_gpus=576, global_batch_size=1536, seq_len=2048, top_k=1)
    dgx = plan(cluster="dgx-h100", **q).plans[0]
    nvl = plan(cluster="gb200-nvl72", **q).plans[0]
    assert dgx.strategy.tp != nvl.strategy.tp
    assert dgx.strategy.tp == 8 and dgx.strategy.pp > 1 and nvl.strategy.pp == 1
    q.pop("top_k")
    links = {name: {g.dim: g for g in evaluate(cluster=c, strategy=p.strategy, **q).groups}
             for name, c, p in (("dgx", "dgx-h100", dgx), ("nvl", "gb200-nvl72", nvl))}
    assert links["dgx"]["dp"].limited_by == "nvlink-domain"  # one NIC per member of each server
    assert links["nvl"]["dp"].bus_bw_bytes_per_s > 10 * links["dgx"]["dp"].bus_bw_bytes_per_s


def test_llama3_405b_published_layout_on_the_published_fabric():
    """Llama 3 405B at 16,384 GPUs: TP 8, CP 1, PP 16, DP 128 in the order [TP, CP, PP, DP] (Llama 3 paper,
    Sec. 3.3.2 and Table 4). The layout is valid and priced; its data-parallel rings cross the 1:7 pod
    boundary (24 members per pod); Megatron's default order would instead send pipeline transfers across it,
    which is slower: the search prefers the published order."""
    q = dict(model="llama3.1-405b", cluster="llama3-h100-24k", num_gpus=16384, global_batch_size=2048, seq_len=8192)
    layout = dict(tp=8, pp=16, vpp=8, sequence_parallel=True, zero_stage=1, embedding_as_layer=True, loss_as_layer=True)
    published = evaluate(strategy=Strategy(**layout, rank_order="tp-cp-ep-pp-dp"), **q)
    default = evaluate(strategy=Strategy(**layout), **q)
    assert published.valid and default.valid and published.step_time_s > 0
    dp = {g.dim: g for g in published.groups}["dp"]
    assert (dp.size, dp.stride, dp.level) == (128, 128, "pod") and "pod" in dp.shares_bytes_per_s
    pp_default = {g.dim: g for g in default.groups}["pp"]
    assert pp_default.level == "pod" and pp_default.limited_by == "pod"
    assert published.time_s["pp_comm"] < default.time_s["pp_comm"]
    best = plan(constraints={"tp": 8, "pp": 16, "cp": 1, "vpp": 8, "zero_stage": 1, "sequence_parallel": True,
                             "embedding_as_layer": True, "loss_as_layer": True, "recompute": "full"}, top_k=1, **q)
    assert best.plans[0].strategy.rank_order == "tp-cp-ep-pp-dp"


def test_rank_order_is_searched_only_for_megatron_and_where_it_differs():
    q = dict(model="llama3-8b", cluster="dgx-h100", num_gpus=64, global_batch_size=256, seq_len=4096, top_k=5000)
    orders = {(p.strategy.pp > 1 and p.strategy.dp > 1 and p.strategy.cp == 1, p.strategy.rank_order)
              for p in plan(**q).plans}
    assert (True, "tp-cp-ep-pp-dp") in orders and (False, "tp-cp-ep-pp-dp") not in orders
    titan = plan(framework="torchtitan", **q).plans
    assert {p.strategy.rank_order for p in titan} == {"tp-cp-ep-dp-pp"}
    with pytest.raises(SpecError, match="constraint rank_order='dp-tp' must be one of"):
        plan(constraints={"rank_order": "dp-tp"}, **q)


def test_a_fitted_scale_out_rate_scales_every_fabric_level():
    """A calibration (the tuner's, or --calibration) that fits the scale-out tier's link rate moves the
    fabric's egress with it, oversubscription kept: the levels were derived from links at that rate."""
    from profiles import with_parameters

    c = load_cluster("llama3-h100-24k")
    half = with_parameters(c, {"inter_node_bw_bytes_per_s": 25 * GB})
    assert [lv.egress_bytes_per_s for lv in half.levels] == pytest.approx(
        [lv.egress_bytes_per_s / 2 for lv in c.levels])
    slow, fast = comm_model_for(half), comm_model_for(c)
    assert float(slow.all_reduce_s(1e9, 128, 128)) > 1.9 * float(fast.all_reduce_s(1e9, 128, 128))
