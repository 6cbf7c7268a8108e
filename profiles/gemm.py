"""GEMM efficiency by shape: achieved fraction of the dense peak, from measured per-shape tables.

A GPU whose kernel-table set has a `gemm` table (`profiles/kernels/gemm/<set>.yaml`, see
`profiles.tables`) gets each GEMM's throughput from it instead of one `gemm_efficiency` constant
(`cost_models.compute.gemm_time`); this module turns the file into a `GemmTable` and looks shapes up:

- the table holds achieved FLOP/s of (b, m, n, k) GEMMs per dtype on one GPU (2·b·m·n·k FLOP per
  kernel); divided by the measured GPU's dense peak (`peak_tflops` in the file) it is an efficiency,
  applied to the peak of the GPU being planned;
- a batch of b GEMMs of (m, n, k) has as many output tiles as one GEMM of (b·m, n, k), so the b = 2
  and b = 4 rows at m = 4096 extend the m axis to 8192 and 16384;
- outside the grid the physics of tiling decides: an output wider than the grid (n > 4096) has the
  tiles of an (m·n/4096, 4096) one, so it is folded onto m; beyond the largest m the kernel is
  saturated (the efficiency stays at the edge); k beyond the grid keeps the edge value (longer
  reductions only add arithmetic intensity; taking the edge is conservative); below the smallest
  size (256) a kernel's time no longer shrinks (one wave of partly filled tiles), so the efficiency
  falls in proportion to the size;
- tile quantisation: m and n are padded to whole 128-wide tiles (the tensor-core tile width of
  cuBLAS's Hopper and Blackwell kernels), so a 2880-wide GEMM does the work of a 2944-wide one;
- measured tables are noisy (a few shapes dip below smaller ones); the grid is replaced by the
  mean of its upper and lower monotone envelopes along m, n and k, so a larger GEMM is never less
  efficient than a smaller one (a property the tests check);
- interpolation is trilinear in log2(m), log2(n), log2(k).

FP8 on a GPU whose table has no trustworthy FP8 column (`fp8_from_bf16` in the file): the BF16
efficiency at the same shape times the ratio of a measured FP8 curve (by k, at one m = n) to the
BF16 table at that m, n, so the k dependence is measured and the m, n dependence borrowed; the
ratio's level may be set by a second measurement of cuBLAS's FP8 / BF16 ratio (`level`).

Block-scaled FP8 (`recipe_rates` in the file): the table's FP8 column is per-tensor scaled FP8; a
recipe whose GEMMs run another kernel (MXFP8's block-scaled GEMM on Blackwell) runs at a measured
fraction of that column's rate, the same at every shape (one ratio over a model's twelve GEMMs is
what is published). A recipe the file does not name runs at the column's rate.

Lookups are vectorised; the cost model calls them once per distinct micro-batch shape
(`cost_models.blocks.Micro.distinct`), not once per candidate. `profiles.bundle` builds each table once
per file version and hands it to the cost model with the GPU (`GpuSpec.tables`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.errors import SpecError
from profiles.elementwise import FP8_RECIPES

#: Tile width m and n are padded to (cuBLAS Hopper/Blackwell tensor-core tiles are 128 or 256 wide;
#: 128 is the smaller, so the padding is a lower bound).
TILE = 128
#: Precision of a training run -> the table column its GEMMs use.
#: NVFP4 reads the FP8 column's efficiency at the shape, times the table's `recipe_rates.nvfp4`, at the FP4 peak.
COLUMN = {"bf16": "bf16", "fp16": "bf16", "fp8": "fp8", "nvfp4": "fp8", "tf32": "tf32", "fp32": "fp32"}
TERA = 1e12


@dataclass(frozen=True, eq=False)
class GemmTable:
    """Efficiency grids (fractions of the dense peak) on log2 axes; see the module docstring."""

    log_m: np.ndarray
    log_n: np.ndarray
    log_k: np.ndarray
    eff: dict[str, np.ndarray]  # column -> (M, N, K) grid
    source: str
    recipe_rates: tuple[tuple[str, float], ...] = ()  # FP8 recipe -> its GEMMs' rate / the fp8 column's (nvfp4:
    # its efficiency / the fp8 column's efficiency, at the FP4 peak)

    def recipe_rate(self, precision: str, recipe: str | None) -> float:
        """The rate of `recipe`'s quantised GEMMs relative to the table's FP8 column (1 for other
        precisions and for recipes the table does not name)."""
        if precision == "nvfp4":  # no default: a table without the rate cannot time NVFP4 (planner.rules)
            return dict(self.recipe_rates)["nvfp4"]
        if COLUMN.get(precision) != "fp8" or recipe is None:
            return 1.0
        return dict(self.recipe_rates).get(recipe, 1.0)

    def has(self, precision: str) -> bool:
        return COLUMN.get(precision) in self.eff

    def efficiency(self, m, n, k, precision: str, recipe: str | None = None) -> np.ndarray:
        """Achieved fraction of the dense peak of an (m, n, k) GEMM in `precision` (arrays broadcast),
        under FP8 `recipe` (`recipe_rate`).

        >>> from profiles.bundle import load_tables
        >>> t = load_tables("h100-sxm").gemm
        >>> round(float(t.efficiency(8192, 8192, 8192, "bf16")), 3) > round(float(t.efficiency(1024, 1024, 1024, "bf16")), 3)
        True
        >>> b = load_tables("b200").gemm
        >>> round(float(b.efficiency(8192, 8192, 8192, "fp8", "mxfp8") / b.efficiency(8192, 8192, 8192, "fp8")), 3)
        0.951
        """
        grid = self.eff[COLUMN[precision]]
        m, n, k = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (m, n, k)))
        return self._lookup(grid, m, n, k) * self.recipe_rate(precision, recipe)

    def _lookup(self, grid, m, n, k) -> np.ndarray:
        m = np.maximum(m, 1.0)
        n = np.maximum(n, 1.0)
        k = np.maximum(k, 1.0)
        pad = (m * n) / (np.ceil(m / TILE) * TILE * np.ceil(n / TILE) * TILE)
        n_max = 2.0 ** self.log_n[-1]
        fold = np.maximum(n / n_max, 1.0)  # n beyond the grid: its tiles folded onto m
        m, n = m * fold, n / fold
        scale = np.ones_like(m)
        coords = []
        for v, axis in ((m, self.log_m), (n, self.log_n), (k, self.log_k)):
            lo = 2.0 ** axis[0]
            scale = scale * np.minimum(v / lo, 1.0)  # below the grid: time no longer shrinks
            x = np.clip(np.log2(np.maximum(v, lo)), axis[0], axis[-1])
            i = np.clip(np.searchsorted(axis, x, side="right") - 1, 0, len(axis) - 2)
            coords.append((i, (x - axis[i]) / (axis[i + 1] - axis[i])))
        (i, a), (j, b), (l, c) = coords
        out = np.zeros_like(m)
        for di, wi in ((0, 1 - a), (1, a)):
            for dj, wj in ((0, 1 - b), (1, b)):
                for dl, wl in ((0, 1 - c), (1, c)):
                    out = out + wi * wj * wl * grid[i + di, j + dj, l + dl]
        return out * scale * pad


def monotone(grid: np.ndarray) -> np.ndarray:
    """Mean of the upper (running maximum) and lower (running minimum from the far end) monotone
    envelopes along every axis: non-decreasing in each axis, close to the data where it already is.

    >>> monotone(np.array([[[1.0, 3.0, 2.0, 4.0]]]))[0, 0].tolist()
    [1.0, 2.5, 2.5, 4.0]
    """
    upper, lower = grid.copy(), grid.copy()
    for axis in range(grid.ndim):
        upper = np.maximum.accumulate(upper, axis=axis)
        lower = np.flip(np.minimum.accumulate(np.flip(lower, axis=axis), axis=axis), axis=axis)
    return (upper + lower) / 2


def _grid(rows: np.ndarray, col: int, peak: float):
    """(m, n, k) efficiency grid from table rows [b, m, n, k, ...]: b = 1 rows, then b·4096 for
    the batched rows at the largest m."""
    b, m, n, k = (rows[:, i] for i in range(4))
    m_top = m.max()
    keep = (b == 1) | (m == m_top)
    m_eff = (m * b)[keep]
    ms, ns, ks = (np.unique(v) for v in (m_eff, n[keep], k[keep]))
    grid = np.full((len(ms), len(ns), len(ks)), np.nan)
    grid[np.searchsorted(ms, m_eff), np.searchsorted(ns, n[keep]), np.searchsorted(ks, k[keep])] = (
        rows[keep, col] * TERA / peak)
    if np.isnan(grid).any():
        raise SpecError("GEMM table does not cover a full (m, n, k) grid")
    return np.log2(ms), np.log2(ns), np.log2(ks), grid


def build_gemm_table(data: dict, what: str) -> GemmTable:
    """A GemmTable from a parsed table file (`profiles.bundle` caches it per file version; the FP8-level fit
    of benchmarks/te_gemm_profiling.py builds variants)."""
    try:
        columns = list(data["columns"])
        rows = np.asarray(data["rows"], dtype=float)
        peaks = {c: float(v) * TERA for c, v in dict(data["peak_tflops"]).items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"{what} is malformed: {exc}") from None
    if columns[:4] != ["b", "m", "n", "k"] or rows.ndim != 2 or rows.shape[1] != len(columns):
        raise SpecError(f"{what}: columns must start with b, m, n, k and every row have {len(columns)} values")
    eff = {}
    axes = None
    for col, name_ in enumerate(columns[4:], start=4):
        if name_ not in peaks:
            raise SpecError(f"{what}: column {name_!r} has no peak_tflops entry")
        log_m, log_n, log_k, grid = _grid(rows, col, peaks[name_])
        if (grid > 1.0).any():
            raise SpecError(f"{what}: column {name_!r} exceeds the measured GPU's dense peak")
        axes = (log_m, log_n, log_k)
        eff[name_] = monotone(grid)
    derived = data.get("fp8_from_bf16")
    if derived is not None and "bf16" in eff:
        eff["fp8"] = _fp8_from_bf16(eff["bf16"], axes, derived, peaks.get("fp8"), what)
    return GemmTable(*axes, eff=eff, source=str(data["source"]), recipe_rates=_recipe_rates(data, what))


def _recipe_rates(data: dict, what: str) -> tuple[tuple[str, float], ...]:
    """The file's `recipe_rates` (FP8 recipe -> rate relative to its FP8 column), checked; each needs
    `recipe_rates_source`."""
    raw = data.get("recipe_rates")
    if raw is None:
        return ()
    if not isinstance(raw, dict) or not str(data.get("recipe_rates_source", "")).strip():
        raise SpecError(f"{what}: recipe_rates must map FP8 recipes to rates and come with recipe_rates_source")
    out = []
    for recipe, rate in raw.items():
        if recipe not in FP8_RECIPES:
            raise SpecError(f"{what}: recipe_rates names {recipe!r}, not an FP8 recipe ({', '.join(FP8_RECIPES)})")
        try:
            value = float(rate)
        except (TypeError, ValueError):
            raise SpecError(f"{what}: recipe_rates[{recipe!r}] must be a number, got {rate!r}") from None
        if not 0.0 < value <= 1.0:  # never above the column's rate: no GEMM may pass the measured peak fraction
            raise SpecError(f"{what}: recipe_rates[{recipe!r}] must be in (0, 1], got {value}")
        out.append((str(recipe), value))
    return tuple(sorted(out))


def _fp8_from_bf16(bf16: np.ndarray, axes, spec: dict, fp8_peak: float | None, what: str) -> np.ndarray:
    """FP8 grid = BF16 grid × level × (measured FP8 efficiency / BF16 table efficiency) at the
    measured (m, n), the ratio interpolated in log2(k) and capped at 1 (FP8 is never credited more
    than BF16's fraction of its own, doubled, peak). `level` (default 1) scales the measured curve
    to another measurement's FP8 / BF16 ratio; the spec says where it comes from (`level_source`)."""
    if fp8_peak is None:
        raise SpecError(f"{what}: fp8_from_bf16 needs peak_tflops.fp8")
    level = spec.get("level", 1.0)
    if not isinstance(level, (int, float)) or isinstance(level, bool) or not 0.5 <= level <= 2.0:
        raise SpecError(f"{what}: fp8_from_bf16.level must be a number in [0.5, 2], got {level!r}")
    if "level" in spec and not str(spec.get("level_source", "")).strip():
        raise SpecError(f"{what}: fp8_from_bf16.level needs level_source (where it comes from)")
    log_m, log_n, log_k = axes
    table = GemmTable(log_m, log_n, log_k, {"bf16": bf16}, "")
    ks = np.asarray(spec["k"], dtype=float)
    fp8_eff = np.asarray(spec["tflops"], dtype=float) * TERA / fp8_peak
    bf16_eff = table.efficiency(float(spec["m"]), float(spec["n"]), ks, "bf16")
    ratio = np.minimum(float(level) * fp8_eff / bf16_eff, 1.0)
    grid_ratio = np.interp(log_k, np.log2(ks), ratio)
    return monotone(bf16 * grid_ratio[None, None, :])
