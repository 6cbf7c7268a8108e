"""What the fine-tuning toolkits (Axolotl, LLaMA-Factory) share: the plan's checks, the model's Hugging Face id,
the DeepSpeed JSON or the FSDP2 settings they reference, and the shell text that writes their files.

Both toolkits run a Hugging Face model through the Hugging Face Trainer, with peft for LoRA / QLoRA and
bitsandbytes for the 4-bit base, sharded by DeepSpeed's ZeRO (a plan of framework deepspeed) or by PyTorch
FSDP2 through accelerate (a plan of framework torchtitan, whose costs are FSDP2's; zero_stage 0 there is plain
DDP). Neither has tensor, pipeline, context or expert parallelism for that model, Megatron's selective or
partial recomputation, activation offloading or FP8 training, so a plan with any of them is refused.

Choices that are not the plan's (the data set, learning rate, epochs, output folder) are written as sensible
starting values and said to be so in the output's notes: a data set name and an output folder are required
fields of both toolkits' configs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from planner.emit.base import EmitOptions, NotExpressibleError, PlanFacts, check_plan, describe
from planner.emit.deepspeed import ds_config
from planner.emit.quoting import clip, comment, heredoc, one_line
from planner.specs import Plan

#: the frameworks a fine-tuning plan can be costed as, each with how the toolkits shard it
SHARDERS = {"deepspeed": "DeepSpeed ZeRO", "torchtitan": "FSDP2"}
#: the framework a search for a toolkit's config is costed as (the adapter plans' default), and the other one
#: whose plans it also runs as costed (`Emitter.also_runs`)
RUNS = "deepspeed"
ALSO_RUNS = ("torchtitan",)
#: the DeepSpeed JSON both toolkits reference (their `deepspeed:` key)
DS_CONFIG_PATH = "ds_config.json"
#: model preset -> its Hugging Face repository (the id each preset's `source` cites); presets without one (the
#: GPT-3 and MPT shapes, models transformers 4.51 has no class for) need `EmitOptions.hf_model`
HF_MODELS = {
    "llama2-7b": "meta-llama/Llama-2-7b-hf", "llama2-13b": "meta-llama/Llama-2-13b-hf",
    "llama2-70b": "meta-llama/Llama-2-70b-hf",
    "llama3-8b": "meta-llama/Meta-Llama-3-8B", "llama3-70b": "meta-llama/Meta-Llama-3-70B",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B", "llama3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama3.1-405b": "meta-llama/Llama-3.1-405B",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B", "llama3.2-3b": "meta-llama/Llama-3.2-3B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "mixtral-8x22b": "mistralai/Mixtral-8x22B-v0.1",
    "qwen2.5-72b": "Qwen/Qwen2.5-72B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B", "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "gemma-2-27b": "google/gemma-2-27b",
}
#: starting learning rates (not part of the plan): 2e-4 as Axolotl's LoRA and QLoRA examples take, 1e-5 as
#: LLaMA-Factory's full fine-tuning examples take
LEARNING_RATE = {"adapters": 2e-4, "full": 1e-5}
#: DeepSpeed's AdamW for ZeRO-Offload: the Trainer fills each "auto" from its own arguments. A client optimizer
#: beside an offloaded one is refused by DeepSpeed (zero_force_ds_cpu_optimizer), so offload brings its own
DS_OFFLOAD_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto"}}


@dataclass
class FinetuneFacts:
    """A fine-tuning plan checked for one toolkit, with what its config is built from."""

    facts: PlanFacts
    hf_model: str
    sharding: str
    """deepspeed (the DeepSpeed JSON), fsdp2 (accelerate's FSDP2) or ddp (zero_stage 0 under framework torchtitan)."""
    notes: list[str] = field(default_factory=list)

    @property
    def plan(self) -> Plan:
        return self.facts.plan


def check_finetune(plan: Plan, options: EmitOptions, framework: str) -> FinetuneFacts:
    """The plan's facts once every rule a fine-tuning toolkit needs holds; else NotExpressibleError naming the
    field, the rule and the value."""
    f = check_plan(plan, framework)
    s, t, m = f.strategy, f.train, plan.model

    def refuse(reason: str) -> None:
        raise NotExpressibleError(framework, reason)

    if t.finetune == "none":
        refuse(f"finetune 'none' (pre-training); {framework} fine-tunes a pretrained Hugging Face model: plan with "
               "finetune full, lora or qlora")
    if t.framework not in SHARDERS:
        refuse(f"framework {t.framework!r}; {framework} runs the Hugging Face model under DeepSpeed ZeRO (framework "
               "deepspeed) or FSDP2 (framework torchtitan)")
    for name, value in (("tp", s.tp), ("pp", s.pp), ("cp", s.cp), ("ep", s.ep), ("etp", s.etp), ("vpp", s.vpp)):
        if value > 1:
            refuse(f"{name} ({value}) > 1; {framework} shards the Hugging Face model by data parallelism only "
                   f"({SHARDERS[t.framework]})")
    if s.sequence_parallel:
        refuse(f"sequence_parallel; {framework} has no Megatron sequence parallelism")
    if t.precision not in ("bf16", "fp16"):
        refuse(f"precision {t.precision!r}; the Hugging Face Trainer mixes precision in bf16 or fp16 only")
    if s.recompute == "selective" or s.recompute_modules:
        refuse(f"recompute {s.recompute!r} (modules {s.recompute_modules or ['core_attn']}); the Hugging Face "
               "models checkpoint whole decoder layers (gradient_checkpointing), not Megatron's selective modules")
    if s.recompute == "full" and s.recompute_num_layers is not None and s.recompute_num_layers < m.num_layers:
        refuse(f"recompute_num_layers ({s.recompute_num_layers}) of {m.num_layers} layers; gradient_checkpointing "
               "checkpoints every decoder layer")
    if s.offload_activation_layers:
        refuse(f"offload_activation_layers ({s.offload_activation_layers}); {framework} has no activation offloading")
    if t.fp8_param_gather:
        refuse("fp8_param_gather; it is Megatron's --fp8-param-gather, and the Hugging Face model keeps 16-bit weights")
    if s.overlap_moe_comm:
        refuse(f"overlap_moe_comm; {framework} runs the experts without expert parallelism")
    if t.attention_kernel in ("flash1", "unfused"):
        refuse(f"attention_kernel {t.attention_kernel!r}; the emitted config runs FlashAttention-2 (flash-attn 2)")
    if t.framework == "torchtitan" and s.offload_optimizer:
        refuse("offload_optimizer with framework torchtitan; FSDP2's only CPU offload (fsdp_offload_params) moves "
               "parameters and gradients to the host too, not the optimizer alone")
    if t.paged_optimizer and s.offload_optimizer:
        refuse("paged_optimizer with offload_optimizer; ZeRO-Offload runs DeepSpeed's CPU Adam, not bitsandbytes' "
               "paged one")
    if not getattr(t, "transformers", True):
        refuse(f"model_code {t.model_code!r}; {framework} runs Hugging Face Transformers' layers, whose memory differs "
               "from the framework's own: plan the full fine-tuning with model_code 'transformers' "
               "(--model-code transformers)")
    if t.adapters and t.effective_lora_alpha != int(t.effective_lora_alpha):
        refuse(f"lora_alpha {t.effective_lora_alpha:g}; {framework} takes an integer lora_alpha")
    hf_model = options.hf_model or HF_MODELS.get(m.name)
    if hf_model is None:
        refuse(f"model '{one_line(clip(m.name))}' has no Hugging Face id here; pass --hf-model (a Hugging Face id or "
               "a local model folder of its shape; planner.emit.finetune.HF_MODELS lists the presets that have one)")
    sharding = "deepspeed" if t.framework == "deepspeed" else ("fsdp2" if s.zero_stage else "ddp")
    out = FinetuneFacts(facts=f, hf_model=hf_model, sharding=sharding)
    if options.hf_model is not None:
        out.notes.append(f"model {options.hf_model}: the plan is costed for {clip(m.name)}'s shape "
                         f"({m.num_layers} layers, hidden {m.hidden_size}), which this model must have")
    if t.attention_kernel == "flash":
        out.notes.append("attention_kernel flash: the plan is timed with the GPU's fastest fused attention (cuDNN on "
                         "Hopper and Blackwell); the config runs FlashAttention-2 and may run slower than planned")
    if t.cross_entropy_fusion:
        out.notes.append("cross_entropy_fusion: the plan is costed with a fused cross-entropy; the Hugging Face "
                         "model computes PyTorch's cross_entropy over the full logits")
    if sharding == "fsdp2" and s.zero_stage == 1:
        out.notes.append("zero_stage 1: FSDP2 without resharding after the forward also shards gradients (ZeRO-2), "
                         "which only saves memory")
    if sharding == "fsdp2" and t.grad_precision != "fp32":
        out.notes.append(f"grad_precision {t.grad_precision}: FSDP2 reduces gradients in the dtype of accelerate's "
                         "mixed-precision policy, which this config does not set")
    if t.adapters and t.adapter_precision == "fp32" and sharding == "deepspeed":
        out.notes.append("adapter_precision fp32: DeepSpeed's 16-bit engine holds the adapters in 16 bits with an "
                         "fp32 master copy in the optimizer (a few bytes more per adapter weight than planned)")
    return out


def deepspeed_json(ft: FinetuneFacts, framework: str) -> dict[str, Any]:
    """The DeepSpeed config the Hugging Face Trainer reads: the plan's `ds_config` with train_batch_size "auto"
    (the Trainer writes world size × micro-batch × accumulation steps, the plan's global batch), the Trainer's own
    gradient checkpointing instead of DeepSpeed's, and DeepSpeed's AdamW when the optimizer is offloaded."""
    try:
        config = ds_config(ft.plan)
    except NotExpressibleError as exc:  # DeepSpeed's own refusals, said for the toolkit that runs it
        raise NotExpressibleError(framework, f"{exc.reason} (its DeepSpeed config)") from None
    config["train_batch_size"] = "auto"
    config.pop("activation_checkpointing", None)
    if ft.facts.strategy.offload_optimizer:
        config["optimizer"] = json.loads(json.dumps(DS_OFFLOAD_OPTIMIZER))
        ft.notes.append("offload_optimizer: DeepSpeed's AdamW (its CPU Adam) runs the step, as ZeRO-Offload needs; "
                        "the config's optimizer name is not used")
    return config


def fsdp2_settings(ft: FinetuneFacts) -> dict[str, Any]:
    """accelerate's FSDP2 settings (`fsdp_config`), whose keys both toolkits pass on: each decoder layer wrapped
    (the model's `_no_split_modules`), resharded after the forward for zero_stage 3 only (ZeRO-3: parameters
    gathered again in the backward) and kept gathered for zero_stage 1 or 2 (ZeRO-2). Full recompute is FSDP's
    own activation checkpointing of each wrapped layer: the Trainer's gradient_checkpointing would gather a
    resharded layer's parameters once more for the recomputation (transformers warns of the redundant
    all-gather), which the plan does not cost."""
    return {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": ft.facts.strategy.zero_stage == 3, "fsdp_offload_params": False,
            "fsdp_cpu_ram_efficient_loading": True, "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_activation_checkpointing": ft.facts.strategy.recompute == "full"}


def recompute(ft: FinetuneFacts) -> bool:
    """Whether the Trainer checkpoints every decoder layer (gradient_checkpointing): the plan's full recompute,
    except under FSDP2, whose own activation checkpointing does it (`fsdp2_settings`)."""
    return ft.facts.strategy.recompute == "full" and ft.sharding != "fsdp2"


def optimizer_name(ft: FinetuneFacts) -> str:
    """The Trainer's optimizer: bitsandbytes' paged 32-bit AdamW when the plan pages its states, else PyTorch's."""
    return "paged_adamw_32bit" if ft.facts.train.paged_optimizer else "adamw_torch"


def to_yaml(body: dict[str, Any]) -> str:
    """YAML through PyYAML's safe dumper (every user string quoted as data), keys in the order given."""
    return yaml.safe_dump(body, sort_keys=False, default_flow_style=False, width=1000)


def render_files(ft: FinetuneFacts, title: str, files: dict[str, str], command: str) -> str:
    """A shell script that writes each file (through quoted here-documents) and says how to start the run."""
    out = [comment(f"# {title} ", describe(ft.plan, ft.plan.train.framework))]
    out += [comment("# note: ", n) for n in ft.notes]
    out.append(comment("# run: ", command))
    body = "\n".join(out) + "\n"
    for path, text in files.items():
        body += heredoc(path, text)
    return body


def emit_parts(build: Callable[[Plan, EmitOptions], tuple[FinetuneFacts, dict[str, Any], dict[str, str], str]],
               plan: Plan, options: EmitOptions) -> dict[str, Any]:
    """The structured form every fine-tuning emitter returns: the main config, every file written, the notes
    and the launch command."""
    ft, config, files, command = build(plan, options)
    return {"config": config, "files": files, "notes": list(ft.notes), "command": command,
            "hf_model": ft.hf_model, "sharding": ft.sharding}


class ToolkitEmitter:
    """The emitter of a fine-tuning toolkit: `build` writes its YAML and the files it references (returning the
    plan's facts, the config, the files and the command); the toolkit runs plans of framework deepspeed and
    torchtitan (FSDP2) and names the Hugging Face model it loads (EmitOptions.hf_model, --hf-model)."""

    runs = RUNS
    also_runs = ALSO_RUNS
    loads_hf_model = True
    syntax = "shell"

    def __init__(self, name: str, framework: str,
                 build: Callable[[Plan, EmitOptions], tuple[FinetuneFacts, dict[str, Any], dict[str, str], str]]):
        self.name, self.framework, self._build = name, framework, build

    def data(self, plan: Plan, options: EmitOptions) -> dict[str, Any]:
        return emit_parts(self._build, plan, options)

    def render(self, plan: Plan, options: EmitOptions) -> str:
        ft, _, files, command = self._build(plan, options)
        return render_files(ft, self.framework, files, command)
