"""The cluster as a graph: generators (`generators.fat_tree`, `torus.torus_graph`), a user's graph files
(`files`), the graph's conventions and checks (`graph`), and the per-level figures the cost model reads
(`fabric.derive_fabric`). `build_graph` and `with_fabric` are what the loaders use."""

from __future__ import annotations

import functools
from pathlib import Path

import networkx as nx

from planner.errors import SpecError
from planner.specs import ClusterSpec
from planner.specs.topology import Fabric
from profiles.topology.fabric import derive_fabric
from profiles.topology.generators import fat_tree, graph_gpus
from profiles.topology.graph import check_graph
from profiles.topology.torus import torus_graph

__all__ = ["build_graph", "check_graph", "derive_fabric", "fat_tree", "graph_gpus", "torus_graph", "with_fabric"]


def build_graph(cluster: ClusterSpec, num_gpus: int | None = None, base: Path | None = None) -> nx.Graph:
    """The topology graph of `cluster` (`num_gpus` GPUs, default `generators.graph_gpus`; a torus: every
    chip of every slice): its topology's generator, its graph file (relative paths from `base`), or,
    without a topology, the two-tier model's flat fat tree."""
    spec = cluster.topology
    if spec is None or spec.kind == "fat-tree":
        return fat_tree(cluster, num_gpus)
    if spec.kind == "torus":
        return torus_graph(cluster, num_gpus)
    raise SpecError(f"cluster {cluster.name}: topology kind {spec.kind!r} cannot be built yet")


@functools.lru_cache(maxsize=64)
def _fabric(cluster_json: str, base: str | None) -> Fabric:
    cluster = ClusterSpec.model_validate_json(cluster_json)
    graph = build_graph(cluster, base=Path(base) if base else None)
    torus = cluster.topology.torus if cluster.topology is not None else None
    return derive_fabric(graph, f"topology graph of cluster {cluster.name}", torus=torus)


def with_fabric(cluster: ClusterSpec, base: Path | None = None) -> ClusterSpec:
    """`cluster` with `fabric` derived from its topology graph (a cluster without a topology, or one that
    has its fabric already, is returned as it is). Cached per cluster description."""
    if cluster.topology is None or cluster.fabric is not None:
        return cluster
    fabric = _fabric(cluster.model_dump_json(), str(base) if base else None)
    if fabric.levels[0].unit_gpus != cluster.domain_size:
        raise SpecError(f"cluster {cluster.name}: its topology graph's NVLink domains hold "
                        f"{fabric.levels[0].unit_gpus} GPUs but nvlink_domain_size is {cluster.domain_size}")
    return cluster.model_copy(update={"fabric": fabric})
