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
- FP8 training (`fp8_weight_memory`): Transformer Engine's FP8 copies of the quantised GEMMs' weights,
  cached across micro-batches, a transposed or column-wise second copy where the GPU or the recipe
  needs one, and with Megatron's --fp8-param-gather FP8 parameters in place of the 16-bit ones
  (Transformer Engine 2.10 module/linear.py and tensor/; megatron-core 0.16.1 fp8_utils.py and
  distributed/; TransformerEngine#1261, #1880, #647). The inputs of the quantised GEMMs (QKV, projection,
  fc1, fc2, the experts') are kept for backward as their FP8 copies, 1 byte per element plus the block
  recipes' scales, in place of the 16-bit ones (`Micro.gemm_input`; Megatron-core only: torchao keeps
  the 16-bit input); Q, K, V and the gated activation's input stay 16-bit.
- The loss: `cross_entropy_bytes_per_logit` (PyTorch's cross entropy over fp32 logits; for a
  PyTorch-native framework also torch's loss_parallel and flash-attn's fused kernel).
- PyTorch-native frameworks (profiles/frameworks/, `zero3_param_is_master`,
  `tp_head_saves_gathered_input`): FSDP2's fp32 parameter shard is the master weight
  (`model_state_bytes`); DTensor's sequence-parallel output layer saves its all-gathered input.
- Memory outside the model's tensors (`runtime_memory_bytes`): the CUDA context,
  NCCL's own buffers and the caching allocator's slack, from the GPU's memory table
  (profiles/kernels/memory/<name>.yaml); a GPU without one keeps its profile's flat
  `framework_reserve_gib`.
"""

from __future__ import annotations

import numpy as np

from cost_models.arrays import RECOMPUTE_MODULES, StrategyArrays, selected_modules
from cost_models.blocks import ZERO, DenseMLP, LatentAttention, Micro, ModelBlocks, MoE, padded_vocab
from cost_models.elementwise import ELEMENT_BYTES, SCALE_BYTES, fp8_copies
from cost_models.layout import ParallelLayout
from cost_models.units import BF16, DTYPE_BYTES, FP8, FP32, WEIGHT_BYTES, optimizer_state_bytes
from profiles.frameworks import Framework
from profiles.memory import MemoryTable

MIB = 2**20


def _stack(values: list, n: int) -> np.ndarray:
    return np.stack([np.broadcast_to(np.asarray(v, dtype=float), (n,)) for v in values])


def kind_params_per_rank(blocks: ModelBlocks, tp: np.ndarray) -> np.ndarray:
    """(K, N) parameters outside the routed experts of one layer of each kind on one rank."""
    return _stack([k.params_per_rank(tp) for k in blocks.all_kinds], len(tp))


def kind_expert_params_per_rank(blocks: ModelBlocks, ep: np.ndarray, etp: np.ndarray) -> np.ndarray:
    """(K, N) routed-expert parameters of one layer of each kind on one rank of the expert mesh."""
    return _stack([k.expert_params_per_rank(ep, etp) for k in blocks.all_kinds], len(ep))


def stage_kind_counts(blocks: ModelBlocks, lay: ParallelLayout) -> np.ndarray:
    """(K, S, N) layers of each kind of `blocks.all_kinds` on each stage row: the main stack's
    per-layer pattern split as the layout splits it, and the MTP modules on the last rank.
    A kind's weight for picking the heaviest middle rank is its parameter count (MoE layers
    outweigh dense ones), global attention breaking ties with windowed."""
    weights = tuple(k.params() + (0.5 if not getattr(k.attention(), "window", 0) else 0.0) for k in blocks.kinds)
    counts = lay.pattern_counts(blocks.pattern, weights)
    if blocks.mtp:
        counts = np.concatenate([counts, (len(blocks.mtp) * lay.rows.has_head)[None].astype(float)])
    return counts


def per_row(counts: np.ndarray, per_kind: np.ndarray) -> np.ndarray:
    """Sum over kinds of (layers of the kind on each stage row) × (a per-layer quantity): (S, N)."""
    if counts.shape[0] == 1:  # one kind: a broadcast product (the common, dense case)
        return counts[0] * np.reshape(per_kind, (1, -1))
    return np.einsum("ksn,kn->sn", counts, np.broadcast_to(per_kind, (counts.shape[0], counts.shape[2])))


def stage_params(blocks: ModelBlocks, lay: ParallelLayout, counts: np.ndarray | None = None) -> np.ndarray:
    """Parameters outside the routed experts held by one rank of each stage row (S, N), elements.

    First stage: word embedding split over tp (vocab parallel, padded as Megatron pads
    it) + learned positions (replicated). Last stage: final norm + output projection
    split over tp; with tied embeddings and pp > 1 it is Megatron's copy of the word
    embedding, with pp = 1 the embedding itself (no extra parameters).
    """
    rows, tp = lay.rows, lay.tp
    counts = stage_kind_counts(blocks, lay) if counts is None else counts
    shared = blocks.head.tied & (lay.pp == 1)
    return (per_row(counts, kind_params_per_rank(blocks, tp)) + rows.has_embedding * blocks.embedding.params_per_rank(tp)
            + rows.has_head * blocks.head.params_per_rank(tp, shared))


def stage_expert_params(blocks: ModelBlocks, lay: ParallelLayout, counts: np.ndarray) -> np.ndarray:
    """Routed-expert parameters held by one rank of each stage row (S, N): E/ep experts of
    1/etp width per MoE layer."""
    return per_row(counts, kind_expert_params_per_rank(blocks, lay.ep, lay.etp))


def model_state_bytes(params: np.ndarray, zero_stage: np.ndarray, shard: np.ndarray, offload: np.ndarray,
                      precision: str, grad_precision: str, optimizer: str, param_is_master: bool = False
                      ) -> dict[str, np.ndarray]:
    """Weights, gradients and optimizer states of one rank, bytes.

    `shard` is the ZeRO sharding degree (dp·cp ranks hold the same parameters).

    `param_is_master` (a framework's `zero3_param_is_master`, profiles/frameworks/): PyTorch FSDP2
    under ZeRO-3 keeps one shard of each parameter, in the parameter's own dtype (fp32), which the
    optimizer updates in place: it is the fp32 master weight of the optimizer term, and no 16-bit
    shard exists beside it (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: the sharded
    parameter keeps its original dtype, MixedPrecisionPolicy.param_dtype only casts the all-gather's
    input and the unsharded parameter; the gathered 16-bit layers are `zero3_buffers`). The params
    term is then 0 under ZeRO-3; with ZeRO 1-2 (reshard_after_forward False) the unsharded 16-bit
    parameters stay from the forward to the backward and the term is unchanged.

    >>> z = lambda stage, nd: model_state_bytes(np.array(7.5e9), np.array(stage), np.array(nd),
    ...     np.array(False), "fp16", "fp16", "adam")
    >>> [round(float(sum(z(stage, 64).values())) / 1e9, 2) for stage in (1, 2, 3)]  # ZeRO Table 1, 7.5B, Nd=64
    [31.41, 16.64, 1.88]
    >>> fsdp2 = model_state_bytes(np.array(8e9), np.array(3), np.array(8), np.array(False), "bf16", "fp32", "adam",
    ...                           param_is_master=True)
    >>> {k: float(v) / 1e9 for k, v in fsdp2.items()}  # 4 + 4 + 8 bytes per parameter, over 8 ranks
    {'params': 0.0, 'grads': 4.0, 'optimizer': 12.0}
    """
    weights = params * WEIGHT_BYTES[precision] / np.where(zero_stage >= 3, shard, 1)
    grads = params * DTYPE_BYTES[grad_precision] / np.where(zero_stage >= 2, shard, 1)
    states = params * optimizer_state_bytes(optimizer, precision) / np.where(zero_stage >= 1, shard, 1)
    states = np.where(offload, 0.0, states)
    if param_is_master and precision != "fp32":  # FSDP2: the fp32 shard is the parameter; no 16-bit shard
        weights = np.where((zero_stage >= 3) & ~np.asarray(offload, dtype=bool), 0.0, weights)
    return {"params": weights, "grads": grads, "optimizer": states}


def module_activation_bytes(layer, x: Micro, modules=RECOMPUTE_MODULES) -> dict[str, np.ndarray]:
    """Bytes of one layer's stored activations that each of Megatron's `--recompute-modules`
    drops (per rank, one micro-batch); the layer then keeps what the module is recomputed from.

    core_attn: the unfused scores and softmax (flash keeps none); layernorm: the two norm
    outputs (inputs of attention and of the MLP); mla_up_proj: the per-head Q, K, V of latent
    attention; mlp: a dense MLP's inner activations; moe_act: the experts' activation outputs;
    shared_experts: the shared experts' inner activations; moe: everything the MoE block
    keeps past its input."""
    n, act, h = x.tokens, x.act, layer.hidden
    att = layer.attention()
    out: dict[str, np.ndarray] = {m: ZERO for m in modules}
    if "core_attn" in out and x.attention_kernel == "unfused" and att is not None:
        out["core_attn"] = att.activations(x).scores / x.tp
    if "layernorm" in out:  # the norms' outputs are the QKV and fc1 inputs those GEMMs keep (one norm per sub-layer)
        out["layernorm"] = layer.num_sublayers * n * x.gemm_input * h / x.seq_split
    if "mla_up_proj" in out and isinstance(att, LatentAttention):
        out["mla_up_proj"] = n * act * (2 * att._qk + att.num_heads * att.v_dim) / x.tp
    for b in layer.blocks:
        if "mlp" in out and isinstance(b, DenseMLP):
            out["mlp"] = b.activations(x).split / x.tp
        elif isinstance(b, MoE):
            if "moe_act" in out:
                # fc2's kept input, and with megatron-core's clamp the clamped copy the fused activation keeps (the
                # clamps' own input, the fc1 output, is the checkpoint's input and stays)
                out["moe_act"] = b.routed_tokens(x) * (x.gemm_input * b.ffn / x.etp + b.clamp_kept_bytes(x))
            if "shared_experts" in out and b.shared:
                out["shared_experts"] = b.shared.activations(x).split / x.tp
            if "moe" in out:
                moe = b.activations(x)
                out["moe"] = moe.split / x.tp + moe.routed
    return out


def selective_saving_bytes(layer, x: Micro, mask: np.ndarray) -> np.ndarray:
    """Bytes selective recompute drops for the modules in `mask` (see `selected_modules`)."""
    selected = selected_modules(mask)
    parts = module_activation_bytes(layer, x, tuple(selected))
    return sum((np.where(on, parts[m], 0.0) for m, on in selected.items()), ZERO)


def op_sac_activation_bytes(layer, x: Micro) -> np.ndarray | None:
    """Activation bytes one dense layer keeps under torchtitan's op-level selective checkpointing
    (`selective_ac_option = "op"`, profiles/frameworks/torchtitan.yaml), one micro-batch, one rank;
    None for a layer the policy is not costed for (latent attention, MoE).

    The checkpointed layer keeps its input and the outputs of the ops on the save list: every
    other `aten.mm` of the layer in call order (wq, wv, w1 and, gated, w2; wk, wo, w3 or a plain
    MLP's fc2 are recomputed), the attention kernel's output and softmax statistics, and with
    tp > 1 the outputs of the two reduce-scatters. A row-parallel mm (w2) outputs the full hidden
    width of partial sums before its reduce-scatter. Symbols as in the module docstring:
    2sbh/t (input, sequence-sharded) + 2sbq/t (wq) + 2sbk/t (wv) + 2sbq/t + 4asb/t (attention) +
    2sbf/t (w1) + 2sbh (w2, gated) + 2·2sbh/t (reduce-scatters, tp > 1)."""
    att = layer.attention()
    mlps = [b for b in layer.blocks if isinstance(b, DenseMLP)]
    if att is None or isinstance(att, LatentAttention) or layer.is_moe or len(mlps) != 1:
        return None
    mlp, n, act, t = mlps[0], x.tokens, x.act, x.tp
    stats = att.activations(x).scores / t  # flash: fp32 log-sum-exp; unfused: what its kernel keeps
    kept = n * act * att.hidden / x.seq_split  # the checkpoint's input
    kept = kept + n * act * (att.q_width + att.kv_width) / t + n * act * att.q_width / t + stats
    kept = kept + n * act * mlp.ffn / t + (n * act * mlp.hidden if mlp.gated else 0.0)
    return kept + np.where(np.asarray(t) > 1, 2 * n * act * att.hidden / t, 0.0)


def kind_activation_bytes(layer, x: Micro, recompute, modules=0, policy: str = "megatron_modules") -> np.ndarray:
    """Activation bytes one layer of a kind stores for one micro-batch on one rank;
    `recompute`: 0 none, 1 selective, 2 full (layer input only). Selective follows the
    framework's `policy` (cost_models.sharding.SELECTIVE_POLICIES): megatron_modules drops what
    the `modules` bit mask of RECOMPUTE_MODULES frees (0 = the attention core), op_sac keeps
    what torchtitan's op policy saves (`op_sac_activation_bytes`), none checkpoints nothing.
    Tokens routed to this rank's experts are already per rank."""
    recompute = np.asarray(recompute)
    a = layer.activations(x)
    full = a.replicated / x.seq_split + (a.split + a.scores) / x.tp + a.routed
    op_sac = op_sac_activation_bytes(layer, x) if policy == "op_sac" else None
    if not np.any(recompute == 1) or policy == "none":
        selective = full
    elif op_sac is not None:
        selective = np.minimum(op_sac, full)
    else:
        selective = np.maximum(full - selective_saving_bytes(layer, x, modules), 0.0)
    checkpoint = x.tokens * x.act * layer.hidden / x.seq_split
    return np.where(recompute == 2, checkpoint, np.where(recompute == 1, selective, full))


def layer_activation_bytes(blocks: ModelBlocks, x: Micro, recompute) -> np.ndarray:
    """Activation bytes the model's average layer stores for one micro-batch on one rank.

    `recompute`: 0 none, 1 selective (attention core recomputed), 2 full (layer
    input only). Reproduces Korthikanti Table 2 for GPT shapes:

    >>> from types import SimpleNamespace as NS
    >>> from cost_models.blocks import model_blocks
    >>> gpt = NS(hidden_size=12288, num_attention_heads=96, q_width=12288, kv_width=12288, num_layers=1,
    ...          ffn_hidden_size=4 * 12288, gated_mlp=False, dropout=True, norm="layernorm", linear_bias=True,
    ...          qkv_bias=False, position_embedding="learned", max_position_embeddings=2048, vocab_size=51200,
    ...          tie_embeddings=True)
    >>> s, b, h, a, t = 2048, 1, 12288, 96, 8
    >>> x = lambda sp: Micro(s, np.array(b), np.array(t), np.array(1), np.array(sp), "bf16", "unfused")
    >>> bool(layer_activation_bytes(model_blocks(gpt), x(False), 0) == s*b*h*(10 + 24/t + 5*a*s/(h*t)))
    True
    >>> bool(layer_activation_bytes(model_blocks(gpt), x(True), 1) == s*b*h*34/t)
    True
    """
    return blocks.mean(lambda layer: kind_activation_bytes(layer, x, recompute))


def stage_activation_bytes(blocks: ModelBlocks, x: Micro, st: StrategyArrays, lay: ParallelLayout,
                           num_microbatches: np.ndarray, framework: Framework, counts: np.ndarray | None = None
                           ) -> dict[str, np.ndarray]:
    """Activations held at the peak by one rank of each stage row (S, N), bytes.

    The stage holds `inflight_chunks` (micro-batch, chunk) pairs of `chunk_layers`
    layers each (the row's average layer when its layers are of several kinds).
    Full recompute with `recompute_num_layers` n recomputes n layers per chunk
    (Megatron's block method) and stores the rest whole; while it recomputes, one
    layer's full activations are live (`recompute_working`, the largest kind's). `framework` (the
    plan's framework profile) says how selective recompute checkpoints and how the loss holds the logits.
    """
    rows, rc, n = lay.rows, st.recompute, len(st)
    policy = framework.selective_recompute
    counts = stage_kind_counts(blocks, lay) if counts is None else counts
    full_k = _stack([kind_activation_bytes(k, x, 0) for k in blocks.all_kinds], n)
    stored_k = _stack([kind_activation_bytes(k, x, rc, st.recompute_modules, policy) for k in blocks.all_kinds], n)
    if counts.shape[0] == 1:
        layers_row, full_layer, stored_layer = counts[0], full_k[0], stored_k[0]
    else:
        layers_row = counts.sum(axis=0)
        denom = np.maximum(layers_row, 1e-12)
        full_layer, stored_layer = per_row(counts, full_k) / denom, per_row(counts, stored_k) / denom
    chunk = layers_row / lay.vpp
    n_rc = np.where(st.recompute_num_layers > 0, np.minimum(st.recompute_num_layers, chunk), chunk)
    per_chunk = np.where(rc == 2, n_rc * stored_layer + (chunk - n_rc) * full_layer, chunk * stored_layer)
    # activation offloading (pp 1, no recompute: one micro-batch in flight) keeps the other layers only
    layers = np.maximum(lay.inflight_chunks(rows.rank, num_microbatches) * per_chunk
                        - offloaded_layers(st, layers_row) * stored_layer, 0.0)
    working = np.where(rc == 2, full_k.max(axis=0), 0.0) * (layers_row > 0)
    if policy == "op_sac":  # while one layer's backward recomputes, what the op policy dropped is live again
        working = working + np.where(rc == 1, (full_k - stored_k).max(axis=0), 0.0) * (layers_row > 0)
    embed = rows.has_embedding * lay.inflight_microbatches(rows.rank, num_microbatches) * blocks.embedding.input_bytes(x)
    head_act = blocks.head.activations(x)
    per_logit = cross_entropy_bytes_per_logit(x.act, framework.cross_entropy_memory, x.cross_entropy_fusion, np.asarray(x.tp) > 1,
                                              x.cross_entropy_impl)
    logits = per_logit * x.tokens * padded_vocab(blocks.head.vocab, x.tp) / x.tp
    head_in = head_act.replicated / x.seq_split
    if framework.tp_head_saves_gathered_input:  # the output layer's input: all-gathered over tp, saved whole
        head_in = head_act.replicated / 2 * (1 / x.seq_split + 1)
    head = rows.has_head * (head_in + logits)
    return {"activations": layers, "recompute_working": working, "embedding_activations": embed, "logits": head}


def offloaded_layers(st: StrategyArrays, layers_row: np.ndarray) -> np.ndarray:
    """Layers of each stage row whose activations are offloaded to the host (S, N): Megatron's
    `--cpu-offloading-num-layers`, the first layers of the model, on its one stage (the rules allow it
    with pp 1 and no recomputation only). Transformer Engine's offload schedule (cpu_offload.py,
    OffloadSynchronizer._default_offload_sync_init, TE commit 00382b96) finishes the copy of offloaded
    layer i before layer L - N + i starts its forward, so that the activations held are those of the
    L - N other layers: the offloaded ones are not held at the peak."""
    return np.minimum(st.offload_activation_layers, layers_row)


def offloaded_activation_bytes(blocks: ModelBlocks, x: Micro, st: StrategyArrays, counts: np.ndarray) -> np.ndarray:
    """Host memory one rank's offloaded activations take (S, N), bytes: the offloaded layers' activations
    of the one micro-batch in flight (the stage's average layer)."""
    n = len(st)
    if not np.any(st.offload_activation_layers):
        return np.zeros(counts.shape[1:])
    layers_row = counts.sum(axis=0)
    stored_k = _stack([kind_activation_bytes(k, x, 0) for k in blocks.all_kinds], n)
    per_layer = per_row(counts, stored_k) / np.maximum(layers_row, 1e-12)
    return offloaded_layers(st, layers_row) * per_layer


def zero3_working_bytes(blocks: ModelBlocks, st: StrategyArrays, precision: str, grad_precision: str) -> np.ndarray:
    """ZeRO-3 gathers whole layers: the current and the prefetched one (16-bit), plus one
    layer's unsharded gradient before its reduce-scatter, bytes (the largest kind's layer)."""
    per_layer = (kind_params_per_rank(blocks, st.tp) + kind_expert_params_per_rank(blocks, st.ep, st.etp)).max(axis=0)
    gathered = (2 * WEIGHT_BYTES[precision] + DTYPE_BYTES[grad_precision]) * per_layer
    return np.where(st.zero_stage >= 3, gathered, 0.0)


def zero3_head_bytes(blocks: ModelBlocks, st: StrategyArrays, lay: ParallelLayout, precision: str,
                     keeps_head: bool) -> np.ndarray:
    """The output layer's gathered 16-bit weights on the last stage (S, N), bytes, for a framework whose
    ZeRO-3 keeps the final norm and output layer gathered from their forward to their backward
    (`zero3_head_unsharded`, profiles/frameworks/): they are live across the loss, the activation peak.

        bytes = (norm + V·h/t) · weight_bytes      (0 with tied embeddings and pp = 1: the head is the
                                                     embedding, which is resharded after its forward)
    """
    if not keeps_head:
        return np.zeros_like(lay.rows.has_head, dtype=float)
    shared = blocks.head.tied & (lay.pp == 1)
    gathered = blocks.head.params_per_rank(lay.tp, shared) * WEIGHT_BYTES[precision]
    return np.where(st.zero_stage >= 3, lay.rows.has_head * gathered, 0.0)


# ---- FP8 copies of the weights ------------------------------------------------------------------
#: Elements per scale of a quantised weight under the block-scaled recipes: blockwise scales 128x128
#: tiles (Transformer Engine 2.10 tensor/float8_blockwise_tensor.py, block_len 128, block_scaling_dim 2
#: for weights; DeepSeek-V3 Sec. 3.3.2), mxfp8 1x32 blocks (constants.py MXFP8_BLOCK_SCALING_SIZE = 32),
#: with the scale sizes of `cost_models.elementwise.SCALE_BYTES` (fp32; E8M0, one byte). Per-tensor recipes
#: keep one fp32 scale per tensor: nothing per element.
WEIGHT_BLOCK_ELEMENTS = {"blockwise": 128 * 128, "mxfp8": 32, "nvfp4": 16 * 16}  # NVFP4 weights: 16x16 blocks
# (NVFP4BlockScaling's 2D weight quantisation, arXiv 2509.25149 Sec. 4), two FP4 copies (row- and column-wise)


def fp8_weight_bytes_per_element(recipe: str, transpose: bool) -> float:
    """Bytes of all the FP8 copies of one weight element that a quantised GEMM needs, scales included.

    The forward GEMM reads the row-wise copy. The backward's input-gradient GEMM reads the weight
    the other way round: on Hopper (`transpose`, the GPU's element-wise table: FP8 tensor cores take
    the TN layout only) a per-tensor-scaled weight needs a transposed copy (Float8Tensor `_data` and
    `_transpose`, TE tensor/storage/float8_tensor_storage.py; TransformerEngine#1261); a block-scaled
    weight always needs a second, column-wise quantised copy with its own scales, since the scales
    run along one dimension (MXFP8Tensor `_rowwise_data` / `_columnwise_data` and their
    `_*_scale_inv`, mxfp8_tensor_storage.py; Float8BlockwiseQTensor's column-wise data;
    TransformerEngine#1880: "MXFP8 requires 2 bytes/param"). Blackwell runs per-tensor FP8 GEMMs in
    any layout: one copy.

    >>> [fp8_weight_bytes_per_element(r, True) for r in ("delayed", "tensorwise")]  # Hopper
    [2, 2]
    >>> fp8_weight_bytes_per_element("delayed", False), fp8_weight_bytes_per_element("mxfp8", False)  # Blackwell
    (1, 2.0625)
    """
    block = WEIGHT_BLOCK_ELEMENTS.get(recipe)
    copies = fp8_copies(recipe, transpose)
    element = ELEMENT_BYTES.get(recipe, FP8)
    return copies * (element + SCALE_BYTES[recipe] / block) if block else copies * FP8


def fp8_param_bytes_per_element(recipe: str, transpose: bool) -> float:
    """Bytes per element the FP8 parameter itself holds with `fp8_param_gather` (what the optimizer
    writes and ZeRO shards and gathers): the row-wise copy, and for mxfp8 the column-wise one too
    (MXFP8 scales cannot be derived from the row-wise copy, so megatron-core keeps both: Megatron-FSDP
    gathers a second, "transpose" buffer for MXFP8Tensor, fsdp/src/megatron_fsdp/mixed_precision.py
    fp8_need_transpose_data). The other copies are derived after each all-gather
    (`fp8_weight_bytes_per_element` less this).

    >>> fp8_param_bytes_per_element("delayed", True), fp8_param_bytes_per_element("mxfp8", False)
    (1, 2.0625)
    """
    if recipe == "mxfp8":
        return fp8_weight_bytes_per_element(recipe, transpose)
    block = WEIGHT_BLOCK_ELEMENTS.get(recipe)
    return FP8 + SCALE_BYTES[recipe] / block if block else FP8


def fp8_gather_bytes_per_element(recipe: str) -> int:
    """Bytes a ZeRO parameter all-gather moves per element of an FP8 parameter (`fp8_param_gather`):
    one, the row-wise FP8 data (megatron-core 0.16 distributed_data_parallel.py gives FP8 parameters a
    torch.uint8 buffer; TE's post_all_gather_processing then derives the transposed or column-wise copy,
    tensor/utils.py), except for mxfp8, whose two quantised copies cannot be derived from one another:
    the distributed optimizer gathers bf16 values through the gradient buffer and requantises them
    (param_and_grad_buffer.py shared_buffer, distrib_optimizer.py _copy_main_params_to_param_buffer;
    Megatron-LM#4987), Megatron-FSDP gathers both FP8 copies: two bytes either way.

    >>> fp8_gather_bytes_per_element("delayed"), fp8_gather_bytes_per_element("mxfp8")
    (1, 2)
    """
    return BF16 if recipe == "mxfp8" else FP8


def param_gather_saving_per_element(train) -> float:
    """Bytes fewer than the 16-bit weight that a ZeRO all-gather moves per quantised weight element:
    0 unless FP8 training keeps FP8 parameters (`fp8_param_gather`)."""
    if train.precision != "fp8" or not getattr(train, "fp8_param_gather", False):
        return 0.0
    return WEIGHT_BYTES[train.precision] - fp8_gather_bytes_per_element(train.fp8_recipe)


def kind_quantised_weights(blocks: ModelBlocks, x: Micro) -> tuple[np.ndarray, np.ndarray]:
    """((K, N), (K, N)) weight elements of the FP8 GEMMs of one layer of each kind on one rank:
    outside the routed experts, and of the routed experts (the grouped GEMMs: E/ep experts of 1/etp
    width). The GEMMs of `Gemm.quantised` (the step's weight casts read these counts too): the
    transformer layers' linears and the experts, not the router, the embedding or the output layer."""
    n = len(np.atleast_1d(x.tp))
    dense, experts = [], []
    for layer in blocks.all_kinds:
        gemms = [g for g in layer.gemms(x) if g.quantised]
        dense.append(sum((g.count * g.k * g.n for g in gemms if not g.grouped), ZERO))
        experts.append(sum((g.count * g.k * g.n for g in gemms if g.grouped), ZERO))
    return _stack(dense, n), _stack(experts, n)


def fp8_weight_memory(dense: np.ndarray, experts: np.ndarray, zero_stage: np.ndarray, shard: np.ndarray,
                      expert_shard: np.ndarray, recipe: str, transpose: bool, param_gather: bool, cached: bool,
                      weight_bytes: int) -> dict[str, np.ndarray]:
    """The FP8 weight copies of one rank, bytes: {"fp8_weights": the copies' own term, "params": the
    change to the params term}. `dense`, `experts`: quantised weight elements the rank holds
    (`kind_quantised_weights` over its layers); `shard`, `expert_shard`: their ZeRO sharding degrees.

    Without `param_gather` the 16-bit parameters stay, and a framework that caches (`cached`:
    Transformer Engine under Megatron, profiles/frameworks/) keeps every FP8 copy of every quantised
    weight of the rank's layers from the step's first micro-batch to its last, ZeRO stage or not (the
    cache holds the gathered weight; a framework that casts in every GEMM keeps none past it):

        fp8_weights = (dense + experts) · fp8_weight_bytes_per_element

    With `param_gather` (Megatron's --fp8-param-gather: the model is built under TE's fp8_model_init,
    megatron-core's TransformerConfig.fp8_param) the FP8 tensor is the parameter: no 16-bit copy of those
    weights and no workspace beside it (TransformerEngine#647; TE get_weight_workspace returns a quantised
    weight as it is). The params term holds the parameter's own bytes instead of the 16-bit ones (ZeRO-3
    shards them), and the copies derived after the all-gather stay with ZeRO 1-2 (transpose or column-wise,
    kept until the next gather) and are dropped with each layer under ZeRO-3 (Megatron-FSDP discards them
    after use unless keep_fp8_transpose_cache; the gathered layer is `zero3_buffers`):

        params      += (own - weight_bytes) · (dense / shard₃ + experts / expert_shard₃)
        fp8_weights  = (every - own) · (dense + experts), 0 with ZeRO-3

    The fp32 master weights and the gradient buffer do not change (megatron-core keeps main_grad in
    grad_dtype; mxfp8 reuses it for the all-gather, --reuse-grad-buf-for-mxfp8-param-ag).

    >>> q, one = np.array([1e9]), np.array([1])
    >>> m = lambda **kw: {k: float(v[0] if np.ndim(v) else v) / 1e9 for k, v in fp8_weight_memory(
    ...     q, 0 * q, one, 8 * one, one, kw.pop("recipe", "delayed"), kw.pop("transpose", True), cached=True,
    ...     weight_bytes=2, **kw).items()}
    >>> m(param_gather=False), m(param_gather=True)  # Hopper, delayed: GB
    ({'fp8_weights': 2.0, 'params': 0.0}, {'fp8_weights': 1.0, 'params': -1.0})
    """
    every = fp8_weight_bytes_per_element(recipe, transpose)
    if not param_gather:
        copies = (dense + experts) * every if cached else np.zeros_like(dense + experts)
        return {"fp8_weights": copies, "params": np.zeros_like(copies)}
    own = fp8_param_bytes_per_element(recipe, transpose)
    z3 = np.asarray(zero_stage) >= 3
    held = dense / np.where(z3, shard, 1) + experts / np.where(z3, expert_shard, 1)
    return {"fp8_weights": np.where(z3, 0.0, (every - own) * (dense + experts)), "params": (own - weight_bytes) * held}


# ---- the loss ----------------------------------------------------------------------------------
def cross_entropy_bytes_per_logit(act_bytes: int, impl: str = "megatron", fused=False, loss_parallel=False,
                                  fusion_impl: str = "native"):
    """Peak bytes per logit element (one token, one vocabulary entry of this rank's shard) while
    the loss of one micro-batch is computed; `impl` is the framework's `cross_entropy_memory`
    (profiles/frameworks/), `fused` the plan's `cross_entropy_fusion`, `loss_parallel` (tp > 1)
    whether the logits are split over the vocabulary.

    megatron (whatever `fused`), and pytorch without `fused` or `loss_parallel`: PyTorch's cross
    entropy over fp32 logits (`F.cross_entropy(logits.float())`, torchtitan components/loss.py and
    this project's executor). Forward: the logits (act), their fp32 copy (FP32, none when act is
    fp32) and the saved fp32 log-softmax (FP32) are live together. Backward: the saved log-softmax,
    the gradient of the loss with respect to it and the gradient with respect to the logits are
    three fp32 tensors (3·FP32). The peak is the larger. Megatron's fused vocab-parallel cross
    entropy (`_VocabParallelCrossEntropy`) writes its backward in place and peaks in the forward
    (act + 2·FP32), at most 2 bytes less per element; the larger figure is kept for both.

    megatron with `fused` and `fusion_impl` te (`--cross-entropy-fusion-impl te`: Transformer Engine's Triton
    parallel cross-entropy, transformer_engine/pytorch/triton/cross_entropy.py at v2.9): the forward writes
    each logit's gradient over it in place and saves that tensor for the backward, which scales it in place;
    beside the 16-bit logits only fp32 per-token statistics (max, sum, target logit, loss) live: act.

    pytorch with `loss_parallel` (torchtitan's loss_parallel, on whenever tp > 1: the output layer
    leaves its logits sharded over the vocabulary and torch/distributed/tensor/parallel/loss.py runs
    the loss on the shards). Its `_log_softmax` keeps the fp32 input, the shifted logits and their
    exponential live together beside the caller's 16-bit logits (act + FP32 + 2·FP32), and its fused
    `_nll_loss_and_log_softmax_backward` computes `(grad_input + exp(x)) * grad_output` next to the
    saved log-softmax x: x, the one-hot grad_input, exp(x) and their sum are four fp32 tensors
    (4·FP32, then the product replaces exp(x)).

    pytorch with `fused`: flash-attn's fused cross entropy (flash_attn/ops/triton/cross_entropy.py,
    LLM Foundry's default `loss_fn` 'fused_crossentropy', llmfoundry/models/mpt/modeling_mpt.py):
    the kernel reads the 16-bit logits and keeps only fp32 per-token statistics (lse, losses);
    it saves the logits themselves and its backward writes the gradient into a new tensor of the
    logits' dtype (`torch.empty_like(logits)`, inplace_backward False by default): 2·act.

    >>> cross_entropy_bytes_per_logit(2), cross_entropy_bytes_per_logit(4)
    (12, 12)
    >>> [int(cross_entropy_bytes_per_logit(2, "pytorch", f, lp)) for f, lp in ((False, False), (False, True), (True, True))]
    [12, 16, 4]
    >>> cross_entropy_bytes_per_logit(2, "megatron", True, fusion_impl="te"), cross_entropy_bytes_per_logit(2, "megatron", False, fusion_impl="te")
    (2, 12)
    """
    forward = act_bytes + (FP32 if act_bytes < FP32 else 0) + FP32
    backward = 3 * FP32
    plain = max(forward, backward)
    if impl != "pytorch":
        return act_bytes if fused and fusion_impl == "te" else plain
    if fused:
        return 2 * act_bytes
    parallel = max(act_bytes + (FP32 if act_bytes < FP32 else 0) + 2 * FP32, 4 * FP32)
    return np.where(np.asarray(loss_parallel), parallel, plain)


# ---- memory outside the model's tensors ------------------------------------------------------
#: terms that no tensor of the model holds; a measurement of allocated tensors excludes them
RUNTIME_TERMS = ("framework_reserve", "cuda_context", "nccl_buffers", "dispatcher_buffers", "allocator_slack")
#: terms outside PyTorch's caching allocator (a `max_memory_reserved` reading excludes them)
OUTSIDE_ALLOCATOR_TERMS = ("framework_reserve", "cuda_context", "nccl_buffers", "dispatcher_buffers")


#: Channels NCCL opens to a peer it reaches over the network for point-to-point work (all-to-all,
#: send/recv): NCCL_NCHANNELS_PER_NET_PEER, 2 by default (NCCL environment-variable documentation);
#: users report all-to-all across nodes running on 1-2 channels by default and raise it by hand
#: (NVIDIA/nccl#1680; a GB200 tuning note measuring "1 channel" by default). Peers inside the NVLink
#: domain take the table's `nccl_channels` (measured: 32 per pair of H100s, NVIDIA/nccl#1685).
NET_PEER_CHANNELS = 2


def nccl_buffer_bytes(st: StrategyArrays, table: MemoryTable, domain: int | None = None,
                      alltoall: bool = True) -> np.ndarray:
    """NCCL's own device buffers on one rank (N,), bytes; NCCL allocates them itself, outside
    PyTorch's caching allocator.

        bytes = (ring · channels + all-to-all peers' channels) · connection_bytes
        ring  = 2 connections per ring collective group (tp, cp, the gradient group dp·cp; a ring
                connects each rank to its two neighbours whatever the group size)
                + 2 for pipeline sends to the previous and next stage (pp > 1)
        all-to-all peers of expert parallelism: the ep - 1 others, those inside the NVLink domain
                (`domain`, ep ranks etp apart) at `channels` each, the rest at NET_PEER_CHANNELS

    Sources: NCCL's memory is linear in the number of channels and a ring has two connections
    whatever the scale (S. Jeaugey, NVIDIA/nccl#864 / #986); an all-to-all connects every pair
    of ranks (NVIDIA/nccl#1685: 32 channels per pair of H100s, 10 MiB + 2 MiB per channel and
    peer, 3.28 GB more after the first all-to-all on 8 GPUs). Communicators are assumed not to
    share resources (no `ncclCommSplit` sharing), as PyTorch's process groups create them.
    Without `domain` every peer counts as inside it (the upper bound). Only the all-to-all dispatcher
    (`alltoall`) opens the expert peers' connections: the flex dispatchers (DeepEP, HybridEP) move tokens
    through their own NVLink / RDMA buffers (megatron-core transformer/moe/fused_a2a.py `get_buffer`: a
    deep_ep Buffer sized by DeepEP's `get_nvl_buffer_size_hint` / `get_rdma_buffer_size_hint`; HybridEP's
    own buffers), which are the `dispatcher_buffers` term (`dispatcher_buffer_bytes`), not this one.
    """
    ring = 2 * ((st.tp > 1).astype(float) + (st.cp > 1) + (st.dp * st.cp > 1)) + 2.0 * (st.pp > 1)
    peers = np.maximum(st.ep - 1, 0).astype(float) * (1.0 if alltoall else 0.0)
    local = peers if domain is None else np.minimum(peers, np.maximum(domain // np.maximum(st.etp, 1), 1) - 1)
    channels = ring * table.nccl_channels + local * table.nccl_channels + (peers - local) * NET_PEER_CHANNELS
    return channels * table.nccl_connection_bytes


#: DeepEP's peers reached over NVLink (NUM_MAX_NVL_PEERS in csrc/kernels/configs.cuh, v1.2.1): larger groups
#: reach the others by RDMA, through their own buffer.
DEEPEP_NVL_PEERS = 8
#: DeepEP's receive chunk (tokens per channel and peer) of its recommended NVLink configs by group size
#: (`Buffer.get_dispatch_config` / `get_combine_config`, deep_ep/buffer.py v1.2.1: 256 up to 8 ranks, 288 for
#: 16 to 64, 560 for 128, 720 for 144 and 160; the dispatch and combine configs agree on it), read as a step
#: over the group sizes between; its RDMA receive chunk is 128 tokens at every size.
DEEPEP_NVL_RECV_TOKENS = ((8, 256), (64, 288), (128, 560), (1 << 30, 720))
DEEPEP_RDMA_RECV_TOKENS = 128
#: DeepEP's per-token extras in its buffers (config.hpp `get_*_buffer_size_hint`): up to 128 top-k indices
#: (int64) and weights (fp32), 128 fp32 scales, and the 8-byte SourceMeta (internode.cu)
DEEPEP_TOKEN_EXTRA_BYTES = 128 * 8 + 128 * 4 + 128 * 4 + 8


def dispatcher_buffer_bytes(dispatcher: str, tokens: np.ndarray, hidden: int, experts: int, ep: np.ndarray,
                            members: np.ndarray, sms: int | None = None) -> np.ndarray:
    """Device memory one rank's flex MoE dispatcher allocates for itself, outside PyTorch's caching allocator
    (arrays over candidates), bytes; 0 for the all-to-all dispatcher (NCCL's buffers, `nccl_buffer_bytes`).

    `tokens`: the rank's tokens per micro-batch at the MoE layer (after sequence parallelism), `members`: the
    expert-parallel ranks inside one NVLink domain, `sms`: the dispatcher's SMs (None: megatron-core's default).

    DeepEP (megatron-core `fused_a2a.get_buffer`: the larger of its dispatch and combine configs' size hints,
    deep_ep v1.2.1 csrc/config.hpp): per channel (two SMs each) and NVLink peer (at most 8), a receive
    chunk of tokens, each its hidden bytes (16-bit, `get_hidden_bytes`) plus `DEEPEP_TOKEN_EXTRA_BYTES`;
    beyond 8 ranks, per channel and RDMA peer (ep / 8), twice a 128-token chunk of the same plus 16 bytes.
    Independent of the batch: DeepEP streams tokens through the chunks.

    HybridEP (megatron-core `fused_a2a.init_hybrid_ep_buffer` with `max_num_of_tokens_per_rank` the
    micro-batch's tokens; DeepEP hybrid-ep branch at 1dddd19, csrc/hybrid_ep/hybrid_ep.cu `allocate_buffer`
    and internode.cu): a receive buffer for the worst case that every rank's tokens come to this one,
    tokens x ep rows of 16-bit hidden, fp32 probabilities for the domain's experts and fp32 scaling factors
    per 128 values, shared by the dispatch and the combine; across NVLink domains (N = ep / members) also
    the RDMA staging buffers: the rank's own tokens with probabilities for all experts, and three more
    buffers of its tokens per other domain (the dispatch's group buffer with scaling factors, the combine's
    reduction and group buffers).

    DeepSeek-V3 (hidden 7168) at ep 8 with 20 SMs: 10 channels x 8 peers x 256 tokens x 16,392 bytes:

    >>> int(dispatcher_buffer_bytes("deepep", np.array([4096]), 7168, 256, np.array([8]), np.array([8]))[0]) // 2**20
    320
    >>> int(dispatcher_buffer_bytes("hybridep", np.array([16384]), 2048, 128, np.array([8]), np.array([8]))[0]) // 2**20
    584
    """
    tokens, ep, members = (np.asarray(v, dtype=float) for v in (tokens, ep, members))
    zero = np.zeros(np.broadcast(tokens, ep, members).shape)
    if dispatcher == "deepep":
        channels = (sms or 20) // 2
        nvl = np.minimum(ep, DEEPEP_NVL_PEERS)
        rdma = np.maximum(ep // DEEPEP_NVL_PEERS, 1)
        recv = np.select([ep <= limit for limit, _ in DEEPEP_NVL_RECV_TOKENS], [n for _, n in DEEPEP_NVL_RECV_TOKENS])
        token = 2 * hidden + DEEPEP_TOKEN_EXTRA_BYTES
        nvl_bytes = channels * nvl * (recv * token + (2 * rdma + 3) * 4)
        rdma_bytes = np.where(ep > DEEPEP_NVL_PEERS, channels * rdma * (2 * DEEPEP_RDMA_RECV_TOKENS * (token + 16)
                                                                          + (2 * DEEPEP_NVL_PEERS + 2) * 2 * 4), 0.0)
        return np.where(ep > 1, zero + nvl_bytes + rdma_bytes, 0.0)
    if dispatcher == "hybridep":
        local = experts / np.maximum(ep, 1)
        inside = np.minimum(members, ep)
        domains = np.maximum(ep / np.maximum(inside, 1), 1)
        scales = 4 * (hidden // 128)
        row = 2 * hidden + 4 * local * inside  # a token's 16-bit hidden and the domain's experts' fp32 probabilities
        intra = tokens * ep * (row + scales)
        rdma = np.where(domains > 1, tokens * (2 * hidden + 4 * local * inside * domains + scales)
                        + tokens * (domains - 1) * (row + scales) + 2 * tokens * (domains - 1) * row, 0.0)
        return np.where(ep > 1, zero + intra + rdma, 0.0)
    return zero


def runtime_memory_bytes(tensor_bytes: np.ndarray, st: StrategyArrays, gpu, domain: int | None = None,
                         alltoall: bool = True, dispatcher_bytes: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Memory of one rank that no model tensor holds, by term (arrays shaped like `tensor_bytes`,
    the sum of the tensor terms of each stage row), bytes.

    With a memory table for the GPU (`gpu.tables.memory`, from profiles/kernels/memory/<set>.yaml):
        cuda_context       = the table's context size
        nccl_buffers       = `nccl_buffer_bytes`
        dispatcher_buffers = `dispatcher_bytes` (a flex MoE dispatcher's own buffers, `dispatcher_buffer_bytes`)
        allocator_slack    = allocator_slack_fraction · tensor_bytes
    Without one, the profile's flat `framework_reserve` (how the calibrated presets were fitted), and the
    dispatcher's buffers, which no calibrated preset's runs had.
    """
    zero = np.zeros_like(tensor_bytes)
    flex = zero if dispatcher_bytes is None else zero + dispatcher_bytes
    table = gpu.tables.memory
    if table is None:
        return {"framework_reserve": zero + gpu.framework_reserve_bytes, "cuda_context": zero,
                "nccl_buffers": zero, "dispatcher_buffers": flex, "allocator_slack": zero}
    return {"framework_reserve": zero, "cuda_context": zero + table.cuda_context_bytes,
            "nccl_buffers": zero + nccl_buffer_bytes(st, table, domain, alltoall), "dispatcher_buffers": flex,
            "allocator_slack": table.allocator_slack_fraction * tensor_bytes}
