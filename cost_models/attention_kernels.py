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
the causal saving while the model FLOPs (and MFU) do not.

Lookup (`AttentionTable.rate`): linear in log2(seq_len), linear in head dim between the measured head dims; outside
the measured range both are clamped to the nearest measured value (e.g. 32k tokens take the 16k throughput, head
dim 96 lies between 64 and 128, head dim 48 takes 64's). Which point a layer looks up:

- head dim: (d_qk + d_v)/2, the FLOP-weighted mean (MLA: (192 + 128)/2 = 160; GQA/MHA: d). GQA shares K/V
  between query heads; its rate is taken as the MHA rate the tables measure (fewer K/V bytes; the FLOPs are the
  query heads').
- sequence length: the length of one kernel call. Context parallelism (Megatron's load-balanced ring: each rank
  holds chunks i and 2c−1−i) runs c calls of s/c tokens: one causal call on the diagonal and c−1 unmasked calls,
  together half the rank's s/c × s scores. A layer with c > 1 is timed as 1/c of its credited work at the causal
  rate and (c−1)/c at the unmasked rate, both at s/c. A windowed layer runs one banded call: unmasked rate at the
  window length.
- per-rank heads after tp and the micro-batch do not enter: the tables were measured at 16k tokens per call with
  hidden 2048 (a full GPU of thread blocks); fewer heads·tokens than that would run slower than the table says.

Derived, not measured: a table that has the unmasked backward but not the causal backward gets the causal one as
unmasked-backward × (causal-forward ÷ unmasked-forward) at the same (head dim, seq_len), i.e. the causal mask is
assumed to cost the backward the same fraction of throughput it costs the forward. Check on H100 cuDNN, head dim 64,
16k: the rule gives 0.94 × the unmasked rate where PyTorch's FlexAttention benchmark (pytorch/pytorch PR 137036,
fwd/bwd microseconds for noop and causal masks) measured 0.90, so the derived causal backward is about 5 % fast.
"""

from __future__ import annotations

from dataclasses import dataclass
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
class AttentionTable:
    """One GPU's fused-attention throughput: per (direction, causal) a (head dims) × (seq_lens) grid of FLOP/s in
    the FlashAttention convention (causal FLOPs halved), with `log2_seq` the grid's log2 sequence lengths."""

    name: str
    log2_seq: np.ndarray
    head_dims: dict[tuple[str, bool], np.ndarray]
    rates_flop_per_s: dict[tuple[str, bool], np.ndarray]

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


def _body(name: str) -> tuple[dict, str]:
    """The table's data mapping and its label (the measured set's name: a `same_as` file takes that
    set's table, `profiles.tables.kernel_table`)."""
    from profiles.tables import kernel_table

    data = kernel_table("attention", name)
    if data is None:
        return {}, ""
    return data, str(data.get("alias_of", name))


@lru_cache(maxsize=None)
def attention_table(name: str | None) -> AttentionTable | None:
    """The parsed attention table of table set `name` (cached: one parse per set), or None when it has none."""
    from planner.errors import SpecError

    if not name:
        return None
    data, label = _body(name)
    if not data:
        return None
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
    return AttentionTable(name, np.log2(seq), dims, grids)


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
    table = attention_table(gpu.kernel_tables)
    if table is None:
        return None
    core = att.core(x)
    s, keys, cp = x.seq_len, x.keys(att.window), np.asarray(x.cp, dtype=float)
    d = _head_dim(att)
    hbm = gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency
    overhead = core.num_kernels * gpu.kernel_overhead_s
    if keys < s:  # causal sliding window: one banded, unmasked-rate call per window
        credited = core.flop * (1 - keys / (2 * s))
        fwd = credited / table.rate("fwd", False, d, np.full(np.shape(cp), float(keys)))
        bwd = BACKWARD_FLOP_RATIO * credited / table.rate("bwd", False, d, np.full(np.shape(cp), float(keys)))
    else:  # global causal: 1/cp of the work in the diagonal causal call, the rest unmasked, calls of s/cp tokens
        credited, call = core.flop / 2, s / cp

        def seconds(direction: str) -> np.ndarray:
            return (credited / cp / table.rate(direction, True, d, call)
                    + credited * (1 - 1 / cp) / table.rate(direction, False, d, call))

        fwd, bwd = seconds("fwd"), BACKWARD_FLOP_RATIO * seconds("bwd")
    return (np.maximum(fwd, core.bytes / hbm) + overhead,
            np.maximum(bwd, 2 * core.bytes / hbm) + overhead)
