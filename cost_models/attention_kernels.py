"""Fused (flash) attention: the attention core's forward and backward seconds from measured kernel throughput.

A GPU whose table set (`GpuSpec.kernel_tables`) has an `attention` table (`profiles/kernels/attention/<name>.yaml`,
parsed by `profiles.attention` into the `AttentionTable`s the GPU carries, `GpuSpec.tables.attention`) times the attention core (QKᵀ, softmax, PV, one fused kernel per direction) from the achieved TFLOP/s published for
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

from typing import TYPE_CHECKING

import numpy as np

from profiles.attention import AttentionTable

if TYPE_CHECKING:  # read by attribute only
    from cost_models.blocks import Attention, LatentAttention, Micro
    from planner.specs import GpuSpec

#: FlashAttention's backward FLOP convention: 2.5 × the forward (benchmark_flash_attention.py `flops()`).
BACKWARD_FLOP_RATIO = 2.5
#: The core runs in 16-bit under these training precisions (FP8 training keeps attention in BF16, as the
#: GEMM model does: `cost_models.compute.UNQUANTISED`); fp32 has no table.
SIXTEEN_BIT_CORE = ("bf16", "fp16", "fp8")


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
    tables = gpu.tables.attention
    if not tables:
        if kernel in ROOFLINE_KERNELS:
            return None
        return (f"attention_kernel {kernel!r} on {gpu.name}: no attention table measures that kernel there and its "
                f"fitted roofline times {' and '.join(ROOFLINE_KERNELS)} only; use one of those, or measure the GPU "
                "with meshplan profile")
    table = tables.get(kernel)
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
    table: AttentionTable | None = gpu.tables.attention.get(x.attention_kernel)
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
