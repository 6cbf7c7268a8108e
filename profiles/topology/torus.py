"""The topology graph of TPU slices: chips on a 2-D or 3-D torus of ICI links, slices joined by the DCN.

`torus_graph` follows the conventions of `profiles.topology.graph`:

- every chip is a node of kind ``gpu`` named ``chip<rank>``, with `rank` and `coords` (its position
  (x, y[, z]) in its slice) and `slice`. Ranks run along x fastest, then y, then z, slices outermost:
  rank = x + X·(y + Y·z) + chips_per_slice·slice, as MaxText's and JAX's device order on a slice
  (and as `cost_models.torus` decomposes a parallel group into torus axes);
- ICI links (``link="ici"``) join each chip to its neighbour along every axis, at the cluster's
  `intra_node` tier (one ICI link: bytes/s per direction, its latency); an axis with wraparound also
  joins its last chip to its first. An axis of two chips has one link between them whatever its
  wraparound says (the neighbour on either side is the same chip; the graph holds one edge per pair),
  and an axis of one chip has none;
- each chip has a DCN NIC (kind ``nic``, ``link="pcie"`` at the DCN rate, as the fat tree's GPU-NIC
  links), and every NIC joins one DCN switch (kind ``switch``, tier 1, level ``dcn``) at the
  cluster's `inter_node` tier (the DCN bandwidth per chip, with its latency).

`profiles.topology.fabric.derive_fabric` then finds level 0 = the chips one slice's ICI joins, with
the DCN as its egress (per chip: the `inter_node` rate); one slice is the whole graph and has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import networkx as nx

from planner.errors import SpecError
from profiles.topology.generators import MAX_GRAPH_GPUS

if TYPE_CHECKING:
    from planner.specs import ClusterSpec
    from planner.specs.topology import TorusSpec


def chip_coords(shape: list[int], rank: int) -> tuple[int, ...]:
    """(x, y[, z]) of local rank `rank` on a slice of `shape` (x fastest)."""
    out = []
    for n in shape:
        out.append(rank % n)
        rank //= n
    return tuple(out)


def _local_rank(shape: list[int], coords: tuple[int, ...]) -> int:
    rank, scale = 0, 1
    for c, n in zip(coords, shape):
        rank += c * scale
        scale *= n
    return rank


def _torus_of(cluster: ClusterSpec) -> TorusSpec:
    spec = cluster.topology
    if spec is None or spec.kind != "torus" or spec.torus is None:
        raise SpecError(f"cluster {cluster.name}: a torus graph needs topology kind 'torus' with a torus: mapping")
    return spec.torus


def torus_graph(cluster: ClusterSpec, num_gpus: int | None = None) -> nx.Graph:
    """The graph of `num_gpus` chips (default: every chip of every slice) of a TPU cluster (module
    docstring). `num_gpus` must be a whole number of slices, and the cluster's `max_gpus`, when given,
    the chips of all its slices."""
    torus = _torus_of(cluster)
    shape, wrap = list(torus.shape), list(torus.wraparound)
    per_slice = torus.chips_per_slice
    total = per_slice * torus.num_slices
    if cluster.max_gpus is not None and cluster.max_gpus != total:
        raise SpecError(f"cluster {cluster.name}: max_gpus ({cluster.max_gpus}) must be the chips of all its slices: "
                        f"{torus.num_slices} x {'x'.join(map(str, shape))} = {total}")
    n = total if num_gpus is None else int(num_gpus)
    if n < 1 or n % per_slice:
        raise SpecError(f"cluster {cluster.name}: a torus graph of {n} chips is not a whole number of "
                        f"{'x'.join(map(str, shape))} slices ({per_slice} chips each)")
    if n > MAX_GRAPH_GPUS:
        raise SpecError(f"cluster {cluster.name}: a topology graph of {n:,} chips is larger than the "
                        f"{MAX_GRAPH_GPUS:,} meshplan builds")
    ici, dcn = cluster.intra_node, cluster.inter_node
    g = nx.Graph(name=cluster.name)
    g.add_node("dcn", kind="switch", tier=1, level="dcn")
    for r in range(n):
        s, local = divmod(r, per_slice)
        g.add_node(f"chip{r}", kind="gpu", rank=r, coords=chip_coords(shape, local), slice=s)
        g.add_node(f"nic{r}", kind="nic")
        g.add_edge(f"chip{r}", f"nic{r}", bw=dcn.bw_bytes_per_s, latency=0.0, link="pcie")
        g.add_edge(f"nic{r}", "dcn", bw=dcn.bw_bytes_per_s, latency=dcn.latency_s, link="dcn")
    for r in range(n):
        s, local = divmod(r, per_slice)
        coords = chip_coords(shape, local)
        for axis, size in enumerate(shape):
            nxt = coords[axis] + 1
            if nxt == size:  # the last chip of the axis: its wraparound link back to the first
                if not wrap[axis] or size <= 2:
                    continue
                nxt = 0
            other = list(coords)
            other[axis] = nxt
            peer = _local_rank(shape, tuple(other)) + s * per_slice
            g.add_edge(f"chip{r}", f"chip{peer}", bw=ici.bw_bytes_per_s, latency=ici.latency_s, link="ici")
    return g
