"""The conventions of a topology graph, and the checks every graph passes before it is used.

A topology graph is an undirected `networkx.Graph`; every edge is a full-duplex link.

Nodes carry `kind`:
- ``gpu``: a GPU or TPU chip, with `rank` (an integer, the global rank it runs: 0 .. N-1, each once);
- ``nvswitch``: an NVLink switch domain's switches (one node stands for the domain's NVSwitch chips);
- ``nic``: a network adapter (one per GPU on the presets);
- ``switch``: a fabric switch, with `tier` (1 for leaf or top-of-rack switches, 2 above them, ...),
  and optionally `level` (the name of the units its tier joins: rack, pod, ...) and `sharp` (True
  where it reduces in the network).

Edges carry `bw` (bytes/s per direction, > 0), and optionally `latency` (seconds, default 0) and
`link` (nvlink, ici, pcie, nic, fabric, dcn: a label for pictures and explanations).
"""

from __future__ import annotations

import math
from typing import Any

import networkx as nx

from planner.errors import SpecError, short_repr

KINDS = ("gpu", "nvswitch", "nic", "switch")
#: Link rates a graph may state, bytes/s per direction (as planner.specs.hardware.BW_BYTES_PER_S_RANGE).
BW_RANGE = (1e6, 1e15)
#: Latencies a graph may state, seconds.
LATENCY_RANGE = (0.0, 1.0)
#: The most nodes a graph may have: far beyond any cluster (a 100k-GPU cluster with one NIC each
#: and its switches has about 2.2e5), small enough that building and checking it stays quick.
MAX_NODES = 2_000_000


def _name(node: Any) -> str:
    return short_repr(node)


def check_graph(graph: nx.Graph, what: str = "topology graph") -> list[Any]:
    """Refuse a graph that breaks the conventions (module docstring), naming the node or edge; return the
    GPU nodes in rank order."""
    if not isinstance(graph, nx.Graph) or graph.is_directed() or graph.is_multigraph():
        raise SpecError(f"{what} must be an undirected networkx Graph (one edge per pair of nodes)")
    if graph.number_of_nodes() == 0:
        raise SpecError(f"{what} has no nodes")
    if graph.number_of_nodes() > MAX_NODES:
        raise SpecError(f"{what} has {graph.number_of_nodes():,} nodes; at most {MAX_NODES:,} are read")
    gpus: dict[int, Any] = {}
    for node, data in graph.nodes(data=True):
        kind = data.get("kind")
        if kind not in KINDS:
            raise SpecError(f"{what}: node {_name(node)} has kind {short_repr(kind)}; kind must be one of "
                            f"{', '.join(KINDS)}")
        if kind == "gpu":
            rank = data.get("rank")
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise SpecError(f"{what}: GPU node {_name(node)} needs rank, a non-negative integer "
                                f"(got {short_repr(rank)})")
            if rank in gpus:
                raise SpecError(f"{what}: GPU nodes {_name(gpus[rank])} and {_name(node)} both have rank {rank}")
            gpus[rank] = node
            if graph.degree(node) == 0:
                raise SpecError(f"{what}: GPU node {_name(node)} (rank {rank}) has no link")
        if kind == "switch":
            tier = data.get("tier")
            if not isinstance(tier, int) or isinstance(tier, bool) or tier < 1:
                raise SpecError(f"{what}: switch node {_name(node)} needs tier, an integer >= 1 (1: leaf or "
                                f"top-of-rack) (got {short_repr(tier)})")
    if not gpus:
        raise SpecError(f"{what} has no node of kind gpu")
    missing = [r for r in range(len(gpus)) if r not in gpus]
    if missing:
        raise SpecError(f"{what}: GPU ranks must be 0 .. {len(gpus) - 1}, each once; rank {missing[0]} is missing")
    for a, b, data in graph.edges(data=True):
        if a == b:
            raise SpecError(f"{what}: edge {_name(a)} - {_name(b)} joins a node to itself")
        bw = data.get("bw")
        if not isinstance(bw, (int, float)) or isinstance(bw, bool) or not math.isfinite(bw) or not (
                BW_RANGE[0] <= bw <= BW_RANGE[1]):
            raise SpecError(f"{what}: edge {_name(a)} - {_name(b)} has bandwidth {short_repr(bw)} bytes/s; it "
                            f"must be a number from {BW_RANGE[0]:g} to {BW_RANGE[1]:g} (zero, negative and "
                            "missing bandwidths are refused)")
        lat = data.get("latency", 0.0)
        if not isinstance(lat, (int, float)) or isinstance(lat, bool) or not math.isfinite(lat) or not (
                LATENCY_RANGE[0] <= lat <= LATENCY_RANGE[1]):
            raise SpecError(f"{what}: edge {_name(a)} - {_name(b)} has latency {short_repr(lat)} s; it must be "
                            f"from {LATENCY_RANGE[0]:g} to {LATENCY_RANGE[1]:g}")
    if not nx.is_connected(graph):
        first = gpus[0]
        reached = nx.node_connected_component(graph, first)
        stray = next(n for n in graph.nodes if n not in reached)
        raise SpecError(f"{what} is not connected: node {_name(stray)} cannot reach GPU {_name(first)} (rank 0)")
    return [gpus[r] for r in range(len(gpus))]
