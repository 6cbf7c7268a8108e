"""Cost blocks: the pieces of a model, each saying what it costs on one rank.

A transformer layer is a composition of blocks (Megatron-core's
`TransformerLayerSubmodules` in cost form): norm, attention, residual add, norm,
MLP, residual add. The embedding and the output head with its loss are blocks of
their own. Each block answers, over arrays of candidates and for one micro-batch on
one rank (`Micro`):

- `params()`: its parameters (elements, one full copy) and `params_per_rank(tp)`;
- `gemms(x)`: its forward GEMMs as (FLOP, m, n, k), and `core(x)` for attention's
  batched score/value kernels;
- `elementwise(x)`: forward HBM bytes of its non-GEMM kernels and how many kernels;
- `activations(x)`: bytes kept for backward, split into what is replicated over TP
  (sharded by sequence parallelism instead), what is split over TP, and the
  attention scores (what selective recomputation drops);
- `comm(x)`: bytes it exchanges per forward, per parallel dimension.

A model is its embedding, its distinct layer kinds, the kind of each layer in order
(`pattern`), the head and the multi-token-prediction modules (`model_blocks`): one kind
per distinct (MoE or dense MLP, windowed or full attention) pair of the model's
`moe_layer_mask` and `local_attention_mask`, so a uniform stack has one kind and
DeepSeek-V3 (dense first layers) or Gemma (local and global attention) several. A hybrid
Mamba-Transformer stack (`hybrid_override_pattern`: Nemotron-H) has one kind per symbol, each
layer a norm, one of Mamba-2 (`Mamba`), attention, MLP or MoE, and a residual add (`hybrid_layer`).
Per-stage costs count each kind's layers on each stage (`ParallelLayout.pattern_counts`,
`cost_models.memory.stage_kind_counts`); the model's average layer (`ModelBlocks.mean`)
serves only whole-model totals (the step's model and hardware FLOPs) and
`memory.layer_activation_bytes`.

Symbols: s = seq_len, b = micro_batch_size, h = hidden, a = heads, t = tp, c = cp,
f = ffn_hidden_size, q = a·d (query width), k = g·d (key/value width), V = vocabulary.
Sources per block below; activation terms are Korthikanti et al. 2022 Sec. 4 / Table 2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import numpy as np

from cost_models.elementwise import BLOCK_ELEMENTS, ELEMENT_BYTES, SCALE_BYTES
from cost_models.units import ACTIVATION_BYTES, FP8, FP32, INT64, MASK, QUANTISED_PRECISIONS

if TYPE_CHECKING:  # specs are read by attribute only; no import of the planner package at run time
    from planner.specs import ModelSpec

#: Megatron-LM pads the vocabulary to a multiple of `--make-vocab-size-divisible-by` (default
#: 128) times tp (megatron/training/tokenizer `_vocab_size_with_padding`).
VOCAB_PAD_MULTIPLE = 128


@dataclass(frozen=True)
class Micro:
    """One micro-batch on one rank (arrays broadcast over candidates)."""

    seq_len: int
    micro_batch_size: np.ndarray
    tp: np.ndarray
    cp: np.ndarray
    sequence_parallel: np.ndarray  # bool
    precision: str
    attention_kernel: str  # "flash" | "unfused"
    ep: np.ndarray | int = 1
    etp: np.ndarray | int = 1
    moe_load_imbalance: float = 1.0  # busiest expert rank's tokens over the mean (MoE layers)
    cross_entropy_fusion: bool = True  # Megatron's --cross-entropy-loss-fusion (see Head.loss_bytes)
    fp8_recipe: str = "delayed"  # Megatron's --fp8-recipe (cost_models.elementwise)
    moe_dispatcher: str = "alltoall"  # MoE token dispatcher (cost_models.dispatch)
    framework: str = "megatron"  # the training framework whose code runs the layers (its host operations)
    eager: bool = False  # element-wise work as torchtitan's eager PyTorch operators (torch_compile false)
    cross_entropy_impl: str = "native"  # Megatron's --cross-entropy-fusion-impl (see Head.loss_bytes)
    moe_flex_sms: int | None = None  # SMs of the flex dispatcher's kernels (None: Megatron's default; cost_models.dispatch)
    moe_router_padding: bool = False  # Megatron's --moe-router-padding-for-quantization (MoE.quantization_padding)
    cuda_graph: frozenset = frozenset()  # the CUDA graph scopes captured (`graph_scopes`; compute.graph_captured_kernels)
    frozen_base: bool = False  # the base weights are frozen (adapters): GEMM backwards compute input gradients only

    @property
    def te_cross_entropy(self) -> bool:
        """Whether the loss is Transformer Engine's fused cross-entropy (see Head.loss_bytes)."""
        return self.cross_entropy_fusion and self.cross_entropy_impl == "te"

    @cached_property
    def tokens(self) -> np.ndarray:
        """Tokens of the micro-batch on this rank: s / c · b."""
        return self.seq_len / self.cp * self.micro_batch_size

    @property
    def act(self) -> int:
        """Bytes per stored activation element."""
        return ACTIVATION_BYTES[self.precision]

    @property
    def gemm_input(self) -> float:
        """Bytes per element of a quantised GEMM's input kept for its backward (the weight gradient).

        FP8 under Megatron-core (Transformer Engine's modules): the FP8 copy the forward GEMM ran on,
        one byte per element plus the block recipes' scales, not the 16-bit tensor. Transformer Engine
        2.x module/linear.py and layernorm_linear.py keep `inputmat` / `ln_out` quantised for backward,
        dropping its row-wise data where the column-wise copy suffices (`update_usage(rowwise_usage=False,
        columnwise_usage=True)`) or keeping the row-wise one where the input is all-gathered again in the
        backward; grouped_linear.py does the same per expert. The attention core's Q, K, V, the gated
        activation's input and the unquantised router keep 16 bits. Other frameworks keep the 16-bit
        input: torchao's float8 linear saves `input_hp` (torchao/float8/float8_linear.py)."""
        if self.precision not in QUANTISED_PRECISIONS or self.framework != "megatron":
            return self.act
        block = BLOCK_ELEMENTS.get(self.fp8_recipe)
        element = ELEMENT_BYTES.get(self.fp8_recipe, FP8)  # NVFP4 keeps its FP4 copy the same way
        return element + (SCALE_BYTES[self.fp8_recipe] / block if block else 0.0)

    @cached_property
    def seq_split(self) -> np.ndarray:
        """Divisor of TP-replicated tensors: tp with sequence parallelism, else 1."""
        return np.where(self.sequence_parallel, self.tp, 1)

    #: The per-candidate fields that shape a micro-batch's kernels.
    SHAPE_FIELDS = ("micro_batch_size", "tp", "cp", "sequence_parallel", "ep", "etp")

    @cached_property
    def distinct(self) -> tuple["Micro", np.ndarray | None]:
        """The distinct micro-batch shapes among the candidates, and each candidate's index into
        them (None when there is nothing to gain). Thousands of candidates share a few dozen
        shapes, so per-kernel lookups run once per shape.

        >>> x = Micro(4096, np.array([1, 2, 1, 2]), np.array([2, 2, 2, 2]), np.ones(4), np.zeros(4, bool), "bf16", "flash")
        >>> small, index = x.distinct
        >>> small.micro_batch_size.tolist(), index.tolist()
        ([1, 2], [0, 1, 0, 1])
        """
        cols = [np.asarray(getattr(self, f)) for f in self.SHAPE_FIELDS]
        n = max(c.size for c in cols)
        if n < 2:
            return self, None
        cols = [np.broadcast_to(c, (n,)).astype(np.int64) for c in cols]
        key = np.zeros(n, dtype=np.int64)
        for c in cols:  # mixed radix: every field is a small non-negative integer
            key = key * (int(c.max()) + 1) + c
        uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        if len(uniq) == n:
            return self, None
        picked = {f: np.asarray(getattr(self, f)) for f in self.SHAPE_FIELDS}
        picked = {f: (np.broadcast_to(v, (n,))[first] if v.ndim else v) for f, v in picked.items()}
        small = replace(self, **picked)  # every other field (precision, FP8 recipe, ...) carries over
        return small, inverse.ravel()

    def keys(self, window: int) -> np.ndarray | int:
        """Keys each query attends to: the sequence, or the window where it is shorter."""
        return min(self.seq_len, window) if window else self.seq_len


def graph_scopes(impl: str, scope) -> frozenset:
    """The scopes a layer's CUDA graphs capture, from TrainSpec.cuda_graph_impl and cuda_graph_scope (Megatron's
    --cuda-graph-impl, --cuda-graph-scope): none without graphs; an empty scope is the whole layer (attn, mlp,
    and an MoE layer's router and preprocessing).

    >>> sorted(graph_scopes("transformer_engine", [])), sorted(graph_scopes("none", None))
    (['attn', 'mlp', 'moe_preprocess', 'moe_router'], [])
    """
    if impl == "none":
        return frozenset()
    return frozenset(scope) if scope else frozenset({"attn", "mlp", "moe_router", "moe_preprocess"})


@dataclass(frozen=True)
class Gemm:
    """One forward GEMM (m×k)·(k×n) on one rank; `quantised`: runs in FP8 under FP8 training."""

    flop: np.ndarray
    m: np.ndarray
    n: np.ndarray
    k: np.ndarray
    quantised: bool = True
    count: np.ndarray | int = 1  # GEMMs of this shape (a grouped GEMM's experts); flop is their total
    grouped: bool = False  # one grouped-GEMM kernel over `count` experts (GPU's grouped_gemm_efficiency)


@dataclass(frozen=True)
class Core:
    """Attention's batched score and value kernels (never FP8): FLOPs, HBM bytes,
    and the unfused softmax's own traffic (0 with flash attention)."""

    flop: np.ndarray
    bytes: np.ndarray
    num_kernels: int
    softmax_bytes: np.ndarray
    softmax_kernels: int


@dataclass(frozen=True)
class Elementwise:
    bytes: np.ndarray
    num_kernels: int | np.ndarray  # an array where it depends on the candidate (local experts, the dispatcher)


@dataclass(frozen=True)
class Activations:
    """Bytes kept for backward per micro-batch on one rank, before TP/SP division:
    `replicated` is divided by the sequence split, `split` by tp, `scores` by tp."""

    replicated: np.ndarray
    split: np.ndarray
    scores: np.ndarray
    routed: np.ndarray | float = 0.0  # MoE: already per rank (tokens routed to this rank's experts)


@dataclass(frozen=True)
class Comm:
    """Bytes a block exchanges per forward: `tp_exchanges` activations of `tp_bytes` each
    (an all-reduce, or an all-gather + reduce-scatter pair with SP), and `cp_hop_bytes`
    per ring step of context parallelism."""

    tp_exchanges: int = 0
    tp_bytes: np.ndarray | float = 0.0
    cp_hop_bytes: np.ndarray | float = 0.0
    ep_a2a_bytes: np.ndarray | float = 0.0  # MoE: bytes one rank sends in one dispatch (and again in the combine)
    etp_bytes: np.ndarray | float = 0.0  # MoE with etp > 1: tokens all-gathered (and reduce-scattered) over etp
    cp_a2a_bytes: np.ndarray | float = 0.0  # Mamba: bytes one rank sends in the forward's all-to-alls over cp


ZERO = np.zeros(())


@runtime_checkable
class Block(Protocol):
    """Contract: pure functions of the model's shape and numpy arrays (`Micro`); every
    value is per rank, for one micro-batch, in elements / FLOP / bytes as named; never
    negative; a block with nothing of a kind returns zeros (or an empty list)."""

    def params(self) -> int: ...

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray: ...

    def gemms(self, x: Micro) -> list[Gemm]: ...

    def elementwise(self, x: Micro) -> Elementwise: ...

    def activations(self, x: Micro) -> Activations: ...

    def comm(self, x: Micro) -> Comm: ...


class _Quiet:
    """Defaults for blocks that lack a kind of cost."""

    def gemms(self, x: Micro) -> list[Gemm]:
        return []

    def elementwise(self, x: Micro) -> Elementwise:
        return Elementwise(ZERO, 0)

    def activations(self, x: Micro) -> Activations:
        return Activations(ZERO, ZERO, ZERO)

    def comm(self, x: Micro) -> Comm:
        return Comm()


#: Eager PyTorch (torch_compile false, torchtitan's decoder layer): what its operators move beyond the fused
#: kernels. RMSNorm (torch.nn.RMSNorm -> aten rms_norm, layer_norm.cpp rms_norm_symint: upcast to fp32, pow, mean,
#: add eps, rsqrt, multiply, type_as, multiply by the weight): bytes per element of a 16-bit input of `act` bytes,
#: and its kernels (the add and rsqrt on the (tokens, 1) statistics are tiny). LayerNorm is one ATen kernel eager
#: too (native_layer_norm), as fused.
def eager_rmsnorm_bytes(act: int) -> int:
    """Bytes per element of eager RMSNorm: read 16-bit, write fp32 (upcast); pow (read 4, write 4); mean (read 4);
    multiply by the reciprocal (read 4, write 4); type_as (read 4, write 16-bit); times the weight (read, write
    16-bit).

    >>> eager_rmsnorm_bytes(2)  # against 4 for a fused kernel
    36
    """
    return (act + FP32) + 2 * FP32 + FP32 + 2 * FP32 + (FP32 + act) + 2 * act


EAGER_RMSNORM_KERNELS = 8
#: Eager rotary (torchtitan models/llama3/model/model.py apply_rotary_emb): per element of Q and K, upcast
#: (read 16-bit, write 4), complex multiply by the frequencies (read 4, write 4), type_as (read 4, write
#: 16-bit); three kernels for Q, three for K.
EAGER_ROTARY_KERNELS = 6


def eager_rotary_bytes(act: int) -> int:
    """Bytes per element of Q and K of eager rotary (see above).

    >>> eager_rotary_bytes(2)  # against 2 x 2 inside a fused QKV epilogue
    20
    """
    return (act + FP32) + 2 * FP32 + (FP32 + act)


#: megatron-core's unfused rotary (`_apply_rotary_pos_emb_bshd`, models/common/embeddings/rope_utils.py, core_v0.16.1),
#: which runs where the fused one may not: Megatron-LM turns apply_rope_fusion off for any position_embedding_type
#: but rope (training/arguments.py), Megatron-Bridge likewise (utils/fusions.py validate_rope_fusion_compatibility),
#: and `apply_rotary_pos_emb` falls back to it for a YaRN mscale != 1 even with fusion on. Per call (Q, then K):
#: cos and sin of the frequencies times mscale, cast to the activation type (six small kernels on the
#: sequence x head-width table, bytes negligible), then per element of the tensor: t * cos (read, write), the
#: rotated half's negation (half read, half write), its cat (read, write), times sin (read, write), the add (two
#: reads, one write) and the final cat with the empty pass-through part (read, write).
UNFUSED_ROTARY_KERNELS = 2 * (6 + 6)


#: Megatron-DeepSpeed's rotary (megatron/model/rotary_pos_embedding.py `apply_rotary_pos_emb`, microsoft/Megatron-DeepSpeed
#: at f4157bea, 2024-12; the cos and sin tables are cached across calls): per element of Q and K, t * cos (read t,
#: write), the rotated half's negation (read and write half the elements), its cat (read both halves, write), * sin
#: (read, write) and the add (read two, write one): five kernels each for Q and for K.
MDS_ROTARY_KERNELS = 10


def mds_rotary_bytes(act: int) -> int:
    """Bytes per element of Q and K of Megatron-DeepSpeed's rotary (see above).

    >>> mds_rotary_bytes(2)  # against 2 x 2 inside a fused QKV epilogue
    20
    """
    return 2 * act + act + 2 * act + 2 * act + 3 * act


def unfused_rotary_bytes(act: int) -> int:
    """Bytes per element of Q and K of megatron-core's unfused rotary (see above).

    >>> unfused_rotary_bytes(2)  # against 2 x 2 inside a fused QKV epilogue
    24
    """
    return mds_rotary_bytes(act) + 2 * act  # Megatron-DeepSpeed's five operators, and the final cat


@dataclass(frozen=True)
class Norm(_Quiet):
    """LayerNorm (weight + bias) or RMSNorm (weight), replicated over TP. Reads and writes
    the hidden state (one kernel); keeps its input for backward."""

    hidden: int
    layernorm: bool

    def params(self) -> int:
        return self.hidden * (2 if self.layernorm else 1)

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        return np.broadcast_to(float(self.params()), np.shape(tp))

    def elementwise(self, x: Micro) -> Elementwise:
        if x.eager and not self.layernorm:
            return Elementwise(eager_rmsnorm_bytes(x.act) * x.tokens * self.hidden / x.seq_split, EAGER_RMSNORM_KERNELS)
        return Elementwise(2 * x.act * x.tokens * self.hidden / x.seq_split, 1)

    def activations(self, x: Micro) -> Activations:
        return Activations(x.tokens * x.act * self.hidden, ZERO, ZERO)


@dataclass(frozen=True)
class Residual(_Quiet):
    """Bias-dropout-add: reads x and the residual, writes the sum (+ a 1-byte dropout mask,
    which it keeps for backward when dropout is on). One kernel."""

    hidden: int
    dropout: bool

    def params(self) -> int:
        return 0

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        return np.zeros(np.shape(tp))

    def elementwise(self, x: Micro) -> Elementwise:
        mask = MASK if self.dropout else 0
        return Elementwise((3 * x.act + mask) * x.tokens * self.hidden / x.seq_split, 1)

    def activations(self, x: Micro) -> Activations:
        return Activations(x.tokens * (MASK * self.hidden if self.dropout else 0), ZERO, ZERO)


@dataclass(frozen=True)
class Attention:
    """Multi-head / grouped-query self-attention (Megatron's column-parallel QKV,
    row-parallel output projection), with rotary embeddings or not, flash or unfused core.

    FLOPs: QKV 2sbh(q + 2k), scores 2s²bq, over V 2s²bq, output 2sbqh (Korthikanti
    Eq. 7 for q = k = h); causal masking is not credited (SC'21 / Korthikanti convention).
    A sliding window w < s replaces s keys by w per query (2swbq each). Context
    parallelism still passes every K/V block around the ring (an upper bound for
    windowed layers, whose far blocks a window-aware ring could skip).
    """

    hidden: int
    num_heads: int
    q_width: int
    kv_width: int
    bias: int  # bias elements (QKV and/or output)
    rope: bool
    dropout: bool
    window: int = 0  # sliding window (tokens); 0 = global attention
    sinks: bool = False  # one learned sink logit per head (gpt-oss); parameters only, its FLOPs are negligible
    yarn: bool = False  # YaRN-scaled rotary frequencies: megatron-core's unfused rotary (`unfused_rotary_bytes`)
    qk_norm: str = "none"  # ModelSpec.qk_norm: none, per_head (each head's width) or full (all heads together)
    layernorm: bool = False  # the model's norm kind, which its query/key norms share (weight + bias, or weight)

    def _qk_norm_params(self) -> int:
        """Weights of the query and key norms: one head's width each (per_head, the same for every head), or the
        whole query and key widths (full)."""
        per = 2 if self.layernorm else 1
        if self.qk_norm == "per_head":
            return per * 2 * (self.q_width // self.num_heads)
        return per * (self.q_width + self.kv_width) if self.qk_norm == "full" else 0

    def params(self) -> int:
        h, q, k = self.hidden, self.q_width, self.kv_width
        sinks = self.num_heads if self.sinks else 0
        # Wq, Wk, Wv, Wo (+ biases, sinks, query/key norms)
        return h * q + 2 * h * k + q * h + self.bias + sinks + self._qk_norm_params()

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        """Split over TP, but a per-head query/key norm's weights, which every rank holds whole."""
        whole = self._qk_norm_params() if self.qk_norm == "per_head" else 0
        return (self.params() - whole) / tp + whole

    def gemms(self, x: Micro) -> list[Gemm]:
        h, q, k, t, n = self.hidden, self.q_width, self.kv_width, x.tp, x.tokens
        return [Gemm(2 * n * h * (q + 2 * k) / t, n, (q + 2 * k) / t, h),
                Gemm(2 * n * q * h / t, n, h, q / t)]

    def core(self, x: Micro) -> Core:
        """Scores and over-V: each rank's queries see all s keys. Unfused kernels write the
        (a/t)·b·s² scores and read the probabilities back; flash attention reads Q, K, V and
        writes the output only. The unfused softmax (+ dropout) traffic is its own kernel."""
        q, k, t, n, s, act = self.q_width, self.kv_width, x.tp, x.tokens, x.keys(self.window), x.act
        flop = 2 * 2 * n * s * q / t
        qkvo = act * n * (2 * q + 2 * k) / t
        if x.attention_kernel == "unfused":
            scores = self.num_heads / t * n * s
            mask = MASK if self.dropout else 0
            softmax = (2 * act + (2 * act + mask if self.dropout else 0)) * scores
            return Core(flop, qkvo + 2 * act * scores, 2, softmax, 1)
        return Core(flop, qkvo, 2, ZERO, 0)

    def elementwise(self, x: Micro) -> Elementwise:
        """Rotary on Q and K, applied inside the QKV epilogue (no kernel of its own); eager (torchtitan without
        torch.compile) its own kernels (`eager_rotary_bytes`), and the core's head-major output copied back to
        token-major (`.transpose(1, 2).contiguous()`: read and write the output, one kernel). With YaRN under
        megatron-core, its unfused rotary's kernels (`unfused_rotary_bytes`). Query/key norms (`qk_norm`) are
        two norm kernels of their own over Q and K (megatron-core's q_layernorm and k_layernorm, applied
        between the QKV projection and the rotary: `SelfAttention.get_query_key_value_tensors`), eager RMSNorm's
        where the layers run eager."""
        qk_all = x.tokens * (self.q_width + self.kv_width) / x.tp  # elements of Q and K
        qk = qk_all if self.rope else ZERO
        norms = self.qk_norm_elementwise(x, qk_all)
        if x.eager:
            copy = 2 * x.act * x.tokens * self.q_width / x.tp
            return Elementwise(eager_rotary_bytes(x.act) * qk + copy + norms.bytes,
                               (EAGER_ROTARY_KERNELS if self.rope else 0) + 1 + norms.num_kernels)
        if self.rope and self.yarn and x.framework == "megatron":
            return Elementwise(unfused_rotary_bytes(x.act) * qk + norms.bytes, UNFUSED_ROTARY_KERNELS + norms.num_kernels)
        if x.framework == "deepspeed":
            mds = self.megatron_deepspeed_elementwise(x)
            return Elementwise(mds.bytes + norms.bytes, mds.num_kernels + norms.num_kernels)
        return Elementwise(2 * x.act * qk + norms.bytes, norms.num_kernels)

    def megatron_deepspeed_elementwise(self, x: Micro) -> Elementwise:
        """Megatron-DeepSpeed's attention outside its GEMMs and flash kernel (megatron/model/transformer.py
        `ParallelAttention.forward` at f4157bea): its unfused rotary on Q and K (`mds_rotary_bytes`); with grouped
        query attention, K and V repeated to every query head (`repeat_kv`: expand and reshape, a copy that reads
        the KV heads and writes one per query head); with flash attention, flash-attn's [s, b] to [b, s] layout as
        contiguous copies of Q, K and V (`rearrange(...).contiguous()`, at the repeated width) and of the output back.

        >>> x = Micro(4096, np.array([1]), np.array([1]), np.ones(1), np.zeros(1, bool), "bf16", "flash",
        ...           framework="deepspeed")
        >>> e = Attention(4096, 32, 4096, 1024, 0, True, False).megatron_deepspeed_elementwise(x)
        >>> round(float(e.bytes[0]) / 1e6, 1), int(e.num_kernels)  # Llama 3 8B: 4096 tokens, 8 KV heads of 32
        (771.8, 16)
        """
        n, act, t, q, k = x.tokens, x.act, x.tp, self.q_width, self.kv_width
        rotary = mds_rotary_bytes(act) * n * (q + k) / t if self.rope else ZERO
        repeated = k < q
        repeat = 2 * act * n * (k + q) / t if repeated else ZERO  # K and V: read the KV heads, write q wide
        width = q if repeated else k
        flash = x.attention_kernel != "unfused"  # its unfused core attention takes the [s, b] layout as it is
        layout = 2 * act * n * (q + 2 * width + q) / t if flash else ZERO  # Q, K and V to [b, s], the output back
        kernels = (MDS_ROTARY_KERNELS if self.rope else 0) + (2 if repeated else 0) + (4 if flash else 0)
        return Elementwise(rotary + repeat + layout, kernels)

    def qk_norm_elementwise(self, x: Micro, qk_elements) -> Elementwise:
        """The query and key norms (one kernel each, reading and writing Q or K), nothing without them.

        >>> x = Micro(4096, np.array([1]), np.array([1]), np.ones(1), np.zeros(1, bool), "bf16", "flash")
        >>> att = Attention(2048, 32, 4096, 512, 0, True, False, qk_norm="per_head")
        >>> n = att.qk_norm_elementwise(x, 4096 * (4096 + 512))
        >>> round(float(n.bytes) / 1e6, 1), n.num_kernels  # 4096 tokens x 4608 elements, read and write
        (75.5, 2)
        """
        if self.qk_norm == "none":
            return Elementwise(ZERO, 0)
        if x.eager and not self.layernorm:
            return Elementwise(eager_rmsnorm_bytes(x.act) * qk_elements, 2 * EAGER_RMSNORM_KERNELS)
        return Elementwise(2 * x.act * qk_elements, 2)

    def activations(self, x: Micro) -> Activations:
        """QKV input (replicated); Q, K, V and the projection input (split); scores: unfused
        softmax output (+ dropout mask and output) 5as²b for GPT, flash only fp32
        log-sum-exp statistics (4asb). The two GEMM inputs are kept at `Micro.gemm_input` bytes."""
        q, k, n, act, gin = self.q_width, self.kv_width, x.tokens, x.act, x.gemm_input
        if x.attention_kernel == "unfused":
            probs = act + (MASK + act if self.dropout else 0)
            scores = probs * self.num_heads * n * x.keys(self.window)
        else:
            scores = FP32 * self.num_heads * n
        norms = act * (q + k) if self.qk_norm != "none" else 0  # the query/key norms keep their inputs
        if x.framework == "deepspeed" and x.attention_kernel != "unfused":
            k = max(k, q)  # Megatron-DeepSpeed hands flash-attn K and V repeated to every query head, which it keeps
        return Activations(n * gin * self.hidden, n * (act * (q + k) + act * k + gin * q + norms), scores)

    def comm(self, x: Micro) -> Comm:
        """One TP exchange of the output; context parallelism passes K and V around the ring."""
        return Comm(tp_exchanges=1, tp_bytes=x.tokens * self.hidden * x.act,
                    cp_hop_bytes=x.tokens * 2 * self.kv_width * x.act / x.tp)


@dataclass(frozen=True)
class Mamba:
    """A Mamba-2 mixer (Dao & Gu 2024, "Transformers are SSMs", SSD; megatron-core's MambaMixer,
    megatron/core/ssm/mamba_mixer.py, core_v0.16.1), the sequence mixer of a hybrid stack's M layers.

    Shapes: d = heads·P inner width (P head dim), G = groups·N (N state size) the width of B and of C,
    H heads, w the convolution width, Q the chunk length. Weights: in_proj h→(2d + 2G + H) producing z, x,
    B, C and dt (column-parallel; its RMSNorm weight is the layer's `Norm`), the depthwise conv1d over
    x, B, C ((d + 2G)·w weights + d + 2G biases), A_log, D and dt_bias (H each), the gated RMSNorm on
    y (d), out_proj d→h (row-parallel). megatron-core asserts heads and groups divisible by tp, so TP
    splits every one of them: one TP exchange of the output, as attention.

    FLOPs per token (forward; Mamba-2 Sec. 6, the chunked SSD algorithm as mamba_ssm's Triton kernels run
    it): in_proj 2h(2d + 2G + H), out_proj 2dh, conv 2(d + 2G)w, and the scan: C·Bᵀ inside each chunk
    2QN per group, its masked product with x 2Qd (both quadratic in Q, linear in the sequence), the
    chunk states Bᵀx 2Nd, the inter-chunk state passing 2Nd/Q, and the states' contribution C·state 2Nd.
    Causal masking inside a chunk is not credited (the attention convention).

    Context parallelism (megatron/core/ssm/mamba_context_parallel.py): all-to-all, not a ring: before the
    conv and scan the sequence shards become head shards (z, x, B, C and dt: 2d + 2G·r + H per token, r the
    group repeat when cp exceeds the groups on a TP rank), after them y goes back (d per token); each
    rank then scans the whole sequence for heads/(tp·cp) heads, the same FLOPs as n/tp tokens.
    """

    hidden: int
    num_heads: int
    head_dim: int
    state: int
    groups: int
    conv: int
    chunk: int

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def bc(self) -> int:
        """Width of B (and of C): groups · state."""
        return self.groups * self.state

    @property
    def in_width(self) -> int:
        """in_proj's output width: z, x, B, C, dt."""
        return 2 * self.inner + 2 * self.bc + self.num_heads

    def params(self) -> int:
        h, d, conv_dim = self.hidden, self.inner, self.inner + 2 * self.bc
        return h * self.in_width + conv_dim * (self.conv + 1) + 3 * self.num_heads + d + d * h

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        return self.params() / tp

    def gemms(self, x: Micro) -> list[Gemm]:
        h, d, t, n = self.hidden, self.inner, x.tp, x.tokens
        return [Gemm(2 * n * h * self.in_width / t, n, self.in_width / t, h), Gemm(2 * n * d * h / t, n, h, d / t)]

    def scan_flop(self, x: Micro) -> np.ndarray:
        """The convolution and the SSD scan of one micro-batch on one rank (see the class docstring)."""
        d, big_n, q = self.inner, self.state, self.chunk
        per_token = (2 * (d + 2 * self.bc) * self.conv + 2 * q * self.bc + 2 * q * d + 2 * big_n * d
                     + 2 * big_n * d / q + 2 * big_n * d)
        return x.tokens * per_token / x.tp

    def core(self, x: Micro) -> Core:
        """The conv1d and SSD kernels of megatron-core's training path (`mamba_split_conv1d_scan_combined`, one
        conv and five Triton kernels: chunk cumsum, chunk state, state passing, C·Bᵀ, chunk scan), as a core of
        their own. Bytes: read zxBCdt, write and read back the convolved x, B, C, read dt and z, write the gated
        output and the ungated one it keeps for backward; the fp32 chunk states (d·N per chunk) written and read
        by the state kernels, twice."""
        n, act, t = x.tokens, x.act, x.tp
        conv_dim = self.inner + 2 * self.bc
        states = 2 * 2 * FP32 * (n / self.chunk) * self.inner * self.state / t
        io = act * n * (self.in_width + 2 * conv_dim + self.num_heads + self.inner + 2 * self.inner) / t
        return Core(self.scan_flop(x), io + states, 6, ZERO, 0)

    def elementwise(self, x: Micro) -> Elementwise:
        """The gated RMSNorm over y (read, write; one kernel); the z gate is inside the scan's kernel."""
        return Elementwise(2 * x.act * x.tokens * self.inner / x.tp, 1)

    def activations(self, x: Micro) -> Activations:
        """in_proj's input (replicated, `Micro.gemm_input` bytes); split over TP: zxBCdt and the ungated scan
        output that `mamba_split_conv1d_scan_combined` saves, the gated norm's input, and out_proj's input
        (`Micro.gemm_input`). The chunk states are recomputed in backward (not saved). No scores."""
        n, act, gin, d = x.tokens, x.act, x.gemm_input, self.inner
        return Activations(n * gin * self.hidden, n * (act * (self.in_width + 2 * d) + gin * d), ZERO)

    def cp_a2a_bytes(self, x: Micro) -> np.ndarray:
        """Bytes one rank sends in the forward's two all-to-alls over cp (before and after the scan; its share
        that stays local is the collective's to drop). The group repeat r = max(1, cp / (groups/tp))."""
        repeat = np.maximum(1, x.cp / np.maximum(1, self.groups / x.tp))
        width = 2 * self.inner + 2 * self.bc * repeat + self.num_heads + self.inner
        return np.where(x.cp > 1, x.tokens * x.act * width / x.tp, 0.0)

    def comm(self, x: Micro) -> Comm:
        return Comm(tp_exchanges=1, tp_bytes=x.tokens * self.hidden * x.act, cp_a2a_bytes=self.cp_a2a_bytes(x))


def gated_activation(gated: bool, x: Micro) -> tuple[int, int]:
    """(bytes per element of the FFN width, kernels) of an MLP's activation: GELU reads and writes once; fused
    SwiGLU reads gate and up and writes the product; eager (torchtitan `F.silu(w1(x)) * w3(x)`, Megatron-DeepSpeed's
    `swiglu`) SiLU reads and writes the gate, then the product reads both and writes.

    >>> from types import SimpleNamespace as S
    >>> gated_activation(True, S(act=2, eager=False)), gated_activation(True, S(act=2, eager=True))
    ((6, 1), (10, 2))
    """
    if not gated:
        return 2 * x.act, 1
    # Megatron-DeepSpeed's swiglu is the same two eager operators (transformer.py ParallelMLP: F.silu(x[0]) * x[1])
    eager = x.eager or getattr(x, "framework", "megatron") == "deepspeed"
    return (5 * x.act, 2) if eager else (3 * x.act, 1)


def eager_silu_output(gated: bool, x: Micro) -> int:
    """Bytes per element of the FFN width Megatron-DeepSpeed's SwiGLU keeps beyond a fused one: its product
    `F.silu(x[0]) * x[1]` saves the SiLU's output for its backward (fused kernels recompute it from the gate).
    torchtitan's eager operators keep it too, and fp32 copies in their RMSNorm; under torch_compile false their
    memory is costed as compiled (a stated convention, tests/test_eager.py)."""
    return x.act if gated and getattr(x, "framework", "megatron") == "deepspeed" else 0


@dataclass(frozen=True)
class DenseMLP:
    """Plain (2 matrices, GELU) or gated (SwiGLU: fused [gate, up] then down) MLP,
    column- then row-parallel. Megatron's fused SwiGLU keeps the [gate, up] output
    (4sbf) and the down-projection input (2sbf)."""

    hidden: int
    ffn: int
    gated: bool
    bias: bool

    def params(self) -> int:
        h, f = self.hidden, self.ffn
        num_in = 2 if self.gated else 1
        return num_in * h * f + f * h + ((num_in * f + h) if self.bias else 0)

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        return self.params() / tp

    def gemms(self, x: Micro) -> list[Gemm]:
        h, f, t, n = self.hidden, self.ffn, x.tp, x.tokens
        num_in = 2 if self.gated else 1
        return [Gemm(2 * n * h * f * num_in / t, n, num_in * f / t, h), Gemm(2 * n * h * f / t, n, h, f / t)]

    def elementwise(self, x: Micro) -> Elementwise:
        """The activation (fused SwiGLU: read gate and up, write the product); eager, SiLU and the product are two
        kernels (`gated_activation`)."""
        per, kernels = gated_activation(self.gated, x)
        return Elementwise(per * x.tokens * self.ffn / x.tp, kernels)

    def activations(self, x: Micro) -> Activations:
        """fc1's input (replicated); fc1's output, the activation's input (2f gated), and fc2's input
        (split); the GEMM inputs at `Micro.gemm_input` bytes. Megatron-DeepSpeed's SwiGLU also keeps the SiLU's
        output for the product's backward (f more, `eager_silu_output`)."""
        inner = ((2 if self.gated else 1) * x.act + eager_silu_output(self.gated, x) + x.gemm_input) * self.ffn
        return Activations(x.tokens * x.gemm_input * self.hidden, x.tokens * inner, ZERO)

    def comm(self, x: Micro) -> Comm:
        return Comm(tp_exchanges=1, tp_bytes=x.tokens * self.hidden * x.act)


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2 Sec. 2.1; Megatron-core's MultiLatentAttention).

    Queries: a low-rank down-projection h→r_q (replicated over TP), its RMSNorm, and a
    column-parallel up-projection r_q→a(d_n + d_r) (or one h→a(d_n + d_r) projection when
    r_q = 0). Keys and values: a replicated down-projection h→(r_kv + d_r) (the latent and
    the shared rotary key), its RMSNorm, a column-parallel up-projection r_kv→a(d_n + d_v),
    and a row-parallel output a·d_v→h. Training materialises per-head K and V (no
    latent absorption), so the core is ordinary attention with query/key width d_n + d_r
    and value width d_v: 2·s·keys·b·a(d_n + d_r) + 2·s·keys·b·a·d_v FLOPs.
    """

    hidden: int
    num_heads: int
    q_rank: int  # 0: full query projection
    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    window: int = 0

    @property
    def _qk(self) -> int:
        return self.num_heads * (self.nope_dim + self.rope_dim)

    def _replicated_params(self) -> int:
        h, rq, rkv = self.hidden, self.q_rank, self.kv_rank
        q_down = h * rq + rq if rq else 0  # + its RMSNorm
        return q_down + h * (rkv + self.rope_dim) + rkv

    def _split_params(self) -> int:
        h, rq, a = self.hidden, self.q_rank, self.num_heads
        q_up = (rq or h) * self._qk
        return q_up + self.kv_rank * a * (self.nope_dim + self.v_dim) + a * self.v_dim * h

    def params(self) -> int:
        return self._replicated_params() + self._split_params()

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        return self._replicated_params() + self._split_params() / tp

    def gemms(self, x: Micro) -> list[Gemm]:
        h, rq, rkv, a, t, n = self.hidden, self.q_rank, self.kv_rank, self.num_heads, x.tp, x.tokens
        kv_up = a * (self.nope_dim + self.v_dim)
        out = [Gemm(2 * n * h * (rkv + self.rope_dim) * np.ones_like(t), n, rkv + self.rope_dim, h),
               Gemm(2 * n * rkv * kv_up / t, n, kv_up / t, rkv),
               Gemm(2 * n * a * self.v_dim * h / t, n, h, a * self.v_dim / t)]
        if rq:
            out += [Gemm(2 * n * h * rq * np.ones_like(t), n, rq, h), Gemm(2 * n * rq * self._qk / t, n, self._qk / t, rq)]
        else:
            out += [Gemm(2 * n * h * self._qk / t, n, self._qk / t, h)]
        return out

    def up_gemms(self, x: Micro) -> list[Gemm]:
        """The up-projections (what Megatron's `mla_up_proj` recompute repeats)."""
        g = self.gemms(x)
        return [g[1]] + (g[4:] if self.q_rank else [])

    def core(self, x: Micro) -> Core:
        a, t, n, keys, act = self.num_heads, x.tp, x.tokens, x.keys(self.window), x.act
        v = a * self.v_dim
        flop = 2 * n * keys * (self._qk + v) / t
        qkvo = act * n * (2 * self._qk + 2 * v) / t
        if x.attention_kernel == "unfused":
            scores = a / t * n * keys
            return Core(flop, qkvo + 2 * act * scores, 2, 2 * act * scores, 1)
        return Core(flop, qkvo, 2, ZERO, 0)

    def elementwise(self, x: Micro) -> Elementwise:
        """The two latent RMSNorms (one kernel each) and rotary on the rope part of Q and K."""
        n, act = x.tokens, x.act
        norms = 2 * act * n * (self.q_rank + self.kv_rank)
        rotary = 2 * act * n * (self.num_heads + 1) * self.rope_dim / x.tp
        return Elementwise(norms + rotary, 2 if self.q_rank else 1)

    def activations(self, x: Micro) -> Activations:
        """Down-projection input (replicated) and the latents feeding the up-projections
        (every TP rank keeps them whole); per-head Q, K, V and the output-projection input
        (split); flash keeps fp32 softmax statistics, unfused the 16-bit probabilities. The down-projection
        and output-projection inputs are kept at `Micro.gemm_input` bytes (the latents, also the inputs of
        their norms, at 16 bits)."""
        n, act, a, gin = x.tokens, x.act, self.num_heads, x.gemm_input
        latents = act * n * (self.q_rank + self.kv_rank + self.rope_dim) * x.seq_split
        split = n * (act * (2 * self._qk + a * self.v_dim) + gin * a * self.v_dim)
        scores = FP32 * a * n if x.attention_kernel != "unfused" else act * a * n * x.keys(self.window)
        return Activations(n * gin * self.hidden + latents, split, scores)

    def comm(self, x: Micro) -> Comm:
        return Comm(tp_exchanges=1, tp_bytes=x.tokens * self.hidden * x.act,
                    cp_hop_bytes=x.tokens * (self._qk + self.num_heads * self.v_dim) * x.act / x.tp)


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts MLP (Megatron-core's MoELayer; Shazeer et al. 2017, GShard,
    DeepSeekMoE): a router (replicated), `num_experts` routed experts of which each token
    uses `top_k`, and optional shared experts that every token uses (a TP-split dense MLP).

    On one rank (Megatron-core's expert mesh: etp innermost, then ep, then the
    expert-data-parallel group) the routed experts are split over ep (E/ep experts per
    rank) and each expert's inner width over etp. A rank's distinct tokens n/tp (sequence
    parallel) are sent to k experts; the rank computes, on average, the tokens its experts
    receive: R = n/tp · k · etp, times the load imbalance (the busiest rank sets the pace
    of the all-to-all that follows). FLOPs of the experts: 2·R·h·f·(3 gated | 2)/etp.

    Communication per forward (Megatron's all-to-all token dispatcher): a dispatch and a
    combine all-to-all over ep of n/tp · k hidden vectors each; with etp > 1 the routed
    tokens are all-gathered before the experts and reduce-scattered after, over etp.
    """

    hidden: int
    num_experts: int
    top_k: int
    ffn: int
    gated: bool
    num_shared: int
    shared_ffn: int
    expert_bias: bool
    router_bias: bool
    router_groups: int = 0  # group-limited routing: expert groups (0: none) ...
    router_group_topk: int = 0  # ... and the groups each token may use
    glu_clamp: float | None = None  # ModelSpec.glu_clamp: the experts' branches clamped before the activation (gpt-oss)

    def _expert_params(self) -> int:
        h, f = self.hidden, self.ffn
        num_in = 2 if self.gated else 1
        return num_in * h * f + f * h + ((num_in * f + h) if self.expert_bias else 0)

    @property
    def shared(self) -> DenseMLP | None:
        if not self.num_shared:
            return None
        return DenseMLP(self.hidden, self.num_shared * self.shared_ffn, self.gated, False)

    def router_params(self) -> int:
        return self.hidden * self.num_experts + (self.num_experts if self.router_bias else 0)

    def expert_params(self) -> int:
        return self.num_experts * self._expert_params()

    def params(self) -> int:
        return self.router_params() + self.expert_params() + (self.shared.params() if self.shared else 0)

    def active_params(self) -> int:
        return self.router_params() + self.top_k * self._expert_params() + (self.shared.params() if self.shared else 0)

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        """Non-expert parameters: the router (replicated) and the shared experts (split over tp)."""
        return self.router_params() + (self.shared.params_per_rank(tp) if self.shared else 0.0)

    def expert_params_per_rank(self, ep: np.ndarray, etp: np.ndarray) -> np.ndarray:
        return self.expert_params() / (ep * etp)

    def routed_tokens(self, x: Micro, imbalance: bool = True) -> np.ndarray:
        """Tokens this rank's experts process per micro-batch (R above)."""
        distinct = x.tokens / x.seq_split  # MoE with tp > 1 needs sequence parallelism (planner.rules)
        return distinct * self.top_k * x.etp * (x.moe_load_imbalance if imbalance else 1.0)

    def shared_gemms(self, x: Micro) -> list[Gemm]:
        return self.shared.gemms(x) if self.shared else []

    def gemms(self, x: Micro) -> list[Gemm]:
        h, f, etp = self.hidden, self.ffn, x.etp
        num_in = 2 if self.gated else 1
        routed = self.routed_tokens(x)
        local = self.num_experts / x.ep
        per_expert = routed / local
        distinct = x.tokens / x.seq_split
        router = Gemm(2 * distinct * h * self.num_experts, distinct, self.num_experts, h, quantised=False)
        fc1 = Gemm(2 * routed * h * num_in * f / etp, per_expert, num_in * f / etp, h, count=local, grouped=True)
        fc2 = Gemm(2 * routed * f * h / etp, per_expert, h, f / etp, count=local, grouped=True)
        return [router, fc1, fc2] + self.shared_gemms(x)

    def elementwise(self, x: Micro) -> Elementwise:
        """Router softmax/top-k (fp32 logits), permute and unpermute of the routed tokens
        (read + write each), the experts' activation, the shared experts', and under Megatron-core
        the all-to-all dispatcher's sort by local expert (`sort_by_local_expert`) and the output bias
        of experts that have one (`expert_output_bias`). The permute and unpermute are Megatron's
        alltoall and DeepEP paths' own kernels (token_dispatcher.py: permute before the all-to-all,
        or after DeepEP's dispatch); HybridEP's dispatch and combine kernels write and read the tokens
        in expert order themselves, and the two passes stand for those copies (an estimate)."""
        routed, act = self.routed_tokens(x), x.act
        distinct = x.tokens / x.seq_split
        router = 2 * FP32 * distinct * self.num_experts
        permute = 2 * 2 * act * routed * self.hidden
        sort = self.sort_by_local_expert(x)
        per, kernels = gated_activation(self.gated, x)
        activation = per * routed * self.ffn / x.etp
        shared = self.shared.elementwise(x) if self.shared else Elementwise(ZERO, 0)
        bias = self.expert_output_bias(x)
        pad = self.quantization_padding(x)
        clamp = self.clamp_elementwise(x)
        return Elementwise(router + permute + sort.bytes + activation + shared.bytes + bias.bytes + pad.bytes
                           + clamp.bytes,
                           3 + kernels + sort.num_kernels + shared.num_kernels + bias.num_kernels + pad.num_kernels
                           + clamp.num_kernels)

    def clamp_elementwise(self, x: Micro) -> Elementwise:
        """Megatron-core clamps the experts' two branches outside its fused activation (`weighted_bias_quick_geglu_impl`
        with `activation_func_clamp_value`, megatron/core/fusions/fused_bias_geglu.py, core_v0.16.1 to core_v0.19.0):
        `chunk` (views), the gate's clamp and the linear branch's (each reads and writes one f-wide half), and a `cat`
        of the two (reads and writes both): 8 values per routed token and f-element of one branch, three eager kernels
        (their backward is the layer's usual factor on them). Nothing without a clamp or under another framework.

        >>> x = Micro(4096, np.array([1]), np.array([1]), np.ones(1), np.zeros(1, bool), "bf16", "flash",
        ...           ep=np.array([8]), etp=np.array([1]))
        >>> moe = MoE(2880, 128, 4, 2880, True, 0, 0, True, True, glu_clamp=7.0)
        >>> c = moe.clamp_elementwise(x)
        >>> round(float(c.bytes[0]) / 1e6, 1), int(c.num_kernels)  # 16384 routed tokens x 2880, 8 values of 2 bytes
        (755.0, 3)
        """
        if not self._megatron_clamp(x):
            return Elementwise(ZERO, 0)
        return Elementwise(8 * x.act * self.routed_tokens(x) * self.ffn / x.etp, 3)

    def clamp_kept_bytes(self, x: Micro) -> np.ndarray:
        """Per routed token, what megatron-core's clamp keeps beyond a fused activation: the clamps save their inputs
        (the fc1 output, 2f wide) and the fused activation its own (the clamped copy), so one more 2f-wide tensor."""
        return 2 * x.act * self.ffn / x.etp if self._megatron_clamp(x) else ZERO

    def _megatron_clamp(self, x: Micro) -> bool:
        """Whether megatron-core clamps these experts' branches in eager kernels of their own."""
        return self.glu_clamp is not None and self.gated and x.framework == "megatron"

    def quantization_padding(self, x: Micro) -> Elementwise:
        """Megatron-core's grouped MLP under FP8 pads each local expert's rows to the quantised GEMMs' alignment
        before the experts and drops the padding after them (`TEGroupedMLP.forward`: `quantization_padding` of the
        permuted tokens and of their probabilities, `quantization_unpadding` of the output, core_v0.16.1 to
        core_v0.19.0), unless the router already padded the routing map (`moe_router_padding_for_quantization`).
        Transformer Engine's Fp8Padding and Fp8Unpadding copy the whole tensor (`fused_multi_row_padding`, one
        kernel) whenever any expert's count is off the alignment (16 rows, MXFP8 32: `fp8_padding.py` at v2.9),
        which dropless routing makes the rule: the routed tokens are read and written twice (in, out), the
        probabilities once. Nothing in BF16, under another framework, with the router's padding, or with the
        HybridEP dispatcher, whose dispatch kernel writes each expert's rows at the alignment itself
        (`_HybridEPManager.dispatch` passes `pad_multiple` under FP8, token_dispatcher.py core_v0.16.1).

        >>> x = Micro(4096, np.array([1]), np.array([1]), np.ones(1), np.zeros(1, bool), "fp8", "flash",
        ...           ep=np.array([8]), etp=np.array([1]), fp8_recipe="mxfp8")
        >>> moe = MoE(2048, 128, 8, 768, True, 0, 0, False, False)
        >>> p = moe.quantization_padding(x)
        >>> round(float(p.bytes[0]) / 1e6, 1), int(p.num_kernels)  # 32768 routed tokens x 2048, twice, + probs
        (537.1, 3)
        >>> float(moe.quantization_padding(replace(x, moe_router_padding=True)).bytes)
        0.0
        """
        if (x.framework != "megatron" or x.precision not in QUANTISED_PRECISIONS or x.moe_router_padding
                or x.moe_dispatcher == "hybridep"):
            return Elementwise(ZERO, 0)
        routed = self.routed_tokens(x)
        return Elementwise(2 * 2 * x.act * routed * self.hidden + 2 * FP32 * routed, 3)

    def sort_by_local_expert(self, x: Micro) -> Elementwise:
        """Megatron-core's all-to-all dispatcher receives each source rank's tokens in one chunk and,
        with more than one local expert, sorts them by expert before the experts ("Permutation 2",
        `sort_chunks_by_idxs` in MoEAlltoAllTokenDispatcher.dispatch_postprocess) and back after them
        (combine_preprocess): two more passes over the routed tokens (read and write each) than the
        flex dispatcher (DeepEP, HybridEP), whose dispatch kernel delivers the tokens per expert
        (megatron/core/transformer/moe/token_dispatcher.py, core_v0.16.1). Nothing under another
        framework or with one local expert.

        >>> x = Micro(4096, np.array([1, 1]), np.array([1, 1]), np.ones(2), np.zeros(2, bool), "bf16", "flash",
        ...           ep=np.array([8, 128]), etp=np.array([1, 1]))
        >>> sort = MoE(2048, 128, 8, 768, True, 0, 0, False, False).sort_by_local_expert(x)
        >>> (sort.bytes / 1e6).round(1).tolist(), sort.num_kernels.tolist()  # 32768 routed tokens x 2048
        ([536.9, 0.0], [2, 0])
        """
        if x.framework != "megatron" or x.moe_dispatcher != "alltoall":
            return Elementwise(ZERO, 0)
        several = np.asarray(self.num_experts / x.ep) > 1
        passes = 2 * 2 * x.act * self.routed_tokens(x) * self.hidden
        return Elementwise(np.where(several, passes, 0.0), np.where(several, 2, 0))

    def expert_output_bias(self, x: Micro) -> Elementwise:
        """Megatron-core's TEGroupedMLP adds the second expert linear's bias outside the GEMM, weighted
        by each token's routing probability, one expert at a time (`TEGroupedMLP._apply_bias`,
        megatron/core/transformer/moe/experts.py, core_v0.16.1 to core_v0.19.0: linear_fc2 has
        skip_bias_add=True, then torch.cat([t + b * p for each local expert's rows])): per routed
        element b·p writes one value, the add reads two and writes one, the cat reads and writes one,
        all in the 16-bit activation type (the router's probabilities are cast to it without
        moe_router_dtype): 6 values; two kernels per local expert and the cat. Nothing for models
        whose experts have no bias, or under another framework.

        >>> x = Micro(4096, np.array([1]), np.array([1]), np.ones(1), np.zeros(1, bool), "bf16", "flash",
        ...           ep=np.array([64]), etp=np.array([1]))
        >>> moe = MoE(2880, 128, 4, 2880, True, 0, 0, True, True)
        >>> b = moe.expert_output_bias(x)
        >>> round(float(b.bytes[0]) / 1e9, 3), b.num_kernels.tolist()  # 16384 routed tokens x 2880
        (0.566, [5.0])
        """
        if not self.expert_bias or x.framework != "megatron":
            return Elementwise(ZERO, 0)
        routed = self.routed_tokens(x)
        local = np.asarray(self.num_experts / x.ep, dtype=float)
        return Elementwise(6 * x.act * routed * self.hidden, 2 * local + 1)

    def activations(self, x: Micro) -> Activations:
        """MLP input (replicated), router probabilities (fp32, per distinct token), and per
        routed token: the permuted input (fc1's), the fc1 output (2f/etp gated) and the
        activation output (f/etp). Megatron-core applies the routing weights inside the
        experts' activation, so the unpermute keeps no input of its own. The experts' GEMM inputs are
        kept at `Micro.gemm_input` bytes; the MoE input at 16 bits (the router GEMM is not quantised)."""
        routed, act, h, f, gin = self.routed_tokens(x), x.act, self.hidden, self.ffn, x.gemm_input
        per_token = (gin * h + ((2 if self.gated else 1) * act + eager_silu_output(self.gated, x) + gin) * f / x.etp
                     + self.clamp_kept_bytes(x))
        shared = self.shared.activations(x) if self.shared else Activations(ZERO, ZERO, ZERO)
        router = FP32 * self.num_experts * x.tokens  # divided by tp below, as distinct tokens are n/tp
        return Activations(x.tokens * act * h, router + shared.split, ZERO, routed * per_token)

    def comm(self, x: Micro) -> Comm:
        """The shared experts' TP exchange (none without them: the routed tokens travel by the
        dispatcher) and the token dispatch; see the class docstring."""
        dispatched = self.routed_tokens(x) / x.etp * x.act * self.hidden
        return Comm(tp_exchanges=1 if self.shared else 0, tp_bytes=x.tokens * self.hidden * x.act,
                    ep_a2a_bytes=dispatched,
                    etp_bytes=np.where(x.etp > 1, dispatched * x.etp, 0.0))


@dataclass(frozen=True)
class Projection(_Quiet):
    """A column-parallel linear layer (DeepSeek-V3's MTP `eh_proj`, 2h→h)."""

    inputs: int
    outputs: int

    def params(self) -> int:
        return self.inputs * self.outputs

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        return self.params() / tp

    def gemms(self, x: Micro) -> list[Gemm]:
        n = x.tokens
        return [Gemm(2 * n * self.inputs * self.outputs / x.tp, n, self.outputs / x.tp, self.inputs)]


def padded_vocab(vocab: int, tp: np.ndarray) -> np.ndarray:
    """Megatron's padded vocabulary: the next multiple of 128·tp (elements).

    >>> int(padded_vocab(50257, 1)), int(padded_vocab(128256, 8)), int(padded_vocab(51200, 8))
    (50304, 129024, 51200)
    """
    multiple = VOCAB_PAD_MULTIPLE * np.asarray(tp)
    return -(-vocab // multiple) * multiple


@dataclass(frozen=True)
class Embedding(_Quiet):
    """Vocab-parallel word embedding (split over tp) plus learned positions (replicated).
    Its output is all-reduced over TP (one exchange). Keeps the input ids (int64) and,
    with dropout, the embedding dropout mask per in-flight micro-batch (Korthikanti App. A)."""

    hidden: int
    vocab: int
    positions: int  # rows of the learned position table (0 for rotary / none)
    dropout: bool

    def params(self) -> int:
        return (self.vocab + self.positions) * self.hidden

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        return padded_vocab(self.vocab, tp) * self.hidden / tp + self.positions * self.hidden

    def input_bytes(self, x: Micro) -> np.ndarray:
        """Kept per in-flight micro-batch on the first stage."""
        return x.tokens * (INT64 + (MASK * self.hidden / x.seq_split if self.dropout else 0))

    def comm(self, x: Micro) -> Comm:
        return Comm(tp_exchanges=1, tp_bytes=x.tokens * self.hidden * x.act)


@dataclass(frozen=True)
class Head(_Quiet):
    """Final norm, output projection (vocab-parallel, never FP8: Transformer Engine's
    recipe) and fp32 softmax cross-entropy over the vocabulary shard. `weights_shared`:
    the projection is the input embedding (tied, same stage), adding no parameters."""

    hidden: int
    vocab: int
    norm: Norm
    tied: bool

    def params(self) -> int:
        return self.norm.params() + (0 if self.tied else self.vocab * self.hidden)

    def params_per_rank(self, tp: np.ndarray, weights_shared: np.ndarray | bool = False) -> np.ndarray:
        matrix = np.where(weights_shared, 0.0, padded_vocab(self.vocab, tp) * self.hidden / tp)
        return self.norm.params() + matrix

    def gemms(self, x: Micro) -> list[Gemm]:
        v = padded_vocab(self.vocab, x.tp) / x.tp
        return [Gemm(2 * x.tokens * self.hidden * v, x.tokens, v, self.hidden, quantised=False)]

    def elementwise(self, x: Micro) -> Elementwise:
        """Final norm (read + write) and the loss: read the logits, write fp32 probabilities
        and their gradient (Transformer Engine's: read the 16-bit logits twice, write the gradient over them)."""
        v = padded_vocab(self.vocab, x.tp) / x.tp
        per_logit = 3 * x.act if x.te_cross_entropy else x.act + FP32 + FP32
        return Elementwise(2 * x.act * x.tokens * self.hidden / x.seq_split + per_logit * x.tokens * v, 2)

    def loss_bytes(self, x: Micro) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(forward bytes, backward bytes, forward kernels, backward kernels) of
        Megatron's vocab-parallel cross-entropy over the rank's n×v logits (v = V/t), as
        megatron/core/tensor_parallel/cross_entropy.py runs it.

        Unfused: cast the bf16 logits to fp32 (read 2, write 4), max (read 4), subtract it in place
        (read 4, write 4), exp (read 4, write 4), sum (read 4), divide into the softmax kept for
        backward (read 4, write 4): 38 bytes per logit in 6 kernels; backward: scale the softmax minus
        the one-hot by the loss gradient (read 4, write 4) and cast the gradient back to bf16
        (read 4, write 2): 14 bytes in 3 kernels. Fused (`--cross-entropy-loss-fusion`,
        megatron/core/fusions/fused_cross_entropy.py): the cast and max in one kernel (read 2,
        write 4), subtract-exp-sum in one (read 4, write 4), the division in one (read 4, write 4):
        22 bytes in 3 kernels; the backward is one fused kernel (read 4, write 4) and the cast: 14
        bytes in 2 kernels. Transformer Engine's (`--cross-entropy-fusion-impl te`, Megatron's
        `te_parallel_cross_entropy`; transformer_engine/pytorch/triton/cross_entropy.py at v2.9) never
        leaves the 16-bit logits: an online-softmax kernel reads them once for each row's max and sum
        (read 2), a second reads them again and writes each gradient over its logit (read 2, write 2):
        6 bytes in 2 kernels; the backward scales that gradient in place by the per-token loss gradient
        Megatron passes (`element_mul_kernel`, read 2, write 2): 4 bytes in 1 kernel. (The final norm is
        `self.norm.elementwise`.)

        >>> head = Head(4096, 128256, Norm(4096, False), False)
        >>> x = Micro(8192, np.array([1]), np.array([1]), np.array([1]), np.array([False]), "bf16", "flash")
        >>> [round(float(b[0]) / (8192 * 128256)) for b in head.loss_bytes(x)[:2]]  # bytes per logit, fused
        [22, 14]
        >>> te = head.loss_bytes(replace(x, cross_entropy_impl="te"))
        >>> [round(float(b[0]) / (8192 * 128256)) for b in te[:2]], te[2:]
        ([6, 4], (2, 1))
        """
        v = padded_vocab(self.vocab, x.tp) / x.tp
        logits = x.tokens * v
        if x.te_cross_entropy:
            return 3 * x.act * logits, 2 * x.act * logits, 2, 1
        to_fp32 = x.act + FP32
        softmax_passes = FP32 + 2 * FP32 + 2 * FP32 + FP32 + 2 * FP32  # max, subtract, exp, sum, divide
        fused_passes = 2 * FP32 + 2 * FP32  # subtract-exp-sum, divide
        backward = 2 * FP32 + (FP32 + x.act)  # scale the gradient, cast it back to 16-bit
        if x.cross_entropy_fusion:
            return (to_fp32 + fused_passes) * logits, backward * logits, 3, 2
        return (to_fp32 + softmax_passes) * logits, backward * logits, 6, 3

    def activations(self, x: Micro) -> Activations:
        """Final norm input and output-layer input (16-bit) + fp32 logits, one micro-batch."""
        return Activations(2 * x.act * self.hidden * x.tokens, FP32 * padded_vocab(self.vocab, x.tp) * x.tokens, ZERO)


@dataclass(frozen=True)
class Layer:
    """A layer as a composition of blocks: a transformer layer (attention and MLP or MoE), or one of a hybrid
    stack's single-purpose layers (norm, one of Mamba, attention, MLP or MoE, residual)."""

    blocks: tuple

    def params(self) -> int:
        return sum(b.params() for b in self.blocks)

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        """Parameters outside the routed experts on one TP rank (elements)."""
        return sum(b.params_per_rank(tp) for b in self.blocks)

    def moe(self) -> MoE | None:
        return next((b for b in self.blocks if isinstance(b, MoE)), None)

    @property
    def is_moe(self) -> bool:
        return self.moe() is not None

    def expert_params(self) -> int:
        moe = self.moe()
        return moe.expert_params() if moe else 0

    def active_params(self) -> int:
        moe = self.moe()
        return self.params() - (moe.params() - moe.active_params() if moe else 0)

    def expert_params_per_rank(self, ep: np.ndarray, etp: np.ndarray) -> np.ndarray:
        """Routed-expert parameters on one rank of the expert mesh (elements)."""
        moe = self.moe()
        return moe.expert_params_per_rank(ep, etp) if moe else np.zeros(np.shape(ep))

    def gemms(self, x: Micro) -> list[Gemm]:
        return [g for b in self.blocks for g in b.gemms(x)]

    def attention(self) -> Attention | LatentAttention | None:
        """The layer's attention block; None in a hybrid stack's Mamba, MLP and MoE layers."""
        return next((b for b in self.blocks if isinstance(b, (Attention, LatentAttention))), None)

    def mamba(self) -> Mamba | None:
        return next((b for b in self.blocks if isinstance(b, Mamba)), None)

    @property
    def hidden(self) -> int:
        return self.blocks[0].hidden

    @property
    def num_sublayers(self) -> int:
        """Sequence mixers and MLPs of the layer (2 in a transformer layer, 1 in a hybrid stack's layers): the
        norm outputs Megatron's `layernorm` recompute module drops."""
        return sum(isinstance(b, (Attention, LatentAttention, Mamba, DenseMLP, MoE)) for b in self.blocks)

    def core(self, x: Micro) -> Core:
        """The attention core, or a Mamba layer's conv and SSD scan, or nothing (MLP and MoE layers)."""
        mixer = self.attention() or self.mamba()
        return mixer.core(x) if mixer is not None else Core(ZERO, ZERO, 0, ZERO, 0)

    def elementwise(self, x: Micro) -> Elementwise:
        parts = [b.elementwise(x) for b in self.blocks]
        return Elementwise(sum(p.bytes for p in parts), sum(p.num_kernels for p in parts))

    def activations(self, x: Micro) -> Activations:
        parts = [b.activations(x) for b in self.blocks]
        return Activations(sum(p.replicated for p in parts), sum(p.split for p in parts),
                           sum(p.scores for p in parts), sum(p.routed for p in parts))

    def comms(self, x: Micro) -> list[Comm]:
        """Each block's exchanges (TP time is a sum over them, CP a sum of hop bytes)."""
        return [c for c in (b.comm(x) for b in self.blocks)
                if c.tp_exchanges or np.any(c.cp_hop_bytes) or np.any(c.ep_a2a_bytes) or np.any(c.cp_a2a_bytes)]

    def forward_flop(self, x: Micro) -> np.ndarray:
        return sum(g.flop for g in self.gemms(x)) + self.core(x).flop


@dataclass(frozen=True)
class ModelBlocks:
    """A model as blocks: the embedding, the distinct layer kinds and which kind each layer
    is (`pattern`), the head, and the multi-token-prediction modules (`mtp`, on the last
    pipeline rank, each running the head once more)."""

    embedding: Embedding
    kinds: tuple[Layer, ...]
    pattern: tuple[int, ...]  # kind index of each layer, first to last
    head: Head
    mtp: tuple[Layer, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def layers(self) -> list[tuple[Layer, int]]:
        """(layer kind, number of layers) of the main stack."""
        return [(kind, self.pattern.count(i)) for i, kind in enumerate(self.kinds) if i in self.pattern]

    @property
    def all_kinds(self) -> tuple[Layer, ...]:
        """The kinds a stage can hold: the main stack's, then one for the MTP modules."""
        return self.kinds + self.mtp[:1]

    @property
    def head_passes(self) -> int:
        """Times the output head and loss run per micro-batch (1 + MTP modules)."""
        return 1 + len(self.mtp)

    def mean(self, f: Callable[[Layer], np.ndarray]) -> np.ndarray:
        """The model's average layer of a per-layer quantity `f(layer)` (exact for one kind)."""
        return sum(n * f(layer) for layer, n in self.layers) / self.num_layers


def _attention(model: ModelSpec, window: int) -> Attention | LatentAttention:
    if getattr(model, "kv_lora_rank", None) is not None:
        return LatentAttention(model.hidden_size, model.num_attention_heads, model.q_lora_rank or 0,
                               model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim,
                               window)
    q, k = model.q_width, model.kv_width
    bias = (q + 2 * k + model.hidden_size) if model.linear_bias else (q + 2 * k) if model.qkv_bias else 0
    return Attention(model.hidden_size, model.num_attention_heads, q, k, bias, model.position_embedding == "rope",
                     model.dropout, window, getattr(model, "attention_sinks", False),
                     getattr(model, "rope_scaling", "none") == "yarn", getattr(model, "qk_norm", "none"),
                     model.norm == "layernorm")


def _mlp(model: ModelSpec, moe: bool) -> DenseMLP | MoE:
    if not moe:
        return DenseMLP(model.hidden_size, model.ffn_hidden_size, model.gated_mlp, model.linear_bias)
    return MoE(model.hidden_size, model.num_experts, model.moe_top_k, model.expert_ffn, model.gated_mlp,
               model.num_shared_experts, model.shared_expert_ffn, model.moe_expert_bias, model.moe_router_bias,
               model.moe_router_num_groups, model.moe_router_group_topk, getattr(model, "glu_clamp", None))


def decoder_layer(model: ModelSpec, moe: bool = False, local: bool = False) -> Layer:
    """A decoder layer of a ModelSpec: norm, attention (global or windowed), add, norm, MLP or MoE, add."""
    norm = Norm(model.hidden_size, model.norm == "layernorm")
    residual = Residual(model.hidden_size, model.dropout)
    attention = _attention(model, model.sliding_window if local else 0)  # local only where a window is set
    return Layer((norm, attention, residual, norm, _mlp(model, moe), residual))


def hybrid_layer(model: ModelSpec, symbol: str) -> Layer:
    """One layer of a hybrid stack (megatron-core's HybridModel, `hybrid_override_pattern`): its norm (fused into
    the first linear layer where Transformer Engine does it), one Mamba-2 mixer (M), self-attention (*), MLP (-) or
    MoE (E), and the residual add."""
    norm = Norm(model.hidden_size, model.norm == "layernorm")
    residual = Residual(model.hidden_size, model.dropout)
    if symbol == "M":
        body = Mamba(model.hidden_size, model.mamba_heads, model.mamba_head_dim, model.mamba_state_dim,
                     model.mamba_num_groups, model.mamba_conv_kernel, model.mamba_chunk_size)
    elif symbol == "*":
        body = _attention(model, 0)
    else:
        body = _mlp(model, symbol == "E")
    return Layer((norm, body, residual))


def model_blocks(model: ModelSpec) -> ModelBlocks:
    """The blocks of a ModelSpec (read by attribute)."""
    positions = model.max_position_embeddings if model.position_embedding == "learned" else 0
    embedding = Embedding(model.hidden_size, model.vocab_size, positions, model.dropout)
    norm = Norm(model.hidden_size, model.norm == "layernorm")
    head = Head(model.hidden_size, model.vocab_size, norm, model.tie_embeddings)
    hybrid = getattr(model, "hybrid_override_pattern", None)
    if hybrid is not None:
        symbols = list(dict.fromkeys(hybrid))
        kinds = tuple(hybrid_layer(model, c) for c in symbols)
        return ModelBlocks(embedding, kinds, tuple(symbols.index(c) for c in hybrid), head)
    moe_mask = getattr(model, "moe_layer_mask", lambda: (False,) * model.num_layers)()
    local_mask = getattr(model, "local_attention_mask", lambda: (False,) * model.num_layers)()
    keys = list(zip(moe_mask, local_mask))
    distinct = list(dict.fromkeys(keys))
    kinds = tuple(decoder_layer(model, moe, local) for moe, local in distinct)
    pattern = tuple(distinct.index(k) for k in keys)
    mtp: tuple[Layer, ...] = ()
    if getattr(model, "num_mtp_layers", 0):
        # DeepSeek-V3 Sec. 2.2: RMSNorm of the hidden state and of the next token's embedding, a
        # projection of their concatenation (2h→h), one transformer layer, and the shared head.
        last = kinds[pattern[-1]]
        module = Layer((norm, norm, Projection(2 * model.hidden_size, model.hidden_size)) + last.blocks)
        mtp = (module,) * model.num_mtp_layers
    return ModelBlocks(embedding, kinds, pattern, head, mtp)
