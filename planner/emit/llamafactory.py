"""LLaMA-Factory (0.9.4): the training YAML (`llamafactory-cli train`), with the DeepSpeed JSON it references
or accelerate's FSDP2 config file it is launched with.

Mapping (LLaMA-Factory's argument names: llamafactory.hparams ModelArguments, DataArguments,
FinetuningArguments and the Trainer's TrainingArguments):
- model: `model_name_or_path`, the Hugging Face id of the plan's model preset (planner.emit.finetune.HF_MODELS)
  or `EmitOptions.hf_model`; `template`, the chat template of the model's family (TEMPLATES; `default` for
  another model).
- finetune lora / qlora: `finetuning_type: lora`; qlora adds `quantization_bit: 4`, `quantization_method: bnb`,
  `quantization_type: nf4`, `double_quantization` as planned (the compute dtype is the run's bf16/fp16).
  `lora_rank`, `lora_alpha` (an integer), `lora_dropout`; `lora_target: all` (every linear layer but the
  output layer) or the modules, comma-separated. adapter_precision bf16 is `pure_bf16: true` (no fp32 upcast
  of the trainable weights), which LLaMA-Factory refuses beside ZeRO-3 (refused here too). finetune full:
  `finetuning_type: full`.
- batch: `per_device_train_batch_size`, `gradient_accumulation_steps` = global batch / (micro-batch × dp);
  `cutoff_len` = seq_len; `bf16` or `fp16`; `optim`: adamw_torch, or paged_adamw_32bit; `flash_attn: fa2`;
  `torch_compile` as costed. LLaMA-Factory checkpoints every decoder layer unless told not to:
  `disable_gradient_checkpointing` is true unless the plan recomputes fully (and under FSDP2, whose
  `fsdp_activation_checkpointing` recomputes instead).
- sharding: framework deepspeed -> `deepspeed: ds_config.json`; framework torchtitan -> accelerate's FSDP2
  config (`accelerate_fsdp2.yaml`, `accelerate launch --config_file ...`) for zero_stage 1-3, plain DDP
  (torchrun) for zero_stage 0.

lora_layers is refused: LLaMA-Factory has no argument for peft's layers_to_transform (its freeze_trainable_layers
is for finetuning_type freeze). LLaMA-Factory 0.9.4 checks for deepspeed <= 0.16.9 when it starts a DeepSpeed
run (DISABLE_VERSION_CHECK=1 skips the check), said in the output's notes.
"""

from __future__ import annotations

import json
from typing import Any

from planner.emit.base import REGISTRY, EmitOptions, NotExpressibleError
from planner.emit.finetune import (DS_CONFIG_PATH, LEARNING_RATE, FinetuneFacts, ToolkitEmitter, check_finetune,
                                   deepspeed_json, fsdp2_settings, optimizer_name, recompute,
                                   to_yaml)
from planner.specs import Plan

FRAMEWORK = "LLaMA-Factory"
#: the LLaMA-Factory release whose arguments the YAML is written for (tests/emit/test_emit_llamafactory.py parses it)
LLAMAFACTORY_VERSION = "0.9.4"
CONFIG_PATH = "llamafactory.yaml"
ACCELERATE_CONFIG_PATH = "accelerate_fsdp2.yaml"
#: a starting data set (not part of the plan): the Alpaca sample LLaMA-Factory's data/dataset_info.json names
DATASET = "alpaca_en_demo"
OUTPUT_DIR = "saves/meshplan"
#: model preset prefix -> LLaMA-Factory chat template (its data/template.py names); `default` for another model
TEMPLATES = {"llama2-": "llama2", "llama3": "llama3", "mistral-": "mistral", "mixtral-": "mistral",
             "qwen2.5-": "qwen", "qwen3-": "qwen3", "gemma-2-": "gemma"}
DEFAULT_TEMPLATE = "default"


def template(model_name: str) -> str:
    """The chat template for the preset `model_name` (`DEFAULT_TEMPLATE` when none matches)."""
    return next((t for prefix, t in TEMPLATES.items() if model_name.startswith(prefix)), DEFAULT_TEMPLATE)


def config(plan: Plan, options: EmitOptions) -> tuple[FinetuneFacts, dict[str, Any], dict[str, str], str]:
    """(facts, the YAML's fields, every file to write by name, the launch command)."""
    ft = check_finetune(plan, options, FRAMEWORK)
    f, t = ft.facts, ft.facts.train

    def refuse(reason: str) -> None:
        raise NotExpressibleError(FRAMEWORK, reason)

    if t.adapters and t.lora_layers is not None:
        refuse(f"lora_layers {t.lora_layers}; LLaMA-Factory has no argument for peft's layers_to_transform "
               "(freeze_trainable_layers is for finetuning_type freeze)")
    pure_bf16 = t.adapters and t.adapter_precision == "bf16"
    if pure_bf16 and t.precision != "bf16":
        refuse(f"adapter_precision 'bf16' with precision {t.precision!r}; LLaMA-Factory's pure_bf16 trains in bf16")
    if pure_bf16 and f.strategy.zero_stage == 3 and ft.sharding == "deepspeed":
        refuse("adapter_precision 'bf16' with zero_stage 3; LLaMA-Factory refuses pure_bf16 beside DeepSpeed ZeRO-3")
    model = plan.model.name if options.hf_model is None else ""
    body: dict[str, Any] = {"model_name_or_path": ft.hf_model}
    if t.finetune == "qlora":
        body |= {"quantization_bit": 4, "quantization_method": "bnb", "quantization_type": "nf4",
                 "double_quantization": t.qlora_double_quant}
    body["flash_attn"] = "fa2"
    body |= {"stage": "sft", "do_train": True, "finetuning_type": "lora" if t.adapters else "full"}
    if t.adapters:
        body |= {"lora_rank": t.lora_rank, "lora_alpha": int(t.effective_lora_alpha), "lora_dropout": t.lora_dropout,
                 "lora_target": "all" if t.lora_target_modules is None else ",".join(t.lora_target_modules)}
        if pure_bf16:
            body["pure_bf16"] = True
    files: dict[str, str] = {}
    if ft.sharding == "deepspeed":
        body["deepspeed"] = DS_CONFIG_PATH
        files[DS_CONFIG_PATH] = json.dumps(deepspeed_json(ft, FRAMEWORK), indent=2) + "\n"
        ft.notes.append(f"LLaMA-Factory {LLAMAFACTORY_VERSION} checks for deepspeed <= 0.16.9 when it starts a "
                        "DeepSpeed run; DISABLE_VERSION_CHECK=1 skips that check for a newer DeepSpeed")
    body |= {"dataset": DATASET, "template": template(model), "cutoff_len": t.seq_len, "output_dir": OUTPUT_DIR,
             "per_device_train_batch_size": f.strategy.micro_batch_size,
             "gradient_accumulation_steps": f.num_microbatches,
             "learning_rate": LEARNING_RATE["adapters" if t.adapters else "full"], "num_train_epochs": 1.0,
             "optim": optimizer_name(ft), "bf16": t.precision == "bf16", "fp16": t.precision == "fp16",
             "disable_gradient_checkpointing": not recompute(ft), "torch_compile": t.torch_compile}
    ft.notes.append(f"not from the plan: the data set {DATASET} (LLaMA-Factory's data/dataset_info.json), learning "
                    f"rate, one epoch and output_dir {OUTPUT_DIR} are starting values to replace")
    files = {CONFIG_PATH: to_yaml(body), **files}
    multi = f.num_nodes > 1
    if ft.sharding == "fsdp2":
        files[ACCELERATE_CONFIG_PATH] = to_yaml(accelerate_config(ft))
        command = (f"accelerate launch --config_file {ACCELERATE_CONFIG_PATH} "
                   + ("--machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR " if multi else "")
                   + f"-m llamafactory.launcher {CONFIG_PATH}")
    else:
        command = ("FORCE_TORCHRUN=1 " + (f"NNODES={f.num_nodes} NODE_RANK=$NODE_RANK MASTER_ADDR=$MASTER_ADDR "
                                          if multi else "") + f"llamafactory-cli train {CONFIG_PATH}")
    where = f"on each of the {f.num_nodes} nodes; " if multi else ""
    return ft, body, files, f"{command}  ({where}LLaMA-Factory {LLAMAFACTORY_VERSION})"


def accelerate_config(ft: FinetuneFacts) -> dict[str, Any]:
    """accelerate's config file for an FSDP2 run over the plan's GPUs (accelerate.commands.config's ClusterConfig
    fields); each node's `machine_rank` is given on its command line."""
    f, t = ft.facts, ft.facts.train
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": t.precision,
            "num_machines": f.num_nodes, "num_processes": ft.plan.num_gpus, "machine_rank": 0,
            "main_training_function": "main", "rdzv_backend": "static", "same_network": True,
            "fsdp_config": fsdp2_settings(ft)}


REGISTRY.register(ToolkitEmitter("llamafactory", FRAMEWORK, config))
