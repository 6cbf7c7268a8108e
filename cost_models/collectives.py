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

Tables are parsed once per table set (`functools.lru_cache`); every lookup is numpy over
the candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

import numpy as np

from cost_models.comm import TierCommModel
from planner.errors import SpecError

if TYPE_CHECKING:  # specs are read by attribute only
    from planner.specs import ClusterSpec

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
GB = 1e9
#: The lookup grid of `Curves.busbw`: 1/32 octave in bytes, from 1 byte to 2**48 (beyond the largest
#: measured size the bus bandwidth stays at the last value, as the curve itself does).
GRID_STEP = float(np.log(2.0)) / 32
GRID_POINTS = 48 * 32 + 2


def bus_factor(op: str, n):
    """busbw / algbw of `op` over `n` ranks (nccl-tests doc/PERFORMANCE.md)."""
    n = np.asarray(n, dtype=float)
    return (2.0 if op == "all_reduce" else 1.0) * (n - 1) / np.maximum(n, 1)  # gather_scatter: the mean curve


@dataclass(frozen=True)
class Curves:
    """One operation's measured curves on one tier, ready for lookup.

    group_sizes (G,) ascending; for each group g the knots log_bytes[g] (ascending) and
    log_busbw[g] (after the monotone-time envelope), bytes/s."""

    group_sizes: np.ndarray
    log_bytes: tuple[np.ndarray, ...]
    log_busbw: tuple[np.ndarray, ...]

    def busbw(self, nbytes, n) -> np.ndarray:
        """Bus bandwidth (bytes/s) of one collective of `nbytes` over `n` ranks (whole numbers),
        arrays broadcast: `exact_busbw` tabulated once per group size on a grid of 1/32 octave in
        bytes, which holds every knot at a power-of-two size, so the lookup is the exact curve there
        and between (the curve is linear in log bytes between knots)."""
        grid = self._grid
        nbytes, n = np.broadcast_arrays(np.asarray(nbytes, dtype=float), np.asarray(n, dtype=float))
        k = np.minimum(np.log(np.maximum(nbytes, 1.0)) / GRID_STEP, GRID_POINTS - 1 - 1e-9)
        i = k.astype(np.int64)
        flat = np.minimum(np.maximum(n, 0), grid.shape[0] - 1).astype(np.int64) * GRID_POINTS + i
        table = grid.ravel()
        lo = table[flat]
        return np.exp(lo + (k - i) * (table[flat + 1] - lo))

    @cached_property
    def _grid(self) -> np.ndarray:
        """log busbw per whole group size 0..largest measured (smaller and larger ones clamp to the
        nearest measured curve) at GRID_POINTS byte sizes 2**(j/32)."""
        u = np.arange(GRID_POINTS) * GRID_STEP
        top = int(self.group_sizes[-1])
        return np.stack([np.log(self.exact_busbw(np.exp(u), np.full(u.shape, float(max(n, 1)))))
                         for n in range(top + 1)])

    def exact_busbw(self, nbytes, n) -> np.ndarray:
        """Bus bandwidth (bytes/s) of one collective of `nbytes` over `n` ranks, arrays broadcast:
        linear in log bytes along each measured group's curve, linear in log group size between the
        two measured groups around `n` (clamped at the smallest and largest)."""
        nbytes, n = np.broadcast_arrays(np.asarray(nbytes, dtype=float), np.asarray(n, dtype=float))
        shape = nbytes.shape
        u = np.log(np.maximum(nbytes.ravel(), 1.0))
        log_g = np.log(self.group_sizes)
        if len(log_g) == 1:
            return np.exp(self._at(0, u)).reshape(shape)
        x = np.clip(np.log(np.maximum(n.ravel(), 1.0)), log_g[0], log_g[-1])
        hi = np.clip(np.searchsorted(log_g, x, side="left"), 1, len(log_g) - 1)
        w = (x - log_g[hi - 1]) / (log_g[hi] - log_g[hi - 1])
        out = np.empty_like(u)
        for j in range(1, len(log_g)):  # each pair of measured group sizes, on the queries between them
            sel = hi == j
            if sel.all():
                out = (1 - w) * self._at(j - 1, u) + w * self._at(j, u)
                break
            if sel.any():
                uu, ww = u[sel], w[sel]
                out[sel] = (1 - ww) * self._at(j - 1, uu) + ww * self._at(j, uu)
        return np.exp(out).reshape(shape)

    def _at(self, g: int, u: np.ndarray) -> np.ndarray:
        """log busbw on measured group g's curve at log bytes `u`; below its smallest size the time
        stays at that size's (busbw proportional to bytes)."""
        lb, lbw = self.log_bytes[g], self.log_busbw[g]
        clamped = np.maximum(u, lb[0])
        return np.interp(clamped, lb, lbw) + (u - clamped)

    def time_s(self, op: str, nbytes, n) -> np.ndarray:
        """Seconds of one `op` of `nbytes` over `n` ranks (no zero case: callers handle n = 1)."""
        n = np.asarray(n, dtype=float)
        return bus_factor(op, np.maximum(n, 2)) * np.asarray(nbytes, dtype=float) / self.busbw(nbytes, n)


def _curve(op: str, row: dict, what: str) -> tuple[int, np.ndarray, np.ndarray]:
    try:
        n = int(row["group_size"])
        b = np.asarray(row["bytes"], dtype=float)
        bw = np.asarray(row["busbw_gb_per_s"], dtype=float) * GB
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"{what}: each curve needs group_size, bytes and busbw_gb_per_s ({exc})") from None
    if n < 2 or b.ndim != 1 or b.shape != bw.shape or len(b) < 2:
        raise SpecError(f"{what}: group_size must be >= 2 and bytes, busbw_gb_per_s equal lists of >= 2 values "
                        f"(group_size {n}, {b.size} sizes, {bw.size} bandwidths)")
    if np.any(np.diff(b) <= 0) or b[0] <= 0 or np.any(bw <= 0):
        raise SpecError(f"{what} group_size {n}: bytes must be positive and ascending, busbw_gb_per_s positive")
    t = bus_factor(op, n) * b / bw
    t = np.minimum.accumulate(t[::-1])[::-1]  # no message faster than a larger one was measured
    return n, np.log(b), np.log(bus_factor(op, n) * b / t)


def curves_from_table(table: dict, name: str) -> dict[str, dict[str, Curves]]:
    """{tier: {op: Curves}} from a parsed collectives table."""
    tiers = table.get("tiers")
    if not isinstance(tiers, dict) or not tiers:
        raise SpecError(f"collectives table {name}: needs tiers: {{nvlink: {{all_reduce: [...], ...}}}}")
    out: dict[str, dict[str, Curves]] = {}
    for tier, ops in tiers.items():
        out[tier] = {}
        for op, rows in (ops or {}).items():
            if op not in OPS:
                raise SpecError(f"collectives table {name}: unknown operation {op!r}; known: {', '.join(OPS)}")
            parsed = sorted(_curve(op, row, f"collectives table {name} {tier}.{op}") for row in rows)
            sizes = [n for n, _, _ in parsed]
            if len(set(sizes)) != len(sizes):
                raise SpecError(f"collectives table {name} {tier}.{op}: group sizes repeat: {sizes}")
            out[tier][op] = Curves(np.array(sizes, dtype=float), tuple(p[1] for p in parsed), tuple(p[2] for p in parsed))
    return out


@lru_cache(maxsize=None)
def load_curves(name: str | None) -> dict[str, dict[str, Curves]] | None:
    """The curves of table set `name`, parsed once; None when the set has no collectives table.
    A `same_as` file (`profiles.tables.kernel_table`) shares the measured set's curves."""
    from profiles.tables import kernel_table

    table = kernel_table("collectives", name)
    if table is None:
        return None
    if "alias_of" in table:
        return load_curves(table["alias_of"])
    return curves_from_table(table, str(name))


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
        self.nvlink["gather_scatter"] = _mean_curve(nvlink["all_gather"], nvlink["reduce_scatter"])

    def _groups(self, nbytes, size, stride):
        """Flattened (bytes, n, stride, members per domain) of every query, and the masks of the
        groups inside one domain and of those spanning domains (groups of one rank take no time and
        are in neither): each curve is evaluated on the queries that need it only."""
        nbytes, n, stride = np.broadcast_arrays(np.asarray(nbytes, dtype=float), np.asarray(size, dtype=float),
                                                np.asarray(stride, dtype=float))
        shape = n.shape
        nbytes, n, stride = nbytes.ravel(), n.ravel(), stride.ravel()
        active = (n > 1) & (nbytes > 0)  # no ranks to talk to, or nothing to send: no collective
        fits = n * stride <= self.domain
        inside = active & fits
        span = active & ~fits
        local = np.zeros(n.shape)
        if span.any():  # members of a spanning group in one domain (at least 1, at most the group)
            local[span] = np.minimum(np.maximum(self.domain // np.maximum(stride[span], 1), 1), n[span])
        return shape, nbytes, n, local, inside, span

    def _collective_s(self, ops: tuple[str, ...], nbytes, size, stride, hops) -> np.ndarray:
        """Mean time of `ops` (one, or all-gather and reduce-scatter) of `nbytes` over `size` ranks.
        Inside a domain: the measured curve. Spanning domains: TierCommModel's busbw = min(NVLink,
        k · NIC) (the NIC tier's all-reduce or gather/scatter bandwidth), the NVLink side from the
        curve of the k members one domain holds, plus the network tier's latency per hop."""
        shape, nbytes, n, local, inside, span = self._groups(nbytes, size, stride)
        hops = np.broadcast_to(np.asarray(hops, dtype=float), shape).ravel()
        out = np.zeros(n.shape)
        for op in ops:
            curve = self.nvlink[op]
            if inside.any():
                out[inside] += curve.time_s(op, nbytes[inside], n[inside])
            if span.any():
                b, k = nbytes[span], local[span]
                nic_bw = self.inter_bw if op == "all_reduce" else self.inter_gs_bw
                span_bw = np.minimum(curve.busbw(b, np.maximum(k, 2)), nic_bw * k)
                out[span] += bus_factor(op, n[span]) * b / span_bw + hops[span] * self.inter_lat
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
        shape, nbytes, n, local, inside, span = self._groups(nbytes, size, stride)
        intra_scale = np.broadcast_to(np.asarray(intra_scale, dtype=float), shape).ravel()
        inter_scale = np.broadcast_to(np.asarray(inter_scale, dtype=float), shape).ravel()
        curve = self.nvlink["all_to_all"]
        out = np.zeros(n.shape)
        if inside.any():
            out[inside] = curve.time_s("all_to_all", nbytes[inside] * intra_scale[inside], n[inside])
        if span.any():
            b, k, m = nbytes[span], local[span], n[span]
            bi = b * intra_scale[span]
            intra_s = bi * (k - 1) / m / curve.busbw(bi, np.maximum(k, 2))
            inter_s = inter_scale[span] * b * (m - k) / m / self.inter_bw
            out[span] = np.maximum(intra_s, inter_s) + np.ceil(np.log2(m)) * self.inter_lat
        return out.reshape(shape)


def _mean_curve(a: Curves, b: Curves) -> Curves:
    """One curve whose time is the mean of two operations' (all-gather and reduce-scatter share the
    bus-bandwidth factor (n-1)/n): at every knot of either, on the group sizes both measured."""
    sizes = np.intersect1d(a.group_sizes, b.group_sizes)
    if not len(sizes):
        raise SpecError("collectives table: all_gather and reduce_scatter share no group size")
    log_bytes, log_busbw = [], []
    for n in sizes:
        ia, ib = int(np.searchsorted(a.group_sizes, n)), int(np.searchsorted(b.group_sizes, n))
        u = np.union1d(a.log_bytes[ia], b.log_bytes[ib])
        ta = np.exp(u - a._at(ia, u))  # bytes / busbw, the common factor (n-1)/n left out
        tb = np.exp(u - b._at(ib, u))
        log_bytes.append(u)
        log_busbw.append(u - np.log((ta + tb) / 2))
    return Curves(sizes.astype(float), tuple(log_bytes), tuple(log_busbw))


def comm_model_for(cluster: ClusterSpec) -> TierCommModel:
    """The cluster's communication model: measured curves when its GPU's table set has a
    collectives table, otherwise the calibrated two-tier alpha-beta model."""
    curves = load_curves(getattr(cluster.gpu, "kernel_tables", None))
    return CurveCommModel(cluster, curves) if curves is not None else TierCommModel(cluster)
