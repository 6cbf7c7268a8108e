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


class TierCommModel:
    """Two-tier alpha-beta model of a cluster of NVLink domains.

    A group that fits in one NVLink domain (size·stride ≤ domain) runs at the
    intra-domain bus bandwidth. A group that spans domains is limited by the
    scale-out NICs: with one NIC per GPU and k members per domain, k NICs carry
    its traffic (other groups use the others), so busbw = min(intra, k · inter).
    """

    def __init__(self, cluster: ClusterSpec) -> None:
        self.domain = cluster.domain_size
        self.intra_bw = cluster.intra_node.bus_bw_bytes_per_s
        self.intra_lat = cluster.intra_node.latency_s
        self.inter_bw = cluster.inter_node.bus_bw_bytes_per_s
        self.inter_lat = cluster.inter_node.latency_s
        self.intra_gs_bw = cluster.intra_node.gather_scatter_bw_bytes_per_s
        self.inter_gs_bw = cluster.inter_node.gather_scatter_bw_bytes_per_s

    def _tier(self, size, stride, intra_bw, inter_bw):
        size, stride = np.asarray(size, dtype=float), np.asarray(stride, dtype=float)
        inside = size * stride <= self.domain
        bw = np.where(inside, intra_bw, np.minimum(intra_bw, inter_bw * self.domain_members(size, stride)))
        lat = np.where(inside, self.intra_lat, self.inter_lat)
        return bw, lat

    def all_reduce_s(self, nbytes, size, stride) -> np.ndarray:
        """All-reduce of `nbytes` over `size` ranks `stride` apart, seconds.

        1 GB over the 8 GPUs of one node at 100 GB/s bus bandwidth and 10 µs per hop:
        2·7/8·1e9/1e11 + 2·3·1e-5 = 0.01756 s.

        >>> from types import SimpleNamespace as S
        >>> tier = S(bus_bw_bytes_per_s=1e11, latency_s=1e-5, gather_scatter_bw_bytes_per_s=1e11)
        >>> comm = TierCommModel(S(domain_size=8, intra_node=tier, inter_node=tier))
        >>> round(float(comm.all_reduce_s(1e9, 8, 1)), 5)
        0.01756
        """
        n = np.asarray(size, dtype=float)
        bw, lat = self._tier(n, stride, self.intra_bw, self.inter_bw)
        t = 2 * (n - 1) / n * nbytes / bw + 2 * np.ceil(np.log2(np.maximum(n, 1))) * lat
        return np.where(n > 1, t, 0.0)

    def gather_scatter_s(self, nbytes, size, stride) -> np.ndarray:
        n = np.asarray(size, dtype=float)
        bw, lat = self._tier(n, stride, self.intra_gs_bw, self.inter_gs_bw)
        t = (n - 1) / n * nbytes / bw + (n - 1) * lat
        return np.where(n > 1, t, 0.0)

    def p2p_s(self, nbytes, stride, span) -> np.ndarray:
        """Pipeline neighbours cross a domain boundary somewhere once the pipeline
        spans more than one domain; the slowest hop sets the pace."""
        inside = np.asarray(span) <= self.domain
        link_bw = np.where(inside, self.intra_bw, self.inter_bw)
        lat = np.where(inside, self.intra_lat, self.inter_lat)
        return nbytes / link_bw + lat

    def domain_members(self, size, stride) -> np.ndarray:
        """Members of a group of `size` ranks `stride` apart that share one NVLink domain."""
        return np.clip(self.domain // np.maximum(np.asarray(stride, dtype=float), 1), 1, np.asarray(size, dtype=float))

    def all_to_all_s(self, nbytes, size, stride, intra_scale=1.0, inter_scale=1.0) -> np.ndarray:
        """All-to-all (MoE token dispatch): each rank sends (n-1)/n of `nbytes` to the other
        members at once; those inside its NVLink domain over NVLink, the others over its NIC,
        so the slower of the two shares sets the time. Latency: ⌈log2 n⌉ hops of the tier
        (an estimate of NCCL's concurrent sends). `intra_scale` and `inter_scale` scale each
        tier's bytes: a deduplicating dispatcher's copies against the all-to-all's
        (`cost_models.dispatch.tier_scales`).

        64 ranks, 8 per domain, 1 MB each at 400 GB/s NVLink and 45 GB/s NIC: the 56/64 MB
        that leave the node take 19.4 µs, plus 6 hops of 6 µs:

        >>> from types import SimpleNamespace as S
        >>> nv = S(bus_bw_bytes_per_s=4e11, latency_s=3e-6, gather_scatter_bw_bytes_per_s=4e11)
        >>> ib = S(bus_bw_bytes_per_s=4.5e10, latency_s=6e-6, gather_scatter_bw_bytes_per_s=4.5e10)
        >>> comm = TierCommModel(S(domain_size=8, intra_node=nv, inter_node=ib))
        >>> round(float(comm.all_to_all_s(1e6, 64, 1)) * 1e6, 1)  # µs
        55.4
        """
        n = np.asarray(size, dtype=float)
        stride = np.asarray(stride, dtype=float)
        inside = n * stride <= self.domain
        local = self.domain_members(n, stride)
        intra_s = intra_scale * nbytes * (local - 1) / n / self.intra_bw
        inter_s = inter_scale * nbytes * (n - local) / n / self.inter_bw
        lat = np.where(inside, self.intra_lat, self.inter_lat)
        t = np.maximum(intra_s, inter_s) + np.ceil(np.log2(np.maximum(n, 1))) * lat
        return np.where(n > 1, t, 0.0)


def exposed_s(comm_s, window_s, overlap: float):
    """Communication time left on the critical path when it is overlapped with
    `window_s` of compute: all of it past the window, and the share of the rest
    that does not really run concurrently (1 - cluster.comm_overlap)."""
    return comm_s - overlap * np.minimum(comm_s, window_s)
