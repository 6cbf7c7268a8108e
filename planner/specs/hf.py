"""Hugging Face `config.json` → ModelSpec: only the JSON's numbers are read (no hub
access, no remote code).

Each family (`model_type`) has a reader that maps its field names onto ModelSpec and,
where a field is missing, takes the default of that family's configuration class in
transformers (`src/transformers/models/<family>/configuration_<family>.py`; values in
`FAMILY_DEFAULTS`, read from transformers 4.51 and, for gpt_oss, from the main branch).

Hybrid Mamba-Transformer stacks are read for Nemotron-H and Nemotron 3 (`model_type` nemotron_h: its
`hybrid_override_pattern` in megatron-core's vocabulary, `_nemotron_h`).

What is refused, each with one line naming the field and its value:
- other hybrid state-space / linear-attention stacks (Mamba, Jamba, Falcon-H1, ...);
- per-layer architecture-search configs (`block_configs`, DeciLM / Nemotron-NAS);
- mixture-of-experts fields this reader does not map (any key naming experts, MoE,
  routers, routed or sparse steps), so that an MoE model is never read as a dense one;
- a `model_type` it does not know without the standard decoder fields;
- any other field the family's reader does not look up, unless it is in `HARMLESS_FIELDS`
  (no part of the trained network: bookkeeping, token ids, generation settings), in
  `NOT_COSTED_FIELDS` (part of the network but of nothing meshplan costs, each with its
  reason), `_`-prefixed, or a training-only router field.

A `model_type` it does not know that has the standard decoder fields
(`num_hidden_layers`, `hidden_size`, `num_attention_heads`, `intermediate_size`,
`vocab_size`) and no MoE fields is read as a dense Llama-style decoder, with a
`ConfigWarning` saying so (the CLI prints it once on stderr).

Query/key norms are read from the family: per head for Qwen3 (and Qwen3-MoE) and Gemma 3,
over all heads together for OLMo 2 (`ModelSpec.qk_norm`).

Small extras that the ModelSpec does not carry, under 0.1% of any model here:
Gemma 2/3's two extra norms per layer,
Qwen2-MoE's shared-expert gate (h per layer), DeepSeek-V3's routing-correction bias
(E per layer, not trained by gradients), OLMo's weightless LayerNorm, the output
projection bias of a Llama config with attention_bias (h per layer).
"""

from __future__ import annotations

import math

import re
import warnings
from pathlib import Path
from typing import Any, Callable

from planner.errors import ConfigWarning, SpecError, SpecValidationError, short_repr
from planner.specs.files import check_tree, load_path
from planner.specs.model import ModelSpec


def read_hf_config(config: str | Path | dict[str, Any], name: str | None = None) -> ModelSpec:
    """Read a Hugging Face `config.json` (a local path or an already loaded dict).

    The model is named `name`, else the config's `_name_or_path`, else (for a path) the
    file's name, or its folder's for a file called `config.json` (a downloaded model folder),
    else its `model_type`. See the module docstring for the families read
    and the configs refused.
    """
    folder = None
    if not isinstance(config, dict):
        path = Path(config)
        config = load_path(path, "model config", "json")
        folder = path.stem if path.stem != "config" else (path.resolve().parent.name or path.stem)
    if not isinstance(config, dict):
        raise SpecError("a Hugging Face config must be a JSON object")
    check_tree(config, "Hugging Face config")
    fields = _hf_fields(config)
    own = config.get("_name_or_path")
    fields["name"] = name or (own.strip() if isinstance(own, str) and own.strip() else None) or folder \
        or fields["name"]
    try:
        return ModelSpec(**fields)
    except SpecValidationError as exc:
        raise SpecError(f"Hugging Face config {fields['name']!r} read as an invalid model: {exc.problems}") from None


# ---- defaults of the transformers configuration classes -------------------------
#: Per family, the class defaults of the fields read here when a config.json omits them
#: (transformers `configuration_<family>.py`, `__init__` signature; gpt_oss: main branch;
#: deepseek_v2: the remote-code `configuration_deepseek.py` of deepseek-ai/DeepSeek-V2-Lite).
#: `tie_word_embeddings` is what matters most: Gemma ties by default, most others do not,
#: and a class that does not set it inherits PretrainedConfig's True (starcoder2, gpt2).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "mistral": {"tie_word_embeddings": False, "sliding_window": 4096},
    "mixtral": {"tie_word_embeddings": False, "sliding_window": None, "num_local_experts": 8,
                "num_experts_per_tok": 2},
    "qwen2": {"tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28},
    "qwen3": {"tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "head_dim": 128, "attention_bias": False},
    "qwen2_moe": {"tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
                  "max_window_layers": 28, "decoder_sparse_step": 1, "mlp_only_layers": None,
                  "num_experts_per_tok": 4, "num_experts": 60, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
                  "max_window_layers": 28, "attention_bias": False, "decoder_sparse_step": 1,
                  "mlp_only_layers": None, "num_experts_per_tok": 8, "num_experts": 128,
                  "moe_intermediate_size": 768},
    "deepseek_v2": {"tie_word_embeddings": False, "attention_bias": False, "first_k_dense_replace": 0,
                    "moe_layer_freq": 1, "n_shared_experts": None, "n_routed_experts": None,
                    "num_experts_per_tok": None, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "moe_intermediate_size": 1407, "topk_method": "greedy", "n_group": None, "topk_group": None},
    "deepseek_v3": {"tie_word_embeddings": False, "attention_bias": False, "first_k_dense_replace": 3,
                    "moe_layer_freq": 1, "n_shared_experts": 1, "n_routed_experts": 256,
                    "num_experts_per_tok": 8, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "moe_intermediate_size": 2048, "num_nextn_predict_layers": 0,
                    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4},
    # Kimi K2 ships DeepSeek-V3's remote code (its auto_map loads configuration_deepseek.DeepseekV3Config), so a
    # field its config.json omits takes DeepSeek-V3's default; its published configs set every field read here
    "kimi_k2": {"tie_word_embeddings": False, "attention_bias": False, "first_k_dense_replace": 3,
                "moe_layer_freq": 1, "n_shared_experts": 1, "n_routed_experts": 256,
                "num_experts_per_tok": 8, "q_lora_rank": 1536, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "moe_intermediate_size": 2048, "num_nextn_predict_layers": 0,
                "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4},
    "gpt_oss": {"tie_word_embeddings": False, "attention_bias": True, "sliding_window": 128,
                "num_local_experts": 128, "num_experts_per_tok": 4, "head_dim": 64, "swiglu_limit": 7.0},
    "gemma": {"tie_word_embeddings": True, "head_dim": 256, "attention_bias": False,
              "hidden_activation": "gelu_pytorch_tanh"},
    "gemma2": {"tie_word_embeddings": True, "head_dim": 256, "attention_bias": False, "sliding_window": 4096,
               "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"tie_word_embeddings": True, "head_dim": 256, "attention_bias": False,
                    "hidden_activation": "gelu_pytorch_tanh",
                    "sliding_window": 4096, "sliding_window_pattern": 6, "vocab_size": 262208,
                    "max_position_embeddings": 131072},
    "phi3": {"tie_word_embeddings": False, "sliding_window": None},
    "olmo": {"tie_word_embeddings": False, "attention_bias": False},
    "olmo2": {"tie_word_embeddings": False, "attention_bias": False},
    "starcoder2": {"tie_word_embeddings": True, "use_bias": True, "sliding_window": None},
    "llama4_text": {"tie_word_embeddings": False, "head_dim": 128, "num_local_experts": 16,
                    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "intermediate_size_mlp": 16384,
                    "attention_chunk_size": 8192, "no_rope_layers": None, "moe_layers": None},
    "gpt2": {"tie_word_embeddings": True},
    "gpt_neox": {"tie_word_embeddings": False},
}
#: PretrainedConfig's own default, for a model_type not listed above.
BASE_TIE_DEFAULT = True
#: The norm epsilon's key names (Llama-style rms_norm_eps; GPT-NeoX layer_norm_eps; GPT-2 layer_norm_epsilon;
#: StarCoder2 norm_epsilon): a config may carry one of them.
NORM_EPSILON_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")
#: Per family, its configuration class's default epsilon where a config.json omits it (transformers 4.51
#: `__init__` signatures; gpt_oss: main branch; deepseek_v2: its remote-code configuration_deepseek.py; olmo:
#: OlmoLayerNorm's fixed 1e-5, which the config cannot change). Other model types read as Llama-style
#: decoders take LlamaConfig's.
NORM_EPSILON_DEFAULTS: dict[str, float] = {
    "llama": 1e-6, "mistral": 1e-6, "mixtral": 1e-5, "qwen2": 1e-6, "qwen3": 1e-6, "qwen2_moe": 1e-6,
    "qwen3_moe": 1e-6, "deepseek_v2": 1e-6, "deepseek_v3": 1e-6, "kimi_k2": 1e-6, "gpt_oss": 1e-5, "gemma": 1e-6, "gemma2": 1e-6,
    "gemma3_text": 1e-6, "phi3": 1e-5, "olmo": 1e-5, "olmo2": 1e-5, "starcoder2": 1e-5, "llama4_text": 1e-5,
    "gpt2": 1e-5, "gpt_neox": 1e-5,
}

#: Hybrid state-space / linear-attention families (refused: their layers are not transformer layers).
HYBRID_TYPES = frozenset({"jamba", "zamba", "zamba2", "falcon_h1", "falcon_mamba", "bamba",
                          "granitemoehybrid", "mamba", "mamba2", "plamo2", "lfm2", "qwen3_next",
                          "recurrent_gemma", "rwkv", "xlstm"})
_HYBRID_KEY = re.compile(r"^(mamba_|ssm_)|hybrid_override_pattern|layers_block_type|attn_layer_period"
                         r"|linear_attn|linear_num_key_heads")
#: Keys that look like mixture-of-experts structure.
_MOE_KEY = re.compile(r"expert|moe|router|routed|sparse_step|mlp_only_layers")
#: MoE-looking keys that only tune training (loss weights, logging); harmless in any family.
_TRAINING_ONLY = frozenset({"router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
                            "router_z_loss_coef"})
#: Keys whose contents are not architecture (quantisation, multimodal towers read elsewhere).
_NOT_ARCHITECTURE = frozenset({"quantization_config", "vision_config", "audio_config", "rope_scaling",
                               "rope_parameters", "text_config"})
#: The `layer_types` entries this reader maps (anything else, e.g. linear attention, is refused).
_ATTENTION_KINDS = frozenset({"sliding_attention", "full_attention"})
_STANDARD = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
#: Dropout probabilities a Llama-style decoder may carry (any above 0 turns ModelSpec.dropout on).
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "residual_dropout",
                "embedding_dropout")
#: Fields that describe no part of the trained network: bookkeeping, tokenizer ids, inference and generation
#: settings, heads the language model does not build. Accepted in any config (as is any `_`-prefixed key).
HARMLESS_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "cache_implementation", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "unk_token_id",
    "decoder_start_token_id", "tokenizer_class", "auto_map", "initializer_range", "return_dict",
    "output_attentions", "output_hidden_states", "torchscript", "id2label", "label2id", "problem_type",
    "finetuning_task", "task_specific_params", "prefix", "max_length", "min_length", "do_sample", "temperature",
    "top_k", "top_p", "num_beams", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "classifier_dropout", "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout",
})
#: Fields of the network that change none of what meshplan costs (no parameter, shape or modelled kernel), and
#: why: accepted in any config; any other field the family's reader did not look up is refused (`_unread_fields`).
NOT_COSTED_FIELDS: dict[str, str] = {
    "pretraining_tp": "Llama 1/2: splits the output matmul for numerics only",
    "attn_logit_softcapping": "Gemma 2: an element-wise tanh on the attention scores",
    "final_logit_softcapping": "Gemma 2: an element-wise tanh on the logits",
    "query_pre_attn_scalar": "Gemma 2/3: the attention scale",
    "attention_multiplier": "Granite: a scalar", "embedding_multiplier": "Granite: a scalar",
    "residual_multiplier": "Granite: a scalar", "logits_scaling": "Granite: a scalar",
    "norm_topk_prob": "router arithmetic on the top-k weights", "routed_scaling_factor": "router arithmetic",
    "scoring_func": "DeepSeek's router score (softmax or sigmoid), no parameters",
    "aux_loss_alpha": "a load-balancing loss weight", "seq_aux": "a load-balancing loss switch",
    "ep_size": "DeepSeek's own expert-parallel setting: the plan chooses ep",
    "use_qk_norm": "Llama 4: a weightless L2 norm of queries and keys (element-wise)",
    "initial_context_length": "gpt-oss: YaRN's original context (frequencies only)",
    "original_max_position_embeddings": "rotary scaling's original context (frequencies only)",
    "hidden_act": "a plain MLP's activation (element-wise) and gpt-oss's, which its code hard-codes; a gated "
                  "MLP's is read",
    "activation_function": "GPT-2: the plain MLP's activation (element-wise)",
    "n_ctx": "GPT-2: a legacy copy of n_positions",
    "scale_attn_weights": "GPT-2: the attention scale", "scale_attn_by_inverse_layer_idx": "GPT-2: a scale",
    "reorder_and_upcast_attn": "GPT-2: attention numerics",
    "rotary_pct": "GPT-NeoX: the rotary share of a head (frequencies only)",
    "rotary_emb_base": "GPT-NeoX: the rotary base", "use_parallel_residual": "GPT-NeoX: the residual wiring",
    "mlp_type": "StarCoder2: a field transformers' modelling code ignores",
    "norm_type": "StarCoder2: a field transformers' modelling code ignores",
    "boi_token_index": "Gemma 3: an image token id", "eoi_token_index": "Gemma 3: an image token id",
    "image_token_index": "a multimodal token id", "mm_tokens_per_image": "Gemma 3: the vision tower's tokens",
}
#: Fields `_hf_fields` itself reads (the wrapper and its towers, per-layer kinds, the name).
_STRUCTURE_FIELDS = frozenset({"text_config", "vision_config", "layer_types", "_name_or_path"})


class _Cfg:
    """One config mapping with typed, family-defaulted reads; every error names the field."""

    def __init__(self, data: dict[str, Any], model_type: str, outer: dict[str, Any] | None = None) -> None:
        self.data, self.model_type, self.outer = data, model_type, outer or {}
        self.defaults = FAMILY_DEFAULTS.get(model_type, {})
        self.seen: set[str] = set()  # every key a reader looked up, whatever it made of it (`_unread_fields`)

    def _where(self) -> str:
        return f"Hugging Face config (model_type={self.model_type or '?'})"

    def raw(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        if key in self.data:
            return self.data[key]
        return self.defaults.get(key, default)

    def has(self, key: str) -> bool:
        self.seen.add(key)
        return key in self.data or key in self.defaults

    def int(self, key: str, default: Any = ..., minimum: int = 1) -> int:
        value = self.raw(key, None if default is ... else default)
        if value is None and default is ... and key not in self.data:
            raise SpecError(f"{self._where()} lacks field {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SpecError(f"{self._where()}: {key} must be an integer >= {minimum} (got {value!r})")
        return value

    def rope_theta(self, default: float) -> float:
        """The rotary base: a positive finite number (Hugging Face's own default where the key is absent)."""
        params = self.raw("rope_parameters")  # transformers 5 moves the base into rope_parameters
        nested = params.get("rope_theta") if isinstance(params, dict) else None
        return self.positive("rope_theta", self.raw("rope_theta", default if nested is None else nested))

    def norm_epsilon(self) -> float:
        """The norm epsilon under whichever of NORM_EPSILON_KEYS the config uses (two that disagree are refused),
        else the family's default."""
        self.seen.update(NORM_EPSILON_KEYS)
        given = {key: self.positive(key, self.data[key]) for key in NORM_EPSILON_KEYS if key in self.data}
        if len(set(given.values())) > 1:
            raise SpecError(f"{self._where()}: {' and '.join(f'{k} ({v:g})' for k, v in given.items())} disagree")
        if given:
            return next(iter(given.values()))
        return NORM_EPSILON_DEFAULTS.get(self.model_type, NORM_EPSILON_DEFAULTS["llama"])

    def positive(self, key: str, value: Any = ...) -> float:
        """`value` (default: the config's `key`, family-defaulted) as a positive finite number; else refused,
        naming `key`."""
        value = self.raw(key) if value is ... else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise SpecError(f"{self._where()}: {key} must be a positive number (got {short_repr(value)})")
        return float(value)

    def rope_scaling(self) -> str:
        """`yarn` where rope_scaling (transformers 5: rope_parameters) names YaRN as its type, else `none`: the
        other types (llama3, linear, dynamic, ...) change only the rotary frequencies, which the costs do not see."""
        for key in ("rope_scaling", "rope_parameters"):
            params = self.raw(key)
            if isinstance(params, dict) and (params.get("rope_type") or params.get("type")) == "yarn":
                return "yarn"
        return "none"

    def opt_int(self, key: str, minimum: int = 1) -> int | None:
        return None if self.raw(key) is None else self.int(key, minimum=minimum)

    def bool(self, key: str, default: bool = False) -> bool:
        return parse_bool(self.raw(key, default), key, self._where())

    def tie(self) -> bool:
        """`tie_word_embeddings`: the text config's, else the outer config's, else the family default."""
        self.seen.add("tie_word_embeddings")
        if "tie_word_embeddings" in self.data:
            return self.bool("tie_word_embeddings")
        if "tie_word_embeddings" in self.outer:
            return parse_bool(self.outer["tie_word_embeddings"], "tie_word_embeddings", self._where())
        return parse_bool(self.defaults.get("tie_word_embeddings", BASE_TIE_DEFAULT), "tie_word_embeddings",
                          self._where())

    def dropout(self, *keys: str) -> bool:
        out = False
        for key in keys:
            value = self.raw(key, 0.0) or 0.0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise SpecError(f"{self._where()}: {key} must be a probability between 0 and 1 (got {value!r})")
            out = out or value > 0
        return out

    def layer_list(self, key: str, num_layers: int) -> list[Any]:
        value = self.raw(key)
        if not isinstance(value, list) or len(value) != num_layers:
            raise SpecError(f"{self._where()}: {key} must be a list of one entry per layer "
                            f"({num_layers}), got {value!r:.80}")
        return value


def parse_bool(value: Any, key: str, where: str = "Hugging Face config") -> bool:
    """A JSON boolean, or the strings "true" / "false" (any case: "false" is False, not a
    truthy string); anything else is refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise SpecError(f"{where}: {key} must be true or false (got {value!r})")


# ---- the common decoder ---------------------------------------------------------------
def _decoder(c: _Cfg, **overrides: Any) -> dict[str, Any]:
    """The fields every Llama-style decoder shares (gated MLP, RMSNorm, rotary)."""
    num_layers, hidden, heads = c.int("num_hidden_layers"), c.int("hidden_size"), c.int("num_attention_heads")
    kv = c.raw("num_key_value_heads")
    out = dict(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
        num_kv_heads=heads if kv is None else c.int("num_key_value_heads"),
        head_dim=c.opt_int("head_dim"), ffn_hidden_size=c.int("intermediate_size"), gated_mlp=True,
        vocab_size=c.int("vocab_size"), tie_embeddings=c.tie(), position_embedding="rope",
        max_position_embeddings=c.int("max_position_embeddings", 4096), norm="rmsnorm",
        linear_bias=False, qkv_bias=False, dropout=c.dropout(*(k for k in DROPOUT_KEYS if k in c.data)),
        rope_theta=c.rope_theta(10000.0),  # transformers' LlamaConfig default
        norm_epsilon=c.norm_epsilon(),
        rope_scaling=c.rope_scaling(),
    )
    attention_bias, mlp_bias = c.bool("attention_bias"), c.bool("mlp_bias")
    if mlp_bias:  # ModelSpec has one switch for all linear biases (attention biases too: q+2k+h per layer)
        out["linear_bias"] = True
    elif attention_bias:  # q, k, v biases (the output projection's h per layer is not counted)
        out["qkv_bias"] = True
    out |= overrides
    if out["gated_mlp"] and "glu_activation" not in overrides:
        out["glu_activation"] = glu_activation(c)
    return out


#: Hugging Face activation names (transformers ACT2FN) of a gated MLP's gate -> ModelSpec.glu_activation.
GLU_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                   "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def glu_activation(c: _Cfg) -> str:
    """The gate's activation: `hidden_activation` where the config has it (Gemma's, which its MLP uses), else
    `hidden_act` (default silu); a name meshplan does not know is refused, naming the field."""
    gemma = c.raw("hidden_activation") or c.defaults.get("hidden_activation")  # None in a Gemma config: its default
    key, name = ("hidden_activation", gemma) if gemma is not None else ("hidden_act", c.raw("hidden_act", "silu"))
    if name not in GLU_ACTIVATIONS:
        raise SpecError(f"{c._where()}: {key} {name!r} is not a gated-MLP activation meshplan models "
                        f"({', '.join(sorted(GLU_ACTIVATIONS))})")
    return GLU_ACTIVATIONS[name]


def _window(c: _Cfg, num_layers: int, every: int = 0, local_from: int = 0) -> dict[str, Any]:
    """sliding_window with its layer pattern: `layer_types` when the config lists it (the
    layers that are not "sliding_attention" are global), else every layer from `local_from` on
    is local except each `every`-th one (0 = none global)."""
    window = c.opt_int("sliding_window")
    if window is None:
        return {}
    if c.raw("layer_types") is not None:
        types = c.layer_list("layer_types", num_layers)
        glob = [i for i, t in enumerate(types) if t != "sliding_attention"]
        if len(glob) == num_layers:
            return {}
        return {"sliding_window": window, "global_attention_layers": glob}
    if local_from:
        glob = list(range(min(local_from, num_layers)))
        return {} if len(glob) == num_layers else {"sliding_window": window, "global_attention_layers": glob}
    return {"sliding_window": window, "global_attention_every": every}


def _qwen_window(c: _Cfg, num_layers: int) -> dict[str, Any]:
    """Qwen2/3: windowed only with use_sliding_window, on layers >= max_window_layers
    (transformers `Qwen2Attention`)."""
    if not c.bool("use_sliding_window") or c.raw("sliding_window") is None:
        return {}
    return _window(c, num_layers, local_from=c.int("max_window_layers", 0, minimum=0))


# ---- families ----------------------------------------------------------------------
def _llama(c: _Cfg) -> dict[str, Any]:
    return _decoder(c)


def _mistral(c: _Cfg) -> dict[str, Any]:
    out = _decoder(c)
    return out | _window(c, out["num_layers"])  # every layer local (Mistral 7B v0.1: 4096)


def _phi3(c: _Cfg) -> dict[str, Any]:
    out = _decoder(c)  # fused qkv_proj / gate_up_proj: the same matrices, no biases
    return out | _window(c, out["num_layers"])


def _qwen2(c: _Cfg) -> dict[str, Any]:
    out = _decoder(c, qkv_bias=True)  # Qwen2Attention: q/k/v projections always have a bias
    return out | _qwen_window(c, out["num_layers"])


def _qwen3(c: _Cfg) -> dict[str, Any]:
    """Qwen3 (and Qwen3-MoE): an RMSNorm over each head's query and key (Qwen3Attention's q_norm / k_norm,
    head_dim wide)."""
    out = _decoder(c) | {"qk_norm": "per_head"}
    return out | _qwen_window(c, out["num_layers"])


def _gemma(c: _Cfg) -> dict[str, Any]:
    return _decoder(c)  # GeGLU MLP (gated), tied by default


def _gemma2(c: _Cfg) -> dict[str, Any]:
    """Alternating local / global attention starting local (transformers Gemma2DecoderLayer:
    sliding on even layers). Logit soft-capping is not modelled (elementwise, no parameters)."""
    out = _decoder(c)
    return out | _window(c, out["num_layers"], every=2)


def _gemma3(c: _Cfg) -> dict[str, Any]:
    """Every `sliding_window_pattern`-th layer global, the rest local (Gemma3DecoderLayer)."""
    out = _decoder(c) | {"qk_norm": "per_head"}  # Gemma3Attention's q_norm / k_norm, head_dim wide
    return out | _window(c, out["num_layers"], every=c.int("sliding_window_pattern"))


def _olmo(c: _Cfg) -> dict[str, Any]:
    return _decoder(c)  # OLMo's LayerNorm has no weights (3h per layer fewer than counted here)


def _olmo2(c: _Cfg) -> dict[str, Any]:
    """OLMo 2: RMSNorms over all query heads together and all key heads together (Olmo2Attention's q_norm,
    num_attention_heads x head_dim wide, and k_norm, num_key_value_heads x head_dim)."""
    return _decoder(c) | {"qk_norm": "full"}


def _starcoder2(c: _Cfg) -> dict[str, Any]:
    """LayerNorm, biases on every linear layer (use_bias), a plain two-matrix GELU MLP."""
    out = _decoder(c, gated_mlp=False, norm="layernorm", qkv_bias=False, linear_bias=c.bool("use_bias"))
    return out | _window(c, out["num_layers"])


def _mixtral(c: _Cfg) -> dict[str, Any]:
    out = _decoder(c)  # intermediate_size is each expert's width; every layer is MoE
    out.update(num_experts=c.int("num_local_experts"), moe_top_k=c.int("num_experts_per_tok"))
    return out | _window(c, out["num_layers"])


def _qwen_moe(c: _Cfg, shared: bool) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE (transformers Qwen2MoeDecoderLayer): layer i is MoE when
    num_experts > 0, (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers;
    other layers are dense MLPs of intermediate_size. Qwen2-MoE adds one shared expert of
    shared_expert_intermediate_size (its scalar sigmoid gate, h per layer, is not counted)."""
    out = _qwen2(c) if shared else _qwen3(c)
    L = out["num_layers"]
    experts = c.int("num_experts", minimum=0)
    if not experts:
        return out
    step = c.int("decoder_sparse_step")
    only = c.raw("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise SpecError(f"{c._where()}: mlp_only_layers must be a list of layer indices (got {only!r})")
    out.update(num_experts=experts, moe_top_k=c.int("num_experts_per_tok"),
               moe_ffn_hidden_size=c.int("moe_intermediate_size"))
    if only:
        out["moe_dense_layers"] = sorted({*only} | {i for i in range(L) if (i + 1) % step})
    else:
        out["moe_layer_freq"] = step
    if shared and c.raw("shared_expert_intermediate_size"):
        out.update(num_shared_experts=1, shared_expert_ffn_hidden_size=c.int("shared_expert_intermediate_size"))
    return out


def _deepseek(c: _Cfg) -> dict[str, Any]:
    """DeepSeek-V2/V3: multi-head latent attention; layer i is MoE when n_routed_experts is
    set, i >= first_k_dense_replace and i % moe_layer_freq == 0 (DeepseekV3DecoderLayer);
    n_shared_experts shared experts of moe_intermediate_size; num_nextn_predict_layers
    multi-token-prediction modules (V3: 1). Every head has its own key and value."""
    out = _decoder(c, num_kv_heads=None, head_dim=None)
    out.update(q_lora_rank=c.opt_int("q_lora_rank"), kv_lora_rank=c.int("kv_lora_rank"),
               qk_nope_head_dim=c.int("qk_nope_head_dim"), qk_rope_head_dim=c.int("qk_rope_head_dim"),
               v_head_dim=c.int("v_head_dim"))
    if c.has("num_nextn_predict_layers"):
        out["num_mtp_layers"] = c.int("num_nextn_predict_layers", minimum=0)
    if c.raw("n_routed_experts") is None:
        return out
    L, k, freq = out["num_layers"], c.int("first_k_dense_replace", minimum=0), c.int("moe_layer_freq")
    out.update(num_experts=c.int("n_routed_experts"), moe_top_k=c.int("num_experts_per_tok"),
               moe_ffn_hidden_size=c.int("moe_intermediate_size"))
    if freq == 1:
        out["moe_first_k_dense"] = k
    else:
        out["moe_dense_layers"] = [i for i in range(L) if not (i >= k and i % freq == 0)]
    shared = c.int("n_shared_experts", 0, minimum=0)
    if shared:
        out.update(num_shared_experts=shared, shared_expert_ffn_hidden_size=out["moe_ffn_hidden_size"])
    # group-limited routing: topk_method "group_limited_greedy" (V2) or "noaux_tc" (V3) picks the top-k experts
    # inside topk_group of n_group groups; "greedy" (V2-Lite) ignores the groups
    if c.raw("topk_method", "greedy") != "greedy" and (c.raw("n_group") or 1) > 1:
        out.update(moe_router_num_groups=c.int("n_group"), moe_router_group_topk=c.int("topk_group"))
    return out


def _kimi_k2(c: _Cfg) -> dict[str, Any]:
    """Kimi K2 (model_type kimi_k2): DeepSeek-V3's network under another name (its config.json names
    DeepseekV3ForCausalLM and DeepSeek-V3's remote code; Moonshot's deployment guide has engines run it as
    deepseek_v3). What it sets differently is read the same way: 64 heads, 384 routed experts, one dense
    layer (first_k_dense_replace 1), no expert groups (n_group 1: plain top-8), no MTP module
    (num_nextn_predict_layers 0), rope_theta 50000, vocabulary 163840."""
    return _deepseek(c)


def _refuse_sparse_attention(c: _Cfg) -> dict[str, Any]:
    """DeepSeek-V3.2 (deepseek_v32; DeepSeek-V3.2-Exp's model card: V3.1-Terminus's architecture plus DeepSeek
    Sparse Attention) adds a lightning indexer (index_n_heads, index_head_dim) that picks index_topk keys per
    query, so the attention cost and the indexer's own weights and GEMMs differ from MLA's. Not modelled."""
    raise SpecError(f"{c._where()}: DeepSeek Sparse Attention (index_topk={c.raw('index_topk')!r}, a lightning "
                    "indexer choosing the keys each query attends to) is not modelled; refusing rather than "
                    "costing it as dense MLA (describe a dense-attention variant as a model YAML)")


def _gpt_oss(c: _Cfg) -> dict[str, Any]:
    """gpt-oss: every layer MoE (num_local_experts, experts_per_token / num_experts_per_tok),
    biases on attention, router and experts, one attention-sink logit per head, windowed
    layers from layer_types (default: alternating, starting windowed)."""
    # its experts' activation is hard-coded (transformers GptOssExperts: alpha 1.702, the linear branch + 1, both
    # branches clamped by swiglu_limit), whatever hidden_act says
    out = _decoder(c, linear_bias=c.bool("attention_bias"), qkv_bias=False, glu_activation="quick_gelu")
    given = {k: c.int(k) for k in ("num_experts_per_tok", "experts_per_token") if k in c.data}
    if len(set(given.values())) > 1:
        raise SpecError(f"{c._where()}: experts_per_token ({given['experts_per_token']}) and num_experts_per_tok "
                        f"({given['num_experts_per_tok']}) disagree")
    top_k = next(iter(given.values())) if given else c.int("num_experts_per_tok")
    out.update(num_experts=c.int("num_local_experts"), moe_top_k=top_k, moe_router_bias=True,
               moe_expert_bias=True, attention_sinks=True, glu_linear_offset=1.0, glu_clamp=c.positive("swiglu_limit"))
    return out | _window(c, out["num_layers"], every=2)


def _llama4(c: _Cfg) -> dict[str, Any]:
    """Llama 4 text decoder (transformers Llama4TextDecoderLayer): MoE layers `moe_layers`
    (default every interleave_moe_layer_step-th), each with num_local_experts routed experts
    and one shared expert of intermediate_size; dense layers of intermediate_size_mlp.
    Chunked attention (`attention_chunk_size`) on the rotary layers (`no_rope_layers` 1) is
    approximated as a sliding window of the chunk size: a query in a chunk sees between 1 and
    C keys, a window C keys, the same upper bound as the full-sequence count of global layers
    (causal masking is not credited). The NoPE layers (0) attend globally."""
    L = c.int("num_hidden_layers")
    out = _decoder(c, ffn_hidden_size=c.int("intermediate_size_mlp"))
    step = c.int("interleave_moe_layer_step")
    moe_layers = c.raw("moe_layers")
    moe = list(range(step - 1, L, step)) if moe_layers is None else moe_layers
    if not isinstance(moe, list) or not all(isinstance(i, int) and 0 <= i < L for i in moe):
        raise SpecError(f"{c._where()}: moe_layers must be a list of layer indices 0..{L - 1} (got {moe!r:.80})")
    out.update(num_experts=c.int("num_local_experts"), moe_top_k=c.int("num_experts_per_tok"),
               moe_ffn_hidden_size=c.int("intermediate_size"), num_shared_experts=1,
               moe_dense_layers=[i for i in range(L) if i not in set(moe)])
    chunk = c.opt_int("attention_chunk_size")
    if chunk is not None:
        rope = c.raw("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(L)]
        if not isinstance(rope, list) or len(rope) != L:
            raise SpecError(f"{c._where()}: no_rope_layers must list one 0/1 per layer ({L}), got {rope!r:.80}")
        out.update(sliding_window=chunk, global_attention_layers=[i for i, r in enumerate(rope) if not r])
    return out


def _gpt2(c: _Cfg) -> dict[str, Any]:
    h = c.int("n_embd")
    return dict(
        num_layers=c.int("n_layer"), hidden_size=h, num_attention_heads=c.int("n_head"),
        ffn_hidden_size=c.raw("n_inner") and c.int("n_inner") or 4 * h, gated_mlp=False,
        vocab_size=c.int("vocab_size"), tie_embeddings=c.tie(), position_embedding="learned",
        max_position_embeddings=c.int("n_positions", 1024), norm="layernorm", norm_epsilon=c.norm_epsilon(),
        linear_bias=True, dropout=c.dropout("resid_pdrop", "attn_pdrop", "embd_pdrop"),
    )


def _gpt_neox(c: _Cfg) -> dict[str, Any]:
    return dict(
        num_layers=c.int("num_hidden_layers"), hidden_size=c.int("hidden_size"),
        num_attention_heads=c.int("num_attention_heads"), ffn_hidden_size=c.int("intermediate_size"),
        gated_mlp=False, vocab_size=c.int("vocab_size"), tie_embeddings=c.tie(), position_embedding="rope",
        max_position_embeddings=c.int("max_position_embeddings", 2048), norm="layernorm",
        norm_epsilon=c.norm_epsilon(), linear_bias=True, dropout=c.dropout("hidden_dropout", "attention_dropout"),
    )


#: Hugging Face MLP activation names of Nemotron-H configs (mlp_hidden_act) -> ModelSpec.mlp_activation.
NEMOTRON_H_ACTIVATIONS = {"relu2": "squared_relu", "gelu": "gelu"}


def _nemotron_h(c: _Cfg) -> dict[str, Any]:
    """Nemotron-H (8B, 47B, 56B; Nano v2) and Nemotron 3 (Nano): a hybrid stack given layer by layer by
    `hybrid_override_pattern` (M Mamba-2, * attention, - MLP, E MoE: megatron-core's symbols, one layer each), no
    position embedding, RMSNorm, plain (not gated) MLPs and experts with squared ReLU (`mlp_hidden_act` relu2).
    Mamba-2: mamba_num_heads, mamba_head_dim, ssm_state_size, n_groups, conv_kernel, chunk_size, expand (where the
    last three are absent, megatron-core's defaults 4, 128, 2). E layers: n_routed_experts of moe_intermediate_size,
    num_experts_per_tok, one shared expert of moe_shared_expert_intermediate_size; the sigmoid router's correction
    bias (E per layer, not trained by gradients) is not counted. Refused: LatentMoE (moe_latent_size, Nemotron 3
    Super), MTP modules (num_nextn_predict_layers, mtp_hybrid_override_pattern), mamba_proj_bias,
    residual_in_fp32 and a conv without bias (use_conv_bias false), which megatron-core's Mamba layers do not
    build or the costs do not model."""
    for key, why in (("moe_latent_size", "LatentMoE's latent projections (Nemotron 3 Super)"),
                     ("mtp_hybrid_override_pattern", "multi-token-prediction modules of a hybrid stack")):
        if c.raw(key) is not None:
            raise SpecError(f"{c._where()}: {key} ({short_repr(c.raw(key))}): {why} are not modelled")
    if c.int("num_nextn_predict_layers", 0, minimum=0):
        raise SpecError(f"{c._where()}: num_nextn_predict_layers ({c.raw('num_nextn_predict_layers')}): "
                        "multi-token-prediction modules of a hybrid stack are not modelled")
    for key, bad in (("mamba_proj_bias", True), ("residual_in_fp32", True), ("use_conv_bias", False)):
        if c.bool(key, not bad) == bad:
            raise SpecError(f"{c._where()}: {key} {str(bad).lower()} is not modelled (megatron-core's Mamba "
                            "layers have no projection biases, a 16-bit residual and a conv bias)")
    act = c.raw("mlp_hidden_act", "relu2")
    if act not in NEMOTRON_H_ACTIVATIONS:
        raise SpecError(f"{c._where()}: mlp_hidden_act {short_repr(act)} is not one of "
                        f"{', '.join(NEMOTRON_H_ACTIVATIONS)}")
    mamba_act = c.raw("mamba_hidden_act", "silu")
    if mamba_act != "silu":
        raise SpecError(f"{c._where()}: mamba_hidden_act {short_repr(mamba_act)}: megatron-core's Mamba-2 layer "
                        "uses silu only")
    pattern = c.raw("hybrid_override_pattern")
    if not isinstance(pattern, str):
        raise SpecError(f"{c._where()}: hybrid_override_pattern must be a string of layer symbols "
                        f"(got {short_repr(pattern)})")
    out = _decoder(c, gated_mlp=False, position_embedding="none", rope_theta=None, rope_scaling="none",
                   linear_bias=c.bool("use_bias") or c.bool("mlp_bias"), qkv_bias=c.bool("attention_bias"),
                   head_dim=c.opt_int("head_dim") or c.opt_int("attention_head_dim"))
    out.update(mlp_activation=NEMOTRON_H_ACTIVATIONS[act], hybrid_override_pattern=pattern,
               mamba_num_heads=c.int("mamba_num_heads"), mamba_head_dim=c.int("mamba_head_dim"),
               mamba_state_dim=c.int("ssm_state_size"), mamba_num_groups=c.int("n_groups"),
               mamba_conv_kernel=c.int("conv_kernel", 4), mamba_chunk_size=c.int("chunk_size", 128),
               mamba_expand=c.int("expand", 2))
    if "E" in pattern and c.raw("n_routed_experts"):
        out.update(num_experts=c.int("n_routed_experts"), moe_top_k=c.int("num_experts_per_tok"),
                   moe_ffn_hidden_size=c.int("moe_intermediate_size"))
        shared = c.int("n_shared_experts", 1, minimum=0)
        if shared > 1:
            raise SpecError(f"{c._where()}: n_shared_experts ({shared}): one shared expert of "
                            "moe_shared_expert_intermediate_size is modelled")
        if shared and c.raw("moe_shared_expert_intermediate_size"):
            out.update(num_shared_experts=1,
                       shared_expert_ffn_hidden_size=c.int("moe_shared_expert_intermediate_size"))
        if (c.raw("n_group") or 1) > 1:
            out.update(moe_router_num_groups=c.int("n_group"), moe_router_group_topk=c.int("topk_group"))
    return out


#: Fields of a Nemotron-H config that change nothing meshplan costs, and why.
_NEMOTRON_H_NOT_COSTED = frozenset({
    "time_step_min", "time_step_max", "time_step_floor", "time_step_limit", "time_step_rank",  # dt init and clamp
    "rescale_prenorm_residual",  # initialisation
    "use_mamba_kernels", "num_logits_to_keep", "mamba_chunk_size",  # inference settings; chunk_size is read
    "hidden_act",  # a copy of mlp_hidden_act in some configs (mlp_hidden_act is read)
    "norm_topk_prob", "routed_scaling_factor", "topk_group", "n_group",  # router arithmetic; n_group read when > 1
})

#: model_type → (reader, the MoE-looking keys it maps).
_DEEPSEEK_KEYS = frozenset({"n_routed_experts", "n_shared_experts", "moe_intermediate_size", "moe_layer_freq",
                            "num_experts_per_tok", "routed_scaling_factor", "first_k_dense_replace",
                            "n_group", "topk_group", "topk_method"})
_QWEN_MOE_KEYS = frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                            "mlp_only_layers"})
FAMILIES: dict[str, tuple[Callable[[_Cfg], dict[str, Any]], frozenset[str]]] = {
    "llama": (_llama, frozenset()),
    "mistral": (_mistral, frozenset()),
    "phi3": (_phi3, frozenset()),
    "qwen2": (_qwen2, frozenset()),
    "qwen3": (_qwen3, frozenset()),
    "gemma": (_gemma, frozenset()),
    "gemma2": (_gemma2, frozenset()),
    "gemma3_text": (_gemma3, frozenset()),
    "olmo": (_olmo, frozenset()),
    "olmo2": (_olmo2, frozenset()),
    "starcoder2": (_starcoder2, frozenset()),
    "mixtral": (_mixtral, frozenset({"num_local_experts", "num_experts_per_tok"})),
    "qwen2_moe": (lambda c: _qwen_moe(c, shared=True), _QWEN_MOE_KEYS | {"shared_expert_intermediate_size"}),
    "qwen3_moe": (lambda c: _qwen_moe(c, shared=False), _QWEN_MOE_KEYS),
    "deepseek_v2": (_deepseek, _DEEPSEEK_KEYS),
    "deepseek_v3": (_deepseek, _DEEPSEEK_KEYS),
    "kimi_k2": (_kimi_k2, _DEEPSEEK_KEYS),
    "deepseek_v32": (_refuse_sparse_attention, _DEEPSEEK_KEYS),
    "gpt_oss": (_gpt_oss, frozenset({"num_local_experts", "num_experts_per_tok", "experts_per_token"})),
    "llama4_text": (_llama4, frozenset({"num_local_experts", "num_experts_per_tok", "interleave_moe_layer_step",
                                        "moe_layers"})),
    "gpt2": (_gpt2, frozenset()),
    "gpt_neox": (_gpt_neox, frozenset()),
    "nemotron_h": (_nemotron_h, frozenset({"n_routed_experts", "n_shared_experts", "moe_intermediate_size",
                                           "moe_shared_expert_intermediate_size", "num_experts_per_tok",
                                           "routed_scaling_factor", "n_group", "topk_group",
                                           "moe_latent_size"}) | _NEMOTRON_H_NOT_COSTED),
}
#: Hybrid families this module reads (their Mamba / pattern fields are not refused).
HYBRID_READ = frozenset({"nemotron_h"})
#: Multimodal wrappers whose `text_config` holds the decoder (the vision tower is not planned).
_WRAPPERS = {"gemma3": "gemma3_text", "llama4": "llama4_text"}


def _moe_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """MoE-looking keys with a non-empty value, nested mappings included (DBRX's ffn_config)."""
    found = []
    for key, value in data.items():
        if key in _NOT_ARCHITECTURE or key in _TRAINING_ONLY:
            continue
        if isinstance(value, dict):
            found += _moe_keys(value, f"{prefix}{key}.")
        elif _MOE_KEY.search(key.lower()) and value not in (None, 0, False, [], ""):
            found.append(prefix + key)
    return found


def _refuse_unplannable(cfg: dict[str, Any], model_type: str) -> None:
    if "block_configs" in cfg:
        raise SpecError(f"Hugging Face config (model_type={model_type or '?'}) has per-layer block_configs "
                        "(a neural-architecture-search model whose layers differ in shape): not supported; "
                        "describe it as a model YAML instead")
    hybrid = sorted(k for k in cfg if _HYBRID_KEY.search(k))
    if model_type in HYBRID_READ:
        return
    if model_type in HYBRID_TYPES or hybrid:
        what = f"model_type {model_type!r}" if model_type in HYBRID_TYPES else f"field(s) {', '.join(hybrid)}"
        raise SpecError(f"Hugging Face config {what}: hybrid state-space (Mamba/SSM) or linear-attention "
                        "layers are not modelled; only transformer decoders can be planned")


def _hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    outer_type = str(cfg.get("model_type", "")).lower()
    _refuse_unplannable(cfg, outer_type)
    data, outer, model_type = cfg, None, outer_type
    if isinstance(cfg.get("text_config"), dict) and (outer_type in _WRAPPERS or "num_hidden_layers" not in cfg):
        data, outer = cfg["text_config"], cfg
        model_type = str(data.get("model_type") or _WRAPPERS.get(outer_type, outer_type)).lower()
        model_type = _WRAPPERS.get(model_type, model_type)  # Llama 4's text_config may say "llama4"
        _refuse_unplannable(data, model_type)
        if cfg.get("vision_config") is not None:
            warnings.warn(f"Hugging Face config model_type {outer_type!r}: only the text decoder is planned "
                          "(the vision encoder in vision_config is not counted)", ConfigWarning, stacklevel=3)
    c = _Cfg(data, model_type, outer)
    kinds = data.get("layer_types")
    if kinds is not None and not isinstance(kinds, list):
        raise SpecError(f"Hugging Face config (model_type={model_type or '?'}): layer_types must be a list of "
                        f"layer kinds (got {short_repr(kinds)})")
    odd = sorted({t if isinstance(t, str) else short_repr(t) for t in kinds or []
                  if not isinstance(t, str) or t not in _ATTENTION_KINDS})
    if odd:
        raise SpecError(f"Hugging Face config (model_type={model_type or '?'}): layer_types has {', '.join(odd)} "
                        f"layers; only {' and '.join(sorted(_ATTENTION_KINDS))} are modelled")
    source = f"Hugging Face config.json (model_type={outer_type or '?'})"
    base = {"name": outer_type or "hf-model", "source": source}
    reader, understood = FAMILIES.get(model_type, (None, frozenset()))
    unknown_moe = [k for k in _moe_keys(data) if k not in understood]
    if unknown_moe:
        raise SpecError(f"Hugging Face config (model_type={model_type or '?'}) has mixture-of-experts field(s) "
                        f"{', '.join(unknown_moe)} that this reader does not map; refusing rather than reading "
                        "it as a dense model (describe it as a model YAML with num_experts, moe_top_k, ...)")
    if reader is not None:
        out = base | reader(c)
        _refuse_unread(c, outer, understood)
        return out
    missing = [k for k in _STANDARD if k not in data]
    if missing:
        raise SpecError(f"Hugging Face config model_type {model_type!r} is not supported and lacks the standard "
                        f"decoder field(s) {', '.join(missing)}; supported: {', '.join(sorted(FAMILIES))}")
    warnings.warn(f"Hugging Face config model_type {model_type!r} is not a known family: planned as a dense "
                  "decoder (gated MLP, RMSNorm, rotary) from its standard fields", ConfigWarning, stacklevel=3)
    out = base | _decoder(c)
    if c.bool("use_sliding_window", True):  # a window only where the config does not switch it off (Qwen-style)
        out |= _window(c, out["num_layers"])
    _refuse_unread(c, outer, frozenset())
    return out


def _unread_fields(c: _Cfg, outer: dict[str, Any] | None, understood: frozenset[str]) -> list[str]:
    """The config's fields (a wrapper's too) that the family's reader did not look up and that are neither in its
    family defaults, nor MoE fields it maps, nor HARMLESS_FIELDS / NOT_COSTED_FIELDS, nor `_`-prefixed, nor null
    (a null field sets nothing: Llama configs saved with `"sliding_window": null`)."""
    known = (c.seen | set(c.defaults) | understood | HARMLESS_FIELDS | set(NOT_COSTED_FIELDS) | _STRUCTURE_FIELDS
             | _TRAINING_ONLY | _NOT_ARCHITECTURE)
    prefix = "text_config." if outer is not None else ""
    unread = [prefix + k for k, v in c.data.items() if not k.startswith("_") and k not in known and v is not None]
    return unread + [k for k, v in (outer or {}).items() if not k.startswith("_") and k not in known and v is not None]


def _refuse_unread(c: _Cfg, outer: dict[str, Any] | None, understood: frozenset[str]) -> None:
    unread = _unread_fields(c, outer, understood)
    if unread:
        raise SpecError(f"{c._where()} has field(s) {', '.join(sorted(unread))} that this reader does not "
                        "understand; refusing rather than planning a model that may differ (describe it as a "
                        "model YAML, or drop the field if it does not change the network)")
