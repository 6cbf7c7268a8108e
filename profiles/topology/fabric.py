"""From a topology graph to the per-level figures the communication model reads (`Fabric`).

Levels (planner.specs.topology): level 0 units are the NVLink domains, the connected parts of the
subgraph of GPUs and NVSwitches (a TPU slice: the chips joined by ICI). Level t >= 1 units are the
connected parts of the subgraph of GPUs, NVSwitches, NICs and the switches of tier <= t; a tier whose
parts are the level below's adds no level, and the tier whose part is the whole graph ends the list.
Every unit of a level must hold the same number of GPUs with consecutive ranks (the rank order maps
parallel groups onto units by rank arithmetic); the derivation refuses another graph, naming a node.

A tier whose parts are the level below's (a top-of-rack switch per server) adds no level: its switches join
the units below, whose egress then counts their uplinks too, and whose latency the links up to them.

A unit's egress is the max-flow (scipy's Dinic, exact min cut) from its GPUs to the nodes just outside it,
over the unit's own links and the links that leave it, each link a capacity per direction. The
units of a level are usually alike, so the flow is computed once per distinct shape of unit (its GPU
count and the sorted capacities of its links and boundary links) and reused: on the 24,576-GPU
llama3-h100-24k preset that is three flows, not thousands. The latency of level t is the latency of
level t - 1 plus the largest latency of a link that leaves a unit of level t (level 0: of a link that
leaves the domain, the NIC's uplink carrying the scale-out tier's per-hop latency).
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import breadth_first_order, connected_components, maximum_flow

from planner.errors import SpecError, short_repr
from planner.specs.topology import Fabric, FabricLevel, TorusSpec
from profiles.topology.graph import check_graph

#: scipy's max-flow takes 32-bit integer capacities: each flow's capacities are scaled so that the larger of
#: the largest link and the unit's whole boundary is this many steps (the flow and every sum of boundary
#: links then stay in range) and floored, a relative error of about 1e-9 per link ...
_FLOW_MAX = 2**30
#: The flow's value is then read off the min cut in the exact capacities.


class _Arrays:
    """The graph as index arrays (node kinds, switch tiers, edge ends, rates and latencies), so that the
    parts and boundaries of each level are numpy work rather than walks over networkx views."""

    def __init__(self, graph: nx.Graph, gpus: list[Any]) -> None:
        self.nodes = list(graph.nodes)
        index = {node: i for i, node in enumerate(self.nodes)}
        data = graph.nodes
        self.kind = np.array([data[n]["kind"] for n in self.nodes])
        self.tier = np.array([data[n].get("tier", 0) if data[n]["kind"] == "switch" else 0 for n in self.nodes])
        self.rank = np.full(len(self.nodes), -1)
        self.rank[[index[g] for g in gpus]] = np.arange(len(gpus))
        edges = list(graph.edges(data=True))
        self.a = np.array([index[a] for a, _, _ in edges], dtype=np.int64)
        self.b = np.array([index[b] for _, b, _ in edges], dtype=np.int64)
        self.bw = np.array([float(d["bw"]) for _, _, d in edges])
        self.lat = np.array([float(d.get("latency", 0.0)) for _, _, d in edges])

    def parts(self, keep: np.ndarray) -> np.ndarray:
        """Component label of every node of the subgraph `keep` selects (-1 outside it)."""
        n = len(self.nodes)
        both = keep[self.a] & keep[self.b]
        adj = coo_matrix((np.ones(int(both.sum())), (self.a[both], self.b[both])), shape=(n, n))
        _, labels = connected_components(adj, directed=False)
        return np.where(keep, labels, -1)


def _units(arr: _Arrays, labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(unit of each node, -1 for nodes in no unit; each unit's GPU ranks, sorted) of the parts that hold a
    GPU, numbered in rank order of their first GPU."""
    gpu = arr.rank >= 0
    part_of_rank = np.empty(int(gpu.sum()), dtype=np.int64)
    part_of_rank[arr.rank[gpu]] = labels[gpu]
    order = np.unique(part_of_rank, return_index=True)
    ids = order[0][np.argsort(order[1])]  # parts in order of their first rank
    number = np.full(labels.max() + 2, -1, dtype=np.int64)
    number[ids] = np.arange(len(ids))
    unit = np.where(labels >= 0, number[labels], -1)
    by_unit = number[part_of_rank]
    ranks_sorted = np.argsort(by_unit, kind="stable")
    cuts = np.cumsum(np.bincount(by_unit, minlength=len(ids)))[:-1]
    return unit, np.split(ranks_sorted, cuts)


def _check_units(units: list[np.ndarray], gpus: list[Any], level: str, what: str) -> int:
    """The common size of `units`, each consecutive ranks; a SpecError naming a node otherwise."""
    size = len(units[0])
    for u in units:
        if len(u) != size:
            raise SpecError(f"{what}: the {level} units differ in size ({size} and {len(u)} GPUs, the latter "
                            f"holding GPU {short_repr(gpus[u[0]])}); every unit of a level must be alike")
        if u[-1] - u[0] + 1 != len(u):
            present = set(u.tolist())
            gap = next(r for r in range(int(u[0]), int(u[-1])) if r not in present)
            raise SpecError(f"{what}: the {level} unit of GPU {short_repr(gpus[u[0]])} skips rank {gap}; a unit's "
                            "GPUs must have consecutive ranks")
    return size


def _max_flow(sources: np.ndarray, ia: np.ndarray, ib: np.ndarray, cap: np.ndarray, out: np.ndarray,
              out_cap: np.ndarray) -> float:
    """Max-flow from the nodes `sources` over the links (ia, ib, cap), each a capacity per direction, to the
    nodes `out` (with the capacity `out_cap` of the boundary link from each), bytes/s: scipy's Dinic on
    capacities scaled to integers (`_FLOW_MAX`) (networkx's preflow-push took a second on one 3,072-GPU pod;
    tests/test_topology_maxflow.py checks the two agree)."""
    if not len(out):
        return 0.0
    nodes = np.unique(np.concatenate([sources, ia, ib, out]))
    local = {int(v): i + 2 for i, v in enumerate(nodes)}  # 0: source, 1: sink
    at = np.vectorize(local.__getitem__, otypes=[np.int64])
    total = float(out_cap.sum())
    rows = np.concatenate([at(ia), at(ib), at(out), np.zeros(len(sources), dtype=np.int64)])
    cols = np.concatenate([at(ib), at(ia), np.ones(len(out), dtype=np.int64), at(sources)])
    unit = max(total, float(cap.max(initial=0.0))) / _FLOW_MAX  # bytes/s per integer step of capacity
    steps = np.floor(np.concatenate([cap, cap, out_cap]) / unit)
    steps = np.concatenate([steps, np.full(len(sources), 2**31 - 1)])  # a GPU may send at any rate
    n = len(nodes) + 2
    exact = np.concatenate([cap, cap, out_cap, np.full(len(sources), np.inf)])
    net = coo_matrix((steps.astype(np.int32), (rows, cols)), shape=(n, n)).tocsr()
    net.sum_duplicates()
    flow = maximum_flow(net, 0, 1, method="dinic").flow
    # The min cut: the nodes the source still reaches in the residual graph. Its value in the exact
    # capacities is the max-flow, free of the integer steps' rounding.
    residual = (net - flow).tocsr()
    residual.data = np.where(residual.data > 0, 1, 0)
    residual.eliminate_zeros()
    reached = np.zeros(n, dtype=bool)
    reached[breadth_first_order(residual, 0, directed=True, return_predecessors=False)] = True
    crossing = reached[rows] & ~reached[cols]
    return float(exact[crossing].sum())


def derive_fabric(graph: nx.Graph, what: str = "topology graph", torus: TorusSpec | None = None) -> Fabric:
    """The `Fabric` of `graph` (module docstring); refuses a graph that breaks the conventions
    (profiles.topology.graph) or whose units are not alike."""
    gpus = check_graph(graph, what)
    n = len(gpus)
    arr = _Arrays(graph, gpus)
    is_switch = arr.kind == "switch"
    tiers = sorted(set(arr.tier[is_switch].tolist()))
    # per level: name, unit of each node, units' ranks, sharp (the switches that join this level's units
    # reduce), and the latency of the links inside a unit that a message leaving it crosses first
    first, first_units = _units(arr, arr.parts((arr.kind == "gpu") | (arr.kind == "nvswitch")))
    first = _with_nics(arr, first)
    partitions = [{"name": "ici-slice" if torus is not None else "nvlink-domain", "unit": first,
                   "units": first_units, "sharp": False, "inner_latency": 0.0}]
    for t in tiers:
        unit, units = _units(arr, arr.parts(~is_switch | (arr.tier <= t)))
        at_tier = [i for i in np.flatnonzero(is_switch & (arr.tier == t))]
        sharp = any(bool(graph.nodes[arr.nodes[i]].get("sharp")) for i in at_tier)
        below = partitions[-1]
        if len(units) == len(below["units"]):
            # The tier joins no two units of the level below (a top-of-rack switch per server): its switches
            # belong to those units, whose egress is then what leaves the switches (the NICs' or the switch's
            # uplinks, whichever is less), and a message leaving one crosses the links up to them first.
            below["inner_latency"] += _leaving(arr, below["unit"])[2]
            below["unit"] = unit
            continue
        names = {graph.nodes[arr.nodes[i]].get("level") for i in at_tier}
        name = str(next(iter(names))) if len(names) == 1 and None not in names else f"tier{t}"
        partitions.append({"name": name, "unit": unit, "units": units, "sharp": sharp, "inner_latency": 0.0})
    levels: list[FabricLevel] = []
    latency = 0.0
    gpu_node = np.empty(n, dtype=np.int64)
    gpu_node[arr.rank[arr.rank >= 0]] = np.flatnonzero(arr.rank >= 0)
    for i, part in enumerate(partitions):
        name, unit, units = part["name"], part["unit"], part["units"]
        size = _check_units(units, gpus, name, what)
        if i and size % len(partitions[i - 1]["units"][0]):
            raise SpecError(f"{what}: a {name} unit ({size} GPUs) is not a whole number of "
                            f"{partitions[i - 1]['name']} units")
        if size == n:  # the whole graph: nothing outside it
            break
        ua = unit[arr.a]
        inside = (ua == unit[arr.b]) & (ua >= 0)
        (out_from, out_bw, out_lat), leave_unit, _ = _leaving(arr, unit)
        in_by = _group(ua[inside], len(units))
        out_by = _group(leave_unit, len(units))
        in_a, in_b, in_bw = arr.a[inside], arr.b[inside], arr.bw[inside]
        worst, lat_max = float("inf"), 0.0
        flows: dict[tuple, float] = {}
        for u, ranks in enumerate(units):
            e_in, e_out = in_by[u], out_by[u]
            shape = (len(ranks), tuple(np.sort(in_bw[e_in]).tolist()), tuple(np.sort(out_bw[e_out]).tolist()))
            if shape not in flows:
                flows[shape] = _max_flow(gpu_node[ranks], in_a[e_in], in_b[e_in], in_bw[e_in], out_from[e_out],
                                         out_bw[e_out])
            worst = min(worst, flows[shape])
            if len(e_out):
                lat_max = max(lat_max, float(out_lat[e_out].max()))
        if worst <= 0:
            raise SpecError(f"{what}: no link leaves the {name} unit of GPU {short_repr(gpus[units[0][0]])}")
        latency += part["inner_latency"] + lat_max
        sharp = partitions[i + 1]["sharp"] if i + 1 < len(partitions) else False
        levels.append(FabricLevel(name=name, unit_gpus=size, egress_bytes_per_s=worst / size, latency_s=latency,
                                  sharp=sharp))
    if not levels:  # one domain holds every GPU: no scale-out level
        levels.append(FabricLevel(name=partitions[0]["name"], unit_gpus=n, egress_bytes_per_s=1e15, latency_s=0.0))
    return Fabric(levels=levels, torus=torus, nodes=graph.number_of_nodes(), edges=graph.number_of_edges(),
                  source=f"{what}: {graph.number_of_nodes():,} nodes, {graph.number_of_edges():,} edges, {n:,} GPUs")


def _with_nics(arr: _Arrays, unit: np.ndarray) -> np.ndarray:
    """`unit` with each GPU's NICs in the GPU's unit (a domain's NICs belong to it: their links count in its
    egress)."""
    unit = unit.copy()
    nic_a = (arr.kind[arr.a] == "nic") & (arr.rank[arr.b] >= 0)
    nic_b = (arr.kind[arr.b] == "nic") & (arr.rank[arr.a] >= 0)
    unit[arr.a[nic_a]] = unit[arr.b[nic_a]]
    unit[arr.b[nic_b]] = unit[arr.a[nic_b]]
    return unit


def _leaving(arr: _Arrays, unit: np.ndarray):
    """The links that leave a unit: ((node inside, rate, latency) arrays, the unit each leaves, the largest
    latency among them)."""
    ua, ub = unit[arr.a], unit[arr.b]
    leave_a = (ua >= 0) & (ua != ub)
    leave_b = (ub >= 0) & (ua != ub)
    out_from = np.concatenate([arr.a[leave_a], arr.b[leave_b]])
    out_bw = np.concatenate([arr.bw[leave_a], arr.bw[leave_b]])
    out_lat = np.concatenate([arr.lat[leave_a], arr.lat[leave_b]])
    return (out_from, out_bw, out_lat), np.concatenate([ua[leave_a], ub[leave_b]]), float(out_lat.max(initial=0.0))


def _group(unit_of: np.ndarray, count: int) -> list[np.ndarray]:
    """Positions of `unit_of` per unit 0 .. count-1."""
    order = np.argsort(unit_of, kind="stable")
    cuts = np.cumsum(np.bincount(unit_of, minlength=count))[:-1]
    return np.split(order, cuts)
