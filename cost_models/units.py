"""Byte sizes of the numbers training keeps, built from parts."""

from __future__ import annotations

FP32 = 4
BF16 = 2
FP16 = 2
FP8 = 1
FP4 = 0.5  # E2M1, two per byte (NVFP4)
INT64 = 8
MASK = 1  # dropout masks are stored as one byte per element (Korthikanti et al. 2022, Sec. 4.1)

DTYPE_BYTES: dict[str, int] = {"fp32": FP32, "tf32": FP32, "bf16": BF16, "fp16": FP16, "fp8": FP8}

#: Weights kept for compute: 16-bit for bf16/fp16/fp8 training (FP8 GEMMs cast on the fly), 32-bit for fp32.
WEIGHT_BYTES: dict[str, int] = {"bf16": BF16, "fp16": FP16, "fp8": BF16, "nvfp4": BF16, "fp32": FP32}

#: Activations stored for backward (fp8 training keeps bf16 activations).
ACTIVATION_BYTES: dict[str, int] = {"bf16": BF16, "fp16": FP16, "fp8": BF16, "nvfp4": BF16, "fp32": FP32}

#: Precisions whose linear-layer GEMMs run on quantised inputs (FP8 casts, NVFP4 quantisation) that the
#: cost model prices; their recipe is Micro.fp8_recipe ("nvfp4" under nvfp4).
QUANTISED_PRECISIONS = ("fp8", "nvfp4")

ADAM_MOMENTS = FP32 + FP32  # first and second moment
SGD_MOMENTUM = FP32
FP32_MASTER = FP32


def optimizer_state_bytes(optimizer: str, precision: str) -> int:
    """Optimizer bytes per parameter: fp32 master copy (unless training in fp32) + moments.

    Mixed-precision Adam: 4 + 4 + 4 = 12 (ZeRO paper's K=12, Sec. 3.1).

    >>> optimizer_state_bytes("adam", "bf16"), optimizer_state_bytes("adam", "fp32")
    (12, 8)
    """
    master = 0 if precision == "fp32" else FP32_MASTER
    moments = ADAM_MOMENTS if optimizer == "adam" else SGD_MOMENTUM
    return master + moments


def optimizer_step_traffic_bytes(optimizer: str, precision: str, grad_precision: str) -> int:
    """HBM bytes moved per parameter by one optimizer step: read the gradient,
    read and write the fp32 weights and moments, write the 16-bit compute copy.

    Mixed-precision Adam with fp32 grads: 4 + 2·(4 + 4 + 4) + 2 = 30.

    >>> optimizer_step_traffic_bytes("adam", "bf16", "fp32")
    30
    """
    moments = ADAM_MOMENTS if optimizer == "adam" else SGD_MOMENTUM
    fp32_weights = FP32
    compute_copy = 0 if precision == "fp32" else WEIGHT_BYTES[precision]
    return DTYPE_BYTES[grad_precision] + 2 * (fp32_weights + moments) + compute_copy
