"""Collectives on a TPU torus: a parallel group decomposed into torus axes, priced axis by axis.

A parallel group is `size` ranks `stride` apart (`cost_models.layout`); ranks run along x fastest,
then y, then z, slices outermost (`profiles.topology.torus`). On a slice of shape (X, Y[, Z]) with
P_k = X·…·(axis k-1) chips below axis k, a group is a product of **segments** along consecutive
axes (`decompose`):

- its first axis k is where P_k ≤ stride < P_(k+1); stride must be e·P_k with e dividing the axis
  (members e chips apart along it: `step` e);
- along that axis it takes a = min(size, n_k / e) members; a group that continues to the next axis
  must cover the whole axis (a·e = n_k) and goes on contiguously (step 1) there; the last segment's
  a·e must divide its axis, so that the group and its siblings (the other groups of the same
  dimension) tile the slice;
- what is left after the last axis spans slices over the DCN (stride a multiple of the slice).

A group that is not such a product (stride 3 on an axis of 4, a segment of 6 on an axis of 8) does
not tile the torus: `tiles` says so per candidate, `torus_groups_ok` is the search's rule (such
candidates are dropped), and `torus_groups_message` is its one line naming the group, its stride and
the torus shape (what `evaluate` reports).

Bandwidth of a segment (bytes/s per direction, `intra_node` = one ICI link, L below):

- a segment covering a whole axis with wraparound (a·e = n_k, n_k ≥ 3) is a bidirectional ring:
  two links per chip carry the collective, 2·L;
- an open line, a partial axis, or an axis of two chips (one link between them): 1·L;
- a segment strided within its axis (e > 1) shares every link it uses with its e - 1 interleaved
  sibling groups, which run the same collective at once: the rate over e.

Times follow NCCL's bus-bandwidth convention (nccl-tests PERFORMANCE.md; `cost_models.comm`), with
the tier's efficiency applied to each axis's rate (bw_i = links·L·efficiency / e):

  all-reduce          Σ_i 2·(a_i - 1)/a_i · M_i / bw_i,   M_1 = bytes, M_(i+1) = M_i / a_i
  all-gather, reduce-scatter (bytes = the full size)
                      Σ_i (a_i - 1)/a_i · M_i / bw_i
  all-to-all          max(bisection, injection) of the sub-torus (`all_to_all_s`)
  send/recv           bytes / (L·efficiency) + hops · latency, hops = torus distance of the stride

i.e. a reduce-scatter along each axis in turn on the shrinking message, then the all-gathers back
(axes in x, y, z order); latency: one ICI latency per ring step (2·(a_i - 1) for an all-reduce,
a_i - 1 for the others). Across slices the DCN rule of `cost_models.comm.TierCommModel` applies: the
k members of a group in one slice send over their k DCN NICs, busbw = min(the slice part's bus
bandwidth, k · DCN), plus 2·⌈log2 s⌉ (all-reduce) or s - 1 (the others) DCN latencies for s slices.

Worked example (v5p, L = 100 GB/s, efficiency 0.8, no latency): an all-reduce of 1 GB over a data-
parallel group of 16 ranks at stride 4 on 4x4x8 covers y (4, whole, wrapped) and half of z (4 of 8,
a line): 2·3/4·1e9/160e9 + 2·3/4·0.25e9/80e9 = 9.375 ms + 4.6875 ms = 14.0625 ms.

>>> import numpy as np
>>> m = TorusCommModel.of([4, 4, 8], [True, True, True], ici_bw_bytes_per_s=100e9, ici_efficiency=0.8)
>>> round(float(m.all_reduce_s(1e9, 16, 4)) * 1e3, 4)
14.0625
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from planner.errors import SpecError

if TYPE_CHECKING:  # specs are read by attribute only
    from planner.specs import ClusterSpec

AXIS_NAMES = ("x", "y", "z")


def _ints(x) -> np.ndarray:
    """Integer counts from arrays the step model may hold as floats."""
    return np.rint(np.asarray(x, dtype=float)).astype(np.int64)


def _flat(*arrays) -> tuple[tuple[int, ...], list[np.ndarray]]:
    """(broadcast shape, each array broadcast to it and flattened): the formulas work on 1-D arrays."""
    out = np.broadcast_arrays(*[np.asarray(a) for a in arrays])
    return out[0].shape, [np.ravel(a) for a in out]


@dataclass(frozen=True)
class Segments:
    """The decomposition of N groups on a torus of A axes (arrays over candidates).

    `members[:, k]` groups' members along axis k (1: the group does not use the axis), `step[:, k]`
    chips between neighbouring members there; column A is the slice axis (members = slices spanned).
    `ok`: the group tiles the torus (where False, the other arrays are not meaningful)."""

    members: np.ndarray  # (N, A + 1) int
    step: np.ndarray  # (N, A + 1) int
    ok: np.ndarray  # (N,) bool

    @property
    def in_slice(self) -> np.ndarray:
        """Members of one group in one slice (k of the DCN rule)."""
        return np.prod(self.members[:, :-1], axis=1)

    @property
    def slices(self) -> np.ndarray:
        return self.members[:, -1]


def decompose(shape, size, stride) -> Segments:
    """Segments of groups of `size` ranks `stride` apart on slices of `shape` (module docstring),
    broadcast over candidates."""
    _, (size, stride) = _flat(_ints(size), _ints(stride))
    n_axes = len(shape)
    members = np.ones((len(size), n_axes + 1), dtype=np.int64)
    step = np.ones((len(size), n_axes + 1), dtype=np.int64)
    ok = (size >= 1) & (stride >= 1)
    left, d = size.copy(), np.maximum(stride, 1)
    below = 1  # chips below axis k: P_k
    with np.errstate(divide="ignore", invalid="ignore"):
        for k, n in enumerate(shape):
            upto = below * n
            touch = (left > 1) & (d % upto != 0)  # the group moves along axis k
            ok &= ~touch | (d % below == 0)
            e = np.where(touch, np.maximum(d // below, 1), 1)
            ok &= ~touch | (n % e == 0)
            cap = np.maximum(n // e, 1)
            fits = touch & (left <= cap)
            ok &= ~fits | (n % (left * e) == 0)  # the last segment divides its axis
            spans = touch & (left > cap)
            ok &= ~spans | (left % cap == 0)
            members[:, k] = np.where(fits, left, np.where(spans, cap, 1))
            step[:, k] = e
            left = np.where(fits, 1, np.where(spans, left // cap, left))
            d = np.where(spans, upto, d)
            below = upto
        across = left > 1
        ok &= ~across | (d % below == 0)
        members[:, n_axes] = left
        step[:, n_axes] = np.where(across, np.maximum(d // below, 1), 1)
    return Segments(members=members, step=step, ok=ok)


def tiles(shape, size, stride) -> np.ndarray:
    """Whether each group of `size` ranks `stride` apart tiles a torus of `shape` (with its siblings;
    a group beyond one slice must continue across whole slices): a bool array over candidates.

    >>> tiles([4, 4, 8], [4, 16, 3, 6], [1, 4, 1, 16]).tolist()
    [True, True, False, False]
    """
    out_shape, _ = _flat(size, stride)
    return decompose(shape, size, stride).ok.reshape(out_shape)


def shape_text(shape) -> str:
    return "x".join(str(int(a)) for a in shape)


# ---- the search's rule and the refusal of one strategy ---------------------------------------------------
def _groups(lay: Any, has_experts: bool) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, size, stride) of every group a step runs collectives over (`cost_models.layout`)."""
    out = [(d, *lay.group(d)) for d in ("tp", "cp", "dp")]
    try:
        out.append(("dp·cp", *lay.group("cp", "dp")))
    except ValueError:  # not adjacent in this rank order: no single group of both
        pass
    if has_experts:
        out += [(d, *lay.expert_group(d)) for d in ("etp", "ep", "edp")]
    return out


def _torus(cluster: Any):
    spec = getattr(cluster, "topology", None)
    return spec.torus if spec is not None and spec.kind == "torus" else None


def torus_groups_ok(cluster: Any, lay: Any, has_experts: bool = False) -> np.ndarray:
    """The search's rule: True for each candidate of layout `lay` whose every group tiles the cluster's
    torus (every candidate on a cluster that is not a torus)."""
    torus = _torus(cluster)
    ok = np.ones(len(lay), dtype=bool)
    if torus is None:
        return ok
    for _, size, stride in _groups(lay, has_experts):
        ok &= decompose(torus.shape, size, stride).ok
    return ok


def torus_groups_message(cluster: Any, lay: Any, has_experts: bool = False, i: int = 0) -> str | None:
    """Why candidate `i` of `lay` breaks the rule (one line naming the group, its size and stride and the
    torus shape), or None."""
    torus = _torus(cluster)
    if torus is None:
        return None
    for name, size, stride in _groups(lay, has_experts):
        n, s = int(size[i]), int(stride[i])
        if not bool(decompose(torus.shape, n, s).ok[0]):
            return (f"the {name} group of {n} ranks at stride {s} does not tile the {shape_text(torus.shape)} torus of "
                    f"cluster {cluster.name}: a group must cover whole segments of consecutive torus axes (ranks run "
                    f"along x first), each segment dividing its axis")
    return None


# ---- the communication model ---------------------------------------------------------------------------
class TorusCommModel:
    """`cost_models.comm.CommModel` of a TPU cluster: inside a slice the torus formulas of the module
    docstring, across slices the DCN (k members per slice · DCN rate per chip, as `TierCommModel`).

    Groups that do not tile the torus (the rule drops them before they are ranked) are priced as a ring
    over one link, so that a vectorised search never sees NaN."""

    def __init__(self, cluster: ClusterSpec) -> None:
        torus = _torus(cluster)
        if torus is None:
            raise SpecError(f"cluster {cluster.name}: the torus communication model needs topology kind 'torus'")
        ici, dcn = cluster.intra_node, cluster.inter_node
        self.shape = [int(a) for a in torus.shape]
        self.wrap = [bool(w) for w in torus.wraparound]
        self.chips_per_slice = int(np.prod(self.shape))
        self.link = ici.bw_bytes_per_s
        self.ar_eff = ici.efficiency
        self.gs_eff = ici.gather_scatter_efficiency or ici.efficiency
        self.ici_lat = ici.latency_s
        self.dcn_bw = dcn.bus_bw_bytes_per_s
        self.dcn_gs_bw = dcn.gather_scatter_bw_bytes_per_s
        self.dcn_lat = dcn.latency_s

    @classmethod
    def of(cls, shape, wraparound, ici_bw_bytes_per_s: float, ici_efficiency: float = 1.0, ici_latency_s: float = 0.0,
           dcn_bw_bytes_per_s: float = 1e10, dcn_efficiency: float = 1.0, dcn_latency_s: float = 0.0,
           num_slices: int = 1) -> "TorusCommModel":
        """A model from plain numbers (tests, examples): the cluster fields it reads, by name."""
        tier = SimpleNamespace
        ici = tier(bw_bytes_per_s=ici_bw_bytes_per_s, efficiency=ici_efficiency, gather_scatter_efficiency=None,
                   latency_s=ici_latency_s)
        dcn = tier(bus_bw_bytes_per_s=dcn_bw_bytes_per_s * dcn_efficiency,
                   gather_scatter_bw_bytes_per_s=dcn_bw_bytes_per_s * dcn_efficiency, latency_s=dcn_latency_s)
        torus = SimpleNamespace(shape=list(shape), wraparound=list(wraparound), num_slices=num_slices)
        return cls(SimpleNamespace(name="torus", topology=SimpleNamespace(kind="torus", torus=torus),
                                   intra_node=ici, inter_node=dcn))

    # ---- per-axis rates ---------------------------------------------------------------------------------
    def _links(self, seg: Segments) -> np.ndarray:
        """(N, A) link-equivalents per chip of each segment, over the sibling groups sharing them."""
        out = np.ones(seg.members[:, :-1].shape)
        for k, n in enumerate(self.shape):
            a, e = seg.members[:, k], seg.step[:, k]
            ring = (a * e == n) & self.wrap[k] & (n >= 3)
            out[:, k] = np.where(ring, 2.0, 1.0) / e
        bad = ~seg.ok
        out[bad] = 1.0  # the fallback of the class docstring: one link
        return out

    def _segments(self, size, stride) -> Segments:
        """`decompose`, with each group that does not tile replaced by one line of its members in a slice
        (the fallback of the class docstring)."""
        seg = decompose(self.shape, size, stride)
        bad = ~seg.ok
        if not bad.any():
            return seg
        size = _flat(_ints(size), _ints(stride))[1][0]
        members, step = seg.members.copy(), seg.step.copy()
        members[bad], step[bad] = 1, 1
        members[bad, 0] = np.minimum(size[bad], self.chips_per_slice)
        members[bad, -1] = np.maximum(size[bad] // self.chips_per_slice, 1)
        return Segments(members=members, step=step, ok=seg.ok)

    def _ring_passes(self, nbytes, seg: Segments, eff: float, factor: float) -> tuple[np.ndarray, np.ndarray]:
        """(seconds of bandwidth, ring steps) of one pass per axis (`factor` 2: all-reduce, 1: the others) on
        the shrinking message."""
        links = self._links(seg)
        m = np.broadcast_to(np.asarray(nbytes, dtype=float), seg.ok.shape).astype(float)
        t = np.zeros(seg.ok.shape)
        steps = np.zeros(seg.ok.shape)
        for k in range(len(self.shape)):
            a = seg.members[:, k].astype(float)
            t += np.where(a > 1, factor * (a - 1) / a * m / (links[:, k] * self.link * eff), 0.0)
            steps += factor * (a - 1)
            m = m / a
        return t, steps

    def _collective(self, nbytes, size, stride, factor: float, eff: float, dcn_bw: float, dcn_hops) -> np.ndarray:
        shape, (nb, size_b, stride_b) = _flat(np.asarray(nbytes, dtype=float), _ints(size), _ints(stride))
        seg = self._segments(size_b, stride_b)
        t_slice, steps = self._ring_passes(nb, seg, eff, factor)
        n = size_b.astype(float)
        k = seg.in_slice.astype(float)
        slices = seg.slices.astype(float)
        t = t_slice + steps * self.ici_lat
        across = slices > 1
        if across.any():
            # busbw of the slice part (k members), then min(it, k · DCN) for the whole group
            slice_bus = np.where((k > 1) & (t_slice > 0),
                                 factor * (k - 1) / np.maximum(k, 1) * nb / np.where(t_slice > 0, t_slice, 1.0), np.inf)
            busbw = np.minimum(slice_bus, k * dcn_bw)
            t_span = factor * (n - 1) / n * nb / busbw + steps * self.ici_lat + dcn_hops(slices) * self.dcn_lat
            t = np.where(across, t_span, t)
        return np.where(n > 1, t, 0.0).reshape(shape)

    # ---- CommModel ----------------------------------------------------------------------------------------
    def all_reduce_s(self, nbytes, size, stride) -> np.ndarray:
        """All-reduce of `nbytes` over `size` ranks `stride` apart, seconds (module docstring).

        A ring of 4 along x (wrapped, 2 links of 100 GB/s at 0.8), 1 GB: 2·3/4·1e9/160e9 = 9.375 ms.

        >>> m = TorusCommModel.of([4, 4, 8], [True] * 3, ici_bw_bytes_per_s=100e9, ici_efficiency=0.8)
        >>> round(float(m.all_reduce_s(1e9, 4, 1)) * 1e3, 3)
        9.375
        """
        return self._collective(nbytes, size, stride, 2.0, self.ar_eff, self.dcn_bw,
                                lambda s: 2 * np.ceil(np.log2(np.maximum(s, 1))))

    def gather_scatter_s(self, nbytes, size, stride) -> np.ndarray:
        """One all-gather or one reduce-scatter of `nbytes` (the full size), seconds."""
        return self._collective(nbytes, size, stride, 1.0, self.gs_eff, self.dcn_gs_bw, lambda s: s - 1)

    def p2p_s(self, nbytes, stride, span) -> np.ndarray:
        """One transfer between ranks `stride` apart in a group spanning `span` consecutive ranks: one ICI
        link plus one latency per hop of the torus distance of `stride` inside a slice; the DCN once the
        group spans slices (its slowest hop sets the pace, as `TierCommModel.p2p_s`)."""
        shape, (nb, stride, span) = _flat(np.asarray(nbytes, dtype=float), _ints(stride), _ints(span))
        local = stride % self.chips_per_slice
        hops = np.zeros(stride.shape)
        for k, n in enumerate(self.shape):
            c = local % n
            hops += np.where(self.wrap[k] & (n >= 3), np.minimum(c, n - c), c)
            local = local // n
        ici = nb / (self.link * self.ar_eff) + np.maximum(hops, 1) * self.ici_lat
        dcn = nb / self.dcn_bw + self.dcn_lat
        return np.where(span <= self.chips_per_slice, ici, dcn).reshape(shape)

    def describe(self, size: int, stride: int, op: str = "all_reduce") -> dict:
        """As `cost_models.comm.TierCommModel.describe`: the level a group crosses (None inside one slice,
        "ici-slice" across slices over DCN) and its bus bandwidth, read off the time of two message sizes
        (the latency cancels)."""
        timed = {"all_reduce": self.all_reduce_s, "gather": self.gather_scatter_s, "all_to_all": self.all_to_all_s}[op]
        factor = 2.0 if op == "all_reduce" else 1.0
        n = float(size)
        dt = float(timed(2e9, size, stride)) - float(timed(1e9, size, stride))
        busbw = factor * (n - 1) / n * 1e9 / dt if dt > 0 else float("inf")
        k = float(self.domain_members(size, stride))
        across = size * stride > self.chips_per_slice
        dcn = self.dcn_bw if op == "all_reduce" else self.dcn_gs_bw
        shares = {"ici-slice": k * dcn} if across else {}
        limited = "ici-slice" if across and k * dcn <= busbw * (1 + 1e-9) else "ici"
        return {"crosses": "ici-slice" if across else None, "busbw": busbw, "latency_s": self.dcn_lat if across
                else self.ici_lat, "shares": shares, "bottleneck": limited}

    def describe_p2p(self, stride: int, span: int) -> dict:
        """As `describe`, for one send/recv between ranks `stride` apart in a group spanning `span` ranks."""
        across = span > self.chips_per_slice
        bw = self.dcn_bw if across else self.link * self.ar_eff
        return {"crosses": "ici-slice" if across else None, "busbw": bw,
                "latency_s": self.dcn_lat if across else self.ici_lat,
                "shares": {"ici-slice": self.dcn_bw} if across else {}, "bottleneck": "ici-slice" if across else "ici"}

    def with_world(self, world) -> "TorusCommModel":
        """The model itself: the rules keep every group inside whole slices or tiling them (a group that does
        not tile the torus is dropped before it is ranked), so no group straddles a slice boundary."""
        return self

    def crosses_domain(self, size, stride) -> np.ndarray:
        """Whether a group of `size` ranks `stride` apart leaves its slice."""
        return np.asarray(size, dtype=float) * np.asarray(stride, dtype=float) > self.chips_per_slice

    def domain_members(self, size, stride) -> np.ndarray:
        """Members of a group that share one slice (the ICI domain)."""
        return np.clip(self.chips_per_slice // np.maximum(np.asarray(stride, dtype=float), 1), 1,
                       np.asarray(size, dtype=float))

    def _a2a_slice_s(self, nbytes, seg: Segments) -> np.ndarray:
        """Bandwidth time of an all-to-all of `nbytes` per rank among one slice's members of each group: the
        larger of the bisection bound (across the axis whose cut carries the most: each half sends a quarter
        of n·bytes over n/a_k lines of c_k links shared by e_k siblings, bytes·a_k·e_k / (4·c_k·L)) and the
        injection bound ((n-1)/n of the bytes over the chip's links in the group's axes)."""
        links = self._links(seg)
        nb = np.asarray(nbytes, dtype=float)
        k = seg.in_slice.astype(float)
        bis = np.zeros(seg.ok.shape)
        inject = np.zeros(seg.ok.shape)
        rate = self.link * self.ar_eff
        for ax in range(len(self.shape)):
            a = seg.members[:, ax].astype(float)
            ring_links = links[:, ax] * seg.step[:, ax]  # c_k: 2 for a wrapped whole axis, else 1
            bis = np.maximum(bis, np.where(a > 1, nb * a / (4 * links[:, ax] * rate), 0.0))
            out_links = np.where(a >= 3, 2.0, ring_links) / seg.step[:, ax]
            inject += np.where(a > 1, out_links, 0.0)
        inj = np.where(inject > 0, (k - 1) / np.maximum(k, 1) * nb / (np.maximum(inject, 1e-300) * rate), 0.0)
        return np.maximum(bis, inj)

    def all_to_all_s(self, nbytes, size, stride, intra_scale=1.0, inter_scale=1.0) -> np.ndarray:
        """All-to-all in which every rank sends `nbytes` in all, an equal share to each member: inside a slice
        bounded by the sub-torus's bisection and each chip's links (`_a2a_slice_s`); across slices the slower
        of the slice part (the k/n of the bytes for slice peers) and the DCN part ((n - k)/n over the chip's
        DCN link), as `TierCommModel.all_to_all_s`. Latency: ⌈log2 n⌉ hops of the tier. The scales multiply
        the bytes that stay in the slice and those that leave it."""
        shape, (nb, size_b, stride_b, si, so) = _flat(np.asarray(nbytes, dtype=float), _ints(size), _ints(stride),
                                                      np.asarray(intra_scale, dtype=float),
                                                      np.asarray(inter_scale, dtype=float))
        seg = self._segments(size_b, stride_b)
        n = size_b.astype(float)
        k = seg.in_slice.astype(float)
        across = seg.slices > 1
        intra = si * self._a2a_slice_s(nb * k / n, seg)
        inter = np.where(across, so * nb * (n - k) / n / self.dcn_bw, 0.0)
        lat = np.ceil(np.log2(np.maximum(n, 1))) * np.where(across, self.dcn_lat, self.ici_lat)
        return np.where(n > 1, np.maximum(intra, inter) + lat, 0.0).reshape(shape)
