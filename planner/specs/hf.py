"""Hugging Face `config.json` → ModelSpec: only the JSON's numbers are read (no hub
access, no remote code)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.errors import SpecError
from planner.specs.model import ModelSpec


def read_hf_config(config: str | Path | dict[str, Any], name: str | None = None) -> ModelSpec:
    """Read a Hugging Face `config.json` (a local path or an already loaded dict).

    Supports the Llama, Mistral, Qwen2, GPT-2 and GPT-NeoX families.
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
    return ModelSpec(**_hf_fields(config, name))


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
