"""The collectives table (`profiles/kernels/collectives/<set>.yaml`) as typed curves, and their lookups.

For each tier and operation (all_reduce, all_gather, reduce_scatter, all_to_all) and group size, the bus
bandwidth (nccl-tests convention) measured at a series of message sizes. On load each curve's time is made
non-decreasing in the message size; lookups interpolate in log bytes and log group size. The rules and
the communication model built on them are in `cost_models.collectives`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from planner.errors import SpecError

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


@dataclass(frozen=True, eq=False)
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


def mean_curve(a: Curves, b: Curves) -> Curves:
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
