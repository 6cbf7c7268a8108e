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
from profiles.files import file_stamp
from profiles.topology.fabric import derive_fabric
from profiles.topology.files import read_graph
from profiles.topology.generators import fat_tree, graph_gpus
from profiles.topology.graph import check_graph
from profiles.topology.torus import torus_graph

__all__ = ["build_graph", "check_graph", "derive_fabric", "fat_tree", "graph_file", "graph_gpus", "read_graph",
           "torus_graph", "with_fabric"]


def graph_file(cluster: ClusterSpec, base: Path | None = None) -> Path | None:
    """The graph file of a cluster whose topology is a user's graph (kind 'graph'), absolute: a relative
    `graph_file` is taken from `base` (the cluster file's folder), or from the working directory without
    one. None for a generated topology."""
    spec = cluster.topology
    if spec is None or spec.kind != "graph" or not spec.graph_file:
        return None
    path = Path(spec.graph_file).expanduser()
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    return path.absolute()


def build_graph(cluster: ClusterSpec, num_gpus: int | None = None, base: Path | None = None) -> nx.Graph:
    """The topology graph of `cluster` (`num_gpus` GPUs, default `generators.graph_gpus`; a torus: every
    chip of every slice): its topology's
    generator, its graph file (relative paths from `base`: `graph_file`), or, without a topology, the
    two-tier model's flat fat tree. A graph file is the whole cluster: `num_gpus`, when given, must be
    its GPU count."""
    spec = cluster.topology
    if spec is None or spec.kind == "fat-tree":
        return fat_tree(cluster, num_gpus)
    if spec.kind == "torus":
        return torus_graph(cluster, num_gpus)
    if spec.kind == "graph":
        path = graph_file(cluster, base)
        graph = read_graph(path)
        gpus = sum(1 for _, kind in graph.nodes(data="kind") if kind == "gpu")
        if num_gpus is not None and num_gpus != gpus:
            raise SpecError(f"cluster {cluster.name}: its topology graph {str(path)!r} holds {gpus:,} GPUs, not "
                            f"{num_gpus:,}; a graph file is the whole cluster")
        return graph
    raise SpecError(f"cluster {cluster.name}: unknown topology kind {spec.kind!r}; kinds: fat-tree, torus, graph")


@functools.lru_cache(maxsize=64)
def _fabric(cluster_json: str, base: str | None, stamp: tuple | None) -> tuple[Fabric, int]:
    """The fabric of one cluster description (and, for a graph file, of one version of the file: `stamp`),
    and the GPU count of the graph it was derived from."""
    cluster = ClusterSpec.model_validate_json(cluster_json)
    graph = build_graph(cluster, base=Path(base) if base else None)
    torus = cluster.topology.torus if cluster.topology is not None else None
    path = graph_file(cluster, Path(base) if base else None)
    what = f"topology graph of cluster {cluster.name}" + (f" ({str(path)!r})" if path is not None else "")
    fabric = derive_fabric(graph, what, torus=torus)
    return fabric, sum(1 for _, kind in graph.nodes(data="kind") if kind == "gpu")


def with_fabric(cluster: ClusterSpec, base: Path | None = None) -> ClusterSpec:
    """`cluster` with `fabric` derived from its topology graph (a cluster without a topology, or one that
    has its fabric already, is returned as it is). Cached per cluster description and graph file version.

    A graph file's cluster comes back with its `graph_file` absolute (so that the cluster reads the same
    file wherever it is used later) and, as the graph is the whole cluster, `max_gpus` its GPU count (a
    smaller `max_gpus` stays; a larger one is refused)."""
    if cluster.topology is None or cluster.fabric is not None:
        return cluster
    path = graph_file(cluster, base)
    update: dict = {}
    if path is not None:
        update["topology"] = cluster.topology.model_copy(update={"graph_file": str(path)})
        cluster = cluster.model_copy(update=update)
    stamp = file_stamp(path, "topology graph") if path is not None else None
    fabric, gpus = _fabric(cluster.model_dump_json(), str(base) if base else None, stamp)
    if fabric.levels[0].unit_gpus != cluster.domain_size:
        raise SpecError(f"cluster {cluster.name}: its topology graph's NVLink domains hold "
                        f"{fabric.levels[0].unit_gpus} GPUs but nvlink_domain_size is {cluster.domain_size}")
    if path is not None:
        step = max(cluster.domain_size, cluster.gpus_per_node)
        if gpus % step:
            raise SpecError(f"cluster {cluster.name}: its topology graph {str(path)!r} holds {gpus:,} GPUs, not a "
                            f"whole number of servers of gpus_per_node {cluster.gpus_per_node}")
        if cluster.max_gpus is not None and cluster.max_gpus > gpus:
            raise SpecError(f"cluster {cluster.name}: max_gpus ({cluster.max_gpus:,}) exceeds the {gpus:,} GPUs of "
                            f"its topology graph {str(path)!r}")
        update["max_gpus"] = cluster.max_gpus or gpus
    return cluster.model_copy(update=update | {"fabric": fabric})
