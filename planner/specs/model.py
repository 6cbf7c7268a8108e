"""ModelSpec: the architecture of a decoder-only transformer.

Parameter counts come from the cost blocks (`cost_models.blocks`) and follow
Megatron-LM's `theoretical_memory_usage.py` layout
(`../shared/validation/formulas.json`, "parameter_count") generalised to GQA,
gated MLPs and optional biases; `num_params()` for the GPT-3 presets reproduces
SC'21 Eq. 2 (`P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))`) exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.errors import SpecError


class ModelSpec(BaseModel):
    """A decoder-only transformer. Counts are elements, not bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field("custom", description="Preset or user name of the model.")
    num_layers: int = Field(gt=0, description="Number of transformer layers (L).")
    hidden_size: int = Field(gt=0, description="Model width h.")
    num_attention_heads: int = Field(gt=0, description="Number of query heads a.")
    num_kv_heads: int | None = Field(
        None, gt=0, description="Number of key/value heads (GQA groups); default: num_attention_heads (MHA)."
    )
    head_dim: int | None = Field(None, gt=0, description="Width of one head; default: hidden_size / num_attention_heads.")
    ffn_hidden_size: int = Field(gt=0, description="MLP inner width f (per branch for gated MLPs).")
    gated_mlp: bool = Field(False, description="SwiGLU-style gated MLP (three matrices) instead of a plain two-matrix MLP.")
    vocab_size: int = Field(gt=0, description="Vocabulary size V (unpadded).")
    tie_embeddings: bool = Field(True, description="Input embedding and output projection share weights.")
    position_embedding: Literal["learned", "rope", "none"] = Field(
        "rope", description="learned absolute (GPT-2/3), rotary (Llama) or none."
    )
    max_position_embeddings: int = Field(2048, gt=0, description="Rows of the learned position table; unused for rope.")
    norm: Literal["layernorm", "rmsnorm"] = Field("rmsnorm", description="Normalisation: LayerNorm (weight+bias) or RMSNorm (weight).")
    linear_bias: bool = Field(False, description="Biases on all linear layers (GPT-2/3, NeoX).")
    qkv_bias: bool = Field(False, description="Biases on the QKV projection only (Qwen2); implied by linear_bias.")
    dropout: bool = Field(False, description="Hidden/attention dropout is active (stores 1-byte masks; GPT-3 style).")
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
        return self

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

    # ---- parameter counts (elements), from the cost blocks -----------------
    def _blocks(self):
        from cost_models.blocks import model_blocks

        return model_blocks(self)

    def attention_params(self) -> int:
        return self._blocks().layers[0][0].attention().params()

    def mlp_params(self) -> int:
        from cost_models.blocks import DenseMLP

        layer = self._blocks().layers[0][0]
        return next(b for b in layer.blocks if isinstance(b, DenseMLP)).params()

    def layer_params(self) -> int:
        """One transformer layer: attention + MLP + two norms."""
        return self._blocks().layers[0][0].params()

    def embedding_params(self) -> int:
        """Word embedding plus learned position table (input side), unpadded."""
        return self._blocks().embedding.params()

    def output_params(self) -> int:
        """Final norm plus the untied output projection (0 extra when tied)."""
        return self._blocks().head.params()

    def num_params(self) -> int:
        """Total unique parameters (elements), vocabulary unpadded."""
        b = self._blocks()
        return sum(n * layer.params() for layer, n in b.layers) + b.embedding.params() + b.head.params()

    # ---- Hugging Face ---------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: str | Path | dict[str, Any], name: str | None = None) -> "ModelSpec":
        """Read a Hugging Face `config.json` (a local path or an already loaded dict).

        Supports the Llama, Mistral, Qwen2, GPT-2 and GPT-NeoX families. No hub
        access and no remote code: only the JSON's numbers are read.
        """
        if not isinstance(config, dict):
            path = Path(config)
            try:
                config = json.loads(path.read_text())
            except FileNotFoundError:
                raise SpecError(f"model config file {str(path)!r} does not exist") from None
            except json.JSONDecodeError as exc:
                raise SpecError(f"model config file {str(path)!r} is not valid JSON: {exc}") from None
            name = name or path.parent.name or path.stem
        if not isinstance(config, dict):
            raise SpecError("a Hugging Face config must be a JSON object")
        return cls(**_hf_fields(config, name))


_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "mixtral_dense", "gemma", "olmo", "phi3"}


def _hf_fields(cfg: dict[str, Any], name: str | None) -> dict[str, Any]:
    model_type = str(cfg.get("model_type", "")).lower()

    def need(key: str) -> Any:
        if key not in cfg:
            raise SpecError(f"Hugging Face config (model_type={model_type or '?'}) lacks field {key!r}")
        return cfg[key]

    base: dict[str, Any] = {"name": name or cfg.get("_name_or_path") or model_type or "hf-model",
                            "source": f"Hugging Face config.json (model_type={model_type})"}
    if model_type == "gpt2":
        h = int(need("n_embd"))
        return base | dict(
            num_layers=int(need("n_layer")), hidden_size=h, num_attention_heads=int(need("n_head")),
            ffn_hidden_size=int(cfg.get("n_inner") or 4 * h), gated_mlp=False, vocab_size=int(need("vocab_size")),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), position_embedding="learned",
            max_position_embeddings=int(cfg.get("n_positions", 1024)), norm="layernorm", linear_bias=True,
            dropout=float(cfg.get("resid_pdrop", 0.0)) > 0 or float(cfg.get("attn_pdrop", 0.0)) > 0,
        )
    if model_type == "gpt_neox":
        return base | dict(
            num_layers=int(need("num_hidden_layers")), hidden_size=int(need("hidden_size")),
            num_attention_heads=int(need("num_attention_heads")), ffn_hidden_size=int(need("intermediate_size")),
            gated_mlp=False, vocab_size=int(need("vocab_size")), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            position_embedding="rope", max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            norm="layernorm", linear_bias=True,
            dropout=float(cfg.get("hidden_dropout", 0.0)) > 0 or float(cfg.get("attention_dropout", 0.0)) > 0,
        )
    if model_type in _LLAMA_LIKE or "intermediate_size" in cfg and "num_key_value_heads" in cfg:
        return base | dict(
            num_layers=int(need("num_hidden_layers")), hidden_size=int(need("hidden_size")),
            num_attention_heads=int(need("num_attention_heads")),
            num_kv_heads=int(cfg.get("num_key_value_heads") or need("num_attention_heads")),
            head_dim=int(cfg["head_dim"]) if cfg.get("head_dim") else None,
            ffn_hidden_size=int(need("intermediate_size")), gated_mlp=True, vocab_size=int(need("vocab_size")),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), position_embedding="rope",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), norm="rmsnorm",
            linear_bias=bool(cfg.get("mlp_bias", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            dropout=float(cfg.get("attention_dropout", 0.0) or 0.0) > 0,
        )
    raise SpecError(
        f"Hugging Face config model_type {model_type!r} is not supported; "
        "supported: llama, mistral, qwen2, gpt2, gpt_neox (and configs with the Llama field names)"
    )
