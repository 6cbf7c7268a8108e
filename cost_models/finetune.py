"""Fine-tuning with adapters: LoRA (Hu et al. 2021) and QLoRA (Dettmers et al. 2023) over a frozen base.

What changes against pre-training, and how each part is costed (TrainSpec.finetune 'lora' / 'qlora'; the
plans run the Hugging Face model with peft under DeepSpeed ZeRO or FSDP2, data parallel only):

- Parameters. Each adapted linear layer W (in x out) gets A (in x r) and B (r x out): r·(in + out)
  trainable parameters, peft's LoraConfig(r, target_modules, layers_to_transform) exactly
  (`adapter_params`; tests/test_finetune.py counts them against peft on a small model).
- Memory. The frozen base keeps its weights only: no gradients, no optimizer states. LoRA keeps them in
  16 bits. QLoRA keeps every linear weight of the transformer layers in 4-bit NF4 (bitsandbytes'
  Linear4bit: 0.5 byte a weight plus an fp32 absmax per 64 weights, or with double quantisation an 8-bit
  absmax per 64 and an fp32 constant per 256 of those: 0.127 bits a weight, the QLoRA paper Sec. 3); the
  embedding, the norms and the output layer stay 16-bit (Transformers skips the output layer). Adapters
  hold their weights, gradients and two Adam moments (`adapter_state_bytes`). A dequantised 16-bit copy
  of the largest linear weight is a working buffer (`dequant_buffer_bytes`).
- Time. A frozen GEMM's backward computes its input gradient only (no weight gradient:
  cost_models.compute.gemm_backward_time with `frozen`), and only above the lowest adapted layer: below
  it nothing needs a gradient, so those layers run forward only and store nothing. Each adapter runs
  x·A, then ·B, a scale and an add (peft's Linear.forward), forward and backward, timed as a roofline of
  their FLOPs and bytes (`adapter_layer_s`). QLoRA dequantises every 4-bit weight to bf16 before each
  GEMM that reads it, forward and backward (bitsandbytes' MatMul4Bit): read 4-bit, write 16-bit
  (`dequant_layer_s`).
- Data parallel. Only the adapters' gradients are reduced and only they are stepped; ZeRO-3 still
  gathers the frozen weights (in their stored width) forward and backward.
- Activations. What the Hugging Face layer's autograd saves (`layer_activation_bytes`), also for a fully
  trained Transformers model (TrainSpec.model_code 'transformers'): a frozen linear layer keeps no input, each
  adapter keeps its own; counted from Transformers' Llama code and checked against the tensors PyTorch saves on
  CPU (tests/test_finetune.py). Gradient checkpointing (recompute full) keeps each layer's input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models.units import BF16, FP32
from planner.specs.adapters import adapted_layers, adapter_params, adapter_params_per_layer, module_shapes, targets

__all__ = ["adapted_layers", "adapter_params", "adapter_params_per_layer", "module_shapes", "targets"]

#: QLoRA's NF4 storage: 4 bits a weight in blocks of 64 with an fp32 absmax each (0.5 bit a weight), or with
#: double quantisation an 8-bit absmax per 64 weights and an fp32 second-level constant per 256 absmax values
#: (8/64 + 32/(64·256) = 0.127 bit a weight). Dettmers et al. 2023 Sec. 3 'Double Quantization';
#: bitsandbytes functional.quantize_4bit (blocksize 64) and its compress_statistics (blocksize 256).
NF4_BLOCK = 64
NF4_DQ_BLOCK = 256


def nf4_bytes_per_weight(double_quant: bool) -> float:
    """Bytes a 4-bit NF4 weight takes with its quantisation constants.

    >>> round(nf4_bytes_per_weight(False) * 8, 3), round(nf4_bytes_per_weight(True) * 8, 3)  # bits a weight
    (4.5, 4.127)
    """
    if double_quant:
        return 0.5 + 1 / NF4_BLOCK + FP32 / (NF4_BLOCK * NF4_DQ_BLOCK)
    return 0.5 + FP32 / NF4_BLOCK


def backward_share(model, train) -> float:
    """Share of the transformer layers that run a backward: those from the lowest adapted layer up (below it no
    tensor needs a gradient)."""
    if not train.adapters:
        return 1.0
    return (model.num_layers - min(adapted_layers(model, train))) / model.num_layers


def linear_weights_per_layer(model) -> int:
    """Weights of one transformer layer's linear layers (no biases), elements."""
    return sum(i * o for i, o in module_shapes(model).values())


def base_weight_bytes_per_param(train) -> float:
    """Bytes of one frozen weight of a transformer layer's linear layers: 16-bit (LoRA), NF4 (QLoRA)."""
    if train.finetune == "qlora":
        return nf4_bytes_per_weight(train.qlora_double_quant)
    return float(BF16)


@dataclass(frozen=True)
class AdapterStates:
    """Bytes per adapter parameter of its weight, gradient and optimizer states."""

    weight: float
    grad: float
    optimizer: float


def adapter_state_bytes(train) -> AdapterStates:
    """fp32 adapters (peft's autocast_adapter_dtype): 4 + 4 bytes and Adam's two fp32 moments (8; SGD's one, 4),
    the fp32 weight being the master. bf16 adapters: 2 + 2, the moments still fp32 (bitsandbytes' 32-bit paged
    AdamW, the QLoRA paper's setting; no separate master copy)."""
    moments = 8.0 if train.optimizer == "adam" else 4.0
    if train.adapter_precision == "bf16":
        return AdapterStates(float(BF16), float(BF16), moments)
    return AdapterStates(float(FP32), float(FP32), moments)


def layer_base_bytes(model, train, layer_params: float) -> float:
    """Bytes one transformer layer's frozen weights take stored (`layer_params` elements in all): the linear
    weights at `base_weight_bytes_per_param`, the rest (norms, biases) 16-bit."""
    linear = linear_weights_per_layer(model)
    return linear * base_weight_bytes_per_param(train) + (layer_params - linear) * BF16


def dequant_buffer_bytes(model, train) -> float:
    """QLoRA's working copy: the largest linear weight dequantised to bf16 while its GEMM runs (and its input
    gradient's), bytes; 0 otherwise."""
    if train.finetune != "qlora":
        return 0.0
    return float(max(i * o for i, o in module_shapes(model).values()) * BF16)


#: Kernels of one adapted module: forward x·A, ·B, the scale and the add into the base output (peft's
#: lora.Linear.forward: result + lora_B(lora_A(dropout(x))) * scaling), with dropout one more; backward the
#: two GEMMs of each adapter matrix (its input gradient and its weight gradient), the scale's backward and the
#: input gradient's accumulation into the base layer's.
ADAPTER_FWD_KERNELS = 4
ADAPTER_BWD_KERNELS = 6


def adapter_layer_work(model, train, tokens, act: int) -> tuple:
    """(forward FLOPs, forward bytes, backward FLOPs, backward bytes) of one adapted layer's adapters on one
    micro-batch of `tokens` tokens with `act`-byte activations (arrays over candidates).

    Forward per module (in x out, rank r): x·A and ·B are 2·T·r·(in + out) FLOPs, reading x and writing the
    r-wide intermediate and the out-wide product; the scale reads and writes the product, the add reads it and
    the base output and writes the sum (5 passes over T·out); dropout reads x and writes its copy and a 1-byte
    mask. Backward: twice the GEMM FLOPs; it reads the output gradient for B's two GEMMs, the input (or its
    dropped copy) and the intermediate for A's, writes the input gradient and adds it to the base layer's
    (read both, write one), and the scale's backward reads and writes T·out once more."""
    r = train.lora_rank
    shapes = module_shapes(model)
    fwd_flop = bwd_flop = fwd_bytes = bwd_bytes = 0.0
    for t in targets(model, train):
        i, o = shapes[t]
        fwd_flop = fwd_flop + 2 * tokens * r * (i + o)
        bwd_flop = bwd_flop + 4 * tokens * r * (i + o)
        fwd_bytes = fwd_bytes + act * tokens * (i + 2 * r + 6 * o)
        bwd_bytes = bwd_bytes + act * tokens * (4 * o + 5 * i + 3 * r)
        if train.lora_dropout > 0:
            fwd_bytes = fwd_bytes + tokens * i * (2 * act + 1)
            bwd_bytes = bwd_bytes + tokens * i * (2 * act + 1)
    return fwd_flop, fwd_bytes, bwd_flop, bwd_bytes


#: Groups of adapted modules that read one input tensor: q, k and v read the attention's norm output; gate and up
#: the MLP's norm output; o and down each their own.
INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


#: Bytes a dropout keeps per element for its backward on a GPU: CUDA's fused native_dropout saves a bool mask.
#: (PyTorch's CPU dropout multiplies by a noise tensor of the input's dtype and keeps that instead.)
DROPOUT_MASK_BYTES = 1


def layer_activation_bytes(model, train, tokens, act: int = BF16, mask_bytes: int = DROPOUT_MASK_BYTES):
    """Bytes one Hugging Face Llama-style decoder layer keeps for its backward on `tokens` tokens (Transformers' eager
    modules, SDPA attention), as autograd saves them (no recomputation), with a frozen base and adapters or (no
    adapters) every weight trained.

    Per token, with h the hidden size, q the query width, f the MLP width (bytes of 16-bit values, `act`):
    - each RMSNorm keeps its fp32 input for the square's backward (4h; the weight's product keeps nothing when the
      weight is frozen), two norms;
    - SDPA keeps the rotated query, the key and value repeated to every query head (Transformers 4.51's repeat_kv)
      and its output: 4 tensors of q; its softmax statistics are small. (Transformers 4.57 passes grouped-query
      attention to SDPA unrepeated, keeping 2q + 2k: 3 fewer q-wide tensors per token for 4:1 GQA, measured here
      with 4.57.6; the count follows the 4.51 pinned with the fine-tuning toolkits here);
    - the gated MLP keeps the SiLU's input and output and the up projection's output (3f; a plain MLP the
      activation's input, f);
    - a frozen linear layer keeps no input (autograd saves an input only for its weight's gradient), except where
      `qlora_saves_inputs` (bitsandbytes before its pull request #1270 kept every 4-bit layer's input); a trained
      one keeps it (h for q, k, v together, q for o, h for gate and up, f for down), and a trained norm weight its
      16-bit output (h each);
    - each adapter keeps what its A reads and its r-wide intermediate for B. With fp32 adapters (peft's default,
      under the Trainer's bf16 autocast) each module's A reads its own bf16 cast of the input (in per module);
      with bf16 adapters the modules reading one input share it (`INPUT_GROUPS`); lora_dropout > 0 adds its mask
      (`mask_bytes` an element) and makes every module's input its own.
    tests/test_finetune.py checks this against the tensors PyTorch saves for such a layer under peft."""
    h, q, f = model.hidden_size, model.q_width, model.ffn_hidden_size
    per_token = 2 * 4 * h + 4 * act * q + (3 if model.gated_mlp else 1) * act * f
    if not train.adapters:  # a trained base: each norm's 16-bit output for its weight, each linear layer's input
        return tokens * (per_token + 2 * act * h + act * (h + q + h + f))
    shapes = module_shapes(model)
    adapted = set(targets(model, train))
    dropout = train.lora_dropout > 0
    shared = train.adapter_precision == "bf16" and not dropout
    kept_inputs = bool(getattr(train, "qlora_saves_inputs", False)) and train.finetune == "qlora"
    for group in INPUT_GROUPS:
        present = [m for m in group if m in shapes]
        if not present:
            continue
        width = shapes[present[0]][0]
        mods = [m for m in present if m in adapted]
        if shared and mods or kept_inputs:
            per_token += act * width  # the group's input tensor, once
        if not shared:
            per_token += len(mods) * act * width  # each adapted module's own copy
        if dropout:
            per_token += len(mods) * mask_bytes * width  # the dropout mask
        per_token += len(mods) * act * train.lora_rank  # B's input
    return tokens * per_token


def roofline_s(flop, nbytes, kernels: int, gpu) -> np.ndarray:
    """Seconds of memory-bound small kernels: their FLOPs at the GPU's flat GEMM efficiency or their bytes at its
    HBM rate, whichever is longer, plus their fixed cost."""
    flop_s = flop / (gpu.peak("bf16") * gpu.gemm_efficiency)
    byte_s = nbytes / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency)
    return np.maximum(flop_s, byte_s) + kernels * gpu.kernel_overhead_s


def adapter_layer_s(model, train, tokens, act: int, gpu) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of one adapted layer's adapters on one micro-batch."""
    fwd_flop, fwd_bytes, bwd_flop, bwd_bytes = adapter_layer_work(model, train, tokens, act)
    n = len(targets(model, train))
    drop = 1 if train.lora_dropout > 0 else 0
    return (roofline_s(fwd_flop, fwd_bytes, n * (ADAPTER_FWD_KERNELS + drop), gpu),
            roofline_s(bwd_flop, bwd_bytes, n * (ADAPTER_BWD_KERNELS + drop), gpu))


def dequant_layer_s(model, train, gpu) -> float:
    """Seconds QLoRA spends dequantising one layer's 4-bit weights to bf16 once (one kernel a linear layer):
    read the NF4 weights and constants, write 16-bit; 0 for LoRA."""
    if train.finetune != "qlora":
        return 0.0
    weights = linear_weights_per_layer(model)
    nbytes = weights * (nf4_bytes_per_weight(train.qlora_double_quant) + BF16)
    return nbytes / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency) + len(module_shapes(model)) * gpu.kernel_overhead_s
