"""The attention table (`profiles/kernels/attention/<set>.yaml`) as typed objects, and its lookups.

A table gives fused-attention throughput (FLOP/s, FlashAttention's convention: causal FLOPs halved) by
direction, causal mask, head dim and sequence length, with optional causal sliding-window curves; a file's
`flash2:` / `flash1:` sections measure other kernels the same way. `cost_models.attention_kernels` times the
attention core from them; the lookups (`AttentionTable.rate`, `band_efficiency`, `window_rate`) and the
derived causal backward are described in its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

import numpy as np

from planner.errors import SpecError
from planner.specs import TrainSpec

TERA = 1e12
DIRECTIONS = ("fwd", "bwd")
#: Kernels a table may measure in a section of their own name (`flash` is the table itself; `unfused` has none).
SECTION_KERNELS = tuple(k for k in get_args(TrainSpec.model_fields["attention_kernel"].annotation)
                        if k not in ("flash", "unfused"))


@dataclass(frozen=True, eq=False)
class WindowCurve:
    """One measured causal sliding-window curve: FLOP/s of the band (w keys per query) by log2 sequence length."""

    head_dim: float
    window: float
    log2_seq: np.ndarray
    rates_flop_per_s: np.ndarray


@dataclass(frozen=True, eq=False)
class AttentionTable:
    """One GPU's fused-attention throughput: per (direction, causal) a (head dims) × (seq_lens) grid of FLOP/s in
    the FlashAttention convention (causal FLOPs halved), with `log2_seq` the grid's log2 sequence lengths; per
    direction the sliding-window curves (none in a table without `window_curves`)."""

    name: str
    log2_seq: np.ndarray
    head_dims: dict[tuple[str, bool], np.ndarray]
    rates_flop_per_s: dict[tuple[str, bool], np.ndarray]
    window_curves: dict[str, tuple[WindowCurve, ...]] = field(default_factory=dict)

    def rate(self, direction: str, causal: bool, head_dim: float, seq_len) -> np.ndarray:
        """Achieved FLOP/s (table convention) at `head_dim` and `seq_len` (array over candidates): linear in log2
        seq_len and in head dim inside the measured grid, clamped to its edge outside it.

        >>> t = AttentionTable("x", np.log2([512.0, 2048.0]), {("fwd", True): np.array([64.0, 128.0])},
        ...                    {("fwd", True): np.array([[100e12, 200e12], [300e12, 400e12]])})
        >>> [round(float(r) / 1e12) for r in t.rate("fwd", True, 96, np.array([256, 1024, 4096]))]
        [200, 250, 300]
        """
        dims, grid = self.head_dims[(direction, causal)], self.rates_flop_per_s[(direction, causal)]
        x = np.log2(np.asarray(seq_len, dtype=float))
        d = float(np.clip(head_dim, dims[0], dims[-1]))
        hi = int(min(np.searchsorted(dims, d), len(dims) - 1))
        lo = max(hi - 1, 0)
        w = 0.0 if dims[hi] == dims[lo] else (d - dims[lo]) / (dims[hi] - dims[lo])
        at = np.interp(x, self.log2_seq, grid[lo])  # np.interp clamps outside the grid
        return at if w == 0.0 else (1 - w) * at + w * np.interp(x, self.log2_seq, grid[hi])

    def band_efficiency(self, direction: str, head_dim: float, window: float, seq_len) -> np.ndarray:
        """E: a causal window-`window` call's rate over the dense unmasked rate at seq_len = window
        (`cost_models.attention_kernels` docstring), by `seq_len` (array over candidates); 1 where the table has no window curve for `direction`.

        >>> dense = {("fwd", False): np.array([64.0])}
        >>> curve = WindowCurve(64.0, 128.0, np.log2([2048.0]), np.array([150e12]))
        >>> t = AttentionTable("x", np.log2([512.0, 2048.0]), dense, {("fwd", False): np.array([[300e12, 400e12]])},
        ...                    {"fwd": (curve,)})
        >>> [round(float(t.band_efficiency("fwd", 64, w, 4096)), 3) for w in (64, 128, 256, 512, 4096)]
        [0.5, 0.5, 0.75, 1.0, 1.0]
        """
        x = np.log2(np.asarray(seq_len, dtype=float))
        curves = self.window_curves.get(direction, ())
        if not curves:
            return np.ones(np.shape(x))
        near = min({c.head_dim for c in curves}, key=lambda d: (abs(d - head_dim), d))
        own = sorted((c for c in curves if c.head_dim == near), key=lambda c: c.window)
        knots = [np.log2(c.window) for c in own]
        eff = [np.interp(x, c.log2_seq, c.rates_flop_per_s) / self.rate(direction, False, near, c.window)
               for c in own]
        above = self.log2_seq[self.log2_seq > knots[-1]]
        if len(above):  # the dense rule takes over at the first dense length above the largest measured window
            knots.append(float(above[0]))
            eff.append(np.ones(np.shape(x)))
        lw = float(np.log2(window))
        if lw <= knots[0]:
            return eff[0]
        if lw >= knots[-1]:
            return eff[-1]
        hi = int(np.searchsorted(knots, lw))
        f = (lw - knots[hi - 1]) / (knots[hi] - knots[hi - 1])
        return (1 - f) * eff[hi - 1] + f * eff[hi]

    def window_rate(self, direction: str, head_dim: float, window: float, seq_len) -> np.ndarray:
        """Achieved FLOP/s (band FLOPs) of a causal sliding-window call: E × the dense unmasked rate at the window
        length (`cost_models.attention_kernels` docstring), by the call's `seq_len` (array over candidates)."""
        dense = self.rate(direction, False, head_dim, np.full(np.shape(seq_len), float(window)))
        return self.band_efficiency(direction, head_dim, window, seq_len) * dense


def attention_table_from(name: str, data: dict, label: str) -> AttentionTable:
    """Parse one attention table (the file itself, or one kernel's section of it) of table set `name`;
    `label` names it in errors."""
    if not isinstance(data, dict):
        raise SpecError(f"attention table {label}: must be a mapping, got {data!r}")
    seq = np.asarray(data.get("seq_lens", []), dtype=float)
    if seq.ndim != 1 or len(seq) < 2 or np.any(seq <= 0) or np.any(np.diff(seq) <= 0):
        raise SpecError(f"attention table {label}: seq_lens must be at least two increasing positive lengths, "
                        f"got {data.get('seq_lens')!r}")
    rows: dict[tuple[str, bool], dict[float, np.ndarray]] = {}
    for i, c in enumerate(data.get("curves") or []):
        where = f"attention table {label} curves[{i}]"
        if c.get("direction") not in DIRECTIONS or not isinstance(c.get("causal"), bool):
            raise SpecError(f"{where}: direction must be fwd or bwd and causal true or false, got "
                            f"{c.get('direction')!r}, {c.get('causal')!r}")
        if not str(c.get("source", "")).strip():
            raise SpecError(f"{where}: every curve names its source")
        tflops = np.asarray(c.get("tflops", []), dtype=float)
        if tflops.shape != seq.shape or np.any(tflops <= 0):
            raise SpecError(f"{where}: tflops must be {len(seq)} positive numbers (one per seq_len), "
                            f"got {c.get('tflops')!r}")
        rows.setdefault((c["direction"], c["causal"]), {})[float(c["head_dim"])] = tflops * TERA
    if ("fwd", False) not in rows or ("fwd", True) not in rows or ("bwd", False) not in rows:
        raise SpecError(f"attention table {label}: needs forward curves with and without the causal mask and the "
                        "backward without it")
    if ("bwd", True) not in rows:  # derived: the forward's causal/unmasked ratio at the same point (docstring)
        fwd_c, fwd_n = rows[("fwd", True)], rows[("fwd", False)]
        rows[("bwd", True)] = {d: r * fwd_c[d] / fwd_n[d] for d, r in rows[("bwd", False)].items()
                               if d in fwd_c and d in fwd_n}
    dims = {k: np.array(sorted(v)) for k, v in rows.items()}
    grids = {k: np.stack([rows[k][d] for d in dims[k]]) for k in rows}
    return AttentionTable(name, np.log2(seq), dims, grids, _window_curves(data, label, seq))


def _window_curves(data: dict, label: str, seq: np.ndarray) -> dict[str, tuple[WindowCurve, ...]]:
    """The optional `window_curves:` list, per direction; every entry is checked and a bad one is refused naming
    the field. An entry's `seq_lens` defaults to the table's."""
    raw = data.get("window_curves")
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise SpecError(f"attention table {label}: window_curves must be a list of curves, got {raw!r}")
    out: dict[str, list[WindowCurve]] = {}
    seen = set()
    for i, c in enumerate(raw):
        where = f"attention table {label} window_curves[{i}]"
        if not isinstance(c, dict):
            raise SpecError(f"{where}: must be a mapping, got {c!r}")
        if c.get("direction") not in DIRECTIONS:
            raise SpecError(f"{where}: direction must be fwd or bwd, got {c.get('direction')!r}")
        if c.get("causal") is not True:
            raise SpecError(f"{where}: causal must be true (only causal sliding windows are modelled), "
                            f"got {c.get('causal')!r}")
        if not str(c.get("source", "")).strip():
            raise SpecError(f"{where}: every curve names its source")
        head_dim = c.get("head_dim")
        if isinstance(head_dim, bool) or not isinstance(head_dim, (int, float)) or head_dim <= 0:
            raise SpecError(f"{where}: head_dim must be a positive number, got {head_dim!r}")
        lens = np.asarray(c.get("seq_lens", seq), dtype=float)
        if lens.ndim != 1 or len(lens) < 1 or np.any(lens <= 0) or np.any(np.diff(lens) <= 0):
            raise SpecError(f"{where}: seq_lens must be increasing positive lengths, got {c.get('seq_lens')!r}")
        window = c.get("window")
        if isinstance(window, bool) or not isinstance(window, int) or not 0 < window < lens[0]:
            raise SpecError(f"{where}: window must be a whole number of tokens, positive and shorter than the "
                            f"shortest seq_len ({lens[0]:g}), got {window!r}")
        tflops = np.asarray(c.get("tflops", []), dtype=float)
        if tflops.shape != lens.shape or np.any(tflops <= 0):
            raise SpecError(f"{where}: tflops must be {len(lens)} positive numbers (one per seq_len), "
                            f"got {c.get('tflops')!r}")
        key = (c["direction"], float(head_dim), window)
        if key in seen:
            raise SpecError(f"{where}: a second curve for direction {key[0]}, head_dim {head_dim}, window {window}")
        seen.add(key)
        out.setdefault(c["direction"], []).append(WindowCurve(float(head_dim), float(window), np.log2(lens),
                                                              tflops * TERA))
    return {k: tuple(v) for k, v in out.items()}


def attention_tables_from(name: str, data: dict, label: str) -> dict[str, AttentionTable]:
    """Every kernel's table in one attention file of table set `name`: `flash` (the file itself: the fused kernel
    the GPU's fastest stack runs, cuDNN on Hopper and Blackwell) and each `SECTION_KERNELS` section it has
    (`flash2:` FlashAttention-2)."""
    out = {"flash": attention_table_from(name, data, label)}
    for kernel in SECTION_KERNELS:
        if data.get(kernel):
            out[kernel] = attention_table_from(name, data[kernel], f"{label} {kernel}")
    return out
