"""Axolotl (0.9.2): the training YAML, with the DeepSpeed JSON it references or its FSDP2 settings.

Mapping (Axolotl's field names; its schema is axolotl.utils.schemas.config.AxolotlInputConfig):
- model: `base_model`, the Hugging Face id of the plan's model preset (planner.emit.finetune.HF_MODELS) or
  `EmitOptions.hf_model`.
- finetune lora / qlora: `adapter: lora|qlora`; qlora adds `load_in_4bit: true` and `bnb_config_kwargs`
  (NF4, double quantisation as planned; the compute dtype is the run's bf16/fp16, Axolotl's torch_dtype).
  `lora_r`, `lora_alpha` (an integer), `lora_dropout`; `lora_target_linear: true` for every linear layer
  (peft's all-linear, the output layer left out) or `lora_target_modules`; `peft_layers_to_transform` for
  lora_layers. Axolotl's fused LoRA kernels (`lora_*_kernel`), which it turns on by itself for dropout 0, are
  turned off: the plan costs peft's own modules. finetune full: no adapter.
- batch: `micro_batch_size`, `gradient_accumulation_steps` = global batch / (micro-batch × dp).
- `sequence_len`; `bf16` or `fp16`; `gradient_checkpointing` for full recompute (under FSDP2 its own
  `fsdp_activation_checkpointing`); `flash_attention: true`;
  `torch_compile` as costed; `optimizer`: adamw_torch, or paged_adamw_32bit for paged_optimizer.
- sharding: framework deepspeed -> `deepspeed: ds_config.json` (the plan's ZeRO stage and offload);
  framework torchtitan -> FSDP2 (`fsdp: [full_shard, auto_wrap]`, `fsdp_config.fsdp_version: 2`) for zero_stage
  1-3, plain DDP for zero_stage 0.

torch_compile under DeepSpeed is refused (Axolotl's schema wants it in the DeepSpeed config instead).
adapter_precision bf16 is refused: Axolotl keeps peft's adapters in fp32 (autocast_adapter_dtype) and has no
setting for 16-bit ones. The rest of what is refused is planner.emit.finetune.check_finetune's.
"""

from __future__ import annotations

import json
from typing import Any

from planner.emit.base import REGISTRY, EmitOptions, NotExpressibleError
from planner.emit.finetune import (DS_CONFIG_PATH, LEARNING_RATE, FinetuneFacts, ToolkitEmitter, check_finetune,
                                   deepspeed_json, fsdp2_settings, optimizer_name, recompute,
                                   to_yaml)
from planner.specs import Plan

FRAMEWORK = "Axolotl"
#: the Axolotl release whose schema the YAML is written for (tests/emit/test_emit_axolotl.py validates it)
AXOLOTL_VERSION = "0.9.2"
CONFIG_PATH = "axolotl.yaml"
#: a starting data set (not part of the plan): Axolotl's own examples' small Alpaca sample
DATASET = {"path": "mhenrichsen/alpaca_2k_test", "type": "alpaca"}
OUTPUT_DIR = "./outputs/meshplan"
#: Axolotl's fused LoRA kernels, which it enables on its own for LoRA without dropout
LORA_KERNELS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")


def config(plan: Plan, options: EmitOptions) -> tuple[FinetuneFacts, dict[str, Any], dict[str, str], str]:
    """(facts, the YAML's fields, every file to write by name, the launch command)."""
    ft = check_finetune(plan, options, FRAMEWORK)
    f, t = ft.facts, ft.facts.train
    if t.adapters and t.adapter_precision == "bf16":
        raise NotExpressibleError(FRAMEWORK, "adapter_precision 'bf16'; Axolotl keeps peft's adapters in fp32 "
                                             "(autocast_adapter_dtype) and has no setting for 16-bit ones")
    if t.torch_compile and ft.sharding == "deepspeed":
        raise NotExpressibleError(FRAMEWORK, "torch_compile with framework deepspeed; the plan is costed with fused "
                                             "element-wise work (torch.compile for the Hugging Face model), which "
                                             "Axolotl's schema refuses beside DeepSpeed: plan with framework "
                                             "torchtitan (FSDP2), or LoRA/QLoRA (eager)")
    body: dict[str, Any] = {"base_model": ft.hf_model}
    if t.adapters:
        if t.finetune == "qlora":
            body |= {"load_in_4bit": True, "adapter": "qlora",
                     "bnb_config_kwargs": {"bnb_4bit_quant_type": "nf4",
                                           "bnb_4bit_use_double_quant": t.qlora_double_quant}}
        else:
            body["adapter"] = "lora"
        body |= {"lora_r": t.lora_rank, "lora_alpha": int(t.effective_lora_alpha), "lora_dropout": t.lora_dropout}
        if t.lora_target_modules is None:
            body["lora_target_linear"] = True
        else:
            body["lora_target_modules"] = list(t.lora_target_modules)
        if t.lora_layers is not None:
            body["peft_layers_to_transform"] = sorted(t.lora_layers)
        body |= {k: False for k in LORA_KERNELS}
    body |= {"datasets": [dict(DATASET)], "output_dir": OUTPUT_DIR,
             "sequence_len": t.seq_len, "micro_batch_size": f.strategy.micro_batch_size,
             "gradient_accumulation_steps": f.num_microbatches, "num_epochs": 1,
             "learning_rate": LEARNING_RATE["adapters" if t.adapters else "full"], "optimizer": optimizer_name(ft),
             "bf16": t.precision == "bf16", "fp16": t.precision == "fp16",
             "gradient_checkpointing": recompute(ft), "flash_attention": True, "torch_compile": t.torch_compile}
    files: dict[str, str] = {}
    if ft.sharding == "deepspeed":
        body["deepspeed"] = DS_CONFIG_PATH
        files[DS_CONFIG_PATH] = json.dumps(deepspeed_json(ft, FRAMEWORK), indent=2) + "\n"
    elif ft.sharding == "fsdp2":
        body |= {"fsdp": ["full_shard", "auto_wrap"], "fsdp_config": fsdp2_settings(ft)}
    ft.notes.append(f"not from the plan: the data set {DATASET['path']} ({DATASET['type']}), learning rate, one "
                    f"epoch and output_dir {OUTPUT_DIR} are starting values to replace")
    files = {CONFIG_PATH: to_yaml(body), **files}
    where = (f"on each of the {f.num_nodes} nodes, with accelerate's machine rank and main process address; "
             if f.num_nodes > 1 else "")
    return ft, body, files, f"axolotl train {CONFIG_PATH}  ({where}Axolotl {AXOLOTL_VERSION})"


REGISTRY.register(ToolkitEmitter("axolotl", FRAMEWORK, config))
