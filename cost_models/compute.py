"""Compute: the time a block's FLOPs and bytes take on one GPU.

FLOPs come from the blocks (`cost_models.blocks`): for GPT shapes a layer's forward
is Korthikanti Eq. 7's 24sbh² + 4s²bh (the `1 + s/(6h)` factor). Backward is twice
the forward in FLOPs; its GEMMs take `gpu.backward_gemm_ratio` times the forward GEMM
time (fitted per GPU, 2.0 where nothing was fitted), and its element-wise kernels move
`BACKWARD_ELEMENTWISE_FACTOR` times the forward's bytes. Full recompute adds a
forward, selective recompute the attention-core forward (Korthikanti Eq. 8).

Time: each GEMM is a roofline, max(FLOP ÷ (peak · gemm_efficiency), bytes ÷
(HBM · hbm_efficiency)), plus a fixed per-kernel cost; element-wise kernels move
their bytes at HBM · hbm_efficiency. The efficiencies and the kernel cost come from
the GPU profile (`profiles/`), never from this file. A GPU with an attention kernel table
times the fused attention core from it instead (`cost_models.attention_kernels`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

import numpy as np

from cost_models.arrays import RECOMPUTE_MODULES, selected_modules
from cost_models.attention_kernels import flash_core_times
from cost_models.blocks import DenseMLP, Gemm, Head, LatentAttention, Layer, Micro, ModelBlocks, MoE, Norm
from cost_models.units import ACTIVATION_BYTES, FP8, WEIGHT_BYTES

if TYPE_CHECKING:  # specs are read by attribute only; no import of the planner package at run time
    from planner.specs import GpuSpec

#: An element-wise backward reads the incoming gradient and the saved input and
#: writes one gradient: three tensors against the forward's two.
BACKWARD_ELEMENTWISE_FACTOR = 3 / 2

#: FP8 training (Transformer Engine's recipe) runs the transformer-layer linear GEMMs in FP8
#: but keeps the attention core and the output (vocabulary) layer in BF16.
UNQUANTISED = {"fp8": "bf16", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclass
class LayerTimes:
    """Seconds for one layer and one micro-batch on one rank (arrays over candidates)."""

    fwd_s: np.ndarray  # GEMMs + attention core + element-wise, forward
    bwd_s: np.ndarray  # backward: backward_gemm_ratio × the GEMM time, 1.5× the element-wise traffic
    attn_core_fwd_s: np.ndarray  # the part selective recompute repeats
    fwd_flop: np.ndarray  # model FLOPs, forward, per rank
    attn_core_flop: np.ndarray
    shared_expert_fwd_s: np.ndarray  # MoE: the shared experts' forward GEMMs (what can hide the dispatch)


def gemm_time(g: Gemm, gpu: GpuSpec, precision: str) -> np.ndarray:
    """Roofline time of one GEMM, seconds, plus the kernel overhead. Non-quantised GEMMs
    run at the unquantised precision's peak under FP8 training.

    An 8192³ bf16 GEMM is compute-bound: 2·8192³ FLOP at 312 TFLOP/s · 0.65, plus 5 µs.

    >>> from types import SimpleNamespace as S
    >>> a100 = S(peak=lambda p: 312e12, gemm_efficiency=0.65, hbm_bw_bytes_per_s=2.039e12, hbm_efficiency=0.9,
    ...          kernel_overhead_s=5e-6)
    >>> n = 8192
    >>> round(float(gemm_time(Gemm(2 * n**3, n, n, n), a100, "bf16")) * 1e3, 3)  # ms
    5.427
    """
    prec = precision if g.quantised else UNQUANTISED[precision]
    efficiency = gpu.gemm_efficiency * (gpu.grouped_gemm_efficiency if g.grouped else 1.0)
    compute = g.flop / (gpu.peak(prec) * efficiency)
    traffic = (g.count * WEIGHT_BYTES[prec] * (g.m * g.k + g.k * g.n + g.m * g.n)
               / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency))
    return np.maximum(compute, traffic) + gpu.kernel_overhead_s


def _layer_times(layer: Layer, x: Micro, gpu: GpuSpec) -> LayerTimes:
    prec = x.precision
    hbm = gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency
    gemms = layer.gemms(x)
    gemm_s = sum(gemm_time(g, gpu, prec) for g in gemms)
    core = layer.attention().core(x)
    flash = flash_core_times(layer.attention(), x, gpu)  # measured fused-attention throughput, if the GPU has a table
    if flash is None:
        core_s = (np.maximum(core.flop / (gpu.peak(UNQUANTISED[prec]) * gpu.gemm_efficiency), core.bytes / hbm)
                  + core.num_kernels * gpu.kernel_overhead_s)
        core_bwd_s = gpu.backward_gemm_ratio * core_s
    else:
        core_s, core_bwd_s = flash
    softmax_s = core.softmax_bytes / hbm + core.softmax_kernels * gpu.kernel_overhead_s
    ew = layer.elementwise(x)
    # FP8: every quantised GEMM's input is cast (read 16-bit, write 8-bit); weights are cast once
    # per step (Transformer Engine caches them across micro-batches), which is not counted here.
    casts = sum((ACTIVATION_BYTES[prec] + FP8) * g.m * g.k for g in gemms if g.quantised) if prec == "fp8" else 0.0
    elementwise_s = (ew.bytes + casts) / hbm + ew.num_kernels * gpu.kernel_overhead_s
    fwd = gemm_s + core_s + softmax_s + elementwise_s
    bwd = gpu.backward_gemm_ratio * gemm_s + core_bwd_s + BACKWARD_ELEMENTWISE_FACTOR * (softmax_s + elementwise_s)
    moe = layer.moe()
    shared_s = sum((gemm_time(g, gpu, prec) for g in moe.shared_gemms(x)), ZERO_S) if moe else ZERO_S
    return LayerTimes(fwd_s=fwd, bwd_s=bwd, attn_core_fwd_s=core_s + softmax_s,
                      fwd_flop=sum(g.flop for g in gemms) + core.flop, attn_core_flop=core.flop,
                      shared_expert_fwd_s=shared_s)


ZERO_S = np.zeros(())
LAYER_FIELDS = ("fwd_s", "bwd_s", "attn_core_fwd_s", "fwd_flop", "attn_core_flop", "shared_expert_fwd_s")


def layer_times(blocks: ModelBlocks, x: Micro, gpu: GpuSpec) -> LayerTimes:
    """Times of every layer kind on one rank: each field is a (K, N) array, one row per kind of
    `blocks.all_kinds` (the main stack's kinds, then the MTP module's)."""
    kinds = [_layer_times(layer, x, gpu) for layer in blocks.all_kinds]
    n = len(x.micro_batch_size) if np.ndim(x.micro_batch_size) else 1
    return LayerTimes(**{f: np.stack([np.broadcast_to(getattr(t, f), (n,)) for t in kinds]) for f in LAYER_FIELDS})


def head_times(head: Head, x: Micro, gpu: GpuSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Output layer + cross-entropy on the last stage, one micro-batch: (fwd_s, bwd_s, fwd_flop)."""
    (g,) = head.gemms(x)
    gemm_s = gemm_time(g, gpu, x.precision)
    ew = head.elementwise(x)
    loss_s = ew.bytes / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency)
    overhead = ew.num_kernels * gpu.kernel_overhead_s
    fwd = gemm_s + loss_s + overhead
    bwd = gpu.backward_gemm_ratio * gemm_s + BACKWARD_ELEMENTWISE_FACTOR * loss_s + overhead
    return fwd, bwd, g.flop


def module_times(layer: Layer, x: Micro, gpu: GpuSpec, core_s: np.ndarray,
                 modules=RECOMPUTE_MODULES) -> dict[str, np.ndarray]:
    """Forward seconds of each of `modules` (parts Megatron's `--recompute-modules` can repeat
    in backward; see `cost_models.memory.module_activation_bytes` for what each drops);
    `core_s` is the layer's attention-core time. MoE's all-to-all, which `moe` also repeats,
    is the step model's to add."""
    prec = x.precision
    hbm = gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency

    def gemms_s(gs) -> np.ndarray:
        return sum((gemm_time(g, gpu, prec) for g in gs), ZERO_S)

    def ew_s(e) -> np.ndarray:
        return e.bytes / hbm + e.num_kernels * gpu.kernel_overhead_s

    out = {m: ZERO_S for m in modules}
    if "core_attn" in out:
        out["core_attn"] = core_s
    if "layernorm" in out:
        out["layernorm"] = sum((ew_s(b.elementwise(x)) for b in layer.blocks if isinstance(b, Norm)), ZERO_S)
    att = layer.attention()
    if "mla_up_proj" in out and isinstance(att, LatentAttention):
        out["mla_up_proj"] = gemms_s(att.up_gemms(x))
    for b in layer.blocks:
        if "mlp" in out and isinstance(b, DenseMLP):
            out["mlp"] = gemms_s(b.gemms(x)) + ew_s(b.elementwise(x))
        elif isinstance(b, MoE):
            if "moe_act" in out:
                act_bytes = (3 if b.gated else 2) * x.act * b.routed_tokens(x) * b.ffn / x.etp
                out["moe_act"] = act_bytes / hbm + gpu.kernel_overhead_s
            if "shared_experts" in out and b.shared:
                out["shared_experts"] = gemms_s(b.shared_gemms(x)) + ew_s(b.shared.elementwise(x))
            if "moe" in out:
                out["moe"] = gemms_s(b.gemms(x)) + ew_s(b.elementwise(x))
    return out


def selective_recompute_s(layer: Layer, x: Micro, gpu: GpuSpec, core_s: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Forward time selective recompute repeats for the modules in `mask` (see `selected_modules`)."""
    selected = selected_modules(mask)
    parts = module_times(layer, x, gpu, core_s, tuple(selected))
    return sum((np.where(on, parts[m], 0.0) for m, on in selected.items()), ZERO_S)
