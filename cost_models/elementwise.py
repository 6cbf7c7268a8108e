"""Everything that is not a GEMM or the attention core: element-wise, norm and loss kernels, FP8
quantisation, the optimizer step, and the host's cost of issuing kernels.

Data: the GPU's `elementwise` kernel table (`profiles/kernels/elementwise/<set>.yaml`, a
`profiles.elementwise.ElementwiseTable` the GPU carries, `GpuSpec.tables`), made the GPU's model by
`elementwise_model`. A GPU without one keeps the calibrated constants of its profile
(`hbm_efficiency`, `kernel_overhead_s`) and the formulas in `cost_models.compute` untouched.

Model (symbols: B = bytes a kernel moves, f = the table's `hbm_fraction`, W = peak HBM bandwidth,
t0 = `kernel_fixed_us`, h = `host_per_kernel_us`, n = kernels of a layer's forward, r =
`backward_kernels_per_forward`):

- a memory-bound kernel takes B / (f·W) + t0 on the GPU: small tensors reach less of the bandwidth
  (a 10 MB kernel on H100 runs at 55 % of the large-tensor rate) — the size curve;
- the CPU issues a layer's forward in n·h and its backward in r·n·h; it runs ahead of the GPU, so a
  layer takes max(GPU time, host time) (`host_floor`): this floor binds for small models and small
  micro-batches, where the GPU work per kernel is shorter than its issue cost; a grouped expert MLP
  adds `host_per_expert_forward_us` (backward: `host_per_expert_backward_us`) of host set-up per
  local expert (buffers, pointers and quantizers per expert), which is what makes fine-grained MoE
  layers with many local experts host-bound;
- Transformer Engine's grouped linear (the `GroupedLinear` Megatron's TEGroupedMLP runs) issues one
  cuBLASLt GEMM per local expert, round-robin over its compute streams: each costs the host
  `host_per_expert_gemm_us` beyond the one launch a grouped GEMM is counted as, two per expert in the
  forward (fc1, fc2) and four in the backward (their input and weight gradients)
  (`EXPERT_GEMMS_FORWARD`, `EXPERT_GEMMS_BACKWARD`; Megatron-core's layer only, `moe_host_floor`);
- Megatron-core's MoE layer (`moe_host_floor`, the megatron framework): with the alltoall dispatcher
  its router and token dispatcher issue the operations `benchmarks/host_ops.py` counts on the
  installed code (`moe_host_ops`: before the host's wait on the token counts, after it, backward),
  in place of the four idealised kernels the layer's count gives them (`ROUTING_KERNELS`); and every
  dropless dispatcher (alltoall, DeepEP, HybridEP) waits on the host for the token counts once per
  forward, so the two parts of the forward each take their own max (`synced_forward_s`);
- FP8 (Transformer Engine recipes, Megatron-LM `--fp8-recipe`): the input of every quantised GEMM is
  cast in the forward and its output gradient in the backward (`fp8_cast_bytes_per_element`); the
  weights are cast once per step (Transformer Engine caches them across micro-batches,
  `is_first_microbatch`); Hopper needs a transposed copy of each cast tensor, block-scaled recipes a
  second, column-wise quantised copy and their scales;
- the optimizer step streams its bytes per parameter at `optimizer_hbm_fraction`, plus the gradient
  norm (a read of the gradient buffer, for clipping) and the zeroing of the buffer for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from cost_models.units import BF16, FP4, FP32, FP8, QUANTISED_PRECISIONS
from planner.errors import SpecError
from profiles.elementwise import ElementwiseTable, MoeHostOps

if TYPE_CHECKING:
    from cost_models.blocks import Core, Elementwise, Gemm, Micro

E8M0 = 1
E4M3 = 1
#: Elements per scale and bytes per scale of the block-scaled recipes (1x128 tiles of activations
#: and gradients; weights' 128x128 tiles have fewer scales, which is negligible here). NVFP4: 1x16 blocks with
#: an E4M3 scale each (Transformer Engine NVFP4BlockScaling; its per-tensor FP32 scale is one number).
BLOCK_ELEMENTS = {"blockwise": 128, "mxfp8": 32, "nvfp4": 16}
SCALE_BYTES = {"blockwise": FP32, "mxfp8": E8M0, "nvfp4": E4M3}
#: Bytes of one quantised element: FP8, or FP4 E2M1 under NVFP4.
ELEMENT_BYTES = {"nvfp4": FP4}
#: Passes over the 16-bit tensor Transformer Engine's NVFP4 quantiser makes for an activation or a gradient,
#: both of which feed the weight-gradient GEMM through a random Hadamard transform
#: (NVFP4Quantizer::quantize_impl, transformer_engine/pytorch/csrc/quantizer.cpp; NVFP4BlockScaling applies the
#: 16x16 RHT to wgrad inputs): `nvte_hadamard_transform_amax` (the row-wise amax of the input and the
#: column-wise amax after the transform, one read), the row-wise cast (`nvte_quantize_v2`, one read) and the
#: fused transform-and-cast of the column-wise copy (`nvte_hadamard_transform_cast_fusion_columnwise`, one
#: read): three reads, three kernels. The transform's 16-point products and the stochastic rounding of the
#: gradients (Philox numbers drawn inside the cast) are taken to hide under the reads (an assumption: no kernel
#: timing of them was found). Weights (16x16 blocks, no transform) take two: the amax, then one cast writing both
#: copies.
NVFP4_PASSES = 3
NVFP4_WEIGHT_PASSES = 2

#: Passes over the gradient buffer an optimizer step makes besides Adam itself: the global norm for
#: clipping (a read; Megatron's `clip_grad_norm`, multi-tensor L2 norm) and zeroing it for the next
#: step (a write; `zero_grad_buffer`).
GRAD_BUFFER_PASSES = 2

#: Kernels of a MoE layer's idealised count (`layer_kernels` + the element-wise ones) that stand for its
#: router and token dispatcher: the router GEMM (`blocks.MoE.gemms`) and the router, permute and
#: unpermute kernels of `blocks.MoE.elementwise` (its fourth, the experts' activation, stays).
ROUTING_KERNELS = 4
#: Kernels of the routed experts in the idealised count, all issued after the host's wait: the two
#: grouped GEMMs (one launch each, `layer_kernels`) and the activation.
EXPERT_KERNELS = 3
#: cuBLASLt GEMMs Transformer Engine's grouped linear issues per local expert: fc1 and fc2 in the forward,
#: the input and the weight gradient of each in the backward (grouped_linear.py, one call per expert
#: in `general_grouped_gemm`'s multi-stream loop).
EXPERT_GEMMS_FORWARD = 2
EXPERT_GEMMS_BACKWARD = 4


def synced_forward_s(gpu_before_s, gpu_after_s, host_before_s, host_after_s) -> np.ndarray:
    """Forward seconds of a layer in which the host waits once for the GPU.

    Without a wait the host runs ahead of the GPU (CUDA launches are asynchronous) and a layer takes
    max(GPU, host) over the whole layer: GPU-heavy parts lend the host the time it needs in
    host-heavy ones. Megatron-core's alltoall dispatcher copies the token counts per expert to the
    host (`_maybe_dtoh_and_synchronize`: non-blocking copies at "before_permutation_1", then
    `d2h_event.synchronize()` at the start of `token_dispatch` with ep > 1, as the all-to-all needs
    its split sizes on the host; at ep = 1 before the experts, which need `tokens_per_expert` as a
    list). At that wait the GPU's queue runs empty: the host can issue nothing of the rest of the
    layer before the GPU has finished the part before it, and what the host queued before the wait
    cannot cover the host time after it. The DeepEP and HybridEP dispatchers wait too
    (megatron/core/transformer/moe/fused_a2a.py): DeepEP's dispatch returns the tokens received per
    expert as a host list (`FusedDispatch.forward`), and HybridEP's blocks on its pinned-memory
    counts unless the permuted token count is known in advance, which it is only when dropping and
    padding (`HybridEPDispatch.forward`: `non_blocking = num_permuted_tokens is not None`). So each
    part takes its own max, and the host time of the part after the wait adds to the GPU time of the
    part before it:

        max(GPU before, host before) + max(GPU after, host after)  >=  max(GPU, host).

    (Within a part the host still runs ahead; the launch latency of the first kernel after the wait
    is left out.)

    >>> float(synced_forward_s(3.0, 1.0, 1.0, 2.0))  # layer-wise max(4, 3) = 4
    5.0
    >>> float(synced_forward_s(3.0, 1.0, 1.0, 0.5))  # GPU-bound in both parts: no change
    4.0
    """
    return np.maximum(gpu_before_s, host_before_s) + np.maximum(gpu_after_s, host_after_s)


def fp8_copies(recipe: str, transpose: bool) -> int:
    """FP8 copies of one tensor a recipe keeps: a second (transposed, or column-wise quantised) one where
    the GEMMs need it (Hopper's TN-only FP8 GEMMs; block scales, which run along one dimension)."""
    return 2 if (transpose or recipe in BLOCK_ELEMENTS) else 1


def fp8_cast_bytes_per_element(recipe: str, transpose: bool) -> float:
    """HBM bytes one quantise kernel moves per element of a 16-bit tensor cast to FP8: read the
    bf16 tensor (twice with current scaling: the amax pass, then the cast), write one FP8 copy, a
    second (transposed, or column-wise quantised) copy where the GEMMs need it, and the scales.

    >>> [fp8_cast_bytes_per_element(r, True) for r in ("delayed", "tensorwise")]  # Hopper
    [4, 6]
    >>> fp8_cast_bytes_per_element("delayed", False), fp8_cast_bytes_per_element("mxfp8", False)  # Blackwell
    (3, 4.0625)
    """
    block = BLOCK_ELEMENTS.get(recipe)
    copies = fp8_copies(recipe, transpose)
    amax_pass = BF16 if recipe == "tensorwise" else 0
    scales = copies * SCALE_BYTES[recipe] / block if block else 0
    if recipe == "nvfp4":  # three passes over the input (NVFP4_PASSES), an FP4 row-wise and column-wise copy
        return NVFP4_PASSES * BF16 + copies * FP4 + scales
    return BF16 + amax_pass + copies * FP8 + scales


def nvfp4_weight_cast_bytes_per_element() -> float:
    """HBM bytes per weight element of NVFP4's weight quantisation (16x16 blocks, no Hadamard transform):
    `NVFP4_WEIGHT_PASSES` reads of the bf16 weight, two FP4 copies and their E4M3 scales per 256 elements.

    >>> nvfp4_weight_cast_bytes_per_element()
    5.0078125
    """
    return NVFP4_WEIGHT_PASSES * BF16 + 2 * (FP4 + SCALE_BYTES["nvfp4"] / 256)


def fp8_cast_kernels(recipe: str) -> int:
    """GPU kernels one cast launches. One fused cast(-transpose) kernel, which also records the amax, under
    delayed, block and MXFP8 scaling; current scaling computes the scale from this tensor's own amax first:
    `Float8CurrentScalingQuantizer::quantize_impl` (transformer_engine/pytorch/csrc/quantizer.cpp at v2.9)
    launches `zero_amax_kernel` and `amax_kernel` (nvte_compute_amax, common/recipe/current_scaling.cu),
    `compute_scale_from_amax_kernel` (one thread) and the cast (nvte_quantize_v2): four.

    >>> [fp8_cast_kernels(r) for r in ("delayed", "tensorwise", "blockwise", "mxfp8")]
    [1, 4, 1, 1]
    """
    if recipe == "nvfp4":
        return NVFP4_PASSES
    return 4 if recipe == "tensorwise" else 1


def fp8_cast_launches(gemms: list[Gemm], recipe: str, grouped: bool | None = None,
                      host: bool = False) -> np.ndarray:
    """Cast kernels one direction of a layer launches for its quantised GEMMs (`grouped`: only the grouped
    ones, or only the others; None: all). A grouped GEMM's input is split per local expert, and Transformer
    Engine quantises the splits in one fused launch only under delayed scaling (`split_quantize` ->
    `multi_tensor_quantize_impl`, whose one fused kernel, `nvte_multi_cast_transpose`, serves FP8 delayed
    scaling alone; every other recipe quantises each split apart: transformer_engine/pytorch/csrc/extensions/
    cast.cpp at v2.9), so its casts are `fp8_cast_kernels` per expert on the GPU. With `host` the count is
    of the host's calls instead: one quantize call per quantised GEMM, whose kernels (current scaling's
    four, a grouped GEMM's per-expert casts, from one C++ loop) are launched inside it (the per-expert part
    of their host time is in `host_per_expert_*`, whose measurement includes the quantizers' set-up).

    >>> from cost_models.blocks import Gemm
    >>> fc = Gemm(1.0, 256, 1536, 2048, count=16, grouped=True)
    >>> [int(fp8_cast_launches([fc], r)) for r in ("delayed", "mxfp8", "tensorwise")]
    [1, 16, 64]
    >>> [int(fp8_cast_launches([fc], r, host=True)) for r in ("mxfp8", "tensorwise")]
    [1, 1]
    """
    quantised = [g for g in gemms if g.quantised and (grouped is None or g.grouped == grouped)]
    per_cast = 1 if host else fp8_cast_kernels(recipe)
    split = not host and recipe != "delayed"
    return sum((per_cast * (np.asarray(g.count) if g.grouped and split else 1) for g in quantised), np.zeros(()))


#: GEMMs the backward runs for each forward GEMM (the input gradient and the weight gradient).
BACKWARD_GEMMS = 2


def mxfp8_swizzle_kernels(gemms: list[Gemm]) -> np.ndarray:
    """Scale-swizzle kernels the forward of a layer's quantised GEMMs launches under MXFP8. cuBLAS reads
    MXFP8 block scales in its own tiled layout, and Transformer Engine rearranges both operands' scales
    before every GEMM (transformer_engine/pytorch/csrc/extensions/gemm.cpp at v2.9: `swizzle_scaling_factors`
    of A and of B, one `nvte_swizzle_scaling_factors` kernel each; a grouped GEMM swizzles all its experts'
    scales of one operand in one `multi_tensor_swizzle_scaling_factors` launch): two per GEMM, a grouped
    GEMM's experts together, and `BACKWARD_GEMMS` times as many in the backward. The scales are 1/32 of the
    elements: each kernel costs its launch, not its bytes. They run inside the GEMM's own call, so the host
    issues no extra call for them.

    >>> from cost_models.blocks import Gemm
    >>> int(mxfp8_swizzle_kernels([Gemm(1.0, 256, 1536, 2048), Gemm(1.0, 256, 1536, 2048, count=16, grouped=True)]))
    4
    """
    return 2 * sum((1 if g.grouped else np.asarray(g.count)) for g in gemms if g.quantised)


@dataclass(frozen=True)
class ElementwiseModel:
    """One GPU's element-wise table in SI units (see the module docstring)."""

    name: str
    bw_bytes_per_s: float  # achieved bandwidth of large element-wise kernels, f·W
    kernel_fixed_s: float  # t0
    host_per_kernel_s: float  # h
    backward_kernels_per_forward: float  # r
    optimizer_bw_bytes_per_s: float
    fp8_recipes: tuple[str, ...]
    fp8_transpose: bool
    host_per_expert_fwd_s: float = 0.0  # e_f: host set-up of one local expert in a grouped MLP's forward
    host_per_expert_bwd_s: float = 0.0  # e_b: the same in its backward
    moe_host_ops: MoeHostOps | None = None  # Megatron-core's router and dispatcher, counted
    host_per_expert_gemm_s: float = 0.0  # g: one per-expert cuBLASLt GEMM of the grouped linear

    def host_scaled(self, scale: float) -> "ElementwiseModel":
        """This table with its host-time figures (per kernel, per-expert set-up, per-expert GEMM call) times
        `scale` (a GPU's fitted `host_time_scale`); the GPU-side figures are unchanged.

        >>> m = ElementwiseModel("x", 3e12, 3e-6, 6.5e-6, 2.0, 2.4e12, ("delayed",), True, 6.8e-6, 11.9e-6)
        >>> s = m.host_scaled(2.0)
        >>> round(s.host_per_kernel_s * 1e6, 1), round(s.host_per_expert_bwd_s * 1e6, 1), s.kernel_fixed_s == m.kernel_fixed_s
        (13.0, 23.8, True)
        """
        return _host_scaled(self, float(scale)) if scale != 1 else self

    def time_s(self, nbytes, num_kernels) -> np.ndarray:
        """GPU seconds of `num_kernels` memory-bound kernels moving `nbytes` in all.

        >>> m = ElementwiseModel("x", 3e12, 3e-6, 6.5e-6, 2.0, 2.4e12, ("delayed",), True)
        >>> round(float(m.time_s(10e6, 1)) * 1e6, 2), round(float(m.time_s(1e9, 1)) * 1e6, 1)  # us
        (6.33, 336.3)
        """
        return np.asarray(nbytes) / self.bw_bytes_per_s + np.asarray(num_kernels) * self.kernel_fixed_s

    def check_recipe(self, recipe: str) -> None:
        """Refuse a recipe this GPU's kernels do not run (a SpecError naming the field and the GPU)."""
        if recipe not in self.fp8_recipes:
            raise SpecError(f"fp8_recipe {recipe!r} is not supported on {self.name} (its kernels run "
                            f"{', '.join(self.fp8_recipes)}); mxfp8 needs a Blackwell GPU")

    def fp8_casts(self, gemms: list[Gemm], recipe: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(forward bytes, backward bytes, forward GPU kernels, backward GPU kernels) of the FP8 casts of one
        layer: the input (m×k) of each quantised GEMM in the forward, its output gradient (m×n) in the
        backward; under MXFP8 also the swizzles of the block scales into cuBLAS's layout
        (`mxfp8_swizzle_kernels`)."""
        per_element = fp8_cast_bytes_per_element(recipe, self.fp8_transpose)
        quantised = [g for g in gemms if g.quantised]
        fwd = sum((per_element * g.count * g.m * g.k for g in quantised), np.zeros(()))
        bwd = sum((per_element * g.count * g.m * g.n for g in quantised), np.zeros(()))
        casts = fp8_cast_launches(gemms, recipe)
        swizzles = mxfp8_swizzle_kernels(gemms) if recipe in ("mxfp8", "nvfp4") else 0  # NVFP4's E4M3 scales too
        return fwd, bwd, casts + swizzles, casts + BACKWARD_GEMMS * swizzles

    def fp8_weight_cast_s(self, weight_elements: np.ndarray, recipe: str) -> np.ndarray:
        """Seconds to cast a rank's FP8 (NVFP4) GEMM weights once per step (cached across micro-batches)."""
        per_element = (nvfp4_weight_cast_bytes_per_element() if recipe == "nvfp4"
                       else fp8_cast_bytes_per_element(recipe, self.fp8_transpose))
        return self.time_s(per_element * weight_elements, 0)

    def layer_s(self, ew: Elementwise, gemms: list[Gemm], x: Micro, backward_factor: float
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward s, backward s, forward host calls) of a layer's element-wise kernels and FP8 casts.
        The backward of the element-wise kernels moves `backward_factor` times their forward bytes
        in as many kernels. The GPU times count every cast kernel (a grouped GEMM's per expert); the
        host calls count a grouped GEMM's casts once (`fp8_cast_launches`)."""
        fwd_bytes, bwd_bytes, kernels = ew.bytes, backward_factor * ew.bytes, ew.num_kernels
        cast_kernels = cast_bwd_kernels = cast_calls = 0
        if x.precision in QUANTISED_PRECISIONS:
            self.check_recipe(x.fp8_recipe)
            cast_fwd, cast_bwd, cast_kernels, cast_bwd_kernels = self.fp8_casts(gemms, x.fp8_recipe)
            cast_calls = fp8_cast_launches(gemms, x.fp8_recipe, host=True)
            fwd_bytes, bwd_bytes = fwd_bytes + cast_fwd, bwd_bytes + cast_bwd
        return (self.time_s(fwd_bytes, kernels + cast_kernels), self.time_s(bwd_bytes, kernels + cast_bwd_kernels),
                np.asarray(kernels + cast_calls))

    def host_floor(self, fwd_s: np.ndarray, bwd_s: np.ndarray, fwd_kernels: np.ndarray, local_experts=0,
                   captured=0, graphs: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """A layer's forward and backward seconds once the host's issue time is a floor under them:
        n·h forward and r·n·h backward for its kernels, plus e_f (e_b) per local expert of a
        grouped MLP.

        >>> m = ElementwiseModel("x", 3e12, 3e-6, 6.5e-6, 2.0, 2.4e12, ("delayed",), True, 18.8e-6, 32.8e-6)
        >>> [round(float(t) * 1e6) for t in m.host_floor(np.array(50e-6), np.array(100e-6), np.array(20))]
        [130, 260]
        >>> [round(float(t) * 1e6) for t in m.host_floor(np.array(50e-6), np.array(100e-6), np.array(20), 16)]
        [431, 785]
        """
        # kernels inside CUDA graphs (`captured` of the forward's, their backward too) are issued by `graphs`
        # graph launches a direction instead (`graph_captured_kernels`)
        host_fwd = (fwd_kernels - captured + graphs) * self.host_per_kernel_s
        experts = np.asarray(local_experts)
        return (np.maximum(fwd_s, host_fwd + experts * self.host_per_expert_fwd_s),
                np.maximum(bwd_s, self.backward_kernels_per_forward * host_fwd + experts * self.host_per_expert_bwd_s))

    def moe_host_floor(self, fwd_s: np.ndarray, bwd_s: np.ndarray, fwd_kernels: np.ndarray, local_experts,
                       experts_fwd_s: np.ndarray, counted: bool = True, expert_kernels=EXPERT_KERNELS,
                       captured=0, captured_ops: int = 0, graphs: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """`host_floor` for a Megatron-core MoE layer: with `counted` (the alltoall dispatcher) the
        router and dispatcher issue the counted `moe_host_ops` in place of the `ROUTING_KERNELS` of the
        idealised count (without it, for the DeepEP and HybridEP dispatchers, whose operations were not
        counted, those kernels stay, all before the wait); the forward is `synced_forward_s` of its
        part before the dispatcher's wait and the part after (GPU: the routed experts' GEMMs,
        `experts_fwd_s`; host: the operations after the wait, the experts' kernels (`expert_kernels` of
        `fwd_kernels`: their GEMMs, activation and FP8 casts), their per-expert set-up and the grouped
        linear's per-expert GEMM calls). The backward has no wait
        (the all-to-alls reuse the split sizes already on the host): max(GPU, host) as in `host_floor`.

        >>> ops = MoeHostOps(41, 9, 24)
        >>> m = ElementwiseModel("x", 3e12, 3e-6, 6.5e-6, 2.0, 2.4e12, ("delayed",), True, 18.8e-6, 32.8e-6, ops)
        >>> fwd, bwd = m.moe_host_floor(np.array(800e-6), np.array(1600e-6), np.array(40), 16, np.array(200e-6))
        >>> round(float(fwd) * 1e6), round(float(bwd) * 1e6)  # us: 0.6 ms of GPU, then 0.38 ms of host time
        (979, 1600)
        >>> round(float(m.host_floor(np.array(800e-6), np.array(1600e-6), np.array(40), 16)[0]) * 1e6)  # layer-wise
        800
        """
        h, r = self.host_per_kernel_s, self.backward_kernels_per_forward
        ops = self.moe_host_ops if counted else MoeHostOps(ROUTING_KERNELS, 0, r * ROUTING_KERNELS)
        experts = np.asarray(local_experts)
        kernels = fwd_kernels - ROUTING_KERNELS
        g = self.host_per_expert_gemm_s
        host_after = ((ops.forward_after_sync + expert_kernels) * h
                      + experts * (self.host_per_expert_fwd_s + EXPERT_GEMMS_FORWARD * g))
        # CUDA graphs take `captured` of the idealised kernels before the wait and `captured_ops` of the counted
        # router and dispatcher operations off the host (`graph_captured_kernels`), for `graphs` graph launches
        captured_ops = min(captured_ops, ops.forward_before_sync)
        host_before = (kernels - expert_kernels + ops.forward_before_sync - captured - captured_ops + graphs) * h
        fwd = synced_forward_s(fwd_s - experts_fwd_s, experts_fwd_s, host_before, host_after)
        captured_bwd = r * captured + (ops.backward * captured_ops / ops.forward_before_sync
                                       if ops.forward_before_sync else 0)
        host_bwd = ((r * kernels + ops.backward - captured_bwd + graphs) * h
                    + experts * (self.host_per_expert_bwd_s + EXPERT_GEMMS_BACKWARD * g))
        return fwd, np.maximum(bwd_s, host_bwd)

    def optimizer_step_s(self, params: np.ndarray, traffic_bytes_per_param: float, grad_bytes: int) -> np.ndarray:
        """Seconds of one optimizer step over `params` parameters (fused multi-tensor kernels)."""
        per_param = traffic_bytes_per_param + GRAD_BUFFER_PASSES * grad_bytes
        return params * per_param / self.optimizer_bw_bytes_per_s


def layer_kernels(gemms: list[Gemm], core: Core, x: Micro, tp_exchanges: int) -> np.ndarray:
    """Kernels of a layer's forward besides its element-wise ones: GEMMs (one launch each, a grouped
    GEMM one for all its experts), the attention core and unfused softmax, and the TP collectives
    (an all-reduce, or an all-gather and a reduce-scatter with sequence parallelism)."""
    comm = tp_exchanges * np.where(np.asarray(x.tp) > 1, np.where(x.sequence_parallel, 2, 1), 0)
    return len(gemms) + core.num_kernels + core.softmax_kernels + comm


@lru_cache(maxsize=None)
def _host_scaled(model: ElementwiseModel, scale: float) -> ElementwiseModel:
    return replace(model, host_per_kernel_s=model.host_per_kernel_s * scale,
                   host_per_expert_fwd_s=model.host_per_expert_fwd_s * scale,
                   host_per_expert_bwd_s=model.host_per_expert_bwd_s * scale,
                   host_per_expert_gemm_s=model.host_per_expert_gemm_s * scale)


def elementwise_model(gpu) -> ElementwiseModel | None:
    """The GPU's element-wise model, or None when its table set has no elementwise table."""
    table = gpu.tables.elementwise
    return None if table is None else _model(table, float(gpu.hbm_bw_bytes_per_s), str(gpu.name))


@lru_cache(maxsize=64)
def _model(table: ElementwiseTable, hbm_bw_bytes_per_s: float, gpu_name: str) -> ElementwiseModel:
    """`table` on a GPU of `hbm_bw_bytes_per_s` (cached per table object, bandwidth and name)."""
    return ElementwiseModel(
        name=gpu_name,
        bw_bytes_per_s=table.hbm_fraction * hbm_bw_bytes_per_s,
        kernel_fixed_s=table.kernel_fixed_s,
        host_per_kernel_s=table.host_per_kernel_s,
        backward_kernels_per_forward=table.backward_kernels_per_forward,
        optimizer_bw_bytes_per_s=table.optimizer_hbm_fraction * hbm_bw_bytes_per_s,
        fp8_recipes=table.fp8_recipes,
        fp8_transpose=table.fp8_transpose,
        host_per_expert_fwd_s=table.host_per_expert_fwd_s,
        host_per_expert_bwd_s=table.host_per_expert_bwd_s,
        moe_host_ops=table.moe_host_ops,
        host_per_expert_gemm_s=table.host_per_expert_gemm_s,
    )
