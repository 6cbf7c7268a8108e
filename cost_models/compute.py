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
from cost_models.blocks import (DenseMLP, Gemm, Head, LatentAttention, Layer, Micro, ModelBlocks, MoE, Norm,
                                 gated_activation)
from cost_models.elementwise import EXPERT_KERNELS, elementwise_model, fp8_cast_launches, layer_kernels
from cost_models.units import ACTIVATION_BYTES, FP8, QUANTISED_PRECISIONS, WEIGHT_BYTES

if TYPE_CHECKING:  # specs are read by attribute only; no import of the planner package at run time
    from planner.specs import GpuSpec

#: An element-wise backward reads the incoming gradient and the saved input and
#: writes one gradient: three tensors against the forward's two.
BACKWARD_ELEMENTWISE_FACTOR = 3 / 2

#: Streams Transformer Engine's grouped linear spreads its per-expert cuBLAS GEMMs over
#: (transformer_engine/common/util/multi_stream.cpp, `num_compute_streams = 4`; the GEMMs are
#: issued round-robin by `multi_stream_cublas_gemm` in gemm/cublaslt_gemm.cu, the path Megatron's
#: TEGroupedMLP takes unless CUTLASS grouped GEMM is switched on for Hopper BF16). Checked against Transformer
#: Engine's published H100 benchmark of that path (PR 2045, TE 2.7: 628 and 554 TFLOP/s for 8 x 4096 and
#: 16 x 2048 rows, n 768, k 2048; tests/test_moe_cost.py), which the model meets within 10 %.
GROUPED_GEMM_STREAMS = 4

#: FP8 training (Transformer Engine's recipe) runs the transformer-layer linear GEMMs in FP8
#: but keeps the attention core and the output (vocabulary) layer in BF16.
UNQUANTISED = {"fp8": "bf16", "nvfp4": "bf16", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclass
class LayerTimes:
    """Seconds for one layer and one micro-batch on one rank (arrays over candidates)."""

    fwd_s: np.ndarray  # GEMMs + attention core + element-wise, forward
    bwd_s: np.ndarray  # backward: backward_gemm_ratio × the GEMM time, 1.5× the element-wise traffic
    attn_core_fwd_s: np.ndarray  # the part selective recompute repeats
    fwd_flop: np.ndarray  # model FLOPs, forward, per rank
    attn_core_flop: np.ndarray
    shared_expert_fwd_s: np.ndarray  # MoE: the shared experts' forward GEMMs (what can hide the dispatch)


def gemm_time(g: Gemm, gpu: GpuSpec, precision: str, recipe: str | None = None) -> np.ndarray:
    """Roofline time of one GEMM, seconds, plus the kernel overhead. Non-quantised GEMMs
    run at the unquantised precision's peak under FP8 training. The achieved fraction of the
    peak is the GPU's measured table at this shape (`profiles.gemm.GemmTable`, `gpu.tables.gemm`) where it has one
    (a quantised GEMM at FP8 `recipe`'s rate, `GemmTable.recipe_rate`), else its calibrated
    `gemm_efficiency`.

    An 8192³ bf16 GEMM is compute-bound: 2·8192³ FLOP at 312 TFLOP/s · 0.65, plus 5 µs.

    >>> from types import SimpleNamespace as S
    >>> a100 = S(peak=lambda p: 312e12, gemm_efficiency=0.65, hbm_bw_bytes_per_s=2.039e12, hbm_efficiency=0.9,
    ...          kernel_overhead_s=5e-6, tables=S(gemm=None))
    >>> n = 8192
    >>> round(float(gemm_time(Gemm(2 * n**3, n, n, n), a100, "bf16")) * 1e3, 3)  # ms
    5.427
    """
    prec = precision if g.quantised else UNQUANTISED[precision]
    if not g.grouped:
        efficiency = gemm_efficiency(g.m, g.n, g.k, gpu, prec, recipe)
    elif _has_table(gpu, prec):
        # Transformer Engine's grouped linear launches one GEMM per local expert, round-robin over
        # GROUPED_GEMM_STREAMS streams: at most that many experts' tiles share the GPU's waves,
        # so it runs like one GEMM that many experts tall, at the measured efficiency of that shape
        rows = g.m * np.minimum(g.count, GROUPED_GEMM_STREAMS)
        efficiency = gemm_efficiency(rows, g.n, g.k, gpu, prec, recipe)
    else:  # a calibrated GPU: one kernel over all experts, at the profile's grouped-GEMM efficiency
        efficiency = gemm_efficiency(g.m * g.count, g.n, g.k, gpu, prec) * gpu.grouped_gemm_efficiency
    compute = g.flop / (gpu.peak(prec) * efficiency)
    traffic = (g.count * WEIGHT_BYTES[prec] * (g.m * g.k + g.k * g.n + g.m * g.n)
               / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency))
    return np.maximum(compute, traffic) + gpu.kernel_overhead_s


def _has_table(gpu: GpuSpec, precision: str) -> bool:
    """Whether `gpu` has a measured GEMM table for `precision` (`gpu.tables.gemm`)."""
    table = gpu.tables.gemm
    return table is not None and table.has(precision)


def gemm_efficiency(m, n, k, gpu: GpuSpec, precision: str, recipe: str | None = None):
    """Achieved fraction of `precision`'s dense peak for an (m, n, k) GEMM on `gpu` (FP8: under `recipe`)."""
    if _has_table(gpu, precision):
        return gpu.tables.gemm.efficiency(m, n, k, precision, recipe) * gpu.sustained_compute_fraction
    return gpu.gemm_efficiency


def gemm_backward_time(g: Gemm, gpu: GpuSpec, precision: str, recipe: str | None = None,
                       frozen: bool = False) -> np.ndarray:
    """Backward of one GEMM: the input gradient (m×n)·(n×k) and the weight gradient (k×m)·(m×n),
    each as many FLOPs as the forward, timed at their own shapes on a GPU with a GEMM table; on
    one without, `backward_gemm_ratio` times the forward (the calibrated ratio). A `frozen` weight
    (fine-tuning adapters over a frozen base, cost_models.finetune) has no weight gradient: the input
    gradient only (half the calibrated ratio without a table)."""
    prec = precision if g.quantised else UNQUANTISED[precision]
    if not _has_table(gpu, prec):
        return (0.5 if frozen else 1.0) * gpu.backward_gemm_ratio * gemm_time(g, gpu, precision, recipe)
    dgrad = Gemm(g.flop, g.m, g.k, g.n, g.quantised, g.count, g.grouped)
    if frozen:
        return gemm_time(dgrad, gpu, precision, recipe)
    wgrad = Gemm(g.flop, g.k, g.n, g.m, g.quantised, g.count, g.grouped)
    return gemm_time(dgrad, gpu, precision, recipe) + gemm_time(wgrad, gpu, precision, recipe)


def _layer_times(layer: Layer, x: Micro, gpu: GpuSpec) -> LayerTimes:
    prec = x.precision
    hbm = gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency
    gemms = layer.gemms(x)
    gemm_ts = [gemm_time(g, gpu, prec, x.fp8_recipe) for g in gemms]
    gemm_s = sum(gemm_ts)
    gemm_bwd_s = sum(gemm_backward_time(g, gpu, prec, x.fp8_recipe, x.frozen_base) for g in gemms)
    core = layer.core(x)
    att = layer.attention()
    # measured fused-attention throughput, if the GPU has a table
    flash = flash_core_times(att, x, gpu) if att is not None else None
    scan_s = scan_bwd_s = ZERO_S
    if layer.mamba() is not None:  # a Mamba layer's SSD scan: not attention, not repeated by selective recompute
        scan_s, scan_bwd_s = ssd_scan_times(core, gpu, prec)
        core_s = core_bwd_s = ZERO_S
    elif flash is None:
        core_s = (np.maximum(core.flop / (gpu.peak(UNQUANTISED[prec]) * gpu.gemm_efficiency), core.bytes / hbm)
                  + core.num_kernels * gpu.kernel_overhead_s)
        core_bwd_s = gpu.backward_gemm_ratio * core_s
    else:
        core_s, core_bwd_s = flash
    softmax_s = core.softmax_bytes / hbm + core.softmax_kernels * gpu.kernel_overhead_s
    ew = layer.elementwise(x)
    table = elementwise_model(gpu)
    if table is None:  # no element-wise table: the calibrated constants
        # FP8: every quantised GEMM's input is cast (read 16-bit, write 8-bit); weights are cast once
        # per step (Transformer Engine caches them across micro-batches), which is not counted here.
        casts = sum((ACTIVATION_BYTES[prec] + FP8) * g.m * g.k for g in gemms if g.quantised) if prec == "fp8" else 0.0
        ew_fwd = (ew.bytes + casts) / hbm + ew.num_kernels * gpu.kernel_overhead_s
        ew_bwd = BACKWARD_ELEMENTWISE_FACTOR * ew_fwd
    else:  # measured bandwidth, size curve and FP8 recipe (cost_models.elementwise)
        ew_fwd, ew_bwd, ew_kernels = table.layer_s(ew, gemms, x, BACKWARD_ELEMENTWISE_FACTOR)
    fwd = gemm_s + core_s + scan_s + softmax_s + ew_fwd
    bwd = gemm_bwd_s + core_bwd_s + scan_bwd_s + BACKWARD_ELEMENTWISE_FACTOR * softmax_s + ew_bwd
    moe = layer.moe()
    if table is not None:  # the host issues every kernel: a layer is never faster than that
        table = table.host_scaled(gpu.host_time_scale)  # the fitted host speed (x86 DGX hosts), 1 elsewhere
        tp_exchanges = sum(c.tp_exchanges for c in layer.comms(x))
        local_experts = moe.num_experts / x.ep if moe else 0
        kernels = ew_kernels + layer_kernels(gemms, core, x, tp_exchanges)
        captured, captured_ops, graphs = graph_captured_kernels(layer, x, kernels)
        if moe and x.framework == "megatron":  # Megatron-core's MoELayer: a host wait in its dispatcher,
            experts_s = sum(t for g, t in zip(gemms, gemm_ts) if g.grouped)  # counted ops for alltoall
            # the experts' FP8 casts are issued after the wait, with their GEMMs
            casts = (fp8_cast_launches(gemms, x.fp8_recipe, grouped=True, host=True)
                     if prec in QUANTISED_PRECISIONS else 0)
            fwd, bwd = table.moe_host_floor(fwd, bwd, kernels, local_experts, experts_s,
                                            counted=x.moe_dispatcher == "alltoall",
                                            expert_kernels=EXPERT_KERNELS + casts, captured=captured,
                                            captured_ops=captured_ops, graphs=graphs)
        else:
            fwd, bwd = table.host_floor(fwd, bwd, kernels, local_experts, captured=captured, graphs=graphs)
    shared_s = sum((gemm_time(g, gpu, prec, x.fp8_recipe) for g in moe.shared_gemms(x)), ZERO_S) if moe else ZERO_S
    return LayerTimes(fwd_s=fwd, bwd_s=bwd, attn_core_fwd_s=core_s + softmax_s,
                      fwd_flop=sum(g.flop for g in gemms) + core.flop,
                      attn_core_flop=core.flop if att is not None else ZERO_S,
                      shared_expert_fwd_s=shared_s)


ZERO_S = np.zeros(())

#: Router operations a `moe_router` CUDA graph captures without `moe_preprocess`: the router's GEMM and its
#: score and top-k kernel. ASSUMED from the router's structure (TopKRouter: the gating linear, then one fused
#: score/top-k function), not counted on the installed code.
ROUTER_GRAPH_KERNELS = 2


def graph_captured_kernels(layer, x: Micro, kernels) -> tuple[np.ndarray | int, int, int]:
    """(forward kernels of the idealised count that CUDA graphs capture, counted router and dispatcher
    operations they capture, graph launches a direction) of one layer under `x.cuda_graph`
    (cost_models.blocks.graph_scopes): the host issues one launch per captured graph instead of their kernels.

    A transformer layer's attention part is its first three blocks (norm, attention, residual: megatron-core's
    `attn` scope) with the attention core and its tensor-parallel exchange; the rest (norm, MLP or MoE,
    residual) is the `mlp` scope of a dense layer. In an MoE layer `moe_router` captures the pre-MLP norm and
    the router (`ROUTER_GRAPH_KERNELS` of its operations) and `moe_preprocess` the dispatcher's operations before
    its host wait; the experts after the wait are never captured (dropless). `full_iteration` captures every
    kernel (one launch a step, not counted)."""
    scopes = x.cuda_graph
    if not scopes:
        return 0, 0, 0
    if "full_iteration" in scopes:
        return kernels, 10**9, 0
    blocks = layer.blocks
    if layer.attention() is None or len(blocks) != 6:  # not a transformer layer: nothing modelled is captured
        return 0, 0, 0
    tp_comm = np.where(np.asarray(x.tp) > 1, np.where(x.sequence_parallel, 2, 1), 0)
    core = layer.core(x)

    def count(parts) -> int:
        return sum(len(b.gemms(x)) + np.asarray(b.elementwise(x).num_kernels) for b in parts)

    captured, ops, graphs = 0, 0, 0
    if "attn" in scopes:
        captured = captured + count(blocks[:3]) + core.num_kernels + core.softmax_kernels + tp_comm
        graphs += 1
    if layer.is_moe:
        if "moe_router" in scopes:
            captured = captured + count(blocks[3:4])  # the pre-MLP norm
            ops = 10**9 if "moe_preprocess" in scopes else ROUTER_GRAPH_KERNELS  # capped at the layer's own
            graphs += 1
    elif "mlp" in scopes:
        captured = captured + count(blocks[3:]) + tp_comm
        graphs += 1
    return np.minimum(captured, kernels), ops, graphs


#: Achieved fraction of the 16-bit tensor-core peak of the SSD scan's matrix work (Mamba-2's chunked kernels in
#: mamba_ssm, ops/triton/ssd_*.py). ASSUMED, not measured here: the Mamba-2 paper (Dao & Gu 2024, Sec. 9.3,
#: Fig. 10, A100) reports SSD on par with FlashAttention-2 at 2K tokens and faster beyond, for state 64 and head
#: dim 64; with FlashAttention-2's ~50-70 % of peak there and SSD's FLOPs a few times smaller than attention's at
#: 2K, SSD's small per-chunk GEMMs (Q x N and Q x P tiles) run at about a quarter of the peak. The kernels are
#: often bound by their bytes instead (`Mamba.core`), which the roofline takes.
SSD_FLOP_EFFICIENCY = 0.25
#: Backward over forward time of the SSD scan. ASSUMED: the Triton backward recomputes the chunk states and runs
#: about twice the forward's FLOPs in more kernels; FlashAttention's 2.5 convention (attention_kernels.py) is used.
SSD_BACKWARD_FACTOR = 2.5


def ssd_scan_times(core, gpu: GpuSpec, precision: str) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of a Mamba layer's conv and SSD scan (`Mamba.core`): a roofline of its FLOPs at
    `SSD_FLOP_EFFICIENCY` of the 16-bit peak and its bytes at the GPU's HBM rate, plus its kernels' fixed cost.
    The scan never runs in FP8.

    >>> from types import SimpleNamespace as S
    >>> from cost_models.blocks import Core
    >>> h100 = S(peak=lambda p: 989e12, hbm_bw_bytes_per_s=3.35e12, hbm_efficiency=0.9, kernel_overhead_s=5e-6)
    >>> fwd, bwd = ssd_scan_times(Core(np.array(1e12), np.array(1e9), 6, ZERO_S, 0), h100, "bf16")
    >>> round(float(fwd) * 1e3, 2), round(float(bwd / fwd), 1)  # ms: compute-bound, 1 TFLOP at 247 TFLOP/s
    (4.07, 2.5)
    """
    hbm = gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency
    fwd = (np.maximum(core.flop / (gpu.peak(UNQUANTISED[precision]) * SSD_FLOP_EFFICIENCY), core.bytes / hbm)
           + core.num_kernels * gpu.kernel_overhead_s)
    return fwd, SSD_BACKWARD_FACTOR * fwd
LAYER_FIELDS = ("fwd_s", "bwd_s", "attn_core_fwd_s", "fwd_flop", "attn_core_flop", "shared_expert_fwd_s")


def layer_times(blocks: ModelBlocks, x: Micro, gpu: GpuSpec) -> LayerTimes:
    """Times of every layer kind on one rank: each field is a (K, N) array, one row per kind of
    `blocks.all_kinds` (the main stack's kinds, then the MTP module's). Computed once per distinct
    micro-batch shape (`Micro.distinct`)."""
    small, index = x.distinct
    if index is not None:
        lt = layer_times(blocks, small, gpu)
        return LayerTimes(**{f: getattr(lt, f)[:, index] for f in LAYER_FIELDS})
    kinds = [_layer_times(layer, x, gpu) for layer in blocks.all_kinds]
    n = len(x.micro_batch_size) if np.ndim(x.micro_batch_size) else 1
    return LayerTimes(**{f: np.stack([np.broadcast_to(getattr(t, f), (n,)) for t in kinds]) for f in LAYER_FIELDS})


def head_times(head: Head, x: Micro, gpu: GpuSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Output layer + cross-entropy on the last stage, one micro-batch: (fwd_s, bwd_s, fwd_flop)."""
    small, index = x.distinct
    if index is not None:
        return tuple(_expand(v, index) for v in head_times(head, small, gpu))
    (g,) = head.gemms(x)
    gemm_s = gemm_time(g, gpu, x.precision, x.fp8_recipe)
    table = elementwise_model(gpu)
    if table is not None:  # measured bandwidth; fused or unfused cross-entropy (Head.loss_bytes)
        norm = head.norm.elementwise(x)
        loss_fwd, loss_bwd, fwd_kernels, bwd_kernels = head.loss_bytes(x)
        fwd = gemm_s + table.time_s(norm.bytes + loss_fwd, norm.num_kernels + fwd_kernels)
        bwd = (gemm_backward_time(g, gpu, x.precision, x.fp8_recipe, x.frozen_base)
               + table.time_s(BACKWARD_ELEMENTWISE_FACTOR * norm.bytes + loss_bwd, norm.num_kernels + bwd_kernels))
        return fwd, bwd, g.flop
    ew = head.elementwise(x)
    loss_s = ew.bytes / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency)
    overhead = ew.num_kernels * gpu.kernel_overhead_s
    fwd = gemm_s + loss_s + overhead
    bwd = (gemm_backward_time(g, gpu, x.precision, x.fp8_recipe, x.frozen_base)
           + BACKWARD_ELEMENTWISE_FACTOR * loss_s + overhead)
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
        return sum((gemm_time(g, gpu, prec, x.fp8_recipe) for g in gs), ZERO_S)

    table = elementwise_model(gpu)

    def ew_s(e) -> np.ndarray:
        if table is not None:
            return table.time_s(e.bytes, e.num_kernels)
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
                act_bytes = gated_activation(b.gated, x)[0] * b.routed_tokens(x) * b.ffn / x.etp
                clamp = b.clamp_elementwise(x)  # megatron-core's clamp runs inside the recomputed function
                out["moe_act"] = (act_bytes + clamp.bytes) / hbm + (1 + clamp.num_kernels) * gpu.kernel_overhead_s
            if "shared_experts" in out and b.shared:
                out["shared_experts"] = gemms_s(b.shared_gemms(x)) + ew_s(b.shared.elementwise(x))
            if "moe" in out:
                out["moe"] = gemms_s(b.gemms(x)) + ew_s(b.elementwise(x))
    return out


def _expand(v, index: np.ndarray):
    """A per-distinct-shape array back to one value per candidate (scalars stay)."""
    v = np.asarray(v)
    return v[index] if v.ndim else v


def selective_recompute_s(layer: Layer, x: Micro, gpu: GpuSpec, core_s: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Forward time selective recompute repeats for the modules in `mask` (see `selected_modules`)."""
    selected = selected_modules(mask)
    small, index = x.distinct
    parts = module_times(layer, small, gpu, core_s, tuple(selected))
    if index is not None:
        parts = {m: (core_s if m == "core_attn" else _expand(v, index)) for m, v in parts.items()}
    return sum((np.where(on, parts[m], 0.0) for m, on in selected.items()), ZERO_S)
