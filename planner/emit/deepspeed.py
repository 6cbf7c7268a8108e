"""DeepSpeed (0.19): the `ds_config.json`, plus Megatron-DeepSpeed flags for 3D parallelism.

The JSON carries what DeepSpeed's engine owns: batch sizes, ZeRO stage,
offload, bucket sizes, overlap, precision and, with pp > 1, the pipeline
engine's settings. Tensor and pipeline degrees are not JSON keys: DeepSpeed
takes them from the model parallel unit (mpu) of the training code, so a plan
with tp > 1 or pp > 1 also needs Megatron-DeepSpeed's `pretrain_gpt.py` flags
(microsoft/Megatron-DeepSpeed, Megatron-LM 23.x-based arguments), emitted by
the `megatron-deepspeed` backend. With tp = pp = 1 the JSON alone drives any
model code (recomputation is then the model's own, e.g. Hugging Face's
`gradient_checkpointing_enable()`).

What DeepSpeed cannot run as planned (each raises NotExpressibleError):
- zero_stage 2 or 3 with pp > 1: the pipeline engine asserts "ZeRO-2 and
  ZeRO-3 are incompatible with pipeline parallelism".
- vpp > 1: the pipeline engine has only the plain 1F1B schedule.
- a split other than the even one with pp > 1 (uneven first/last stage layer
  counts, an explicit `stage_layers` split, the embedding or loss counted as a
  layer): PipelineModule partitions by method (uniform, parameters, type
  regex), not by per-stage counts.
- cp > 1: DeepSpeed's sequence parallelism is Ulysses (all-to-all over heads,
  `sequence_parallel_size`), not ring context parallelism; its memory and
  communication differ from the plan's.
- full recompute of only some layers with pp > 1: the pipeline engine
  checkpoints every `activation_checkpoint_interval` layers, not the first k.
- ZeRO stage 0 with bf16 and fp32 gradients (grad_precision "fp32"):
  `deepspeed.initialize` raises "unsupported mix of model_dtype=bfloat16 and
  grad_accum_dtype=float32" (only the BF16 optimizer of ZeRO stage >= 1
  accumulates bf16 gradients in fp32); DeepSpeedConfig alone accepts it.
- fp8: DeepSpeed's config has no FP8 training mode (it lives in model code,
  e.g. Transformer Engine).
- offload_activation_layers: DeepSpeed's only activation offload,
  `activation_checkpointing.cpu_checkpointing`, moves the checkpointed layer inputs
  to the host and needs recomputation, which an offloading plan does not run
  (Megatron's offloading recomputes nothing: it copies the offloaded layers'
  activations to the host and back).
- ep > 1 or etp > 1: DeepSpeed-MoE takes its expert-parallel degree in model
  code (`deepspeed.moe.layer.MoE(ep_size=...)`), not in the JSON; the refusal
  names the ep_size to pass. With ep = etp = 1 an MoE, latent-attention or
  windowed model runs on the JSON alone (tp = pp = 1: the architecture is the
  model code's); with tp or pp > 1 it would need Megatron-DeepSpeed MoE/MLA/window
  flags, which are not emitted, so it is refused, as are query/key norms (Qwen3), which
  Megatron-DeepSpeed's GPT has no flag for.

Bucket sizes follow the rule Hugging Face's DeepSpeed integration uses for
"auto": reduce and all-gather buckets of hidden² elements, a ZeRO-3 prefetch
bucket of 0.9·hidden² (0 when the plan does not overlap the parameter
gather) and a persistence threshold of 10·hidden.
"""

from __future__ import annotations

import json
from typing import Any

from planner.emit.base import REGISTRY, EmitOptions, NotExpressibleError, PlanFacts, check_plan, describe, shell_array
from planner.emit.quoting import comment
from planner.specs import Plan

FRAMEWORK = "DeepSpeed"
RUNS = "deepspeed"  # the TrainSpec.framework whose costs describe its run (Megatron-DeepSpeed for tp/pp)
CONFIG_PATH = "ds_config.json"

#: DeepSpeed's fp16 dynamic loss scaling, as its documentation configures it
FP16_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                     "min_loss_scale": 1}
GRADIENT_CLIPPING = 1.0
STEPS_PER_PRINT = 10


def _refuse_unsupported(f: PlanFacts) -> None:
    s, t = f.strategy, f.train

    def refuse(reason: str) -> None:
        raise NotExpressibleError(FRAMEWORK, reason)

    if f.model.is_moe and t.moe_dispatcher != "alltoall":
        refuse(f"moe_dispatcher {t.moe_dispatcher}; DeepSpeed-MoE dispatches tokens with its own all-to-all")
    if s.pp > 1 and s.zero_stage >= 2:
        refuse(f"zero_stage {s.zero_stage} with pp ({s.pp}) > 1; DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only")
    if s.vpp > 1:
        refuse(f"vpp ({s.vpp}) > 1; DeepSpeed's pipeline engine has no interleaved (virtual pipeline) schedule")
    if f.uneven:
        refuse(f"uneven pipeline stages (first {s.num_layers_in_first_stage}, last {s.num_layers_in_last_stage} layers); "
               "DeepSpeed's PipelineModule partitions layers by method, not by per-stage counts")
    if s.pp > 1 and not f.even_split:
        refuse(f"{f.split_fields()} with pp ({s.pp}) > 1; DeepSpeed's PipelineModule partitions layers by method "
               "(uniform, parameters, type regex), not by per-stage counts")
    if s.cp > 1:
        refuse(f"cp ({s.cp}) > 1; DeepSpeed's sequence parallelism is Ulysses all-to-all, not ring context parallelism")
    if s.recompute_modules and s.recompute_modules != ["core_attn"]:
        refuse(f"recompute_modules {s.recompute_modules}; DeepSpeed checkpoints whole layers (Megatron-DeepSpeed's "
               "selective recompute is the attention core only)")
    if s.recompute == "full" and s.recompute_num_layers is not None and s.pp > 1:
        refuse(f"recompute_num_layers ({s.recompute_num_layers}) with pp ({s.pp}) > 1; the pipeline engine checkpoints "
               "every activation_checkpoint_interval layers, not the first k of each stage")
    if s.offload_activation_layers:
        refuse(f"offload_activation_layers ({s.offload_activation_layers}); DeepSpeed's only activation offload "
               "(activation_checkpointing.cpu_checkpointing) moves checkpointed layer inputs to the host and needs "
               "recomputation, which the plan does not run")
    if t.precision in ("fp8", "nvfp4"):
        refuse(f"precision {t.precision!r}; the DeepSpeed config has bf16 and fp16 modes only")
    if s.zero_stage == 0 and t.precision == "bf16" and t.grad_precision == "fp32":
        refuse("zero_stage 0 with bf16 and grad_precision 'fp32'; deepspeed.initialize accumulates bf16 gradients in "
               "fp32 only with ZeRO stage >= 1 (its BF16 optimizer); use zero_stage 1 or grad_precision 'bf16'")
    if s.ep > 1:
        refuse(f"ep ({s.ep}) > 1; DeepSpeed sets expert parallelism in model code, "
               f"deepspeed.moe.layer.MoE(ep_size={s.ep}, ...), not in {CONFIG_PATH}")
    if s.etp > 1:
        refuse(f"etp ({s.etp}) > 1; DeepSpeed shards experts over tensor-parallel ranks only inside deepspeed.moe "
               "(model code), not in its config")
    m = f.model
    qk_norm = m.qk_norm != "none"
    if (s.tp > 1 or s.pp > 1) and (m.is_moe or m.is_mla or any(m.local_attention_mask()) or qk_norm):
        what = ", ".join(n for n, on in (("MoE", m.is_moe), ("latent attention", m.is_mla),
                                         ("sliding-window attention", any(m.local_attention_mask())),
                                         (f"query/key norms (qk_norm {m.qk_norm})", qk_norm)) if on)
        refuse(f"{what} with tp ({s.tp}) or pp ({s.pp}) > 1; the Megatron-DeepSpeed flags emitted here build a "
               "dense, full-attention GPT without query/key norms")


def ds_config(plan: Plan) -> dict[str, Any]:
    """The DeepSpeed JSON config for the plan (keys in DeepSpeed's own names)."""
    f = check_plan(plan, FRAMEWORK)
    _refuse_unsupported(f)
    s, t, h = f.strategy, f.train, plan.model.hidden_size
    config: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": f.num_microbatches,
        "steps_per_print": STEPS_PER_PRINT,
        "gradient_clipping": GRADIENT_CLIPPING,
    }
    if t.precision == "fp16":
        config["fp16"] = {"enabled": True, **FP16_LOSS_SCALING}
    else:
        config["bf16"] = {"enabled": True}
    config["communication_data_type"] = t.grad_precision
    if t.grad_precision == "fp32" and t.precision == "bf16":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    config["zero_optimization"] = _zero(f, h)
    if s.pp > 1:
        config["pipeline"] = {"stages": s.pp,
                              "activation_checkpoint_interval": 1 if s.recompute == "full" else 0}
    if s.recompute == "full":
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                              "cpu_checkpointing": False}
    return config


def _zero(f: PlanFacts, h: int) -> dict[str, Any]:
    s = f.strategy
    zero: dict[str, Any] = {"stage": s.zero_stage}
    if s.zero_stage == 0:
        return zero
    zero |= {"overlap_comm": s.overlap_grad_reduce, "contiguous_gradients": True, "reduce_bucket_size": h * h}
    if s.zero_stage in (1, 2):
        zero |= {"reduce_scatter": True, "allgather_bucket_size": h * h}
    else:
        zero |= {"stage3_prefetch_bucket_size": int(0.9 * h * h) if s.overlap_param_gather else 0,
                 "stage3_param_persistence_threshold": 10 * h,
                 "stage3_gather_16bit_weights_on_model_save": True}
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return zero


# ---- Megatron-DeepSpeed launcher flags (mapping table) -------------------------------
MEGATRON_DEEPSPEED_FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "no_pp": "--no-pipeline-parallel",
    "sequence_parallel": "--sequence-parallel",
    "micro_batch_size": "--micro-batch-size",
    "global_batch_size": "--global-batch-size",
    "seq_len": "--seq-length",
    "zero_stage": "--zero-stage",
    "bf16": "--bf16",
    "fp16": "--fp16",
    "recompute_granularity": "--recompute-granularity",
    "recompute_method": "--recompute-method",
    "recompute_num_layers": "--recompute-num-layers",
    "ds_checkpointing": "--deepspeed-activation-checkpointing",
    "cpu_optimizer": "--cpu-optimizer",
    "deepspeed": "--deepspeed",
    "deepspeed_config": "--deepspeed_config",
}


def megatron_deepspeed_args(plan: Plan, config_path: str = CONFIG_PATH) -> list[str]:
    """Flags for Megatron-DeepSpeed's pretrain_gpt.py that match `ds_config(plan)`."""
    ds_config(plan)  # the same refusals as the JSON
    f = check_plan(plan, FRAMEWORK)
    s, t = f.strategy, f.train
    if t.adapters:
        raise NotExpressibleError(FRAMEWORK, f"finetune {t.finetune!r} (adapters over a frozen base); "
                                  "Megatron-DeepSpeed's pretrain_gpt.py trains every parameter: emit deepspeed (the "
                                  "JSON for a peft model's script), axolotl or llamafactory")
    F = MEGATRON_DEEPSPEED_FLAGS
    argv = [F["tp"], str(s.tp), F["pp"], str(s.pp)]
    if s.pp == 1:
        argv.append(F["no_pp"])
    if s.sequence_parallel:
        argv.append(F["sequence_parallel"])
    argv += [F["micro_batch_size"], str(s.micro_batch_size), F["global_batch_size"], str(t.global_batch_size),
             F["seq_len"], str(t.seq_len), F["zero_stage"], str(s.zero_stage),
             F["fp16"] if t.precision == "fp16" else F["bf16"]]
    if s.recompute == "selective":
        argv += [F["recompute_granularity"], "selective"]
    elif s.recompute == "full":
        method, count = ("uniform", 1) if s.recompute_num_layers is None else ("block", s.recompute_num_layers)
        argv += [F["recompute_granularity"], "full", F["recompute_method"], method, F["recompute_num_layers"],
                 str(count), F["ds_checkpointing"]]
    if s.offload_optimizer:
        argv.append(F["cpu_optimizer"])
    argv += [F["deepspeed"], F["deepspeed_config"], config_path]
    return argv


def needs_megatron_deepspeed(plan: Plan) -> bool:
    """Whether the plan needs a model parallel unit (Megatron-DeepSpeed) beside the JSON."""
    s = check_plan(plan, FRAMEWORK).strategy
    return s.tp > 1 or s.pp > 1


class DeepSpeedEmitter:
    name = "deepspeed"
    framework = FRAMEWORK
    runs = RUNS
    syntax = "json"

    def data(self, plan: Plan, options: EmitOptions) -> dict[str, Any]:
        # an adapter plan's JSON serves a peft model's own script: no pretrain_gpt.py flags trains it
        args = None if plan.train.adapters else megatron_deepspeed_args(plan)
        return {"config": ds_config(plan), "megatron_deepspeed_args": args,
                "needs_megatron_deepspeed": needs_megatron_deepspeed(plan)}

    def render(self, plan: Plan, options: EmitOptions) -> str:
        return json.dumps(ds_config(plan), indent=2) + "\n"

    def omissions(self, plan: Plan, options: EmitOptions) -> list[str]:
        """What of the plan the bare ds_config.json cannot carry (the mpu's degrees)."""
        s = check_plan(plan, FRAMEWORK).strategy
        ds_config(plan)
        lost = [f"{name} ({value})" for name, value, on in (
            ("tp", s.tp, s.tp > 1), ("pp", s.pp, s.pp > 1), ("sequence_parallel", "true", s.sequence_parallel)) if on]
        if not lost:
            return []
        return [f"{', '.join(lost)}: {CONFIG_PATH} has no key for them (DeepSpeed takes them from the training "
                "code's model parallel unit); emit --backend megatron-deepspeed for the pretrain_gpt.py flags that "
                "carry them, or --format json for both"]


class MegatronDeepSpeedEmitter:
    name = "megatron-deepspeed"
    framework = FRAMEWORK
    runs = RUNS
    syntax = "shell"

    def data(self, plan: Plan, options: EmitOptions) -> dict[str, Any]:
        return {"args": megatron_deepspeed_args(plan), "config": ds_config(plan)}

    def render(self, plan: Plan, options: EmitOptions) -> str:
        return (comment("# Megatron-DeepSpeed ", describe(plan, RUNS)) + "\n"
                f"# Save `meshplan emit --backend deepspeed` as {CONFIG_PATH}; add your model-shape, data, tokenizer\n"
                "# and learning-rate flags, then run torchrun ... pretrain_gpt.py \"${MEGATRON_DS_ARGS[@]}\" ...\n"
                + shell_array("MEGATRON_DS_ARGS", megatron_deepspeed_args(plan)))


REGISTRY.register(DeepSpeedEmitter())
REGISTRY.register(MegatronDeepSpeedEmitter())
