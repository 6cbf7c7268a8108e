"""Topology graphs from a cluster's compact description (`planner.specs.topology.TopologySpec`).

`fat_tree` builds NVLink domains of `domain_size` GPUs (one NVSwitch node per domain: a DGX/HGX
server's four NVSwitch chips, or an NVL72 rack's eighteen, act as one non-blocking switch), one NIC per
GPU, and the switched levels the spec lists:

- level 1 joins units of `unit_gpus` GPUs: with `rails`, one leaf switch per local GPU index j (the NIC
  of GPU j of every server in the unit on leaf j: a rail-optimised scalable unit); without, one
  top-of-rack switch per unit;
- each further level joins units of the level below under one switch node of its own (a pod's spines,
  a cluster's aggregation switches, as one node of their summed capacity);
- a unit's switches reach up with their downlink capacity over the level's `oversubscription`;
- the last level's units, when the graph holds more than one, join one core switch; a spec without
  levels joins every NIC to one switch (a flat network of full bisection: the two-tier model).

Rates per edge: GPU-NVSwitch the cluster's `intra_node` tier, GPU-NIC and NIC-leaf its `inter_node` tier
(with the tier's latency on the NIC's uplink), switch uplinks their share of the level's capacity (with
the level's `latency_s`). Bandwidths are raw link rates; tier efficiencies apply when collectives are
priced (cost_models.comm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import networkx as nx

from planner.errors import SpecError

if TYPE_CHECKING:
    from planner.specs import ClusterSpec

#: The most GPUs a generated graph holds (a graph per GPU count of a 2^32-GPU bound would not fit in memory).
MAX_GRAPH_GPUS = 1 << 17


def graph_gpus(cluster: ClusterSpec, whole: bool = False) -> int:
    """GPUs of the graph that represents `cluster`: two units of its largest level smaller than the cluster
    (every level then has an outside to send to, and the units of a level are alike, so the figures
    `derive_fabric` takes from it are the whole cluster's), or with `whole` every GPU of a bounded cluster."""
    spec = cluster.topology
    units = [cluster.domain_size, *(t.unit_gpus for t in spec.levels)] if spec is not None else [cluster.domain_size]
    bound = cluster.max_gpus
    if bound is not None:
        units = [u for u in units if u < bound] or [bound]
    n = 2 * max(units)
    if bound is not None:
        n = bound if whole else min(n, bound)
    step = max(cluster.domain_size, cluster.gpus_per_node)
    n = max(step, n - n % step)
    if n > MAX_GRAPH_GPUS:
        raise SpecError(f"cluster {cluster.name}: a topology graph of {n:,} GPUs is larger than the "
                        f"{MAX_GRAPH_GPUS:,} meshplan builds; give max_gpus, or smaller levels")
    return n


def fat_tree(cluster: ClusterSpec, num_gpus: int | None = None) -> nx.Graph:
    """The graph of `num_gpus` GPUs (default `graph_gpus`) of a fat-tree cluster (module docstring)."""
    spec = cluster.topology
    levels = list(spec.levels) if spec is not None else []
    rails = bool(spec is not None and spec.rails)
    n = graph_gpus(cluster) if num_gpus is None else int(num_gpus)
    dom, node = cluster.domain_size, cluster.gpus_per_node
    if n % dom or n % node:
        raise SpecError(f"cluster {cluster.name}: {n} GPUs is not a whole number of NVLink domains ({dom}) "
                        f"and servers ({node})")
    if levels and levels[0].unit_gpus % max(dom, node):
        raise SpecError(f"cluster {cluster.name}: topology level {levels[0].name} holds {levels[0].unit_gpus} "
                        f"GPUs, not a whole number of NVLink domains ({dom}) and servers ({node})")
    intra, inter = cluster.intra_node, cluster.inter_node
    g = nx.Graph(name=cluster.name)
    for r in range(n):
        g.add_node(f"gpu{r}", kind="gpu", rank=r)
        g.add_node(f"nic{r}", kind="nic")
        g.add_edge(f"gpu{r}", f"nic{r}", bw=inter.bw_bytes_per_s, latency=0.0, link="pcie")
        if dom > 1:
            sw = f"nvsw{r // dom}"
            if sw not in g:
                g.add_node(sw, kind="nvswitch")
            g.add_edge(f"gpu{r}", sw, bw=intra.bw_bytes_per_s, latency=intra.latency_s, link="nvlink")
    levels = [t for t in levels if t.unit_gpus <= n]
    if not levels:  # one flat network of full bisection
        g.add_node("fabric", kind="switch", tier=1, level="fabric")
        for r in range(n):
            g.add_edge(f"nic{r}", "fabric", bw=inter.bw_bytes_per_s, latency=inter.latency_s, link="nic")
        return g
    # level 1: rail leaves or a top-of-rack switch per unit
    first = levels[0]
    down: dict[str, float] = {}  # a switch's downlink capacity, bytes/s
    for r in range(n):
        unit = r // first.unit_gpus
        sw = f"{first.name}{unit}.rail{r % node}" if rails else f"{first.name}{unit}"
        if sw not in g:
            g.add_node(sw, kind="switch", tier=1, level=first.name, unit=unit, sharp=first.sharp)
        g.add_edge(f"nic{r}", sw, bw=inter.bw_bytes_per_s, latency=inter.latency_s, link="nic")
        down[sw] = down.get(sw, 0.0) + inter.bw_bytes_per_s
    below, below_level = [s for s in down], first
    for tier, level in enumerate(levels[1:] + [None], start=2):
        units = n // below_level.unit_gpus
        if level is None and units <= 1:
            break
        name = level.name if level is not None else "core"
        size = level.unit_gpus if level is not None else n
        for sw in below:
            unit = g.nodes[sw]["unit"] * below_level.unit_gpus // size
            up = f"{name}{unit}"
            if up not in g:
                g.add_node(up, kind="switch", tier=tier, level=name, unit=unit,
                           sharp=bool(level is not None and level.sharp))
            bw = down[sw] / below_level.oversubscription
            g.add_edge(sw, up, bw=bw, latency=below_level.latency_s, link="fabric")
            down[up] = down.get(up, 0.0) + bw
        below = sorted({f"{name}{g.nodes[sw]['unit'] * below_level.unit_gpus // size}" for sw in below})
        if level is None:
            break
        below_level = level
    return g
