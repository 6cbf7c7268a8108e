"""Compute: FLOPs per layer and the time they take on one GPU.

FLOPs (one layer, forward, one micro-batch of b sequences of s tokens):
  QKV 2sbh(q + 2k) + scores 2s²bq + over V 2s²bq + output 2sbqh
  + MLP 2sbhf·(3 gated | 2 plain); logits 2sbhV on the last stage.
For GPT shapes this is Korthikanti Eq. 7's 24sbh² + 4s²bh per layer (the
`1 + s/(6h)` factor); backward is twice the forward in FLOPs, and its GEMMs take
`gpu.backward_gemm_ratio` times the forward GEMM time (fitted per GPU, 2.0 where
nothing was fitted); full recompute adds a
forward, selective recompute adds the attention-core forward (4s²bh; Eq. 8).
Causal masking is not credited (the convention of SC'21 and Korthikanti).

Time: each GEMM is a roofline, max(FLOP ÷ (peak · gemm_efficiency), bytes ÷
(HBM · hbm_efficiency)), plus a fixed per-kernel cost; element-wise kernels
(norms, residual and dropout, activation, rotary, unfused softmax) move their
bytes at HBM · hbm_efficiency. The three efficiencies come from the GPU
profile (`profiles/calibration/`), never from this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models.units import ACTIVATION_BYTES, FP8, MASK, WEIGHT_BYTES

#: Element-wise kernels per layer forward: 2 norms, 2 bias-dropout-add and the activation
#: (rotary is counted in them; the unfused softmax adds its own; each GEMM pays its overhead in gemm_time).
ELEMENTWISE_KERNELS_FWD = 5
#: An element-wise backward reads the incoming gradient and the saved input and
#: writes one gradient: three tensors against the forward's two.
BACKWARD_ELEMENTWISE_FACTOR = 1.5


#: FP8 training (Transformer Engine's recipe) runs the transformer-layer linear GEMMs in FP8
#: but keeps the attention core and the output (vocabulary) layer in BF16.
UNQUANTISED = {"fp8": "bf16", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclass
class LayerTimes:
    """Seconds for one layer and one micro-batch on one rank (arrays over candidates)."""

    fwd_s: np.ndarray  # GEMMs + element-wise, forward
    bwd_s: np.ndarray  # backward: 2× the GEMM work, 1.5× the element-wise traffic
    attn_core_fwd_s: np.ndarray  # the part selective recompute repeats
    fwd_flop: np.ndarray  # model FLOPs, forward, per rank
    attn_core_flop: np.ndarray


def layer_flops(model, seq_len: int, b, tp, cp) -> dict[str, np.ndarray]:
    """Forward FLOPs of one layer on one rank, by GEMM."""
    h, q, k, f = model.hidden_size, model.q_width, model.kv_width, model.ffn_hidden_size
    tokens = seq_len / cp * b
    return {
        "qkv": 2 * tokens * h * (q + 2 * k) / tp,
        "core": 2 * 2 * tokens * seq_len * q / tp,  # scores and over-V; each rank's queries see all keys
        "out": 2 * tokens * q * h / tp,
        "mlp": 2 * tokens * h * f * (3 if model.gated_mlp else 2) / tp,
    }


def gemm_time(flop, m, n, k, gpu, precision: str) -> np.ndarray:
    """Roofline time of one (m×k)·(k×n) GEMM, seconds, plus the kernel overhead."""
    elem = WEIGHT_BYTES[precision]
    compute = flop / (gpu.peak(precision) * gpu.gemm_efficiency)
    traffic = elem * (m * k + k * n + m * n) / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency)
    return np.maximum(compute, traffic) + gpu.kernel_overhead_s


def layer_times(model, train, gpu, b, tp, cp, sp) -> LayerTimes:
    """Forward, backward and attention-core times of one layer on one rank."""
    prec = train.precision
    act = ACTIVATION_BYTES[prec]
    s, h, q, k, f = train.seq_len, model.hidden_size, model.q_width, model.kv_width, model.ffn_hidden_size
    a = model.num_attention_heads
    tokens = s / cp * b
    fl = layer_flops(model, s, b, tp, cp)
    n_mlp_in = 2 if model.gated_mlp else 1
    gemms = (
        gemm_time(fl["qkv"], tokens, (q + 2 * k) / tp, h, gpu, prec)
        + gemm_time(fl["out"], tokens, h, q / tp, gpu, prec)
        + gemm_time(fl["mlp"] * n_mlp_in / (n_mlp_in + 1), tokens, n_mlp_in * f / tp, h, gpu, prec)
        + gemm_time(fl["mlp"] / (n_mlp_in + 1), tokens, h, f / tp, gpu, prec)
    )
    # Attention core: batched per-head GEMMs (K = head_dim). Unfused kernels write the
    # (a/t)·b·s² scores and read the probabilities back; flash attention only reads Q, K, V
    # and writes the output. The softmax/dropout traffic itself is added below.
    qkvo = act * tokens * (2 * q + 2 * k) / tp
    scores_rw = 2 * act * a / tp * tokens * s if train.attention_kernel == "unfused" else 0.0
    core = np.maximum(fl["core"] / (gpu.peak(UNQUANTISED[prec]) * gpu.gemm_efficiency),
                      (qkvo + scores_rw) / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency)) + 2 * gpu.kernel_overhead_s
    hbm = gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency
    rep = np.where(sp, tp, 1)
    mask = MASK if model.dropout else 0
    norms = 2 * (2 * act * tokens * h) / rep  # read + write, two norms
    residual = 2 * (3 * act + mask) * tokens * h / rep  # read x and residual, write sum (+ mask), twice
    activation = (3 if model.gated_mlp else 2) * act * tokens * f / tp  # read (2 inputs if gated), write
    rotary = (2 * act * tokens * (q + k) / tp) if model.position_embedding == "rope" else 0.0
    # FP8: every linear layer's input is quantised (read 16-bit, write 8-bit); weights are cast once
    # per step (Transformer Engine caches them across micro-batches), which is not counted here.
    fp8_casts = 0.0
    if prec == "fp8":
        gemm_inputs = tokens * (2 * h + q / tp + f / tp)  # QKV and MLP inputs are whole (gathered) sequences
        fp8_casts = (act + FP8) * gemm_inputs
    elementwise = ((norms + residual + activation + rotary + fp8_casts) / hbm
                   + ELEMENTWISE_KERNELS_FWD * gpu.kernel_overhead_s)
    softmax = 0.0
    if train.attention_kernel == "unfused":
        scores = a / tp * tokens * s
        softmax = (2 * act + (2 * act + mask if model.dropout else 0)) * scores / hbm + gpu.kernel_overhead_s
    fwd = gemms + core + softmax + elementwise
    bwd = gpu.backward_gemm_ratio * (gemms + core) + BACKWARD_ELEMENTWISE_FACTOR * (softmax + elementwise)
    return LayerTimes(fwd_s=fwd, bwd_s=bwd, attn_core_fwd_s=core + softmax,
                      fwd_flop=fl["qkv"] + fl["core"] + fl["out"] + fl["mlp"], attn_core_flop=fl["core"])


def head_times(model, train, gpu, b, tp, cp, sp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Output layer + cross-entropy on the last stage, one micro-batch: (fwd_s, bwd_s, fwd_flop)."""
    prec = train.precision
    act = ACTIVATION_BYTES[prec]
    tokens = train.seq_len / cp * b
    v, h = model.vocab_size, model.hidden_size
    flop = 2 * tokens * h * v / tp
    gemm = gemm_time(flop, tokens, v / tp, h, gpu, UNQUANTISED[prec])
    hbm = gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency
    # Final norm (read/write) + fp32 softmax cross-entropy over the vocab shard (read logits, write fp32).
    loss = (2 * act * tokens * h / np.where(sp, tp, 1) + (act + 4 + 4) * tokens * v / tp) / hbm
    fwd = gemm + loss + 2 * gpu.kernel_overhead_s
    bwd = gpu.backward_gemm_ratio * gemm + BACKWARD_ELEMENTWISE_FACTOR * loss + 2 * gpu.kernel_overhead_s
    return fwd, bwd, flop
