"""Collectives from measured curves: bus bandwidth by message size and group size, per tier.

`CurveCommModel` implements `cost_models.comm.CommModel` from a GPU's collectives table
(`profiles/kernels/collectives/<set>.yaml`, see `profiles.tables`): for each operation
(all_reduce, all_gather, reduce_scatter, all_to_all) and group size, the bus bandwidth
(nccl-tests convention, cost_models.comm) measured at a series of message sizes, with every
group of that size running at once. Groups inside one NVLink domain are priced from the
curves; groups that span domains keep the two-tier rules of `TierCommModel` (the NICs of the
members in each domain carry the traffic) with the curve as the NVLink side; point-to-point
transfers use the cluster tiers.

Reading a curve (symbols: b = bytes, n = group size, busbw(b, n) in bytes/s):

  time(b, n) = f(n) · b / busbw(b, n),   f = 2(n-1)/n (all-reduce), (n-1)/n (the others)

- time is made non-decreasing in b once, on load: each measured point's time is lowered to
  the least time measured for any larger message (a message can always be sent padded to a
  larger one, so measured spikes at small sizes are noise);
- between measured sizes log busbw is linear in log b (a power law), which keeps time
  monotone between points whose times are;
- between measured group sizes log busbw is linear in log n at fixed b (outside the measured
  group sizes the nearest one); a weighted sum of monotone log-times stays monotone;
- below the smallest measured size the time is that size's time (the small-message
  latency); above the largest, busbw stays at the largest size's value.

The curves are `profiles.collectives.Curves`, parsed by `profiles` once per file version and
carried by the GPU (`GpuSpec.tables`); every lookup is numpy over the candidates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cost_models.comm import TierCommModel
from cost_models.torus import TorusCommModel
from planner.errors import SpecError
from profiles.collectives import OPS, Curves, bus_factor, mean_curve

if TYPE_CHECKING:  # specs are read by attribute only
    from planner.specs import ClusterSpec

class CurveCommModel(TierCommModel):
    """`CommModel` from measured collective curves inside an NVLink domain, with the two-tier
    rules of `TierCommModel` across domains (the curve is then the NVLink side of
    min(NVLink, k · NIC)) and for point-to-point transfers."""

    def __init__(self, cluster: ClusterSpec, curves: dict[str, dict[str, Curves]]) -> None:
        super().__init__(cluster)
        nvlink = curves.get("nvlink", {})
        missing = [op for op in OPS if op not in nvlink]
        if missing:
            raise SpecError(f"collectives table of {cluster.gpu.name}: nvlink tier lacks {', '.join(missing)}")
        self.nvlink = dict(nvlink)
        self.nvlink["gather_scatter"] = mean_curve(nvlink["all_gather"], nvlink["reduce_scatter"])

    def _groups(self, nbytes, size, stride):
        """Flattened (bytes, n, stride, members per domain) of every query, and the masks of the
        groups inside one domain and of those spanning domains (groups of one rank take no time and
        are in neither): each curve is evaluated on the queries that need it only."""
        shape, (nbytes, n, stride) = self._flat(nbytes, size, stride)
        active = (n > 1) & (nbytes > 0)  # no ranks to talk to, or nothing to send: no collective
        fits = ~self.crosses_domain(n, stride)
        inside = active & fits
        span = active & ~fits
        local = np.zeros(n.shape)
        if span.any():  # the most members of a spanning group in one domain (at least 1, at most the group)
            local[span] = np.minimum(np.maximum(self.domain // np.maximum(stride[span], 1), 1), n[span])
        return shape, nbytes, n, stride, local, inside, span

    def _collective_s(self, ops: tuple[str, ...], nbytes, size, stride, hops) -> np.ndarray:
        """Mean time of `ops` (one, or all-gather and reduce-scatter) of `nbytes` over `size` ranks.
        Inside a domain: the measured curve. Spanning domains: TierCommModel's busbw = min(NVLink,
        k · NIC) (the NIC tier's all-reduce or gather/scatter bandwidth), the NVLink side from the
        curve of the k members one domain holds, plus the network tier's latency per hop."""
        shape, nbytes, n, stride, local, inside, span = self._groups(nbytes, size, stride)
        hops = np.broadcast_to(np.asarray(hops, dtype=float), shape).ravel()
        out = np.zeros(n.shape)
        for op in ops:
            curve = self.nvlink[op]
            if inside.any():
                out[inside] += curve.time_s(op, nbytes[inside], n[inside])
            if span.any():
                b, k = nbytes[span], local[span]
                egress = self.egress if op == "all_reduce" else self.egress_gs
                share, lat, _ = self._crossing(n[span], stride[span], egress, sharp=op == "all_reduce")
                span_bw = np.minimum(curve.busbw(b, np.maximum(k, 2)), share)
                out[span] += bus_factor(op, n[span]) * b / span_bw + hops[span] * lat
        return (out / len(ops)).reshape(shape)

    def all_reduce_s(self, nbytes, size, stride) -> np.ndarray:
        n = np.asarray(size, dtype=float)
        return self._collective_s(("all_reduce",), nbytes, n, stride, 2 * np.ceil(np.log2(np.maximum(n, 1))))

    def gather_scatter_s(self, nbytes, size, stride) -> np.ndarray:
        """The mean of the measured all-gather and reduce-scatter times (the step model asks
        for either with one call; their curves differ by a few per cent)."""
        n = np.asarray(size, dtype=float)
        return self._collective_s(("gather_scatter",), nbytes, n, stride, n - 1)

    def all_to_all_s(self, nbytes, size, stride, intra_scale=1.0, inter_scale=1.0) -> np.ndarray:
        """Inside a domain the measured curve; across domains TierCommModel's rule (the slower of
        the NVLink share and the NIC share) with the NVLink share at the curve's bandwidth. The
        scales multiply each tier's bytes (a deduplicating dispatcher, `cost_models.dispatch`)."""
        shape, nbytes, n, stride, local, inside, span = self._groups(nbytes, size, stride)
        intra_scale = np.broadcast_to(np.asarray(intra_scale, dtype=float), shape).ravel()
        inter_scale = np.broadcast_to(np.asarray(inter_scale, dtype=float), shape).ravel()
        curve = self.nvlink["all_to_all"]
        out = np.zeros(n.shape)
        if inside.any():
            out[inside] = curve.time_s("all_to_all", nbytes[inside] * intra_scale[inside], n[inside])
        if span.any():
            b, k, m, d = nbytes[span], local[span], n[span], stride[span]
            bi = b * intra_scale[span]
            intra_s = bi * (k - 1) / m / curve.busbw(bi, np.maximum(k, 2))
            inter_s = self._leaving_s(b, m, d, inter_scale[span])
            _, lat, _ = self._crossing(m, d, self.egress)
            out[span] = np.maximum(intra_s, inter_s) + np.ceil(np.log2(m)) * lat
        return out.reshape(shape)


def comm_model_for(cluster: ClusterSpec) -> TierCommModel | TorusCommModel:
    """The cluster's communication model: a TPU slice's torus (cost_models.torus); measured curves when its
    GPU's table set has a collectives table; otherwise the calibrated alpha-beta model over the fabric's
    levels."""
    if cluster.topology is not None and cluster.topology.kind == "torus":
        return TorusCommModel(cluster)
    curves = cluster.gpu.tables.collectives
    return CurveCommModel(cluster, curves) if curves is not None else TierCommModel(cluster)
