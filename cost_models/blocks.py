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

A model is a list of (layer kind, number of layers) plus the embedding and the head
(`model_blocks`). Today every ModelSpec has one layer kind; per-stage costs use the
model's average layer, which is exact for uniform stacks. A model with a per-layer
pattern (dense and MoE layers, local and global attention) adds kinds here, and the
stages then need the pattern's counts per stage (`ParallelLayout` gives each stage's
layer range).

Symbols: s = seq_len, b = micro_batch_size, h = hidden, a = heads, t = tp, c = cp,
f = ffn_hidden_size, q = a·d (query width), k = g·d (key/value width), V = vocabulary.
Sources per block below; activation terms are Korthikanti et al. 2022 Sec. 4 / Table 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from cost_models.units import ACTIVATION_BYTES, FP32, INT64, MASK

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

    @cached_property
    def tokens(self) -> np.ndarray:
        """Tokens of the micro-batch on this rank: s / c · b."""
        return self.seq_len / self.cp * self.micro_batch_size

    @property
    def act(self) -> int:
        """Bytes per stored activation element."""
        return ACTIVATION_BYTES[self.precision]

    @cached_property
    def seq_split(self) -> np.ndarray:
        """Divisor of TP-replicated tensors: tp with sequence parallelism, else 1."""
        return np.where(self.sequence_parallel, self.tp, 1)


@dataclass(frozen=True)
class Gemm:
    """One forward GEMM (m×k)·(k×n) on one rank; `quantised`: runs in FP8 under FP8 training."""

    flop: np.ndarray
    m: np.ndarray
    n: np.ndarray
    k: np.ndarray
    quantised: bool = True


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
    num_kernels: int


@dataclass(frozen=True)
class Activations:
    """Bytes kept for backward per micro-batch on one rank, before TP/SP division:
    `replicated` is divided by the sequence split, `split` by tp, `scores` by tp."""

    replicated: np.ndarray
    split: np.ndarray
    scores: np.ndarray


@dataclass(frozen=True)
class Comm:
    """Bytes a block exchanges per forward: `tp_exchanges` activations of `tp_bytes` each
    (an all-reduce, or an all-gather + reduce-scatter pair with SP), and `cp_hop_bytes`
    per ring step of context parallelism."""

    tp_exchanges: int = 0
    tp_bytes: np.ndarray | float = 0.0
    cp_hop_bytes: np.ndarray | float = 0.0


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
    """

    hidden: int
    num_heads: int
    q_width: int
    kv_width: int
    bias: int  # bias elements (QKV and/or output)
    rope: bool
    dropout: bool

    def params(self) -> int:
        h, q, k = self.hidden, self.q_width, self.kv_width
        return h * q + 2 * h * k + q * h + self.bias  # Wq, Wk, Wv, Wo (+ biases)

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        return self.params() / tp

    def gemms(self, x: Micro) -> list[Gemm]:
        h, q, k, t, n = self.hidden, self.q_width, self.kv_width, x.tp, x.tokens
        return [Gemm(2 * n * h * (q + 2 * k) / t, n, (q + 2 * k) / t, h),
                Gemm(2 * n * q * h / t, n, h, q / t)]

    def core(self, x: Micro) -> Core:
        """Scores and over-V: each rank's queries see all s keys. Unfused kernels write the
        (a/t)·b·s² scores and read the probabilities back; flash attention reads Q, K, V and
        writes the output only. The unfused softmax (+ dropout) traffic is its own kernel."""
        q, k, t, n, s, act = self.q_width, self.kv_width, x.tp, x.tokens, x.seq_len, x.act
        flop = 2 * 2 * n * s * q / t
        qkvo = act * n * (2 * q + 2 * k) / t
        if x.attention_kernel == "unfused":
            scores = self.num_heads / t * n * s
            mask = MASK if self.dropout else 0
            softmax = (2 * act + (2 * act + mask if self.dropout else 0)) * scores
            return Core(flop, qkvo + 2 * act * scores, 2, softmax, 1)
        return Core(flop, qkvo, 2, ZERO, 0)

    def elementwise(self, x: Micro) -> Elementwise:
        rotary = 2 * x.act * x.tokens * (self.q_width + self.kv_width) / x.tp if self.rope else ZERO
        return Elementwise(rotary, 0)  # applied inside the QKV epilogue: no kernel of its own

    def activations(self, x: Micro) -> Activations:
        """QKV input (replicated); Q, K, V and the projection input (split); scores: unfused
        softmax output (+ dropout mask and output) 5as²b for GPT, flash only fp32
        log-sum-exp statistics (4asb)."""
        q, k, n, act = self.q_width, self.kv_width, x.tokens, x.act
        if x.attention_kernel == "unfused":
            probs = act + (MASK + act if self.dropout else 0)
            scores = probs * self.num_heads * n * x.seq_len
        else:
            scores = FP32 * self.num_heads * n
        return Activations(n * act * self.hidden, n * (act * (q + k) + act * k + act * q), scores)

    def comm(self, x: Micro) -> Comm:
        """One TP exchange of the output; context parallelism passes K and V around the ring."""
        return Comm(tp_exchanges=1, tp_bytes=x.tokens * self.hidden * x.act,
                    cp_hop_bytes=x.tokens * 2 * self.kv_width * x.act / x.tp)


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
        return Elementwise((3 if self.gated else 2) * x.act * x.tokens * self.ffn / x.tp, 1)

    def activations(self, x: Micro) -> Activations:
        return Activations(x.tokens * x.act * self.hidden, x.tokens * (3 if self.gated else 2) * x.act * self.ffn, ZERO)

    def comm(self, x: Micro) -> Comm:
        return Comm(tp_exchanges=1, tp_bytes=x.tokens * self.hidden * x.act)


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
        and their gradient."""
        v = padded_vocab(self.vocab, x.tp) / x.tp
        return Elementwise(2 * x.act * x.tokens * self.hidden / x.seq_split + (x.act + FP32 + FP32) * x.tokens * v, 2)

    def activations(self, x: Micro) -> Activations:
        """Final norm input and output-layer input (16-bit) + fp32 logits, one micro-batch."""
        return Activations(2 * x.act * self.hidden * x.tokens, FP32 * padded_vocab(self.vocab, x.tp) * x.tokens, ZERO)


@dataclass(frozen=True)
class Layer:
    """A transformer layer as a composition of blocks."""

    blocks: tuple

    def params(self) -> int:
        return sum(b.params() for b in self.blocks)

    def params_per_rank(self, tp: np.ndarray) -> np.ndarray:
        return sum(b.params_per_rank(tp) for b in self.blocks)

    def gemms(self, x: Micro) -> list[Gemm]:
        return [g for b in self.blocks for g in b.gemms(x)]

    def attention(self) -> Attention:
        return next(b for b in self.blocks if isinstance(b, Attention))

    def elementwise(self, x: Micro) -> Elementwise:
        parts = [b.elementwise(x) for b in self.blocks]
        return Elementwise(sum(p.bytes for p in parts), sum(p.num_kernels for p in parts))

    def activations(self, x: Micro) -> Activations:
        parts = [b.activations(x) for b in self.blocks]
        return Activations(sum(p.replicated for p in parts), sum(p.split for p in parts),
                           sum(p.scores for p in parts))

    def comms(self, x: Micro) -> list[Comm]:
        """Each block's exchanges (TP time is a sum over them, CP a sum of hop bytes)."""
        return [c for c in (b.comm(x) for b in self.blocks) if c.tp_exchanges or np.any(c.cp_hop_bytes)]

    def forward_flop(self, x: Micro) -> np.ndarray:
        return sum(g.flop for g in self.gemms(x)) + self.attention().core(x).flop


@dataclass(frozen=True)
class ModelBlocks:
    """A model as blocks: the embedding, the layer kinds with their counts, the head."""

    embedding: Embedding
    layers: Sequence[tuple[Layer, int]]
    head: Head

    @property
    def num_layers(self) -> int:
        return sum(n for _, n in self.layers)

    def mean(self, f: Callable[[Layer], np.ndarray]) -> np.ndarray:
        """The model's average layer of a per-layer quantity `f(layer)` (exact for one kind)."""
        return sum(n * f(layer) for layer, n in self.layers) / self.num_layers


def dense_layer(model: ModelSpec) -> Layer:
    """The decoder layer of a dense ModelSpec: norm, attention, add, norm, MLP, add."""
    norm = Norm(model.hidden_size, model.norm == "layernorm")
    q, k = model.q_width, model.kv_width
    bias = (q + 2 * k + model.hidden_size) if model.linear_bias else (q + 2 * k) if model.qkv_bias else 0
    attention = Attention(model.hidden_size, model.num_attention_heads, q, k, bias,
                          model.position_embedding == "rope", model.dropout)
    mlp = DenseMLP(model.hidden_size, model.ffn_hidden_size, model.gated_mlp, model.linear_bias)
    residual = Residual(model.hidden_size, model.dropout)
    return Layer((norm, attention, residual, norm, mlp, residual))


def model_blocks(model: ModelSpec) -> ModelBlocks:
    """The blocks of a ModelSpec (read by attribute)."""
    positions = model.max_position_embeddings if model.position_embedding == "learned" else 0
    embedding = Embedding(model.hidden_size, model.vocab_size, positions, model.dropout)
    head = Head(model.hidden_size, model.vocab_size, Norm(model.hidden_size, model.norm == "layernorm"),
                model.tie_embeddings)
    return ModelBlocks(embedding, ((dense_layer(model), model.num_layers),), head)
