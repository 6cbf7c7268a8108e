"""ModelSpec: the architecture of a decoder-only transformer, or of a hybrid Mamba-Transformer stack.

Parameter counts come from the cost blocks (`cost_models.blocks`) and follow
Megatron-LM's `theoretical_memory_usage.py` layout
(`benchmarks/data/published/formulas.json`, "parameter_count") generalised to GQA,
gated MLPs and optional biases; `num_params()` for the GPT-3 presets reproduces
SC'21 Eq. 2 (`P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))`) exactly.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from planner.errors import SpecError
from planner.specs.base import (
    MAX_HEADS,
    MAX_LAYERS,
    MAX_TOKENS,
    MAX_VOCAB,
    MAX_WIDTH,
    Spec,
)


#: megatron-core's hybrid layer symbols (megatron/core/ssm/mamba_hybrid_layer_allocation.py `Symbols`, core_v0.16.1).
HYBRID_SYMBOLS = {"M": "Mamba-2", "*": "self-attention", "-": "MLP", "E": "MoE"}


class ModelSpec(Spec):
    """A decoder-only transformer. Counts are elements, not bytes."""

    name: str = Field("custom", description="Preset or user name of the model.")
    num_layers: int = Field(gt=0, le=MAX_LAYERS, description="Number of transformer layers (L).")
    hidden_size: int = Field(gt=0, le=MAX_WIDTH, description="Model width h.")
    num_attention_heads: int = Field(gt=0, le=MAX_HEADS, description="Number of query heads a.")
    num_kv_heads: int | None = Field(
        None, gt=0, le=MAX_HEADS, description="Number of key/value heads (GQA groups); default: num_attention_heads (MHA)."
    )
    head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Width of one head; default: hidden_size / num_attention_heads.")
    ffn_hidden_size: int = Field(gt=0, le=MAX_WIDTH, description="MLP inner width f (per branch for gated MLPs).")
    gated_mlp: bool = Field(False, description="SwiGLU-style gated MLP (three matrices) instead of a plain two-matrix MLP.")
    glu_activation: Literal["silu", "gelu", "gelu_tanh", "quick_gelu"] = Field(
        "silu", description="The gate's activation in a gated MLP: silu (SwiGLU: Llama, Qwen, Mistral, DeepSeek), gelu "
        "or gelu_tanh (GeGLU; Gemma's gelu_pytorch_tanh), quick_gelu (x * sigmoid(1.702 x): gpt-oss; megatron-core's "
        "quick_gelu). Only with gated_mlp.")
    glu_linear_offset: float = Field(
        0.0, ge=-1e3, le=1e3, description="Added to the linear (up) branch of a gated MLP before the product (gpt-oss: "
        "1.0; megatron-core's glu_linear_offset). Only with gated_mlp.")
    glu_clamp: float | None = Field(
        None, gt=0, le=1e6, description="Clamp of a gated MLP's branches before the activation: the gate to at most "
        "this, the linear branch to +- this (gpt-oss's swiglu_limit, 7.0; megatron-core's activation_func_clamp_value); "
        "None: no clamp. Only with gated_mlp.")
    vocab_size: int = Field(gt=0, le=MAX_VOCAB, description="Vocabulary size V (unpadded).")
    tie_embeddings: bool = Field(True, description="Input embedding and output projection share weights.")
    position_embedding: Literal["learned", "rope", "none"] = Field(
        "rope", description="learned absolute (GPT-2/3), rotary (Llama) or none."
    )
    max_position_embeddings: int = Field(2048, gt=0, le=MAX_TOKENS, description="The context the model was trained for, in tokens (Hugging Face "
        "max_position_embeddings); with learned position embeddings also the rows of the position table. A "
        "sequence longer than this is planned with a warning.")
    rope_theta: float | None = Field(None, gt=0, le=1e12, description="Base of the rotary position embedding "
        "(Hugging Face rope_theta; Llama 3: 500000); None where the model has no rotary embedding or the spec does "
        "not say. Not used by the cost model; the Megatron-LM emitter writes it as --rotary-base.")
    rope_scaling: Literal["none", "yarn"] = Field("none", description="Scaling of the rotary frequencies (Hugging "
        "Face rope_scaling's type): yarn (gpt-oss, DeepSeek) or none. It is costed where it changes the kernels: "
        "megatron-core applies YaRN to standard attention in its unfused rotary (position_embedding_type yarn turns "
        "apply_rope_fusion off); other scalings (llama3, linear) change only the frequencies and read as none.")
    norm: Literal["layernorm", "rmsnorm"] = Field("rmsnorm", description="Normalisation: LayerNorm (weight+bias) or RMSNorm (weight).")
    norm_epsilon: float = Field(1e-5, gt=0, le=1.0, description="The epsilon every norm adds to the variance (Hugging "
        "Face rms_norm_eps, layer_norm_eps or layer_norm_epsilon): 1e-5 by default, as GPT-2/3, Llama 2/3, Mistral, "
        "Mixtral, gpt-oss and megatron-core's layernorm_epsilon; Qwen3, DeepSeek and Gemma use 1e-6. Not used by the "
        "cost model; the emitters write it (Megatron-LM --norm-epsilon, megatron-core's layernorm_epsilon).")
    qk_norm: Literal["none", "per_head", "full"] = Field("none", description="Normalisation of the queries and keys "
        "after the QKV projection, of the model's `norm` kind: per_head over each head's width (Qwen3, Gemma 3; "
        "Megatron's --qk-layernorm), full over all query heads together and all key heads together (OLMo 2), or none.")
    linear_bias: bool = Field(False, description="Biases on all linear layers (GPT-2/3, NeoX).")
    qkv_bias: bool = Field(False, description="Biases on the QKV projection only (Qwen2); implied by linear_bias.")
    dropout: bool = Field(False, description="Hidden/attention dropout is active (stores 1-byte masks; GPT-3 style).")
    # ---- mixture of experts (Megatron-core's MoE layer; HF Mixtral / Qwen-MoE / DeepSeek / gpt-oss) ----
    num_experts: int = Field(0, ge=0, le=MAX_HEADS, description="Routed experts per MoE layer; 0 = a dense model.")
    moe_top_k: int = Field(0, ge=0, le=MAX_HEADS, description="Routed experts each token is sent to (top-k); needs num_experts.")
    moe_ffn_hidden_size: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="Inner width of one routed expert (per branch when gated); default ffn_hidden_size.")
    num_shared_experts: int = Field(0, ge=0, le=MAX_HEADS, description="Always-active shared experts per MoE layer (DeepSeek, Qwen2-MoE).")
    shared_expert_ffn_hidden_size: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="Inner width of one shared expert; default moe_ffn_hidden_size.")
    moe_first_k_dense: int = Field(0, ge=0, le=MAX_LAYERS, description="The first k layers are dense (DeepSeek's first_k_dense_replace).")
    moe_layer_freq: int = Field(1, ge=1, le=MAX_LAYERS, description="Every n-th layer (after the dense ones) is MoE; the others dense.")
    moe_dense_layers: list[int] | None = Field(
        None, description="Explicit 0-based indices of the dense layers (overrides first_k_dense and layer_freq).")
    moe_router_bias: bool = Field(False, description="The router has a bias (gpt-oss).")
    moe_router_num_groups: int = Field(
        0, ge=0, le=MAX_HEADS, description="Group-limited routing (DeepSeek-V3 n_group; Megatron --moe-router-num-groups): the "
        "experts form this many equal groups, and each token picks its top-k experts inside moe_router_group_topk of "
        "them; 0 = no group limit.")
    moe_router_group_topk: int = Field(
        0, ge=0, le=MAX_HEADS, description="Groups each token may use (DeepSeek-V3 topk_group: 4 of 8 groups; Megatron "
        "--moe-router-group-topk); needs moe_router_num_groups.")
    moe_expert_bias: bool = Field(False, description="Expert linear layers have biases (gpt-oss).")
    num_mtp_layers: int = Field(
        0, ge=0, le=MAX_LAYERS, description="Multi-token-prediction modules after the last layer (DeepSeek-V3: 1), each a "
        "projection, two norms and one transformer layer of the model's last kind, sharing the output head.")
    # ---- multi-head latent attention (DeepSeek-V2/V3) ----
    q_lora_rank: int | None = Field(None, gt=0, le=MAX_WIDTH, description="MLA query low-rank width; None = a full query projection.")
    kv_lora_rank: int | None = Field(None, gt=0, le=MAX_WIDTH, description="MLA key/value latent width; set = the model uses MLA.")
    qk_nope_head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="MLA query/key head width without rotary.")
    qk_rope_head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="MLA query/key rotary head width (the key's is shared).")
    v_head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="MLA value head width.")
    # ---- windowed attention (Mistral, Gemma 2/3, gpt-oss) ----
    sliding_window: int | None = Field(None, gt=0, le=MAX_TOKENS, description="Local attention window (tokens); None = all layers global.")
    global_attention_every: int = Field(
        0, ge=0, le=MAX_LAYERS, description="With sliding_window: layer i is global when (i + 1) is a multiple of this (Gemma 2 and "
        "gpt-oss: 2, Gemma 3: 6); 0 = every layer local (Mistral).")
    global_attention_layers: list[int] | None = Field(
        None, description="Explicit 0-based indices of the global-attention layers (overrides global_attention_every).")
    attention_sinks: bool = Field(False, description="One learned sink logit per head (gpt-oss); counted as parameters only.")
    mlp_activation: Literal["gelu", "squared_relu"] = Field(
        "gelu", description="The activation of a plain (not gated) MLP and of plain experts: gelu (GPT-2/3) or "
        "squared_relu (relu(x)^2: Nemotron-H, Nemotron 3; Hugging Face mlp_hidden_act relu2, Megatron "
        "--squared-relu). Only without gated_mlp; costed alike (one element-wise kernel).")
    # ---- hybrid Mamba-Transformer stacks (megatron-core's HybridModel / MambaModel; Nemotron-H, Nemotron 3) ----
    hybrid_override_pattern: str | None = Field(
        None, min_length=1, max_length=MAX_LAYERS, description="One symbol per layer, in megatron-core's vocabulary "
        "(megatron/core/ssm/mamba_hybrid_layer_allocation.py Symbols): M a Mamba-2 layer, * a self-attention layer, "
        "- an MLP layer, E a mixture-of-experts layer. Each symbol is one whole layer (its own norm and residual), so "
        "the pattern is num_layers long. None: every layer is a transformer layer (attention and MLP or MoE).")
    mamba_num_heads: int | None = Field(
        None, gt=0, le=MAX_HEADS, description="SSM heads of a Mamba-2 layer (megatron-core's mamba_num_heads); "
        "None: mamba_expand * hidden_size / mamba_head_dim. Given, it sets the inner width (heads * head dim) and "
        "mamba_expand is not used, as in megatron-core.")
    mamba_head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="Width of one SSM head (P; "
        "megatron-core's mamba_head_dim, Hugging Face mamba_head_dim). Needed with M layers.")
    mamba_state_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="SSM state size per head (N; "
        "megatron-core's mamba_state_dim, Hugging Face ssm_state_size). Needed with M layers.")
    mamba_num_groups: int | None = Field(None, gt=0, le=MAX_HEADS, description="Groups sharing one B and C "
        "projection (G; megatron-core's mamba_num_groups, Hugging Face n_groups); must divide mamba heads. Needed "
        "with M layers.")
    mamba_conv_kernel: int = Field(4, gt=0, le=1024, description="Width of the causal depthwise convolution over "
        "x, B and C (Hugging Face conv_kernel; megatron-core's d_conv, 4).")
    mamba_chunk_size: int = Field(128, gt=0, le=MAX_TOKENS, description="Chunk length Q of the SSD scan (Hugging "
        "Face chunk_size; megatron-core's mamba_chunk_size, 128): intra-chunk work grows with Q, inter-chunk state "
        "passing with sequence/Q.")
    mamba_expand: int = Field(2, gt=0, le=64, description="Inner width over hidden_size where mamba_num_heads is "
        "not given (Hugging Face expand; megatron-core's expand, 2).")
    source: str = Field("", description="Where the numbers come from (paper, model card, config.json).")

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        kv = self.kv_heads
        if self.num_attention_heads % kv:
            raise SpecError(
                f"num_kv_heads ({kv}) must divide num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise SpecError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) unless head_dim is given"
            )
        if self.qk_norm != "none" and self.kv_lora_rank is not None:
            raise SpecError(f"qk_norm {self.qk_norm!r} normalises per-head queries and keys, but the model uses "
                            "multi-head latent attention (kv_lora_rank is set), which normalises its latents instead")
        if self.rope_scaling != "none" and self.position_embedding != "rope":
            raise SpecError(f"rope_scaling {self.rope_scaling!r} scales rotary embeddings, but position_embedding is "
                            f"{self.position_embedding!r}")
        glu = self.glu_settings()
        if glu and not self.gated_mlp:
            raise SpecError(f"{', '.join(f'{k}={v!r}' for k, v in glu.items())} describes a gated MLP, but "
                            "gated_mlp is false")
        if self.mlp_activation != "gelu" and self.gated_mlp:
            raise SpecError(f"mlp_activation {self.mlp_activation!r} is the activation of a plain MLP, but gated_mlp "
                            "is true (a gated MLP's gate activation is glu_activation)")
        self._check_hybrid()
        self._check_moe()
        self._check_mla()
        self._check_window()
        return self

    def _check_hybrid(self) -> None:
        mamba = {k: getattr(self, k) for k in ("mamba_num_heads", "mamba_head_dim", "mamba_state_dim",
                                                "mamba_num_groups") if getattr(self, k) is not None}
        pattern = self.hybrid_override_pattern
        if pattern is None:
            if mamba:
                raise SpecError(f"{', '.join(f'{k}={v}' for k, v in mamba.items())} describes Mamba layers, but "
                                "hybrid_override_pattern is not set")
            return
        for i, symbol in enumerate(pattern):
            if symbol not in HYBRID_SYMBOLS:
                raise SpecError(f"hybrid_override_pattern: unknown layer symbol {symbol!r} at position {i} (0-based); "
                                f"allowed: {', '.join(f'{k} ({v})' for k, v in HYBRID_SYMBOLS.items())}")
        if len(pattern) != self.num_layers:
            raise SpecError(f"hybrid_override_pattern has {len(pattern)} symbols but num_layers is {self.num_layers}: "
                            "each symbol is one layer")
        clashes = [k for k, v, default in (("moe_first_k_dense", self.moe_first_k_dense, 0),
                                           ("moe_layer_freq", self.moe_layer_freq, 1),
                                           ("moe_dense_layers", self.moe_dense_layers, None),
                                           ("sliding_window", self.sliding_window, None),
                                           ("kv_lora_rank", self.kv_lora_rank, None),
                                           ("num_mtp_layers", self.num_mtp_layers, 0)) if v != default]
        if clashes:
            raise SpecError(f"{', '.join(clashes)} cannot be combined with hybrid_override_pattern (the pattern says "
                            "which layers are MoE; windowed or latent attention and MTP modules are not modelled in "
                            "hybrid stacks)")
        if "E" in pattern and not self.num_experts:
            raise SpecError("hybrid_override_pattern has E (MoE) layers but num_experts is 0")
        if self.num_experts and "E" not in pattern:
            raise SpecError(f"num_experts ({self.num_experts}) is set but hybrid_override_pattern has no E (MoE) layer")
        if "M" not in pattern:
            return
        missing = [k for k in ("mamba_head_dim", "mamba_state_dim", "mamba_num_groups") if getattr(self, k) is None]
        if missing:
            raise SpecError(f"hybrid_override_pattern has M (Mamba) layers; they need {', '.join(missing)}")
        if self.mamba_num_heads is None and (self.mamba_expand * self.hidden_size) % self.mamba_head_dim:
            raise SpecError(f"mamba_expand * hidden_size ({self.mamba_expand * self.hidden_size}) must be divisible "
                            f"by mamba_head_dim ({self.mamba_head_dim}) unless mamba_num_heads is given")
        if self.mamba_heads % self.mamba_num_groups:
            raise SpecError(f"mamba_num_groups ({self.mamba_num_groups}) must divide the Mamba heads "
                            f"({self.mamba_heads})")

    def _check_moe(self) -> None:
        L = self.num_layers
        if not self.num_experts:
            extras = {k: getattr(self, k) for k in ("moe_top_k", "num_shared_experts", "moe_first_k_dense",
                                                     "moe_router_num_groups", "moe_router_group_topk")
                      if getattr(self, k)} | {k: getattr(self, k) for k in ("moe_ffn_hidden_size", "moe_dense_layers")
                                               if getattr(self, k) is not None}
            if extras:
                raise SpecError(f"{', '.join(f'{k}={v}' for k, v in extras.items())} needs num_experts > 0 "
                                "(the model has no routed experts)")
            return
        if not 1 <= self.moe_top_k <= self.num_experts:
            raise SpecError(f"moe_top_k ({self.moe_top_k}) must be between 1 and num_experts ({self.num_experts})")
        if self.moe_dense_layers is not None:
            bad = [i for i in self.moe_dense_layers if not 0 <= i < L]
            if bad:
                raise SpecError(f"moe_dense_layers {bad} must be layer indices 0..{L - 1}")
        self._check_router_groups()
        if not any(self.moe_layer_mask()):
            raise SpecError(f"num_experts ({self.num_experts}) is set but no layer is MoE (moe_first_k_dense="
                            f"{self.moe_first_k_dense}, moe_layer_freq={self.moe_layer_freq}, num_layers={L})")

    def _check_router_groups(self) -> None:
        g, gk = self.moe_router_num_groups, self.moe_router_group_topk
        if not g and not gk:
            return
        if not g or not gk:
            raise SpecError(f"moe_router_num_groups ({g}) and moe_router_group_topk ({gk}) go together: set both "
                            "or neither")
        if self.num_experts % g:
            raise SpecError(f"moe_router_num_groups ({g}) must divide num_experts ({self.num_experts}) into equal groups")
        if not 1 <= gk <= g:
            raise SpecError(f"moe_router_group_topk ({gk}) must be between 1 and moe_router_num_groups ({g})")
        if self.moe_top_k % gk or self.moe_top_k // gk > self.num_experts // g:
            raise SpecError(f"moe_top_k ({self.moe_top_k}) must be a multiple of moe_router_group_topk ({gk}) with at "
                            f"most {self.num_experts // g} experts per group (megatron-core's group-limited top-k)")

    def _check_mla(self) -> None:
        mla = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        given = [k for k in mla if getattr(self, k) is not None]
        if self.q_lora_rank is not None and not given:
            raise SpecError("q_lora_rank is set but kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and "
                            "v_head_dim are not: multi-head latent attention needs all four")
        if given and len(given) != len(mla):
            missing = [k for k in mla if getattr(self, k) is None]
            raise SpecError(f"multi-head latent attention needs {', '.join(mla)}; missing {', '.join(missing)}")
        if given and self.num_kv_heads not in (None, self.num_attention_heads):
            raise SpecError(f"num_kv_heads ({self.num_kv_heads}) must be unset with multi-head latent attention "
                            "(every head has its own key and value)")

    def _check_window(self) -> None:
        L = self.num_layers
        if self.sliding_window is None:
            if self.global_attention_every or self.global_attention_layers is not None:
                raise SpecError("global_attention_every / global_attention_layers need sliding_window")
            return
        if self.global_attention_layers is not None:
            bad = [i for i in self.global_attention_layers if not 0 <= i < L]
            if bad:
                raise SpecError(f"global_attention_layers {bad} must be layer indices 0..{L - 1}")

    # ---- per-layer patterns ------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        """Whether the stack is given layer by layer (hybrid_override_pattern)."""
        return self.hybrid_override_pattern is not None

    @property
    def mamba_heads(self) -> int:
        """SSM heads of a Mamba-2 layer: mamba_num_heads, else expand * hidden / head dim (megatron-core's rule)."""
        if self.mamba_num_heads is not None:
            return self.mamba_num_heads
        return self.mamba_expand * self.hidden_size // (self.mamba_head_dim or 1)

    @property
    def mamba_inner(self) -> int:
        """Inner width of a Mamba-2 layer (d_inner = heads * head dim)."""
        return self.mamba_heads * (self.mamba_head_dim or 0)

    def layer_symbols(self) -> str:
        """Each layer's kind in megatron-core's hybrid vocabulary; a transformer stack has no pattern and reads
        as one symbol T (attention and MLP or MoE) per layer."""
        return self.hybrid_override_pattern or "T" * self.num_layers

    def glu_settings(self) -> dict[str, Any]:
        """The gated-MLP fields that differ from plain SwiGLU ({} for SwiGLU): glu_activation other than silu,
        a glu_linear_offset, a glu_clamp."""
        return {k: v for k, v, default in (("glu_activation", self.glu_activation, "silu"),
                                           ("glu_linear_offset", self.glu_linear_offset, 0.0),
                                           ("glu_clamp", self.glu_clamp, None)) if v != default}

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def shared_expert_ffn(self) -> int:
        return self.shared_expert_ffn_hidden_size or self.expert_ffn

    def moe_layer_mask(self) -> tuple[bool, ...]:
        """Whether each layer (0-based) is an MoE layer.

        Layer i is MoE when i >= moe_first_k_dense and (i - moe_first_k_dense + 1) is a multiple
        of moe_layer_freq. Llama 4 Maverick-style every 2nd layer, and DeepSeek-style first
        k dense:

        >>> m = dict(num_layers=6, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100,
        ...          num_experts=4, moe_top_k=2)
        >>> ModelSpec(**m, moe_layer_freq=2).moe_layer_mask()
        (False, True, False, True, False, True)
        >>> ModelSpec(**m, moe_first_k_dense=3).moe_layer_mask()
        (False, False, False, True, True, True)
        """
        if not self.num_experts:
            return (False,) * self.num_layers
        if self.hybrid_override_pattern is not None:
            return tuple(c == "E" for c in self.hybrid_override_pattern)
        if self.moe_dense_layers is not None:
            dense = set(self.moe_dense_layers)
            return tuple(i not in dense for i in range(self.num_layers))
        k, f = self.moe_first_k_dense, self.moe_layer_freq
        return tuple(i >= k and (i - k) % f == f - 1 for i in range(self.num_layers))

    def local_attention_mask(self) -> tuple[bool, ...]:
        """Whether each layer (0-based) attends only within `sliding_window` (Gemma 2: even layers)."""
        L = self.num_layers
        if self.sliding_window is None:
            return (False,) * L
        if self.global_attention_layers is not None:
            glob = set(self.global_attention_layers)
            return tuple(i not in glob for i in range(L))
        n = self.global_attention_every
        return tuple(not (n and (i + 1) % n == 0) for i in range(L))

    # ---- derived shapes -------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_width(self) -> int:
        """Width of all query heads together (a·d), equal to h for standard models."""
        return self.num_attention_heads * self.head_size

    @property
    def kv_width(self) -> int:
        """Width of all key (or value) heads together (g·d)."""
        return self.kv_heads * self.head_size
