"""A decoder-only transformer built from a ModelSpec in plain PyTorch (imports torch).

The module tree is fixed so that the parallel plans can name its parts:

    embed.tok, embed.pos          word and (learned) position embeddings
    layers["<i>"].norm1 / .attn.{wq,wk,wv,wo} / .norm2 / .mlp.{w1,w3,w2}
    layers["<i>"].mlp.{router, experts["<e>"].{w1,w3,w2}, shared}   MoE layers
                                  (`ModelSpec.moe_layer_mask()`; executors.moe)
    norm, output                  final norm and the output projection

Layers live in a ModuleDict keyed by their global index, so a pipeline stage
that deletes the layers it does not own keeps the names (and the seeded
weights) of the full model. A stage whose `embed` is None takes hidden states
instead of token ids; one whose `norm`/`output` are None returns hidden states.

Attention reads the number of local heads from the projected tensor, so the
same code runs unsharded and under tensor parallelism (heads split over tp).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from executors.moe import MLP, MoE, glu_of
from planner.specs import ModelSpec

INIT_STD = 0.02  # GPT-2/Megatron default init_method_std


def _norm(spec: ModelSpec, width: int | None = None) -> nn.Module:
    """The model's norm over `width` features (default: the hidden size)."""
    if spec.norm == "layernorm":
        return nn.LayerNorm(width or spec.hidden_size, eps=spec.norm_epsilon)
    return nn.RMSNorm(width or spec.hidden_size, eps=spec.norm_epsilon)


def rope_tables(seq_len: int, head_dim: int, device, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (seq_len, head_dim/2) of rotary embeddings (Su et al. 2021, Eq. 34)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x (b, heads, s, d) by the position angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, q, kv = spec.hidden_size, spec.q_width, spec.kv_width
        qkv_bias = spec.linear_bias or spec.qkv_bias
        self.head_dim = spec.head_size
        self.wq = nn.Linear(h, q, bias=qkv_bias)
        self.wk = nn.Linear(h, kv, bias=qkv_bias)
        self.wv = nn.Linear(h, kv, bias=qkv_bias)
        self.wo = nn.Linear(q, h, bias=spec.linear_bias)
        # query/key norms (ModelSpec.qk_norm): over each head's width, or over all query (key) heads together
        self.qk_norm = spec.qk_norm
        widths = {"per_head": (self.head_dim, self.head_dim), "full": (q, kv)}.get(spec.qk_norm)
        self.q_norm = _norm(spec, widths[0]) if widths else None
        self.k_norm = _norm(spec, widths[1]) if widths else None
        self.recompute_core = False  # selective recompute: the attention core is recomputed in backward

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q, k = self.wq(x), self.wk(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, s, -1, d), k.view(b, s, -1, d)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, s, -1, d).transpose(1, 2)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, moe: bool = False):
        super().__init__()
        self.norm1 = _norm(spec)
        self.attn = Attention(spec)
        self.norm2 = _norm(spec)
        self.mlp = MoE(spec) if moe else MLP(spec.hidden_size, spec.ffn_hidden_size, spec.gated_mlp,
                                             spec.linear_bias, glu_of(spec))

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Embeddings(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab_size, spec.hidden_size)
        learned = spec.position_embedding == "learned"
        self.pos = nn.Embedding(spec.max_position_embeddings, spec.hidden_size) if learned else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos(positions)
        return x


class Transformer(nn.Module):
    """Decoder-only transformer; see the module docstring for the names."""

    def __init__(self, spec: ModelSpec, seq_len: int):
        super().__init__()
        self.spec = spec
        # Everything that depends on the position is a (seq_len, ...) buffer, so that
        # context parallelism can shard it along the sequence together with the batch.
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)
        self.use_rope = spec.position_embedding == "rope"
        if self.use_rope:
            cos, sin = rope_tables(seq_len, spec.head_size, None)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.embed: Embeddings | None = Embeddings(spec)
        moe = spec.moe_layer_mask()
        self.layers = nn.ModuleDict({str(i): Block(spec, moe[i]) for i in range(spec.num_layers)})
        self.norm: nn.Module | None = _norm(spec)
        self.output: nn.Linear | None = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.recompute_layers: set[str] = set()  # full recompute: these layers keep only their input
        self._init_weights()
        if spec.tie_embeddings:
            self.output.weight = self.embed.tok.weight

    def _init_weights(self) -> None:
        """Normal(0, 0.02) weights, zero biases; output projections (attention's wo, every MLP's
        and expert's w2) scaled by 1/sqrt(2L) (GPT-2; Megatron-core's output_layer_init_method,
        which its experts' fc2 take too). Drawn in module order from one generator, so a model
        built from the same seed has the same weights whatever is later sharded or deleted."""
        out_std = INIT_STD / math.sqrt(2 * self.spec.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = out_std if name.endswith(("attn.wo", ".w2")) else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def set_recompute(self, recompute: str, num_layers: int | None = None) -> None:
        """Apply a Strategy's recompute setting: 'full' checkpoints whole layers (the first
        `num_layers` of this module's layers, or all), 'selective' only the attention core."""
        names = list(self.layers.keys())
        self.recompute_layers = set(names[: num_layers or len(names)]) if recompute == "full" else set()
        for layer in self.layers.values():
            layer.attn.recompute_core = recompute == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        h = self.embed(x, self.positions[:s]) if self.embed is not None else x
        cos, sin = (self.rope_cos[:s], self.rope_sin[:s]) if self.use_rope else (None, None)
        for name, layer in self.layers.items():
            if name in self.recompute_layers and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_model(spec: ModelSpec, seq_len: int, seed: int) -> Transformer:
    """The full model with weights drawn from `seed` (identical on every rank and in the reference)."""
    torch.manual_seed(seed)
    return Transformer(spec, seq_len)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all tokens of the micro-batch (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def synthetic_batch(spec: ModelSpec, global_batch_size: int, seq_len: int, seed: int, step: int):
    """Token ids (global_batch_size, seq_len) and their next-token targets for `step`.

    The same function of (seed, step) on every rank and in the reference; each
    data parallel replica then takes its contiguous slice of rows.
    """
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    data = torch.randint(0, spec.vocab_size, (global_batch_size, seq_len + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
