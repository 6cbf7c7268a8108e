"""The element-wise kernel table (`profiles/kernels/elementwise/<set>.yaml`) as a typed object.

The table gives, for one GPU generation, the achieved fraction of HBM bandwidth of large element-wise
and optimizer kernels, the fixed GPU time and host issue time per kernel, the host set-up per local
expert of a grouped MLP, the counted host operations of Megatron-core's MoE router and dispatcher, and
the FP8 recipes the GPU's kernels run. `cost_models.elementwise` turns it into the GPU's element-wise
model (the fractions times the planned GPU's bandwidth); the model itself is described there.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import SpecError

MICRO = 1e-6

#: Transformer Engine's FP8 recipes under Megatron-LM's `--fp8-recipe` names (arguments.py choices):
#: delayed = per-tensor scale from an amax history; tensorwise = per-tensor current scaling (an amax
#: pass before the cast); blockwise = 1x128 activation / 128x128 weight tiles with fp32 scales
#: (DeepSeek-V3 Sec. 3.3.2); mxfp8 = OCP microscaling, 1x32 blocks with E8M0 (1-byte) scales; nvfp4 =
#: Transformer Engine's NVFP4BlockScaling (precision nvfp4, not an --fp8-recipe): FP4 E2M1, 1x16 blocks (16x16
#: for weights) with E4M3 scales and an FP32 per-tensor scale.
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")

_FIELDS = ("hbm_fraction", "kernel_fixed_us", "host_per_kernel_us", "backward_kernels_per_forward",
           "host_per_expert_forward_us", "host_per_expert_backward_us", "host_per_expert_gemm_us", "moe_host_ops",
           "optimizer_hbm_fraction", "fp8_recipes", "fp8_transpose")

#: The keys of a table's `moe_host_ops` (operations of one MoE layer's router and token dispatcher).
MOE_HOST_OPS_KEYS = ("forward_before_sync", "forward_after_sync", "backward")


@dataclass(frozen=True)
class MoeHostOps:
    """Host-issued operations of one Megatron-core MoE layer's router and alltoall token dispatcher
    (not its experts) per micro-batch, as counted by `benchmarks/host_ops.py`: the forward's before
    the dispatcher's wait on the token counts (router, permutation, the copies to the host), after it
    (all-to-alls, sorting by local expert, unpermutation), and the backward's. They do not grow with
    the local experts (the count shows it); only views, which issue no kernel, do."""

    forward_before_sync: float
    forward_after_sync: float
    backward: float


@dataclass(frozen=True, eq=False)
class ElementwiseTable:
    """One GPU generation's element-wise table in SI units (seconds, fractions of the peak HBM bandwidth)."""

    hbm_fraction: float  # f: achieved share of the peak HBM bandwidth of large element-wise kernels
    kernel_fixed_s: float  # t0
    host_per_kernel_s: float  # h
    backward_kernels_per_forward: float  # r
    optimizer_hbm_fraction: float
    fp8_recipes: tuple[str, ...]
    fp8_transpose: bool
    host_per_expert_fwd_s: float
    host_per_expert_bwd_s: float
    moe_host_ops: MoeHostOps
    host_per_expert_gemm_s: float


def elementwise_table_from(table: dict, where: str) -> ElementwiseTable:
    """Parse an element-wise table; a SpecError naming `where` and the field on a bad one."""
    missing = [f for f in _FIELDS if f not in table]
    if missing:
        raise SpecError(f"{where} lacks {', '.join(missing)}")
    for field in ("hbm_fraction", "optimizer_hbm_fraction"):
        if not 0 < float(table[field]) <= 1:
            raise SpecError(f"{where}: {field} must be in (0, 1], got {table[field]!r}")
    for field in ("kernel_fixed_us", "host_per_kernel_us", "backward_kernels_per_forward",
                  "host_per_expert_forward_us", "host_per_expert_backward_us", "host_per_expert_gemm_us"):
        if float(table[field]) < 0:
            raise SpecError(f"{where}: {field} must be >= 0, got {table[field]!r}")
    ops = table["moe_host_ops"]
    if not isinstance(ops, dict) or sorted(ops) != sorted(MOE_HOST_OPS_KEYS) or any(
            not isinstance(ops[k], (int, float)) or ops[k] < 0 for k in MOE_HOST_OPS_KEYS):
        raise SpecError(f"{where}: moe_host_ops must map {', '.join(MOE_HOST_OPS_KEYS)} to counts >= 0, "
                        f"got {ops!r}")
    recipes = tuple(table["fp8_recipes"] or ())
    unknown = [r for r in recipes if r not in FP8_RECIPES]
    if unknown:
        raise SpecError(f"{where}: fp8_recipes {unknown} unknown; known: {', '.join(FP8_RECIPES)}")
    return ElementwiseTable(
        hbm_fraction=float(table["hbm_fraction"]),
        kernel_fixed_s=float(table["kernel_fixed_us"]) * MICRO,
        host_per_kernel_s=float(table["host_per_kernel_us"]) * MICRO,
        backward_kernels_per_forward=float(table["backward_kernels_per_forward"]),
        optimizer_hbm_fraction=float(table["optimizer_hbm_fraction"]),
        fp8_recipes=recipes,
        fp8_transpose=bool(table["fp8_transpose"]),
        host_per_expert_fwd_s=float(table["host_per_expert_forward_us"]) * MICRO,
        host_per_expert_bwd_s=float(table["host_per_expert_backward_us"]) * MICRO,
        moe_host_ops=MoeHostOps(**{k: float(ops[k]) for k in MOE_HOST_OPS_KEYS}),
        host_per_expert_gemm_s=float(table["host_per_expert_gemm_us"]) * MICRO,
    )
