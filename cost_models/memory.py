"""Memory per rank: model states under ZeRO 0-3 and activations per Korthikanti et al.

Symbols: s = seq_len, b = micro_batch_size, h = hidden, a = heads, t = tp,
c = cp, f = ffn_hidden_size, q = a·d (query width), k = g·d (key/value width),
L = layers, p = pp, v = vpp, d = dp.

Sources
- Model states: ZeRO (Rajbhandari et al. 2020) Sec. 3.1/5: mixed-precision Adam
  keeps 2Ψ (16-bit weights) + 2Ψ or 4Ψ (gradients) + KΨ (K = 12: fp32 master,
  momentum, variance); stage 1 shards the K term over the data parallel group,
  stage 2 also the gradients, stage 3 also the weights. Megatron's distributed
  optimizer (6 + 12/d bytes per parameter with fp32 grads, `formulas.json`) is
  stage 1 with fp32 gradients.
- Activations: Korthikanti et al. 2022, Sec. 4 and Table 2, generalised:
  per layer, with 16-bit activations and 1-byte dropout masks,
    replicated over TP unless SP:  LN inputs 4sbh + QKV input 2sbh + MLP input 2sbh
                                    + dropout masks 2sbh          (= 10sbh)
    split over TP:                  Q,K 2sb(q+k) + V 2sbk + projection input 2sbq
                                    + MLP 4sbf (plain) or 6sbf (gated)  (= 24sbh)
    attention scores (unfused):     softmax 2as²b + dropout mask as²b + dropout output 2as²b (= 5as²b)
  which is exactly Eq. 2 (TP), Eq. 4 (TP+SP) and the Table 2 selective rows for
  GPT (q = k = h, f = 4h, dropout). Full recompute keeps the layer input, 2sbh
  (2sbh/t with SP, as Megatron stores the sequence-sharded input). Flash
  attention stores no scores, only fp32 softmax statistics (4asb). A gated MLP
  is assumed to store its fused [gate, up] output (4sbf) and the down-projection
  input (2sbf), as Megatron's fused SwiGLU does.
"""

from __future__ import annotations

import numpy as np

from cost_models.schedule import PipelineLayout
from cost_models.units import ACTIVATION_BYTES, DTYPE_BYTES, FP32, INT64, MASK, WEIGHT_BYTES, optimizer_state_bytes


def layer_params_per_rank(model, tp: np.ndarray) -> np.ndarray:
    """Parameters of one layer on one TP rank: matrices and their biases split over tp,
    the two norms replicated (elements)."""
    norms = 2 * model.norm_params
    return (model.layer_params() - norms) / tp + norms


def stage_params(model, tp: np.ndarray, pp: np.ndarray, lay: PipelineLayout) -> np.ndarray:
    """Parameters held by one rank of each stage kind (3, N), elements.

    First stage: word embedding split over tp (vocab parallel) + learned positions
    (replicated). Last stage: final norm + output projection split over tp; with
    tied embeddings and pp > 1 it is Megatron's copy of the word embedding.
    """
    per_layer = layer_params_per_rank(model, tp)
    word = model.vocab_size * model.hidden_size / tp
    positions = model.embedding_params() - model.vocab_size * model.hidden_size
    head_matrix = np.where(model.tie_embeddings & (pp == 1), 0.0, word)
    head = model.norm_params + head_matrix
    return lay.layers * per_layer + lay.has_embedding * (word + positions) + lay.has_head * head


def model_state_bytes(params: np.ndarray, zero_stage: np.ndarray, shard: np.ndarray, offload: np.ndarray,
                      precision: str, grad_precision: str, optimizer: str) -> dict[str, np.ndarray]:
    """Weights, gradients and optimizer states of one rank, bytes.

    `shard` is the ZeRO sharding degree (dp·cp ranks hold the same parameters).

    >>> z = lambda stage, nd: model_state_bytes(np.array(7.5e9), np.array(stage), np.array(nd),
    ...     np.array(False), "fp16", "fp16", "adam")
    >>> [round(float(sum(z(stage, 64).values())) / 1e9, 2) for stage in (1, 2, 3)]  # ZeRO Table 1, 7.5B, Nd=64
    [31.41, 16.64, 1.88]
    """
    weights = params * WEIGHT_BYTES[precision] / np.where(zero_stage >= 3, shard, 1)
    grads = params * DTYPE_BYTES[grad_precision] / np.where(zero_stage >= 2, shard, 1)
    states = params * optimizer_state_bytes(optimizer, precision) / np.where(zero_stage >= 1, shard, 1)
    states = np.where(offload, 0.0, states)
    return {"params": weights, "grads": grads, "optimizer": states}


def layer_activation_bytes(model, train, b, tp, cp, sp, recompute) -> np.ndarray:
    """Activation bytes one layer stores for one micro-batch on one rank.

    `recompute`: 0 none, 1 selective (attention core recomputed), 2 full (layer
    input only). Reproduces Korthikanti Table 2 for GPT shapes:

    >>> from types import SimpleNamespace as NS
    >>> gpt = NS(hidden_size=12288, num_attention_heads=96, q_width=12288, kv_width=12288,
    ...          ffn_hidden_size=4 * 12288, gated_mlp=False, dropout=True)
    >>> train = NS(seq_len=2048, precision="bf16", attention_kernel="unfused")
    >>> s, b, h, a, t = 2048, 1, 12288, 96, 8
    >>> bool(layer_activation_bytes(gpt, train, b, t, 1, False, 0) == s*b*h*(10 + 24/t + 5*a*s/(h*t)))
    True
    >>> bool(layer_activation_bytes(gpt, train, b, t, 1, True, 1) == s*b*h*34/t)
    True
    """
    b, tp, cp, sp, recompute = map(np.asarray, (b, tp, cp, sp, recompute))
    act = ACTIVATION_BYTES[train.precision]
    h, q, k, f = model.hidden_size, model.q_width, model.kv_width, model.ffn_hidden_size
    a = model.num_attention_heads
    tokens = train.seq_len / cp * b  # s·b on this rank
    masks = 2 * MASK * h if model.dropout else 0
    replicated = tokens * (act * (2 * h + h + h) + masks)  # 2 LN inputs, QKV input, MLP input (+ masks)
    mlp = (3 if model.gated_mlp else 2) * act * f
    split = tokens * (act * (q + k) + act * k + act * q + mlp)
    if train.attention_kernel == "unfused":
        probs = act + (MASK + act if model.dropout else 0)  # softmax out (+ dropout mask and output)
        scores = probs * a * tokens * train.seq_len
    else:
        scores = FP32 * a * tokens  # softmax log-sum-exp statistics
    full = replicated / np.where(sp, tp, 1) + (split + scores) / tp
    selective = full - np.where(train.attention_kernel == "unfused", scores / tp, 0.0)
    checkpoint = tokens * act * h / np.where(sp, tp, 1)
    return np.where(recompute == 2, checkpoint, np.where(recompute == 1, selective, full))


def stage_activation_bytes(model, train, st, lay: PipelineLayout) -> dict[str, np.ndarray]:
    """Activations held at the peak by one rank of each stage kind (3, N), bytes.

    The stage holds `inflight_chunks` (micro-batch, chunk) pairs of `chunk_layers`
    layers each. Full recompute with `recompute_num_layers` n recomputes n layers
    per chunk (Megatron's block method) and stores the rest whole; while it
    recomputes, one layer's full activations are live (`recompute_working`).
    """
    b, t, c, sp, rc = st.micro_batch_size, st.tp, st.cp, st.sequence_parallel, st.recompute
    act = ACTIVATION_BYTES[train.precision]
    h, tokens = model.hidden_size, train.seq_len / c * b
    full_layer = layer_activation_bytes(model, train, b, t, c, sp, 0)
    stored_layer = layer_activation_bytes(model, train, b, t, c, sp, rc)
    n_rc = np.where(st.recompute_num_layers > 0, np.minimum(st.recompute_num_layers, lay.chunk_layers), lay.chunk_layers)
    per_chunk = np.where(rc == 2, n_rc * stored_layer + (lay.chunk_layers - n_rc) * full_layer,
                         lay.chunk_layers * stored_layer)
    layers = lay.inflight_chunks * per_chunk
    working = np.where(rc == 2, full_layer, 0.0) * (lay.layers > 0)
    sp_div = np.where(sp, t, 1)
    # Input ids (int64) and the embedding dropout mask, per in-flight micro-batch (Korthikanti App. A).
    embed = lay.has_embedding * lay.inflight_microbatches * tokens * (INT64 + (MASK * h / sp_div if model.dropout else 0))
    # Final norm input and output-layer input (16-bit) + fp32 logits for the loss, one micro-batch.
    head = lay.has_head * tokens * (2 * act * h / sp_div + FP32 * model.vocab_size / t)
    return {"activations": layers, "recompute_working": working, "embedding_activations": embed, "logits": head}


def zero3_working_bytes(model, st, precision: str, grad_precision: str) -> np.ndarray:
    """ZeRO-3 gathers whole layers: the current and the prefetched one (16-bit),
    plus one layer's unsharded gradient before its reduce-scatter, bytes."""
    per_layer = layer_params_per_rank(model, st.tp)
    gathered = (2 * WEIGHT_BYTES[precision] + DTYPE_BYTES[grad_precision]) * per_layer
    return np.where(st.zero_stage >= 3, gathered, 0.0)
