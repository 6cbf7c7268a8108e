"""Fused (flash) attention: the attention core's forward and backward seconds from measured kernel throughput.

A GPU whose table set (`GpuSpec.kernel_tables`) has an `attention` table (`profiles/kernels/attention/<name>.yaml`)
times the attention core (QKᵀ, softmax, PV, one fused kernel per direction) from the achieved TFLOP/s published for
that GPU by sequence length, head dim, direction and causal mask. Without a table, with the unfused core, or in a
precision no table covers (fp32), `flash_core_times` returns None and the caller keeps the fitted-efficiency roofline.

FLOP conventions (two, kept apart):

- The model (`cost_models.blocks`, MFU): the core's forward FLOP is the full score matrix, 2·2·n·s·q/t for
  `Attention` (Korthikanti Eq. 7's 4s²bh term per layer), 2·n·s·a(d_qk + d_v)/t for MLA; causal masking is NOT
  credited (the SC'21 / Korthikanti / NeMo convention behind published MFU). Those FLOPs are unchanged here.
- The tables (FlashAttention's benchmarks, `benchmarks/benchmark_flash_attention.py` `flops()` and the FA3 paper
  Sec. 4.1): forward FLOP = 4·b·s²·heads·d, HALVED with the causal mask, because a causal kernel skips the masked
  blocks; backward FLOP = 2.5 × the forward FLOP (five matmuls against two).

Time of a call = credited FLOP ÷ table rate, where the credited FLOP is the model's FLOP times the fraction a
causal kernel computes: 1/2 for global causal attention (exactly the FA convention), 1 − w/(2s) for a causal
sliding window of w < s keys (only the first w queries see fewer than w keys). The kernel time therefore carries
the causal saving while the model FLOPs (and MFU) do not. For a window the two counts agree: the model's
`Attention.core` counts x.keys(w) = w keys for every query (2·2·n·w·q/t), NVIDIA's cudnn-frontend benchmark
(`benchmark_single_sdpa.py` `flops()`, commit fb682ce761a2) counts the band w(w+1)/2 + (s − w)·w per head, i.e.
s·w·(1 − (w − 1)/(2s)): the credited FLOP up to w/2 elements of s·w, 1/(2s) relative (0.02 % at s = 2k).

Lookup (`AttentionTable.rate`): linear in log2(seq_len), linear in head dim between the measured head dims; outside
the measured range both are clamped to the nearest measured value (e.g. 32k tokens take the 16k throughput, head
dim 96 lies between 64 and 128, head dim 48 takes 64's). Which point a layer looks up:

- head dim: (d_qk + d_v)/2, the FLOP-weighted mean (MLA: (192 + 128)/2 = 160; GQA/MHA: d). GQA shares K/V
  between query heads; its rate is taken as the MHA rate the tables measure (fewer K/V bytes; the FLOPs are the
  query heads').
- sequence length: the length of one kernel call. Context parallelism (Megatron's load-balanced ring: each rank
  holds chunks i and 2c−1−i) runs c calls of s/c tokens: one causal call on the diagonal and c−1 unmasked calls,
  together half the rank's s/c × s scores. A layer with c > 1 is timed as 1/c of its credited work at the causal
  rate and (c−1)/c at the unmasked rate, both at s/c. A windowed layer runs one banded call of s/c tokens (below).
- per-rank heads after tp and the micro-batch do not enter: the tables were measured at 16k tokens per call with
  hidden 2048 (a full GPU of thread blocks); fewer heads·tokens than that would run slower than the table says.

Sliding windows (`AttentionTable.window_rate`): a banded kernel with a short window runs far below the dense rate,
because each block of queries meets only w/tile + 1 key blocks, so its fixed work (loading Q, the softmax rescale,
writing O and the statistics) is shared by few matrix products. NVIDIA's cuDNN 9.22 on GB200 runs gpt-oss's window
of 128 at 153-167 TFLOP/s forward where a dense call of 2k tokens runs at ~900-1400. A table's optional
`window_curves` hold such measurements: per (direction, head dim, window) the achieved TFLOP/s (FLOPs of the band,
as above) by the call's sequence length, each with its source; only causal windows (the band of w keys ending at
the query) are modelled. The rate of a windowed call of L = s/c tokens with window w and head dim d is

    window_rate = E(w, L) × dense unmasked rate (d, seq_len = w)       (the dense term: the rule before the curves)

with E the band efficiency, read from the window curves of the measured head dim nearest d: at a measured window
w_i, E = that curve's rate at L ÷ the dense unmasked rate at (its head dim, w_i), so a measured point is returned
exactly; between measured windows linear in log2 w; below the smallest the smallest's E; from the largest measured
window to the table's first dense sequence length above it (GB200: 1024 → 2048), E rises linearly in log2 w to 1,
and from there on E = 1, the dense rate at the window length (Mistral's and Gemma 2's 4096 are unchanged). A head
dim other than the measured one keeps the measured E and takes its own dense rate. A table without window curves
(an older or a profiled one) has E = 1 everywhere: the dense rule, which is fast for short windows. Global layers
never read the window curves.

Derived, not measured: a table that has the unmasked backward but not the causal backward gets the causal one as
unmasked-backward × (causal-forward ÷ unmasked-forward) at the same (head dim, seq_len), i.e. the causal mask is
assumed to cost the backward the same fraction of throughput it costs the forward. Check on H100 cuDNN, head dim 64,
16k: the rule gives 0.94 × the unmasked rate where PyTorch's FlexAttention benchmark (pytorch/pytorch PR 137036,
fwd/bwd microseconds for noop and causal masks) measured 0.90, so the derived causal backward is about 5 % fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # read by attribute only
    from cost_models.blocks import Attention, LatentAttention, Micro
    from planner.specs import GpuSpec

TERA = 1e12
DIRECTIONS = ("fwd", "bwd")
#: FlashAttention's backward FLOP convention: 2.5 × the forward (benchmark_flash_attention.py `flops()`).
BACKWARD_FLOP_RATIO = 2.5
#: The core runs in 16-bit under these training precisions (FP8 training keeps attention in BF16, as the
#: GEMM model does: `cost_models.compute.UNQUANTISED`); fp32 has no table.
SIXTEEN_BIT_CORE = ("bf16", "fp16", "fp8")


@dataclass(frozen=True)
class WindowCurve:
    """One measured causal sliding-window curve: FLOP/s of the band (w keys per query) by log2 sequence length."""

    head_dim: float
    window: float
    log2_seq: np.ndarray
    rates_flop_per_s: np.ndarray


@dataclass(frozen=True)
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
        """E: a causal window-`window` call's rate over the dense unmasked rate at seq_len = window (module
        docstring), by `seq_len` (array over candidates); 1 where the table has no window curve for `direction`.

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
        length (module docstring), by the call's `seq_len` (array over candidates)."""
        dense = self.rate(direction, False, head_dim, np.full(np.shape(seq_len), float(window)))
        return self.band_efficiency(direction, head_dim, window, seq_len) * dense


def _body(name: str) -> tuple[dict, str]:
    """The table's data mapping and its label (the measured set's name: a `same_as` file takes that
    set's table, `profiles.tables.kernel_table`)."""
    from profiles.tables import kernel_table

    data = kernel_table("attention", name)
    if data is None:
        return {}, ""
    return data, str(data.get("alias_of", name))


@lru_cache(maxsize=None)
def attention_table(name: str | None, kernel: str = "flash") -> AttentionTable | None:
    """The parsed attention table of table set `name` for `kernel` (cached: one parse per set and kernel), or None
    when the set has none. `flash` is the table itself (the fused kernel the GPU's fastest stack runs: cuDNN on Hopper
    and Blackwell); another kernel is the table's section of that name (`flash2:` FlashAttention-2), None without one."""
    if not name:
        return None
    data, label = _body(name)
    if not data:
        return None
    if kernel != "flash":
        data, label = data.get(kernel) or {}, f"{label} {kernel}"
        if not data:
            return None
    return _parse(name, data, label)


def _parse(name: str, data: dict, label: str) -> AttentionTable:
    from planner.errors import SpecError

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
    from planner.errors import SpecError

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


#: Fused kernels a GPU without an attention table times with its fitted roofline: the A100's was fitted on
#: FlashAttention-2-era runs, which `flash` and `flash2` both are there; FlashAttention v1 runs at half that rate on
#: A100 (FlashAttention-2 README A100 figure) and is refused there.
ROOFLINE_KERNELS = ("flash", "flash2")


def kernel_problem(gpu: GpuSpec, kernel: str, windowed: bool) -> str | None:
    """Why attention kernel `kernel` cannot be timed on `gpu` (for a model with sliding-window layers when
    `windowed`), or None. A GPU without an attention table times `ROOFLINE_KERNELS` with its fitted roofline; one
    with a table needs the kernel's section."""
    if kernel in ("flash", "unfused"):
        return None
    if attention_table(gpu.kernel_tables) is None:
        if kernel in ROOFLINE_KERNELS:
            return None
        return (f"attention_kernel {kernel!r} on {gpu.name}: no attention table measures that kernel there and its "
                f"fitted roofline times {' and '.join(ROOFLINE_KERNELS)} only; use one of those, or measure the GPU "
                "with meshplan profile")
    table = attention_table(gpu.kernel_tables, kernel)
    where = f"profiles/kernels/attention/{gpu.kernel_tables}.yaml"
    if table is None:
        return (f"attention_kernel {kernel!r} on {gpu.name}: its attention table ({where}) has no measurement of that "
                f"kernel (a '{kernel}:' section); use attention_kernel 'flash' (the fused kernel its table measures)")
    if windowed and not table.window_curves:
        return (f"attention_kernel {kernel!r} on {gpu.name}: the model has sliding-window layers and {where} has no "
                f"window measurement of that kernel; use attention_kernel 'flash'")
    return None


def _head_dim(att: Attention | LatentAttention) -> float:
    """(d_qk + d_v)/2: FLOPs are proportional to d_qk + d_v, so this is the head dim of equal work."""
    if hasattr(att, "q_width"):
        return att.q_width / att.num_heads
    return (att.nope_dim + att.rope_dim + att.v_dim) / 2


def flash_core_times(att: Attention | LatentAttention, x: Micro, gpu: GpuSpec) -> tuple[np.ndarray, np.ndarray] | None:
    """(forward, backward) seconds of the attention core of one layer, one micro-batch, one rank, from the GPU's
    attention table; None when the GPU has no table, the core is unfused, or the precision has no table.

    Roofline floor: the core's HBM bytes (forward; twice that backward: Q, K, V, O, dO in, dQ, dK, dV out) at the
    GPU's achievable bandwidth; plus `gpu.kernel_overhead_s` per kernel of the core (`Core.num_kernels`) each way.
    """
    if x.attention_kernel == "unfused" or x.precision not in SIXTEEN_BIT_CORE:
        return None
    table = attention_table(gpu.kernel_tables, x.attention_kernel)
    if table is None:
        return None
    core = att.core(x)
    s, keys, cp = x.seq_len, x.keys(att.window), np.asarray(x.cp, dtype=float)
    d = _head_dim(att)
    hbm = gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency
    overhead = core.num_kernels * gpu.kernel_overhead_s
    if keys < s:  # causal sliding window: one banded call of s/cp tokens at the window rate
        credited, call = core.flop * (1 - keys / (2 * s)), s / cp
        fwd = credited / table.window_rate("fwd", d, keys, call)
        bwd = BACKWARD_FLOP_RATIO * credited / table.window_rate("bwd", d, keys, call)
    else:  # global causal: 1/cp of the work in the diagonal causal call, the rest unmasked, calls of s/cp tokens
        credited, call = core.flop / 2, s / cp

        def seconds(direction: str) -> np.ndarray:
            return (credited / cp / table.rate(direction, True, d, call)
                    + credited * (1 - 1 / cp) / table.rate(direction, False, d, call))

        fwd, bwd = seconds("fwd"), BACKWARD_FLOP_RATIO * seconds("bwd")
    return (np.maximum(fwd, core.bytes / hbm) + overhead,
            np.maximum(bwd, 2 * core.bytes / hbm) + overhead)
