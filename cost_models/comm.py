"""Communication: collectives and point-to-point transfers (alpha-beta model).

`CommModel` is the interface the step model uses; `TierCommModel` implements it
with two link tiers (the cluster's `intra_node` tier for a group inside one NVLink
domain of `domain_size` GPUs, and its `inter_node` scale-out tier for a group that spans
domains), and `cost_models.collectives.CurveCommModel` from measured curves. A
topology-graph model can replace them by implementing the same five methods
(`all_reduce_s`, `gather_scatter_s`, `p2p_s`, `all_to_all_s`, `domain_members`).

Groups are described by their size and the rank stride between members, which
follow from Megatron's rank order (tp innermost, then cp, dp, pp): a TP group
has stride 1, a CP group stride tp, a DP group stride tp·cp, and a pipeline
stride tp·cp·dp.

Time conventions (NCCL's bus-bandwidth convention, nccl-tests PERFORMANCE.md):
  all-reduce       2·(n-1)/n · bytes / busbw
  all-gather       (n-1)/n · bytes / busbw      (bytes = the gathered, full size)
  reduce-scatter   (n-1)/n · bytes / busbw      (bytes = the full input size)
plus a latency term: 2·⌈log2 n⌉ hops for all-reduce (NCCL switches to trees at
scale) and n - 1 hops for all-gather and reduce-scatter (ring only); the hop counts are
an estimate of NCCL's algorithm choice, the latencies per hop come from the cluster profile.
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # specs are read by attribute only
    from planner.specs import ClusterSpec


class CommModel(Protocol):
    """Contract: pure functions of numpy arrays, broadcasting over candidates;
    bytes in, seconds out, zero for a group of one rank; never negative."""

    def all_reduce_s(self, nbytes, size, stride) -> np.ndarray: ...

    def gather_scatter_s(self, nbytes, size, stride) -> np.ndarray:
        """One all-gather or one reduce-scatter of `nbytes` (full size)."""
        ...

    def p2p_s(self, nbytes, stride, span) -> np.ndarray:
        """One point-to-point transfer between ranks `stride` apart, in a group
        spanning `span` consecutive ranks."""
        ...

    def all_to_all_s(self, nbytes, size, stride, intra_scale=1.0, inter_scale=1.0) -> np.ndarray:
        """One all-to-all in which every rank sends `nbytes` in total, an equal share to
        each member (its own share stays local); the scales multiply the bytes that stay in the
        NVLink domain and those that leave it."""
        ...

    def domain_members(self, size, stride) -> np.ndarray:
        """Members of a group that share one NVLink domain."""
        ...

    def crosses_domain(self, size, stride) -> np.ndarray:
        """Whether some group of `size` ranks `stride` apart leaves its NVLink domain (or slice)."""
        ...

    def with_world(self, world) -> "CommModel":
        """This model for a job of `world` GPUs (where its groups sit depends on it)."""
        ...


@functools.lru_cache(maxsize=4096)
def fewest_in_unit(unit: int, span: int, world: int | None) -> int:
    """The fewest consecutive ranks that one block of `span` ranks (a group of size·stride ranks: its groups tile
    the ranks in blocks starting at multiples of the span) puts in one unit of `unit` GPUs, over the blocks that
    leave their unit in a job of `world` GPUs (ranks r in unit r // unit); 0 where no block leaves its unit.
    `world` None: no job, the blocks taken to tile the units (a group leaves its unit when its span is larger,
    with a whole unit's ranks in each).

    Expert parallelism 64 on racks of 72 (NVL72 filled to 72 GPUs each): ranks 0-63 stay in rack 0, ranks
    64-127 put 8 in rack 0 and 56 in rack 1, so on 144 GPUs the fewest is 8; on 64 GPUs no block leaves its rack:

    >>> fewest_in_unit(72, 64, 144), fewest_in_unit(72, 64, 64), fewest_in_unit(72, 64, None)
    (8, 0, 0)
    >>> fewest_in_unit(8, 16, 64), fewest_in_unit(8, 4, 64)  # aligned: whole units, or inside one
    (8, 0)
    """
    if span <= unit and unit % span == 0:
        return 0
    if span % unit == 0:
        return unit
    if world is None:
        return unit if span > unit else 0
    start = np.arange(0, world, span, dtype=np.int64)
    end = np.minimum(start + span, world)
    first = (start // unit + 1) * unit          # the first unit boundary after a block's start
    last = ((end - 1) // unit) * unit           # the last one before its end
    leaves = first < end
    if not leaves.any():
        return 0
    pieces = np.minimum(first - start, end - last)[leaves]
    whole = (last - first >= unit)[leaves]      # a block over three units or more holds whole units too
    return int(min(pieces.min(), unit if whole.any() else pieces.min()))


class TierCommModel:
    """Alpha-beta model of a cluster of NVLink domains joined by a fabric of levels (`ClusterSpec.levels`,
    derived from the topology graph by `profiles.topology`; the two-tier model is one level).

    A group inside one NVLink domain (size·stride ≤ domain) runs at the intra-domain bus bandwidth. A
    group that crosses the units of level L (size·stride > unit_L) with k_L members per unit is limited by
    what leaves a unit: every GPU of the unit belongs to one group of this dimension and all of them run at
    once, so the unit's egress (egress_L per GPU, all GPUs sending) is shared by unit_L / k_L groups and
    each gets k_L · egress_L. A ring (or NCCL's hierarchical tree) enters and leaves each unit once per
    channel, so that share is its bus bandwidth there:

        busbw = min(intra, min over the levels it crosses of k_L · egress_L · tier efficiency)

    On one level, the NVLink domain with the inter_node tier's rate, that is min(intra, k · inter): with one
    NIC per GPU and k members per domain, k NICs carry the group's traffic. An oversubscribed level (a pod's
    uplinks at 1:7) binds once k_L · egress_L drops below the levels under it. A level whose switches reduce
    in the network (SHARP) sends an all-reduce's bytes once up and once down: its share is multiplied by
    the ring's 2(n-1)/n. The latency is the highest crossed level's.
    """

    def __init__(self, cluster: ClusterSpec) -> None:
        self.domain = cluster.domain_size
        self.intra_bw = cluster.intra_node.bus_bw_bytes_per_s
        self.intra_lat = cluster.intra_node.latency_s
        self.intra_gs_bw = cluster.intra_node.gather_scatter_bw_bytes_per_s
        inter = cluster.inter_node
        levels = cluster.levels
        # per level, as (L, 1) columns that broadcast against flattened groups
        self.unit = np.array([lv.unit_gpus for lv in levels], dtype=float)[:, None]
        raw = np.array([lv.egress_bytes_per_s for lv in levels], dtype=float)[:, None]
        self.egress = raw * inter.efficiency
        self.egress_gs = raw * (inter.gather_scatter_efficiency or inter.efficiency)
        self.level_lat = np.array([lv.latency_s for lv in levels], dtype=float)
        self.sharp = np.array([lv.sharp for lv in levels], dtype=bool)[:, None]
        self.level_names = [lv.name for lv in levels]
        # one GPU's own scale-out rate (its NIC: level 0's share per GPU), what a point-to-point flow gets
        self.inter_bw = float(self.egress[0, 0])
        self.inter_gs_bw = float(self.egress_gs[0, 0])
        self.inter_lat = float(self.level_lat[0])
        self.world: int | None = None
        self._job_units = getattr(cluster, "job_units", None)  # plain test clusters: whole units

    def with_world(self, world) -> "TierCommModel":
        """This model for one job of `world` GPUs (a count, or an array of candidates' counts that all agree).

        Where a group sits depends on the job. Its ranks fill `ClusterSpec.job_units` GPUs of each level's
        unit (64 of an NVL72 rack's 72 for a 256-GPU job under Megatron-Bridge's --segment rule): rank r sits
        in the job's unit r // unit_L. The
        groups of a dimension tile the ranks in blocks of size·stride; a block that does not divide the unit
        (expert parallelism 64 on 72-GPU racks of a 576-GPU job) leaves it somewhere, and the fewest members
        one unit holds set its bandwidth there (`fewest_in_unit`). Without a world (`world` None) the groups are
        taken to tile whole units."""
        counts = np.unique(np.asarray(world, dtype=np.int64))
        if counts.size != 1:
            raise ValueError(f"a communication model prices one job; these candidates have {counts.size} GPU counts")
        out = copy.copy(self)
        out.world = int(counts[0])
        if self._job_units is not None:
            out.unit = np.array(self._job_units(out.world), dtype=float)[:, None]
            out.domain = int(out.unit[0, 0])  # level 0 is the NVLink domain
        return out

    def _flat(self, *arrays):
        """The broadcast shape of `arrays` and each of them flattened to it."""
        arrays = [np.asarray(a, dtype=float) for a in arrays]
        shape = np.broadcast_shapes(*(np.shape(a) for a in arrays))
        return shape, [np.broadcast_to(a, shape).ravel() for a in arrays]

    def _fewest(self, span, levels: int | None = None) -> np.ndarray:
        """Per level (the first `levels`, default all), over flattened spans: the fewest ranks a crossing block
        puts in one of the job's units, 0 where no block of that span leaves its unit (`fewest_in_unit`), (L, M)."""
        span = np.rint(span).astype(np.int64)
        units = [int(u) for u in self.unit[:levels, 0]]
        out = np.zeros((len(units), span.size))
        for i, unit in enumerate(units):
            inside = (span <= unit) & (unit % np.maximum(span, 1) == 0)
            whole = span % unit == 0
            out[i] = np.where(whole & ~inside, unit, 0)
            other = ~(inside | whole)
            if other.any():
                keys, back = np.unique(span[other], return_inverse=True)
                found = [fewest_in_unit(unit, int(a), self.world) for a in keys]
                out[i, other] = np.asarray(found, dtype=float)[np.ravel(back)]
        return out

    def _placed(self, n, d):
        """Per level, over flattened groups of `n` ranks `d` apart: (whether some group crosses the level's
        units; the fewest members a crossing group has in one unit, at least 1 and at most n), both (L, M)."""
        fewest = self._fewest(n * d)
        members = np.clip(fewest // np.maximum(d, 1)[None, :], 1, n[None, :])
        return fewest > 0, members

    def _level_shares(self, size, stride, egress, sharp: bool = False):
        """Per level, over flattened groups: (the bus bandwidth the slowest group gets there, k_L · egress_L
        with k_L the fewest members a group has in one unit, times 2(n-1)/n on a SHARP level for an all-reduce;
        whether a group crosses the level's units), both (L, M)."""
        _, (n, d) = self._flat(size, stride)
        crossed, members = self._placed(n, d)
        share = egress * members
        if sharp:
            share = np.where(self.sharp, share * 2 * (n - 1) / np.maximum(n, 1), share)
        return share, crossed

    def _crossing(self, size, stride, egress, sharp: bool = False):
        """(bus bandwidth share over the levels a group crosses, inf where it crosses none; the latency of
        the highest level it crosses, the intra-domain latency where none; how many levels it crosses),
        each in the broadcast shape of `size` and `stride`."""
        shape = self._flat(size, stride)[0]
        share, crossed = self._level_shares(size, stride, egress, sharp)
        share = np.where(crossed, share, np.inf).min(axis=0)
        count = crossed.sum(axis=0)
        lat = np.where(count > 0, self.level_lat[np.maximum(count - 1, 0)], self.intra_lat)
        return share.reshape(shape), lat.reshape(shape), count.reshape(shape)

    def _tier(self, size, stride, intra_bw, egress, sharp: bool = False):
        share, lat, _ = self._crossing(size, stride, egress, sharp)
        return np.minimum(intra_bw, share), lat

    def all_reduce_s(self, nbytes, size, stride) -> np.ndarray:
        """All-reduce of `nbytes` over `size` ranks `stride` apart, seconds.

        1 GB over the 8 GPUs of one node at 100 GB/s bus bandwidth and 10 µs per hop:
        2·7/8·1e9/1e11 + 2·3·1e-5 = 0.01756 s.

        >>> from types import SimpleNamespace as S
        >>> tier = S(bus_bw_bytes_per_s=1e11, latency_s=1e-5, gather_scatter_bw_bytes_per_s=1e11,
        ...          efficiency=1.0, gather_scatter_efficiency=None)
        >>> level = S(unit_gpus=8, egress_bytes_per_s=1e11, latency_s=1e-5, sharp=False, name="nvlink-domain")
        >>> comm = TierCommModel(S(domain_size=8, intra_node=tier, inter_node=tier, levels=[level]))
        >>> round(float(comm.all_reduce_s(1e9, 8, 1)), 5)
        0.01756
        """
        n = np.asarray(size, dtype=float)
        bw, lat = self._tier(n, stride, self.intra_bw, self.egress, sharp=True)
        t = 2 * (n - 1) / n * nbytes / bw + 2 * np.ceil(np.log2(np.maximum(n, 1))) * lat
        return np.where(n > 1, t, 0.0)

    def gather_scatter_s(self, nbytes, size, stride) -> np.ndarray:
        n = np.asarray(size, dtype=float)
        bw, lat = self._tier(n, stride, self.intra_gs_bw, self.egress_gs)
        t = (n - 1) / n * nbytes / bw + (n - 1) * lat
        return np.where(n > 1, t, 0.0)

    def p2p_s(self, nbytes, stride, span) -> np.ndarray:
        """One transfer between neighbours `stride` apart in a group (a pipeline, a context-parallel ring)
        spanning `span` ranks. Every pair of neighbours sends at once, and the slowest hop sets the pace:
        the group crosses level L somewhere once span > unit_L. One flow runs over one NIC (egress_0), and
        at a higher level the min(unit_L, stride) flows that leave one unit share its egress:
        rate = min(NIC, egress_L · unit_L / min(unit_L, stride)) over the crossed levels."""
        shape, (flat_d, flat_span) = self._flat(stride, span)
        crossed = self._fewest(flat_span) > 0
        flows = np.minimum(self.unit, np.maximum(flat_d, 1)[None, :])
        rate = np.minimum(self.inter_bw, self.egress * self.unit / flows)
        rate = np.where(crossed, rate, np.inf).min(axis=0)
        count = crossed.sum(axis=0)
        link_bw = np.where(count > 0, rate, self.intra_bw).reshape(shape)
        lat = np.where(count > 0, self.level_lat[np.maximum(count - 1, 0)], self.intra_lat).reshape(shape)
        return nbytes / link_bw + lat

    def domain_members(self, size, stride) -> np.ndarray:
        """The most members of a group of `size` ranks `stride` apart that share one NVLink domain."""
        return np.clip(self.domain // np.maximum(np.asarray(stride, dtype=float), 1), 1, np.asarray(size, dtype=float))

    def crosses_domain(self, size, stride) -> np.ndarray:
        """Whether some group of `size` ranks `stride` apart leaves its NVLink domain (level 0's unit) in this
        model's job."""
        shape, (n, d) = self._flat(size, stride)
        return (self._fewest(n * d, levels=1)[0] > 0).reshape(shape)

    def members(self, size, stride) -> np.ndarray:
        """The fewest members a group crossing a level has in one of its units (the most it can have, at most
        the group, where none crosses), (L, ...) over the broadcast shape of `size` and `stride`."""
        shape, (n, d) = self._flat(size, stride)
        crossed, fewest = self._placed(n, d)
        most = np.clip(self.unit // np.maximum(d, 1)[None, :], 1, n[None, :])
        return np.where(crossed, fewest, most).reshape((-1,) + shape)

    def _leaving_s(self, nbytes, size, stride, inter_scale):
        """All-to-all: the time of the bytes that leave each crossed level's units, the slowest level's (a GPU
        of a group with k_L members in its unit sends (n - k_L)/n of its bytes out of the unit over its share
        of the unit's egress; the fewest k_L is the slowest group's)."""
        shape, (n, d) = self._flat(size, stride)
        crossed, k = self._placed(n, d)
        t = np.where(crossed, (n - k) / n / self.egress, 0.0).max(axis=0).reshape(shape)
        return inter_scale * nbytes * t

    def all_to_all_s(self, nbytes, size, stride, intra_scale=1.0, inter_scale=1.0) -> np.ndarray:
        """All-to-all (MoE token dispatch): each rank sends (n-1)/n of `nbytes` to the other
        members at once; those inside its NVLink domain over NVLink, the others over the fabric,
        whose slowest crossed level (the bytes leaving a unit over its egress) sets the network's
        time, so the slower of the two shares sets the time. Latency: ⌈log2 n⌉ hops of the highest
        crossed level (an estimate of NCCL's concurrent sends). `intra_scale` and `inter_scale` scale
        the bytes that stay in the domain and those that leave it: a deduplicating dispatcher's copies
        against the all-to-all's (`cost_models.dispatch.tier_scales`).

        64 ranks, 8 per domain, 1 MB each at 400 GB/s NVLink and 45 GB/s NIC: the 56/64 MB
        that leave the node take 19.4 µs, plus 6 hops of 6 µs:

        >>> from types import SimpleNamespace as S
        >>> nv = S(bus_bw_bytes_per_s=4e11, latency_s=3e-6, gather_scatter_bw_bytes_per_s=4e11)
        >>> ib = S(bus_bw_bytes_per_s=4.5e10, latency_s=6e-6, gather_scatter_bw_bytes_per_s=4.5e10,
        ...        efficiency=1.0, gather_scatter_efficiency=None)
        >>> level = S(unit_gpus=8, egress_bytes_per_s=4.5e10, latency_s=6e-6, sharp=False, name="nvlink-domain")
        >>> comm = TierCommModel(S(domain_size=8, intra_node=nv, inter_node=ib, levels=[level]))
        >>> round(float(comm.all_to_all_s(1e6, 64, 1)) * 1e6, 1)  # µs
        55.4
        """
        n = np.asarray(size, dtype=float)
        stride = np.asarray(stride, dtype=float)
        local = self.domain_members(n, stride)
        intra_s = intra_scale * nbytes * (local - 1) / n / self.intra_bw
        inter_s = self._leaving_s(nbytes, n, stride, inter_scale)
        _, lat, _ = self._crossing(n, stride, self.egress)
        t = np.maximum(intra_s, inter_s) + np.ceil(np.log2(np.maximum(n, 1))) * lat
        return np.where(n > 1, t, 0.0)

    def describe(self, size: int, stride: int, op: str = "all_reduce") -> dict:
        """The levels one group of `size` ranks `stride` apart crosses and the bus bandwidth it gets (op
        all_reduce, gather or all_to_all; for explanations): {crosses: the highest level or None, busbw,
        latency_s, shares: bandwidth per crossed level, bottleneck: nvlink or the level with the least}."""
        egress = self.egress if op in ("all_reduce", "all_to_all") else self.egress_gs
        intra = self.intra_gs_bw if op == "gather" else self.intra_bw
        _, lat, count = self._crossing(size, stride, egress, sharp=op == "all_reduce")
        crossed = int(count)
        if op == "all_to_all":  # the bytes leaving each crossed level's units over its egress: (n-1)/n of the
            n = float(size)     # rank's bytes at the bus rate the share below states
            members = self.members(size, stride).ravel()
            shares = {self.level_names[i]: float(egress[i, 0] * (n - 1) / max(n - members[i], 1))
                      for i in range(crossed)}
        else:
            per_level, _ = self._level_shares(size, stride, egress, sharp=op == "all_reduce")
            shares = {self.level_names[i]: float(per_level[i, 0]) for i in range(crossed)}
        return self._described(crossed, shares, intra, float(lat))

    def describe_p2p(self, stride: int, span: int) -> dict:
        """As `describe`, for one transfer between neighbours `stride` apart in a group spanning `span` ranks
        (`p2p_s`'s rate)."""
        crossed = int((self._fewest(np.array([float(span)]))[:, 0] > 0).sum())
        shares = {self.level_names[i]: float(min(self.inter_bw, self.egress[i, 0] * self.unit[i, 0]
                                                 / min(self.unit[i, 0], max(stride, 1)))) for i in range(crossed)}
        lat = float(self.level_lat[crossed - 1]) if crossed else self.intra_lat
        return self._described(crossed, shares, self.intra_bw, lat)

    def _described(self, crossed: int, shares: dict[str, float], intra: float, lat: float) -> dict:
        least = min(shares, key=shares.get) if shares else None
        limited = least if least is not None and shares[least] < intra else "nvlink"
        bw = min([intra, *shares.values()])
        return {"crosses": self.level_names[crossed - 1] if crossed else None, "busbw": bw, "latency_s": lat,
                "shares": shares, "bottleneck": limited}


def exposed_s(comm_s, window_s, overlap: float):
    """Communication time left on the critical path when it is overlapped with
    `window_s` of compute: all of it past the window, and the share of the rest
    that does not really run concurrently (1 - cluster.comm_overlap)."""
    return comm_s - overlap * np.minimum(comm_s, window_s)
