"""Megatron-Bridge (NeMo 2 successor): Hydra-style `section.field=value` overrides.

Written for one Megatron-Bridge version, `EmitOptions.bridge_version` (`--bridge-version`): 0.6 (0.6.0, tag
v0.6.0, the default, the newest release), 0.3 (0.3.1), or main (Megatron-Bridge's main branch at commit
067f987df, after 0.6.0; no release carries it yet). The releases accept the same section and field names except
where the dataset takes the sequence length (DATASET_SEQ_LENGTH): 0.3.1's GPTDatasetConfig has megatron-core's
`sequence_length` field (its `seq_length` is a property, which the override tree does not hold), while 0.6.0's
(and main's) has a `seq_length` field of its own that `finalize()` copies over `sequence_length` and that its
scripts/training/run_recipe.py copies into `model.seq_length` after the overrides, so 0.3.1's key there
would leave the recipe's sequence length in force. Both releases' recipes hold a GPT model provider, and the
model is written flat (`model.<field>`).

main differs in the model's layout, per recipe family (RECIPE_FAMILIES). From commit 061468b78 ("add Llama model
config builder path") its Llama 2/3 recipes build the model with `AutoBridge.get_model_config()`: a
BridgeGPTModelConfig whose dataclass fields are its own GPT fields (`seq_length`, `position_embedding_type`,
`share_embeddings_and_output_weights`, ...) plus `transformer`, a TransformerConfig. Megatron-Bridge builds its
override tree from `dataclasses.fields()`, so Hydra takes `model.transformer.<field>` there and refuses
`model.<field>` for a transformer field ("Could not override"); the GPT fields stay `model.<field>`. Its GPT-3,
DeepSeek, Qwen, gpt-oss and Gemma recipes still hold a flat provider. The recipe is not in the plan, so main
reads the recipe family from the model's name (a Llama 2/3, GPT-3, DeepSeek, Qwen, gpt-oss or Gemma name) and
refuses a model of any other name, whose recipe could take either form. The mixed-precision recipes and the
`ConfigContainer.validate()` rules the refusals cite are the same in all three (main adds a Megatron-FSDP v2
path, taken only with `ddp.megatron_fsdp_version=2`, which no recipe sets and whose default is 1).

Megatron-Bridge's `ConfigContainer` nests megatron-core's own dataclasses:
`model` is a GPT model provider (a `TransformerConfig` plus `seq_length`,
`share_embeddings_and_output_weights`, `position_embedding_type`; on main's Llama
recipes the TransformerConfig fields sit under `model.transformer`, and every `model.<field>` below
that is a TransformerConfig field is written `model.transformer.<field>` there), `ddp` a
`DistributedDataParallelConfig`, `optimizer` an `OptimizerConfig`, `train` the
batch sizes, `dataset` the sequence length, and `mixed_precision` a named recipe.
So the overrides are the Megatron-LM settings (planner.emit.megatron) after
Megatron-LM's own translation into megatron-core field names; the tests build
megatron-core's dataclasses from them. Dtypes and FP8 settings are carried by
the mixed-precision recipe, as Megatron-Bridge expects, not by single fields.
The model's norm epsilon is `model.layernorm_epsilon`, always written (the recipe's
provider has its own). MoE, latent-attention and window fields are the same megatron-core fields
(`model.num_moe_experts`, `model.q_lora_rank`, `model.window_size`, ...); the
per-layer patterns are Hydra lists, and MLA fields need a recipe whose provider
is an MLA config (Megatron-Bridge's DeepSeek providers). Offload sets
`optimizer.optimizer_offload_fraction=1.0` (megatron-core's default is 0). Activation
offloading is `model.cpu_offloading=true`, `model.cpu_offloading_num_layers=N` and
`model.cpu_offloading_weights=false`, the three fields Megatron-Bridge's own performance
scripts set for it (scripts/performance/utils/overrides.py, 0.3.1; the fields are unchanged in 0.6.0 and main).
Megatron-FSDP (ZeRO 2/3) sets `checkpoint.ckpt_format=fsdp_dtensor`, the only
format `ConfigContainer.validate()` accepts with it. The mixed-precision recipe
writes its own gradient reduction precision into the DDP config at validation
(bf16 recipes fp32, fp16 recipes fp16), after the overrides, so a plan whose
grad_precision differs from the recipe's is refused rather than silently changed.
The FP8 recipes likewise write their scaling and `fp8_param_gather` into the model and
DDP configs (MixedPrecisionConfig.setup, training/mixed_precision.py, the same in 0.3.1, 0.6.0 and main):
a plan is emitted with the recipe of its fp8_recipe, and refused where that recipe's
fp8_param_gather is not the plan's (the delayed and mxfp8 recipes set it, blockwise's
does not) or where no recipe matches the plan (tensorwise's keeps the first and last
layer in bf16, which the plan does not cost).
"""

from __future__ import annotations

import re
from typing import Any

from planner.emit.base import (BRIDGE_VERSIONS, DEFAULT_BRIDGE_VERSION, REGISTRY, EmitOptions, NotExpressibleError,
                               check_bridge_version, describe)
from planner.emit.quoting import comment, shell_word
from planner.emit.megatron import core_config_kwargs, qk_norm_omissions, settings
from planner.specs import Plan

FRAMEWORK = "Megatron-Bridge"
RUNS = "megatron"  # Megatron-Bridge runs megatron-core: Megatron's costs

# mapping table: megatron-core config -> Megatron-Bridge section, and the fields it carries
_MODEL_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                 "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                 "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split", "context_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
                 "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
                 "cpu_offloading", "cpu_offloading_num_layers", "cpu_offloading_weights",
                 "cuda_graph_impl", "cuda_graph_scope",
                 "gradient_accumulation_fusion",
                 "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
                 "num_query_groups", "gated_linear_unit", "normalization", "layernorm_epsilon", "qk_layernorm",
                 "add_bias_linear",
                 "add_qkv_bias", "attention_dropout", "hidden_dropout",
                 "num_moe_experts", "moe_layer_freq", "moe_router_topk", "moe_ffn_hidden_size",
                 "moe_shared_expert_intermediate_size", "moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm",
                 "moe_grouped_gemm",
                 "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_router_num_groups",
                 "moe_router_group_topk", "moe_router_load_balancing_type", "moe_router_pre_softmax",
                 "mtp_num_layers", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                 "qk_pos_emb_head_dim", "v_head_dim", "window_size", "window_attn_skip_freq", "softmax_type",
                 "overlap_p2p_comm", "batch_p2p_comm", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
                 "moe_deepep_num_sms", "moe_hybridep_num_sms", "moe_router_padding_for_quantization")
_DDP_FIELDS = ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "grad_reduce_in_fp32",
               "use_megatron_fsdp", "data_parallel_sharding_strategy")
_OPTIMIZER_FIELDS = ("optimizer", "use_distributed_optimizer", "optimizer_cpu_offload", "optimizer_offload_fraction",
                     "use_precision_aware_optimizer")
#: fields megatron-core's settings leave out at their default, written anyway: every recipe sets its own
#: value (e.g. full recompute, cp 2, account_for_*), which an override list that omits them keeps
_ALWAYS_MODEL = {"virtual_pipeline_model_parallel_size": None, "num_layers_in_first_pipeline_stage": None,
                 "num_layers_in_last_pipeline_stage": None, "pipeline_model_parallel_layout": None,
                 "account_for_embedding_in_pipeline_split": False, "account_for_loss_in_pipeline_split": False,
                 "context_parallel_size": 1, "expert_model_parallel_size": 1, "sequence_parallel": False,
                 "recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None,
                 # the query/key norms the plan's model has or lacks (Bridge's Qwen3 providers turn them on)
                 "qk_layernorm": False,
                 # the loss the plan was costed with: Megatron-Bridge's GPT providers turn the fusion on and its Llama
                 # and DeepSeek providers pick Transformer Engine's implementation, so megatron-core's defaults are
                 # written too
                 "cross_entropy_loss_fusion": False, "cross_entropy_fusion_impl": "native",
                 # the grouped MLP's FP8 padding the plan was costed with (Megatron-Bridge's gpt-oss and DeepSeek
                 # performance recipes turn the router's padding on)
                 "moe_router_padding_for_quantization": False}
#: strings Hydra's override grammar takes unquoted
_BARE = re.compile(r"[A-Za-z0-9_.\-]+")
#: TrainSpec.precision -> Megatron-Bridge mixed-precision recipe (bridge.training.mixed_precision); fp8 below
MIXED_PRECISION = {"bf16": "bf16_mixed", "fp16": "fp16_mixed"}
#: TrainSpec.fp8_recipe -> the bf16-based Megatron-Bridge FP8 recipe of that scaling, and the fp8_param_gather it
#: sets (mixed_precision.py: bf16_with_fp8_delayed_scaling_mixed, bf16_with_fp8_subchannel_scaling_mixed
#: = 128x128 / 1x128 blocks, bf16_with_mxfp8_mixed); tensorwise has none the plan can use
FP8_MIXED_PRECISION = {"delayed": ("bf16_with_fp8_delayed_scaling_mixed", True),
                       "blockwise": ("bf16_with_fp8_subchannel_scaling_mixed", False),
                       "mxfp8": ("bf16_with_mxfp8_mixed", True)}
#: the gradient reduction precision each recipe writes into `ddp.grad_reduce_in_fp32` when the config is
#: validated (MixedPrecisionConfig.setup), over whatever the overrides set
RECIPE_GRAD_REDUCE_IN_FP32 = {"bf16_mixed": True, "fp16_mixed": False, "bf16_with_fp8_delayed_scaling_mixed": True,
                              "bf16_with_fp8_subchannel_scaling_mixed": True, "bf16_with_mxfp8_mixed": True}
#: the only checkpoint format ConfigContainer.validate() accepts with Megatron-FSDP
FSDP_CKPT_FORMAT = "fsdp_dtensor"
#: the override that sets the dataset's sequence length, per release (see the module docstring): the model's
#: `model.seq_length` is written with the same value, and validate() refuses a config where the two differ
DATASET_SEQ_LENGTH = {"0.6": "dataset.seq_length", "0.3": "dataset.sequence_length", "main": "dataset.seq_length"}
#: the versions whose recipes differ in the model's layout, read from the model's name (see the module docstring)
FAMILY_VERSIONS = frozenset({"main"})
#: model name prefix -> (Megatron-Bridge recipe family: the folder under megatron/bridge/recipes, whether its
#: recipes at main nest the transformer fields under `model.transformer`). Read from the recipes at commit
#: 067f987df (tests/emit/data/megatron_bridge_main_fields.json, recipe_model_forms)
RECIPE_FAMILIES = {"llama2": ("llama", True), "llama3": ("llama", True), "gpt3": ("gpt", False),
                   "deepseek": ("deepseek", False), "qwen": ("qwen", False), "gpt-oss": ("gpt_oss", False),
                   "gemma": ("gemma", False)}
#: the model's own (GPT) fields the overrides write: `model.<field>` in both layouts
_GPT_FIELDS = ("seq_length", "position_embedding_type", "share_embeddings_and_output_weights")


def recipe_family(plan: Plan) -> tuple[str, bool]:
    """(recipe family, nested) of the plan's model at main, from the model's name; refused for a name of no
    family in RECIPE_FAMILIES."""
    name = plan.model.name.lower()
    for prefix, family in RECIPE_FAMILIES.items():
        if name.startswith(prefix):
            return family
    raise NotExpressibleError(
        FRAMEWORK, f"model name {plan.model.name!r} with bridge_version main: its recipe's model layout cannot be "
        "told from the plan (main's Llama 2/3 recipes take model.transformer.<field>, its GPT-3, DeepSeek, Qwen, "
        "gpt-oss and Gemma recipes model.<field>); give the model a name of its recipe family (" +
        ", ".join(f"{p}..." for p in RECIPE_FAMILIES) + "), or, for a recipe with a flat provider, bridge_version 0.6 (the "
        "keys main's flat recipes take)")


def model_prefix(plan: Plan, bridge_version: str) -> str:
    """Where the transformer fields go: `model.transformer.` for main's nested recipes, else `model.`."""
    if bridge_version in FAMILY_VERSIONS and recipe_family(plan)[1]:
        return "model.transformer."
    return "model."


def overrides(plan: Plan, bridge_version: str = DEFAULT_BRIDGE_VERSION) -> dict[str, Any]:
    """`section.field -> value` in the order they are printed, for the Megatron-Bridge release `bridge_version`
    names (a key of planner.emit.base.BRIDGE_VERSIONS)."""
    check_bridge_version("bridge_version", bridge_version)
    if plan.model.is_hybrid:  # Megatron-Bridge builds hybrid stacks from its own HybridModelProvider recipes
        raise NotExpressibleError(FRAMEWORK, f"model {plan.model.name!r} is a hybrid Mamba-Transformer stack "
                                  "(hybrid_override_pattern), whose HybridModelProvider overrides are not emitted "
                                  "here: emit megatron (Megatron-LM's pretrain_mamba.py)")
    try:
        core = core_config_kwargs(settings(plan))
    except NotExpressibleError as exc:
        raise NotExpressibleError(FRAMEWORK, exc.reason) from None
    tf, ddp, opt, gpt, training = core["transformer"], core["ddp"], core["optimizer"], core["gpt"], core["training"]
    # the gate's activation (SwiGLU, quick-GEGLU) is the recipe provider's own, as are gpt-oss's offset and clamp
    # (a callable and two fields the overrides leave to the recipe): only gated_linear_unit is written
    if tf.get("activation_func") not in (None, "silu", "quick_gelu"):
        raise NotExpressibleError(FRAMEWORK, f"activation {tf['activation_func']!r}")
    tf = _ALWAYS_MODEL | tf
    if tf.get("recompute_granularity") != "selective":
        tf.setdefault("recompute_modules", None)
    if tf.get("cpu_offloading"):  # the activations only, as Megatron-Bridge's performance overrides offload them
        tf["cpu_offloading_weights"] = False
    prefix = model_prefix(plan, bridge_version)
    out: dict[str, Any] = {f"{prefix}{k}": tf[k] for k in _MODEL_FIELDS if k in tf}
    out |= {f"model.{k}": v for k, v in zip(_GPT_FIELDS, (training["seq_length"], gpt["position_embedding_type"],
                                                          gpt["share_embeddings_and_output_weights"]))}
    out |= {"train.micro_batch_size": training["micro_batch_size"],
            "train.global_batch_size": training["global_batch_size"],
            DATASET_SEQ_LENGTH[bridge_version]: training["seq_length"]}
    out |= {f"ddp.{k}": ddp[k] for k in _DDP_FIELDS}
    out |= {f"optimizer.{k}": opt[k] for k in _OPTIMIZER_FIELDS
            if k != "optimizer_offload_fraction" or opt["optimizer_cpu_offload"]}
    if ddp["use_megatron_fsdp"]:
        out["checkpoint.ckpt_format"] = FSDP_CKPT_FORMAT
    recipe = _mixed_precision_recipe(plan.train)
    if RECIPE_GRAD_REDUCE_IN_FP32[recipe] != ddp["grad_reduce_in_fp32"]:
        raise NotExpressibleError(
            FRAMEWORK, f"grad_precision {plan.train.grad_precision!r} with precision {plan.train.precision!r}; the "
            f"{recipe} mixed-precision recipe sets ddp.grad_reduce_in_fp32={RECIPE_GRAD_REDUCE_IN_FP32[recipe]} when "
            "the config is validated, over any override")
    if core["initialize"]["order"] != "tp-cp-ep-dp-pp":  # DistributedInitConfig (training/config.py)
        out["dist.use_tp_pp_dp_mapping"] = True
    out["mixed_precision"] = recipe
    # a recipe's CommOverlapConfig rewrites the model's and DDP's overlap settings when the config is
    # set up (tp_comm_overlap, overlap_moe_expert_parallel_comm, p2p overlap); the plan's own settings
    # above stand only without it
    out["comm_overlap"] = None
    return out


def imposed_settings(precision: str, fp8_recipe: str) -> dict[str, Any]:
    """The training settings Megatron-Bridge's mixed-precision recipe of `precision` (and `fp8_recipe`) writes
    over any override when the config is validated: the gradient reduction precision (fp32 under the bf16 and
    FP8 recipes, fp16 under fp16) and, for FP8, its fp8_param_gather. A search for this backend takes them as
    given, so that the planner does not choose other values the emitted config could not run
    (planner.knobs); empty for a precision the emitter refuses.

    >>> imposed_settings("fp8", "mxfp8"), imposed_settings("bf16", "delayed")
    ({'grad_precision': 'fp32', 'fp8_param_gather': True}, {'grad_precision': 'fp32'})
    """
    if precision in MIXED_PRECISION:
        recipe = MIXED_PRECISION[precision]
    elif precision == "fp8" and fp8_recipe in FP8_MIXED_PRECISION:
        recipe = FP8_MIXED_PRECISION[fp8_recipe][0]
    else:
        return {}
    out: dict[str, Any] = {"grad_precision": "fp32" if RECIPE_GRAD_REDUCE_IN_FP32[recipe] else precision}
    if precision == "fp8":
        out["fp8_param_gather"] = FP8_MIXED_PRECISION[fp8_recipe][1]
    return out


def _mixed_precision_recipe(train) -> str:
    """The Megatron-Bridge mixed-precision recipe of the plan's precision (and FP8 scaling), refused where the
    recipe would set an FP8 parameter handling other than the plan's."""
    if train.precision in MIXED_PRECISION:
        return MIXED_PRECISION[train.precision]
    if train.precision != "fp8":
        raise NotExpressibleError(FRAMEWORK, f"precision {train.precision!r}; the emitter writes one of "
                                             "Megatron-Bridge's mixed-precision recipes (bf16, fp16, fp8), and "
                                             "writes no all-fp32 configuration")
    if train.fp8_recipe not in FP8_MIXED_PRECISION:
        raise NotExpressibleError(FRAMEWORK, f"fp8_recipe {train.fp8_recipe!r}; Megatron-Bridge's current-scaling "
                                             "recipe keeps the first and last layer in bf16, which the plan does not cost")
    recipe, param_gather = FP8_MIXED_PRECISION[train.fp8_recipe]
    if train.fp8_param_gather != param_gather:
        raise NotExpressibleError(
            FRAMEWORK, f"fp8_param_gather {train.fp8_param_gather} with fp8_recipe {train.fp8_recipe!r}; the {recipe} "
            f"mixed-precision recipe sets fp8_param_gather={param_gather} when the config is validated, over any "
            "override")
    return recipe


def format_value(value: Any) -> str:
    """Hydra/OmegaConf literal: true/false, null, numbers, bare strings; a string with characters
    Hydra's override grammar reads as syntax (a pipeline layout's `(`, `)`, `,`, `|`, `*`) is
    double-quoted (a non-printing character, which the grammar cannot escape, is refused); a list or
    tuple is a Hydra list `[a,b]`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):  # a per-layer pattern or a window pair: a Hydra list
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, str) and not _BARE.fullmatch(value):
        if not value.isprintable():  # Hydra's override grammar has no escape for control characters
            raise NotExpressibleError(FRAMEWORK, f"override value {value!r}: a control or other non-printing "
                                                 "character cannot be written in a Hydra override")
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value) if isinstance(value, float) else str(value)


def bridge_overrides(plan: Plan, bridge_version: str = DEFAULT_BRIDGE_VERSION) -> list[str]:
    """The `key=value` override list for the Megatron-Bridge release `bridge_version` names."""
    return [f"{key}={format_value(value)}" for key, value in overrides(plan, bridge_version).items()]


class MegatronBridgeEmitter:
    name = "megatron-bridge"
    framework = FRAMEWORK
    runs = RUNS
    syntax = "shell"

    def data(self, plan: Plan, options: EmitOptions) -> dict[str, Any]:
        return {"bridge_version": BRIDGE_VERSIONS[options.bridge_version],
                "overrides": bridge_overrides(plan, options.bridge_version)}

    def render(self, plan: Plan, options: EmitOptions) -> str:
        lines = bridge_overrides(plan, options.bridge_version)
        body = "".join(f"  {shell_word(line)}\n" for line in lines)
        return (comment("# Megatron-Bridge ", describe(plan, RUNS)) + "\n"
                f"# Megatron-Bridge {BRIDGE_VERSIONS[options.bridge_version]}: append to a recipe script: "
                "python <recipe>.py \"${OVERRIDES[@]}\"\n"
                f"OVERRIDES=(\n{body})\n")

    def omissions(self, plan: Plan, options: EmitOptions) -> list[str]:
        """Query/key norms over all heads together, which megatron-core's qk_layernorm (one head wide) cannot
        build; the recipe's own rotary settings stand, so the Megatron-LM flags' RoPE omissions do not apply."""
        overrides(plan, options.bridge_version)
        return qk_norm_omissions(plan, model_prefix(plan, options.bridge_version) + "qk_layernorm")


REGISTRY.register(MegatronBridgeEmitter())
