"""Colossal-AI (0.5): booster plugin keyword arguments, as JSON and as a Python snippet.

Which plugin:
- tp = pp = cp = 1 (pure data parallel): zero_stage 1 or 2 is
  `LowLevelZeroPlugin(stage=...)`, zero_stage 3 is `GeminiPlugin` with every
  parameter sharded (`shard_param_frac=1.0`), zero_stage 0 is
  `HybridParallelPlugin(tp_size=1, pp_size=1)` (DDP).
- otherwise `HybridParallelPlugin` (zero_stage 0-2), or `GeminiPlugin(tp_size=...)`
  for zero_stage 3 with tensor parallelism only.

Mapping choices:
- Megatron-style sequence parallelism is `sequence_parallelism_mode="split_gather"`;
  context parallelism is ring attention (`"ring_attn"`, `sp_size=cp`), the same
  algorithm the planner models. The two cannot be combined (one mode per plugin).
- `dp_outside=False` puts pipeline stages outermost and tensor ranks innermost,
  the rank layout the planner's communication model assumes.
- Flash attention is `enable_flash_attention` for the plugins that rewrite the
  model (Hybrid, Gemini); LowLevelZeroPlugin keeps the model's own attention, so
  the notes say to load the model with a flash kernel.
- Selective recomputation saves exactly the attention scores, which flash
  attention never stores, so with the flash kernel it is flash attention with
  no checkpointing; full recomputation is `model.gradient_checkpointing_enable()`
  plus, with pp > 1, a `PipelineGradientCheckpointConfig` of checkpointed layers
  per stage.
- An interleaved schedule overlaps its steady-state transfers (`overlap_p2p`, the plugin's default);
  a plan with `overlap_p2p_comm` off writes `overlap_p2p=False`.

Refused: zero_stage 2 with pp > 1 (the plugin asserts ZeRO 0 or 1 with pipelines),
zero_stage 3 with pp > 1 or cp > 1, cp > 1 together with sequence_parallel,
a split other than the even one with vpp > 1 (uneven first/last counts, an
explicit `stage_layers` split or the embedding/loss counted as layers: the stage
manager takes one layer count per pipeline stage, so with vpp > 1 it can only
split evenly; with vpp = 1 any split is `num_layers_per_stage`),
full recompute of only some layers without pipelining, selective recompute with
an unfused attention kernel, and activation offloading (offload_activation_layers:
the plugins offload optimizer states or parameters, never activations).

MoE: an MoE model with ep, tp or pp > 1 runs on `MoeHybridParallelPlugin`
(`ep_size`, `moe_dp_outside=False` so pipeline stages stay outermost); its
expert layers shard each expert over the whole tp group (etp must equal tp)
and draw expert-parallel ranks from data parallelism only (ep must divide dp);
ZeRO-3 is refused there. Offload is the ZeRO plugins' `cpu_offload` (optimizer
states and step on the CPU: ZeRO-Offload) or Gemini's `offload_optim_frac=1.0`.
Latent attention and sliding windows are the Hugging Face model code's own;
multi-token prediction is refused (Hugging Face model code has none).
"""

from __future__ import annotations

import json
from typing import Any

from planner.emit.base import REGISTRY, EmitOptions, NotExpressibleError, PlanFacts, check_plan, describe
from planner.emit.quoting import comment, python_identifier, python_literal
from planner.specs import Plan

FRAMEWORK = "Colossal-AI"
RUNS = "colossalai"  # the TrainSpec.framework whose costs describe the plugin's run
CONFIG_PATH = "colossalai_plugin.json"
#: planner precision -> Colossal-AI `precision` and `use_fp8`
_PRECISION = {"bf16": ("bf16", False), "fp16": ("fp16", False), "fp8": ("bf16", True), "fp32": ("fp32", False)}
#: grad_precision -> torch dtype name for `communication_dtype`
_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: data structures the snippet constructs from JSON (class name -> import)
CONFIG_CLASSES = {"PipelineGradientCheckpointConfig": "colossalai.shardformer"}


def plugin_spec(plan: Plan) -> dict[str, Any]:
    """{"plugin": class name, "kwargs": constructor kwargs, "training": loop settings, "notes": [...]}.

    `kwargs` are JSON values; `communication_dtype` names a torch dtype and
    `gradient_checkpoint_config` is {"PipelineGradientCheckpointConfig": kwargs}.
    """
    f = check_plan(plan, FRAMEWORK)
    _refuse_unsupported(f)
    s, t = f.strategy, f.train
    if t.precision not in _PRECISION:
        raise NotExpressibleError(FRAMEWORK, f"precision {t.precision!r}; Colossal-AI's plugins train in "
                                             f"{', '.join(sorted(_PRECISION))} (its use_fp8 is FP8 only)")
    precision, use_fp8 = _PRECISION[t.precision]
    notes: list[str] = []
    if _moe_plugin(f):
        plugin, kwargs = "MoeHybridParallelPlugin", _hybrid_kwargs(f, precision, notes)
        # ep_size after tp/pp; pipeline stages outermost, expert ranks inside data parallelism
        kwargs = {"tp_size": kwargs.pop("tp_size"), "pp_size": kwargs.pop("pp_size"), "ep_size": s.ep} | kwargs
        del kwargs["dp_outside"]
        kwargs["moe_dp_outside"] = False
        notes.append("MoE: Colossal-AI's shardformer policies replace the MoE blocks of Hugging Face Mixtral, "
                     "DeepSeek and DeepSeek-V3 models")
    elif s.tp == 1 and s.pp == 1 and s.cp == 1 and s.zero_stage in (1, 2):
        plugin, kwargs = "LowLevelZeroPlugin", {"stage": s.zero_stage, "precision": precision}
        kwargs |= _zero_kwargs(f)
    elif s.zero_stage == 3:
        plugin, kwargs = "GeminiPlugin", {"precision": precision, "placement_policy": "static",
                                          "shard_param_frac": 1.0,
                                          "offload_optim_frac": 1.0 if s.offload_optimizer else 0.0,
                                          "offload_param_frac": 0.0, "tp_size": s.tp}
        if s.sequence_parallel:
            kwargs["enable_sequence_parallelism"] = True
        _grad_note(f, notes, "Gemini reduces gradients in the compute dtype")
    else:
        plugin, kwargs = "HybridParallelPlugin", _hybrid_kwargs(f, precision, notes)
    if precision == "fp32" and (plugin == "GeminiPlugin" or kwargs.get("zero_stage", 0) > 0):
        # GeminiPlugin takes fp16 / bf16 only; the hybrid plugins assert a mixed precision with ZeRO
        raise NotExpressibleError(FRAMEWORK, f"precision 'fp32' with zero_stage {s.zero_stage}: {plugin} runs ZeRO "
                                             "only in fp16 or bf16 (LowLevelZeroPlugin, ZeRO-1/2 without tp/pp, "
                                             "takes fp32)")
    if t.attention_kernel == "flash1":
        notes.append("attention_kernel flash1: the plan is timed with FlashAttention v1 (or a Triton kernel of its "
                     "era); Colossal-AI's flash attention runs FlashAttention-2 or newer and may run faster than planned")
    if t.attention_kernel in ("flash", "flash2", "flash1"):
        if plugin == "LowLevelZeroPlugin":  # it does not rewrite the model (no Shardformer)
            notes.append("flash attention: LowLevelZeroPlugin keeps the model's own attention; load it with a "
                         "flash kernel (e.g. Hugging Face attn_implementation='flash_attention_2')")
        else:
            kwargs["enable_flash_attention"] = True
    if use_fp8:
        kwargs["use_fp8"] = True
    if s.recompute == "selective":
        notes.append("selective recompute: flash attention already never stores the attention scores that "
                     "selective recomputation frees, so no layer is checkpointed")
    training = {
        "dataloader_batch_size": s.micro_batch_size * (f.num_microbatches if s.pp > 1 else 1),
        "gradient_accumulation_steps": 1 if s.pp > 1 else f.num_microbatches,
        "gradient_checkpointing": s.recompute == "full",
    }
    return {"plugin": plugin, "kwargs": kwargs, "training": training, "notes": notes}


def _refuse_unsupported(f: PlanFacts) -> None:
    s, t = f.strategy, f.train

    def refuse(reason: str) -> None:
        raise NotExpressibleError(FRAMEWORK, reason)

    if f.model.is_moe and t.moe_dispatcher != "alltoall":
        refuse(f"moe_dispatcher {t.moe_dispatcher}; Colossal-AI's MoE plugin dispatches tokens with its own all-to-all")
    if s.pp > 1 and s.zero_stage == 2:
        refuse(f"zero_stage 2 with pp ({s.pp}) > 1; HybridParallelPlugin allows ZeRO stage 0 or 1 with pipelines")
    if s.zero_stage == 3 and (s.pp > 1 or s.cp > 1):
        refuse(f"zero_stage 3 with pp ({s.pp}) or cp ({s.cp}) > 1; GeminiPlugin (ZeRO-3) supports tensor parallelism only")
    if s.cp > 1 and s.sequence_parallel:
        refuse(f"cp ({s.cp}) > 1 with sequence_parallel; the plugin runs one sequence parallelism mode "
               "(split_gather or ring_attn), not both")
    if f.uneven and s.vpp > 1:
        refuse(f"uneven pipeline stages with vpp ({s.vpp}) > 1; the stage manager takes one layer count per stage")
    if not f.even_split and s.vpp > 1:
        refuse(f"{f.split_fields()} with vpp ({s.vpp}) > 1; the stage manager takes one layer count per stage")
    if s.recompute == "full" and s.recompute_num_layers is not None and s.pp == 1:
        refuse(f"recompute_num_layers ({s.recompute_num_layers}) without pipeline parallelism; Colossal-AI "
               "checkpoints all layers or, with pp > 1, a count per stage")
    if t.fp8_param_gather:
        refuse("fp8_param_gather; it is Megatron's --fp8-param-gather, and Colossal-AI's use_fp8 keeps bf16 weights")
    if s.offload_activation_layers:
        refuse(f"offload_activation_layers ({s.offload_activation_layers}); Colossal-AI's plugins (HybridParallelPlugin, "
               "LowLevelZeroPlugin, GeminiPlugin) offload optimizer states or parameters, never activations")
    if s.overlap_moe_comm:
        refuse("overlap_moe_comm; Colossal-AI does not overlap the expert all-to-all with another micro-batch")
    if s.recompute_modules and s.recompute_modules != ["core_attn"]:
        refuse(f"recompute_modules {s.recompute_modules}; Colossal-AI checkpoints whole layers, not Megatron modules")
    if s.recompute == "selective" and t.attention_kernel == "unfused":
        refuse("selective recompute with the unfused attention kernel; Colossal-AI has no attention-only recomputation")
    if f.model.num_mtp_layers:
        refuse(f"num_mtp_layers ({f.model.num_mtp_layers}); Colossal-AI trains Hugging Face model code, which has "
               "no multi-token-prediction module")
    if _moe_plugin(f):
        if s.etp != s.tp:
            refuse(f"etp ({s.etp}) must equal tp ({s.tp}); Colossal-AI's MoE layers shard every expert over the "
                   "whole tensor-parallel group")
        if s.zero_stage == 3:
            refuse(f"zero_stage 3 with an MoE model on ep ({s.ep}), tp ({s.tp}) or pp ({s.pp}); "
                   "MoeHybridParallelPlugin allows ZeRO stage 0 to 2")
        if f.dp % s.ep:
            refuse(f"ep ({s.ep}) must divide dp ({f.dp}); MoeHybridParallelPlugin draws expert-parallel ranks from "
                   "data-parallel ranks only")


def _moe_plugin(f: PlanFacts) -> bool:
    """An MoE model whose experts are spread or sharded (ep, tp or pp > 1) needs MoeHybridParallelPlugin;
    on data parallelism alone any plugin runs it as it is."""
    s = f.strategy
    return f.model.is_moe and (s.ep > 1 or s.tp > 1 or s.pp > 1)


def _zero_kwargs(f: PlanFacts) -> dict[str, Any]:
    s, t = f.strategy, f.train
    compute = "fp16" if t.precision == "fp16" else "bf16"
    out: dict[str, Any] = {"overlap_communication": s.overlap_grad_reduce, "overlap_allgather": s.overlap_param_gather,
                           "cpu_offload": s.offload_optimizer}
    if t.grad_precision != compute:
        out["communication_dtype"] = _DTYPE[t.grad_precision]
    return out


def _grad_note(f: PlanFacts, notes: list[str], what: str) -> None:
    compute = "fp16" if f.train.precision == "fp16" else "bf16"
    grads = f.train.grad_precision
    if grads != compute:
        effect = "half the plan's gradient traffic" if grads == "fp32" else "the same traffic in another 16-bit type"
        notes.append(f"grad_precision {grads}: {what} ({compute}); {effect}")


def _hybrid_kwargs(f: PlanFacts, precision: str, notes: list[str]) -> dict[str, Any]:
    s = f.strategy
    kwargs: dict[str, Any] = {"tp_size": s.tp, "pp_size": s.pp, "precision": precision, "zero_stage": s.zero_stage,
                              "dp_outside": False}
    if s.sequence_parallel:
        kwargs |= {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather"}
    elif s.cp > 1:
        kwargs |= {"sp_size": s.cp, "enable_sequence_parallelism": True, "sequence_parallelism_mode": "ring_attn"}
    if s.pp > 1:
        kwargs |= {"microbatch_size": s.micro_batch_size, "num_microbatches": f.num_microbatches}
        if s.vpp > 1:
            kwargs |= {"pp_style": "interleaved", "num_model_chunks": s.vpp}
            if not s.overlap_p2p_comm:  # the plugin overlaps the interleaved schedule's transfers by default
                kwargs["overlap_p2p"] = False
        if not f.even_split:
            kwargs["num_layers_per_stage"] = f.layers_per_stage()
        if s.recompute == "full":
            chunks = f.layers_per_chunk()
            ckpt = chunks if s.recompute_num_layers is None else [min(s.recompute_num_layers, n) for n in chunks]
            kwargs["gradient_checkpoint_config"] = {"PipelineGradientCheckpointConfig": {"num_ckpt_layers_per_stage": ckpt}}
    if s.zero_stage >= 1:
        kwargs |= _zero_kwargs(f)
    else:
        kwargs["overlap_communication"] = s.overlap_grad_reduce
        _grad_note(f, notes, "data parallel all-reduce runs in the compute dtype")
    return kwargs


# ---- rendering -----------------------------------------------------------------------
def _py(value: Any, key: str = "") -> str:
    """A keyword argument's Python source: a torch dtype from the `_DTYPE` table, a config class of
    `CONFIG_CLASSES` built from its kwargs, or a literal (`quoting.python_literal`)."""
    if key == "communication_dtype":
        if value not in _DTYPE.values():
            raise ValueError(f"communication_dtype {value!r} is not one of {sorted(_DTYPE.values())}")
        return f"torch.{value}"
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in CONFIG_CLASSES:
        cls, kw = next(iter(value.items()))
        return f"{cls}(" + ", ".join(f"{python_identifier(k)}={_py(v)}" for k, v in kw.items()) + ")"
    return python_literal(value)


def python_snippet(plan: Plan) -> str:
    spec = plugin_spec(plan)
    kwargs, training = spec["kwargs"], spec["training"]
    lines = [comment("# Colossal-AI ", describe(plan, RUNS)),
             "# Paste into your training script, where model, optimizer and dataset are defined."]
    lines += [comment("# note: ", n) for n in spec["notes"]]
    lines.append("import torch")
    lines.append("from colossalai.booster import Booster")
    lines.append(f"from colossalai.booster.plugin import {python_identifier(spec['plugin'])}")
    for cls, module in CONFIG_CLASSES.items():
        if any(isinstance(v, dict) and cls in v for v in kwargs.values()):
            lines.append(f"from {module} import {python_identifier(cls)}")
    lines.append("")
    lines.append(f"plugin = {python_identifier(spec['plugin'])}(")
    lines += [f"    {python_identifier(k)}={_py(v, k)}," for k, v in kwargs.items()]
    lines.append(")")
    lines.append("booster = Booster(plugin=plugin)")
    if training["gradient_checkpointing"]:
        lines.append("model.gradient_checkpointing_enable()  # full recomputation, before booster.boost")
    lines.append(f"train_dataloader = plugin.prepare_dataloader(dataset, batch_size={training['dataloader_batch_size']}, "
                 "shuffle=True, drop_last=True)")
    lines.append("model, optimizer, _, train_dataloader, _ = booster.boost(model, optimizer, dataloader=train_dataloader)")
    if training["gradient_accumulation_steps"] > 1:
        lines.append(f"# step the optimizer every {training['gradient_accumulation_steps']} micro-batches "
                     "(gradient accumulation)")
    return "\n".join(lines) + "\n"


class ColossalAIEmitter:
    name = "colossalai"
    framework = FRAMEWORK
    runs = RUNS
    syntax = "python"

    def data(self, plan: Plan, options: EmitOptions) -> dict[str, Any]:
        return plugin_spec(plan)

    def render(self, plan: Plan, options: EmitOptions) -> str:
        return python_snippet(plan)


def plugin_json(plan: Plan) -> str:
    return json.dumps(plugin_spec(plan), indent=2) + "\n"


REGISTRY.register(ColossalAIEmitter())
