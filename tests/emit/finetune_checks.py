"""Checks of the fine-tuning toolkits' configs against the real packages: Axolotl's pydantic schema,
LLaMA-Factory's argument parser, the Hugging Face Trainer's DeepSpeed integration with DeepSpeed's own
config class, and accelerate's config file and FSDP plugin."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from emit_checks import check_deepspeed
from planner.emit.base import facts
from planner.specs import Plan

#: the compute capability the Axolotl capability checks are run for (an H100: bf16 and FlashAttention-2)
SM = "sm_90"


def write_files(data: dict[str, Any], where: Path) -> dict[str, Path]:
    """Every file of an emitter's structured form written under `where`."""
    where.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in data["files"].items():
        assert "/" not in name
        paths[name] = where / name
        paths[name].write_text(text)
    return paths


def check_hf_deepspeed(plan: Plan, ds_path: Path, **training: Any) -> dict[str, Any]:
    """The DeepSpeed JSON as the Hugging Face Trainer completes it (its "auto" values from TrainingArguments that
    the toolkit's fields give), then read by DeepSpeed's own DeepSpeedConfig at the plan's data-parallel size."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(ds_path.parent / "out"), deepspeed=str(ds_path), report_to=[],
                             **training)
    return check_completed_deepspeed(plan, args.hf_deepspeed_config.config)


def check_completed_deepspeed(plan: Plan, config: dict[str, Any]) -> dict[str, Any]:
    """`config` (the Trainer's, filled for its one test process) at the plan's data-parallel size: the Trainer
    writes train_batch_size = world size × micro-batch × accumulation steps, the plan's global batch."""
    f = facts(plan)
    config = json.loads(json.dumps(config))
    assert config["train_batch_size"] == f.strategy.micro_batch_size * f.num_microbatches  # one process here
    config["train_batch_size"] *= f.dp
    assert not any(v == "auto" for v in _leaves(config)), config
    check_deepspeed(plan, config)
    return config


def _leaves(node: Any):
    if isinstance(node, dict):
        for v in node.values():
            yield from _leaves(v)
    else:
        yield node


def check_accelerate_fsdp2(plan: Plan, settings: dict[str, Any]) -> None:
    """FSDP2 settings as `accelerate launch` takes them (each key one of its options), turned into the environment
    its launcher sets for the processes, from which accelerate's own FSDP plugin is built."""
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--use_fsdp", "--num_processes", str(plan.num_gpus), "--num_machines", "1", "--machine_rank", "0",
            "--mixed_precision", plan.train.precision, "--dynamo_backend", "no"]
    for key, value in settings.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    args = launch_command_parser().parse_args(argv + ["train.py"])  # an unknown option exits the parser
    env = prepare_multi_gpu_env(args)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        plugin = FullyShardedDataParallelPlugin()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is (plan.strategy.zero_stage == 3)
    assert plugin.state_dict_type.name == "FULL_STATE_DICT" and plugin.cpu_ram_efficient_loading
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    # FSDP's own activation checkpointing for full recompute (the Trainer's would gather the parameters again)
    assert plugin.activation_checkpointing is (plan.strategy.recompute == "full")


def check_axolotl(plan: Plan, data: dict[str, Any], where: Path) -> Any:
    """Axolotl's own schema (with the GPU capability checks) accepts the YAML, and its fields are the plan's."""
    pytest.importorskip("axolotl.utils.schemas.config")
    import torch
    from axolotl.utils.schemas.config import AxolotlConfigWCapabilities

    paths = write_files(data, where)
    raw = yaml.safe_load(paths["axolotl.yaml"].read_text())
    assert raw == data["config"]
    f = facts(plan)
    s, t = f.strategy, plan.train
    cfg = AxolotlConfigWCapabilities(
        **raw, capabilities={"bf16": True, "n_gpu": plan.num_gpus, "n_node": f.num_nodes, "compute_capability": SM},
        env_capabilities={"torch_version": torch.__version__.split("+")[0]})
    assert cfg.sequence_len == t.seq_len and cfg.micro_batch_size == s.micro_batch_size
    assert cfg.micro_batch_size * cfg.gradient_accumulation_steps * s.dp == t.global_batch_size
    assert bool(cfg.bf16) == (t.precision == "bf16") and bool(cfg.fp16) == (t.precision == "fp16")
    fsdp2 = t.framework == "torchtitan" and s.zero_stage > 0
    assert cfg.gradient_checkpointing is (s.recompute == "full" and not fsdp2) and cfg.flash_attention
    assert cfg.optimizer == ("paged_adamw_32bit" if t.paged_optimizer else "adamw_torch")
    if t.adapters:
        assert cfg.adapter == t.finetune and cfg.lora_r == t.lora_rank and cfg.lora_alpha == t.effective_lora_alpha
        assert cfg.lora_dropout == t.lora_dropout
        assert bool(cfg.load_in_4bit) == (t.finetune == "qlora")
        if t.lora_target_modules is None:
            assert cfg.lora_target_linear
        else:
            assert cfg.lora_target_modules == t.lora_target_modules
        assert cfg.peft_layers_to_transform == (sorted(t.lora_layers) if t.lora_layers else None)
        assert not (cfg.lora_mlp_kernel or cfg.lora_qkv_kernel or cfg.lora_o_kernel)
        if t.finetune == "qlora":
            assert cfg.bnb_config_kwargs == {"bnb_4bit_quant_type": "nf4",
                                             "bnb_4bit_use_double_quant": t.qlora_double_quant}
    else:
        assert cfg.adapter is None and not cfg.load_in_4bit
    if t.framework == "deepspeed":
        assert cfg.deepspeed == "ds_config.json" and cfg.fsdp is None
        check_hf_deepspeed(plan, paths["ds_config.json"], per_device_train_batch_size=cfg.micro_batch_size,
                           gradient_accumulation_steps=cfg.gradient_accumulation_steps, bf16=bool(cfg.bf16),
                           fp16=bool(cfg.fp16))
    elif s.zero_stage:
        assert cfg.deepspeed is None and cfg.fsdp == ["full_shard", "auto_wrap"]
        assert str(cfg.fsdp_config["fsdp_version"]) == "2"
        check_accelerate_fsdp2(plan, cfg.fsdp_config)
    else:
        assert cfg.deepspeed is None and cfg.fsdp is None and cfg.fsdp_config is None
    return cfg


def check_llamafactory(plan: Plan, data: dict[str, Any], where: Path) -> tuple:
    """LLaMA-Factory's own argument parser (its dataclasses through HfArgumentParser, unknown keys refused, then
    its model-argument checks) accepts the YAML, and the parsed arguments are the plan's.

    Its import-time version check is turned off (DISABLE_VERSION_CHECK, its own switch): the environment holds the
    peft that Colossal-AI pins, older than LLaMA-Factory asks for; the arguments do not depend on it."""
    os.environ["DISABLE_VERSION_CHECK"] = "1"
    pytest.importorskip("llamafactory.hparams.parser")
    from llamafactory.hparams.parser import _parse_train_args, _verify_model_args

    paths = write_files(data, where)
    raw = yaml.safe_load(paths["llamafactory.yaml"].read_text())
    assert raw == data["config"]
    f = facts(plan)
    s, t = f.strategy, plan.train
    args = dict(raw, output_dir=str(where / raw["output_dir"]))
    if "deepspeed" in args:
        args["deepspeed"] = str(paths[args["deepspeed"]])
    model, data_args, training, finetuning, _ = _parse_train_args(args)
    _verify_model_args(model, data_args, finetuning)
    assert data_args.cutoff_len == t.seq_len and data_args.dataset == [raw["dataset"]]
    assert training.per_device_train_batch_size == s.micro_batch_size
    assert training.per_device_train_batch_size * training.gradient_accumulation_steps * s.dp == t.global_batch_size
    assert training.bf16 == (t.precision == "bf16") and training.fp16 == (t.precision == "fp16")
    fsdp2 = t.framework == "torchtitan" and s.zero_stage > 0
    assert model.disable_gradient_checkpointing == (s.recompute != "full" or fsdp2)
    assert _text(model.flash_attn) == "fa2" and training.torch_compile == t.torch_compile
    assert training.optim.value == ("paged_adamw_32bit" if t.paged_optimizer else "adamw_torch")
    assert finetuning.finetuning_type == ("lora" if t.adapters else "full")
    if t.adapters:
        assert finetuning.lora_rank == t.lora_rank and finetuning.lora_alpha == t.effective_lora_alpha
        assert finetuning.lora_dropout == t.lora_dropout
        assert finetuning.lora_target == (["all"] if t.lora_target_modules is None else t.lora_target_modules)
        assert finetuning.pure_bf16 == (t.adapter_precision == "bf16")
    assert model.quantization_bit == (4 if t.finetune == "qlora" else None)
    if t.finetune == "qlora":
        assert model.quantization_type == "nf4" and model.double_quantization == t.qlora_double_quant
    if t.framework == "deepspeed":
        check_completed_deepspeed(plan, training.hf_deepspeed_config.config)
    else:
        assert training.deepspeed is None
    if t.framework == "torchtitan" and s.zero_stage:
        from accelerate.commands.config.config_args import ClusterConfig

        cluster = ClusterConfig.from_yaml_file(str(paths["accelerate_fsdp2.yaml"]))
        assert _text(cluster.distributed_type) == "FSDP" and cluster.num_processes == plan.num_gpus
        assert cluster.num_machines == f.num_nodes and _text(cluster.mixed_precision) == t.precision
        check_accelerate_fsdp2(plan, cluster.fsdp_config)
    else:
        assert "accelerate_fsdp2.yaml" not in paths
    return model, data_args, training, finetuning


def _text(value: Any) -> str:
    """An enum member's value, or a plain string (the packages keep some choices as either)."""
    return str(getattr(value, "value", value))
