"""derive_fabric's per-level egress against networkx's own max-flow, on small random hierarchical graphs and on
the generators' graphs.

What is compared. derive_fabric (profiles/topology/fabric.py) states a unit's egress as the max-flow from the
unit's GPUs to the nodes just outside it, over the unit's own links and the links that leave it. The
reference here is the flow the egress stands for: networkx's `maximum_flow_value` from a super-source on
one unit's GPUs to a super-sink on every GPU outside the unit, over the whole graph. The two agree exactly
when the outside is not the bottleneck, and that is the case the egress is meant for: what the cost model
charges a group that leaves a unit is the unit's own uplinks, and every other unit of the level is alike
(the conventions refuse a graph whose units differ). The random graphs are built so: every unit of a level is
a copy of one random template (its switches at the same places, the same capacities on the same links into
the same parent switches), and every parent holds at least two units, so a sibling unit mirrors whatever flow
leaves a unit and takes it in over the mirrored links; no cut between the unit and the outside GPUs is then
smaller than the unit's own boundary.

A tier of switches whose units are the level below's (one top-of-rack switch per server) adds no level, and
its uplinks are then outside the unit below: `test_a_private_tier_above_a_domain` records what that gives.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import networkx as nx
import pytest

from planner.errors import SpecError
from profiles import load_cluster
from profiles.topology import build_graph, derive_fabric, fat_tree

GB = 1e9


@dataclass
class Hierarchy:
    """A random hierarchical fabric: `graph`, and the GPU count of each derived level's unit."""

    graph: nx.Graph
    unit_gpus: list[int]
    seed: int

    def describe(self) -> str:
        return f"seed {self.seed}: units {self.unit_gpus}, {self.graph.number_of_nodes()} nodes"


def random_hierarchy(seed: int, children: list[int] | None = None) -> Hierarchy:
    """NVLink domains of 1, 2 or 4 GPUs (one NVSwitch node each, when more than one), one NIC per GPU,
    1 to 3 levels of units each holding 2 or 3 units of the level below (`children` fixes the counts,
    innermost first, the last the number of top units), 1 to 3 parallel switches per unit, each lower switch
    linked to each switch of its parent unit, and a core tier joining the top units. Capacities are whole
    GB/s, random per template link; each level's uplinks carry its downlinks over a random oversubscription
    (1:2 under- to 7:1 over-subscribed), jittered per link; latencies random. Every unit of a level repeats
    one template (module docstring)."""
    rng = random.Random(seed)
    domain = rng.choice([1, 2, 4])
    if children is None:
        levels = rng.randint(1, 3)
        children = [rng.randint(2, 3) for _ in range(levels)] + [rng.randint(2, 3)]
        while domain * _prod(children) > 96:  # keep the reference flows quick
            children[rng.randrange(len(children))] = 2
            if domain * _prod(children) > 96:
                domain = max(1, domain // 2)
    switches = [rng.randint(1, 3) for _ in children]  # parallel switches per unit of tier 1 .. core
    switches[-1] = rng.randint(1, 2)  # the core tier
    nvlink = [rng.randint(100, 900) for _ in range(domain)]
    pcie = [rng.randint(10, 100) for _ in range(domain)]
    nic = [rng.randint(10, 100) for _ in range(domain)]
    leaf_of = [rng.randrange(switches[0]) for _ in range(domain)]
    # uplinks[t][p][q]: capacity from the p-th tier-(t+1) switch of a unit to the q-th switch above it: the
    # unit's downlink capacity spread over its uplinks, over a random oversubscription, each link jittered
    tiers = len(children) - 1  # switch tiers below the core
    down = children[0] * sum(nic)  # a level-1 unit's NIC capacity, GB/s
    uplinks = []
    for t in range(tiers):
        below, above = switches[t], switches[t + 1]
        oversubscription = rng.choice([0.5, 1.0, 2.0, 4.0, 7.0])
        each = down / (below * above) / oversubscription
        uplinks.append([[max(1, round(each * rng.uniform(0.7, 1.3))) for _ in range(above)] for _ in range(below)])
        down = children[t + 1] * sum(map(sum, uplinks[-1]))
    lat = lambda: rng.choice([0.0, 0.5, 1.0, 2.0, 6.0]) * 1e-6  # noqa: E731

    g = nx.Graph()
    n = domain * _prod(children)
    for r in range(n):
        local = r % domain
        g.add_node(f"gpu{r}", kind="gpu", rank=r)
        g.add_node(f"nic{r}", kind="nic")
        g.add_edge(f"gpu{r}", f"nic{r}", bw=pcie[local] * GB, latency=0.0, link="pcie")
        if domain > 1:
            g.add_node(f"nvsw{r // domain}", kind="nvswitch")
            g.add_edge(f"gpu{r}", f"nvsw{r // domain}", bw=nvlink[local] * GB, latency=lat(), link="nvlink")
    sizes = [domain]
    for c in children:
        sizes.append(sizes[-1] * c)
    # tier t + 1 switches: one set of switches[t] per unit of sizes[t + 1] GPUs; the core: one set
    for t in range(tiers):
        count = n // sizes[t + 1]
        for u in range(count):
            for p in range(switches[t]):
                g.add_node(f"t{t + 1}.u{u}.s{p}", kind="switch", tier=t + 1, level=f"level{t + 1}")
    for p in range(switches[-1]):
        g.add_node(f"core.s{p}", kind="switch", tier=tiers + 1, level="core")
    for r in range(n):  # NICs on the leaves of their level-1 unit
        local = r % domain
        g.add_edge(f"nic{r}", f"t1.u{r // sizes[1]}.s{leaf_of[local]}", bw=nic[local] * GB, latency=lat(),
                   link="nic")
    for t in range(tiers):
        count = n // sizes[t + 1]
        for u in range(count):
            parent = f"t{t + 2}.u{u // children[t + 1]}" if t + 1 < tiers else "core"
            for p in range(switches[t]):
                for q in range(len(uplinks[t][p])):
                    g.add_edge(f"t{t + 1}.u{u}.s{p}", f"{parent}.s{q}", bw=uplinks[t][p][q] * GB, latency=lat(),
                               link="fabric")
    return Hierarchy(g, sizes[:-1], seed)


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def reference_egress(graph: nx.Graph, ranks: range) -> float:
    """networkx's max-flow (bytes/s) from a super-source on the GPUs of `ranks` to a super-sink on every other
    GPU, each link a capacity per direction; GPUs take and give at any rate (edges without a capacity)."""
    flow = nx.DiGraph()
    for a, b, d in graph.edges(data=True):
        flow.add_edge(a, b, capacity=d["bw"])
        flow.add_edge(b, a, capacity=d["bw"])
    inside = set(ranks)
    for node, rank in graph.nodes(data="rank"):
        if rank is None:
            continue
        if rank in inside:
            flow.add_edge("source", node)
        else:
            flow.add_edge(node, "sink")
    return nx.maximum_flow_value(flow, "source", "sink")


@pytest.mark.parametrize("seed", range(50))
def test_egress_is_the_max_flow_to_the_gpus_outside(seed):
    h = random_hierarchy(seed)
    fabric = derive_fabric(h.graph, f"random hierarchy {seed}")
    assert [lv.unit_gpus for lv in fabric.levels] == h.unit_gpus, h.describe()
    n = sum(1 for _, k in h.graph.nodes(data="kind") if k == "gpu")
    for lv in fabric.levels:
        size = lv.unit_gpus
        for first in sorted({0, n - size}):  # the first and the last unit of the level
            want = reference_egress(h.graph, range(first, first + size))
            assert lv.egress_bytes_per_s * size == pytest.approx(want, rel=1e-9), (h.describe(), lv.name, first)


def test_the_random_graphs_cover_over_and_undersubscription():
    """The 50 graphs above are not all alike: some levels are limited by their uplinks, some by their NICs."""
    bound_by_uplinks = bound_by_nics = 0
    for seed in range(50):
        fabric = derive_fabric(random_hierarchy(seed).graph)
        for lv in fabric.levels[1:]:
            if lv.egress_bytes_per_s < fabric.levels[0].egress_bytes_per_s * (1 - 1e-9):
                bound_by_uplinks += 1
            else:
                bound_by_nics += 1
    assert bound_by_uplinks >= 10 and bound_by_nics >= 10


def test_a_private_tier_above_a_domain():
    """One top-of-rack switch per 8-GPU server, 2:1 above it (400 GB/s of NICs, 200 GB/s up), four servers
    per pod: the ToR tier joins no two servers, so it adds no level but belongs to the server's unit, whose
    egress is then the ToR's uplink, 25 GB/s per GPU, as networkx's flow to the other GPUs says; the latency
    of a message leaving the server counts the NIC's link and the uplink."""
    c = load_cluster("dgx-h100")
    server = c.topology.levels[0].model_copy(update={"name": "server", "unit_gpus": 8, "oversubscription": 2.0,
                                                     "latency_s": 1e-6})
    pod = c.topology.levels[0].model_copy(update={"name": "pod", "unit_gpus": 32})
    cluster = c.model_copy(update={"topology": c.topology.model_copy(update={"rails": False, "levels": [server, pod]}),
                                   "fabric": None})
    graph = fat_tree(cluster, 64)
    fabric = derive_fabric(graph)
    assert [(lv.name, lv.unit_gpus, lv.egress_bytes_per_s) for lv in fabric.levels] == [
        ("nvlink-domain", 8, 25e9), ("pod", 32, 25e9)]
    assert fabric.levels[0].latency_s == pytest.approx(c.inter_node.latency_s + 1e-6)
    assert reference_egress(graph, range(8)) / 8 == pytest.approx(25e9, rel=1e-9)
    assert reference_egress(graph, range(32)) / 32 == pytest.approx(25e9, rel=1e-9)


# ---- the generators' graphs ----------------------------------------------------------------------------
def test_dgx_h100_rails():
    """DGX SuperPOD: the NIC of GPU j of every server of a 256-GPU unit on rail leaf j, the units joined at
    full bisection: every level's egress is one 50 GB/s NIC per GPU."""
    cluster = load_cluster("dgx-h100")
    graph = build_graph(cluster)
    assert sum(1 for _, k in graph.nodes(data="kind") if k == "gpu") == 512
    for r in range(512):
        (leaf,) = [n for n in graph.neighbors(f"nic{r}") if graph.nodes[n]["kind"] == "switch"]
        assert leaf == f"su{r // 256}.rail{r % 8}"
    levels = [(lv.name, lv.unit_gpus, lv.egress_bytes_per_s) for lv in derive_fabric(graph).levels]
    assert levels == [("nvlink-domain", 8, 50e9), ("su", 256, 50e9)]
    assert cluster.fabric.levels == derive_fabric(graph).levels
    assert reference_egress(graph, range(256)) == pytest.approx(256 * 50e9, rel=1e-9)
    assert reference_egress(graph, range(8)) == pytest.approx(8 * 50e9, rel=1e-9)


def test_llama3_24k_pod_egress():
    """Llama 3's cluster (arXiv 2407.21783, Sec. 3.3.1): racks of 16 GPUs at full bisection into pods of
    3,072, pods joined 1:7: a pod's egress is 3,072 x 50 GB/s / 7, each GPU's share 50 / 7 GB/s."""
    cluster = load_cluster("llama3-h100-24k")
    levels = cluster.fabric.levels
    assert [(lv.name, lv.unit_gpus) for lv in levels] == [("nvlink-domain", 8), ("rack", 16), ("pod", 3072)]
    assert levels[0].egress_bytes_per_s == levels[1].egress_bytes_per_s == 50e9
    assert levels[2].egress_bytes_per_s * 3072 == pytest.approx(3072 * 50e9 / 7, rel=1e-12)
    assert levels[2].egress_bytes_per_s == pytest.approx(50e9 / 7, rel=1e-12)


def test_a_non_uniform_graph_is_refused_naming_a_node():
    """The first NVLink domain of a random hierarchy's second level-1 unit moves its NICs into the first unit:
    level-1 units of different sizes."""
    h = random_hierarchy(7, children=[2, 2, 2])
    g = h.graph
    domain, unit = h.unit_gpus[0], h.unit_gpus[1]
    moved = range(unit, unit + domain)
    for r in moved:
        (leaf,) = [n for n in g.neighbors(f"nic{r}") if g.nodes[n]["kind"] == "switch"]
        data = g.edges[f"nic{r}", leaf]
        g.remove_edge(f"nic{r}", leaf)
        g.add_edge(f"nic{r}", leaf.replace("t1.u1.", "t1.u0."), **data)
    with pytest.raises(SpecError, match=rf"the level1 units differ in size \({unit + domain} and {unit - domain} GPUs, "
                                        rf"the latter holding GPU 'gpu{unit + domain}'\)"):
        derive_fabric(g)
