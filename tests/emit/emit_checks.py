"""Real-library checks of emitted output, shared by the per-backend, snapshot and contract tests.

Each `check_*` feeds what a user would paste to the framework's own parser or
constructor and asserts the framework ends up with the plan's numbers. The
frameworks are imported lazily so the module imports everywhere; the tests
call `pytest.importorskip` first.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import re
import subprocess
import sys
import tomllib
import types
from functools import lru_cache
from pathlib import Path
from typing import Any

from planner.emit.base import facts
from planner.emit.megatron import core_config_kwargs, expand_pattern, parse_args
from planner.specs import Plan

DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


# ---- Megatron-LM / megatron-core -----------------------------------------------------------
def megatron_configs(argv: list[str]) -> dict[str, Any]:
    """megatron-core's own config objects, built from emitted flags through the emitter's mapping table."""
    import torch
    import torch.nn.functional as F
    from megatron.core import ModelParallelConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    def resolve(kw: dict[str, Any]) -> dict[str, Any]:
        out = dict(kw)
        for key in ("params_dtype", "pipeline_dtype"):
            if key in out:
                out[key] = getattr(torch, out[key])
        if out.get("activation_func") == "silu":
            out["activation_func"] = F.silu
        elif out.get("activation_func") == "squared_relu":  # Megatron-LM's --squared-relu
            from megatron.core.activations import squared_relu
            out["activation_func"] = squared_relu
        elif out.get("activation_func") == "quick_gelu":  # Megatron-LM's --quick-geglu
            from megatron.core.fusions.fused_bias_geglu import quick_gelu
            out["activation_func"] = quick_gelu
        if "attention_backend" in out:
            out["attention_backend"] = AttnBackend[out["attention_backend"]]
        return out

    kw = core_config_kwargs(parse_args(argv))
    # The precision-aware optimizer (needed for CPU offload) asks Transformer Engine for its version
    # while validating; without TE (a CPU test machine) OptimizerConfig cannot be built for it.
    te_needed = kw["optimizer"]["use_precision_aware_optimizer"] and importlib.util.find_spec("transformer_engine") is None
    return {
        "parallel": ModelParallelConfig(**resolve(kw["parallel"])),
        "transformer": (MLATransformerConfig if kw["transformer"].get("multi_latent_attention")
                        else TransformerConfig)(**resolve(kw["transformer"])),
        "ddp": DistributedDataParallelConfig(**kw["ddp"]),
        "optimizer": None if te_needed else OptimizerConfig(**resolve(kw["optimizer"])),
        "gpt": kw["gpt"],
        "training": kw["training"],
        "initialize": kw["initialize"],
        "args": parse_args(argv),
    }


def check_megatron(plan: Plan, argv: list[str]) -> None:
    f = facts(plan)
    s, m, t = f.strategy, plan.model, plan.train
    cfg = megatron_configs(argv)
    par, tc, ddp, opt, args = cfg["parallel"], cfg["transformer"], cfg["ddp"], cfg["optimizer"], cfg["args"]
    for c in (par, tc):
        assert c.tensor_model_parallel_size == s.tp
        assert c.pipeline_model_parallel_size == s.pp
        assert c.virtual_pipeline_model_parallel_size == (s.vpp if s.vpp > 1 else None)
        assert c.context_parallel_size == s.cp
        assert c.expert_model_parallel_size == s.ep
        assert c.sequence_parallel == s.sequence_parallel
        assert c.bf16 == (t.precision != "fp16") and c.fp16 == (t.precision == "fp16")
    assert tc.num_layers_in_first_pipeline_stage == s.num_layers_in_first_stage
    assert tc.num_layers_in_last_pipeline_stage == s.num_layers_in_last_stage
    check_megatron_split(plan, tc)
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (m.num_layers, m.hidden_size, m.ffn_hidden_size)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (m.num_attention_heads, m.kv_heads, m.head_size)
    assert tc.gated_linear_unit == m.gated_mlp
    if m.gated_mlp:  # quick-GEGLU where the model has it, SwiGLU for the rest (GeGLU is reported as dropped)
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        assert (tc.activation_func is quick_gelu) == (m.glu_activation == "quick_gelu")
    assert tc.normalization == {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}[m.norm]
    assert tc.add_bias_linear == m.linear_bias and tc.add_qkv_bias == (m.linear_bias or m.qkv_bias)
    expected_recompute = {"none": (None, None, None), "selective": ("selective", None, None),
                          "full": ("full", "uniform" if s.recompute_num_layers is None else "block",
                                   s.recompute_num_layers or 1)}[s.recompute]
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == expected_recompute
    check_megatron_activation_offload(plan, tc)
    assert tc.cross_entropy_loss_fusion == t.cross_entropy_fusion
    assert tc.cross_entropy_fusion_impl == (t.cross_entropy_fusion_impl if t.cross_entropy_fusion else "native")
    assert tc.fp8 == ("hybrid" if t.precision == "fp8" else None)
    assert tc.fp8_param == ddp.fp8_param_gather == t.fp8_param_gather  # FP8 parameters, gathered in FP8
    assert ddp.reuse_grad_buf_for_mxfp8_param_ag == (t.fp8_param_gather and t.fp8_recipe == "mxfp8"
                                                      and s.zero_stage == 1)
    assert ddp.use_distributed_optimizer == (s.zero_stage >= 1)
    assert ddp.use_megatron_fsdp == (s.zero_stage >= 2)
    assert ddp.data_parallel_sharding_strategy == {0: "no_shard", 1: "no_shard", 2: "optim_grads",
                                                   3: "optim_grads_params"}[s.zero_stage]
    assert ddp.overlap_grad_reduce == s.overlap_grad_reduce
    assert ddp.overlap_param_gather == (s.overlap_grad_reduce and s.overlap_param_gather and s.zero_stage >= 1)
    assert ddp.grad_reduce_in_fp32 == (t.grad_precision == "fp32")
    if opt is not None:
        assert opt.optimizer == t.optimizer and opt.optimizer_cpu_offload == s.offload_optimizer
        assert opt.use_distributed_optimizer == (s.zero_stage >= 1)
    else:
        assert s.offload_optimizer and args["optimizer_cpu_offload"] and args["use_precision_aware_optimizer"]
    assert cfg["training"] == {"micro_batch_size": s.micro_batch_size, "global_batch_size": t.global_batch_size,
                               "seq_length": t.seq_len}
    assert cfg["gpt"]["share_embeddings_and_output_weights"] == m.tie_embeddings
    check_megatron_moe_and_attention(plan, tc)
    if opt is not None and s.offload_optimizer:
        assert opt.optimizer_offload_fraction == 1.0 and opt.use_precision_aware_optimizer
    megatron_lm_argument_rules(plan, args)


def check_megatron_moe_and_attention(plan: Plan, tc) -> None:
    """The MoE layers, latent attention, query/key norms and attention windows megatron-core builds are the model's:
    which layers are MoE (`get_transformer_layer_spec`'s reading of moe_layer_freq) and which attend
    locally (`is_layer_window_attention`), the expert, shared-expert and MLA widths, ep and etp."""
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.utils import is_layer_window_attention

    m, s = plan.model, facts(plan).strategy
    # per-head query/key norms are megatron-core's q_layernorm / k_layernorm; OLMo 2's whole-width ones it cannot build
    assert tc.qk_layernorm == (m.qk_norm == "per_head")
    if m.is_moe:
        assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == (m.num_experts, m.moe_top_k,
                                                                                     m.expert_ffn)
        assert (tc.expert_model_parallel_size, tc.expert_tensor_parallel_size) == (s.ep, s.etp)
        freq = tc.moe_layer_freq
        built = [i % freq == 0 for i in range(m.num_layers)] if isinstance(freq, int) else [bool(x) for x in freq]
        assert tuple(built) == m.moe_layer_mask()
        shared = m.num_shared_experts * m.shared_expert_ffn if m.num_shared_experts else None
        assert tc.moe_shared_expert_intermediate_size == shared
        alltoall = plan.train.moe_dispatcher == "alltoall"
        assert tc.moe_shared_expert_overlap == (bool(m.num_shared_experts) and alltoall and not s.overlap_moe_comm)
        assert tc.moe_token_dispatcher_type == ("alltoall" if alltoall else "flex") and tc.moe_grouped_gemm
        if not alltoall:
            assert tc.moe_flex_dispatcher_backend == plan.train.moe_dispatcher
        assert (tc.moe_router_num_groups or 0, tc.moe_router_group_topk or 0) == (m.moe_router_num_groups,
                                                                                  m.moe_router_group_topk)
        if s.tp > 1:
            assert tc.sequence_parallel  # megatron-core's MoELayer.forward raises without it
    else:
        assert tc.num_moe_experts is None and tc.moe_shared_expert_intermediate_size is None
    assert (tc.mtp_num_layers or 0) == m.num_mtp_layers
    assert isinstance(tc, MLATransformerConfig) == m.is_mla == tc.multi_latent_attention
    if m.is_mla:
        assert (tc.q_lora_rank, tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim) == (
            m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
    local = tuple(is_layer_window_attention(tc.window_size, tc.window_attn_skip_freq, i + 1)
                  for i in range(m.num_layers))
    assert local == m.local_attention_mask()
    if any(local):
        assert tc.window_size == (m.sliding_window - 1, 0)
    assert (tc.softmax_type == "learnable") == m.attention_sinks


def check_megatron_activation_offload(plan: Plan, tc) -> None:
    """megatron-core offloads the activations (not the weights) of the plan's offload_activation_layers,
    the first ones of the model (TransformerBlock hands cpu_offloading_num_layers to Transformer Engine's
    offload context), and nothing when the plan does not offload."""
    n = facts(plan).strategy.offload_activation_layers or 0
    assert tc.cpu_offloading == (n > 0) and tc.cpu_offloading_num_layers == n
    assert tc.cpu_offloading_activations and not tc.cpu_offloading_weights
    if n:  # what TransformerConfig.__post_init__ allowed: below num_layers, pp 1, no recomputation
        assert n < tc.num_layers and tc.pipeline_model_parallel_size == 1 and tc.recompute_granularity is None


def check_megatron_split(plan: Plan, tc) -> None:
    """megatron-core builds, on every (pipeline rank, virtual stage), the layers the plan's
    `ParallelLayout` puts there: `get_num_layers_to_build` for the first/last-stage and
    embedding/loss-as-layer splits, the parsed `pipeline_model_parallel_layout` for an explicit one."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    f = facts(plan)
    s = f.strategy
    assert tc.account_for_embedding_in_pipeline_split == s.embedding_as_layer
    assert tc.account_for_loss_in_pipeline_split == s.loss_as_layer
    layout = tc.pipeline_model_parallel_layout
    assert (layout is not None) == (s.stage_layers is not None)
    built = {}
    for r in range(s.pp):
        for c in range(s.vpp):
            if layout is not None:
                built[c * s.pp + r] = layout.layout[r][c].count(LayerType.decoder)
            else:
                built[c * s.pp + r] = get_num_layers_to_build(tc, vp_stage=c if s.vpp > 1 else None, pp_rank=r)
    assert [built[i] for i in range(s.pp * s.vpp)] == f.layers_per_chunk(), (built, f.layers_per_chunk())


def megatron_lm_argument_rules(plan: Plan, args: dict[str, Any]) -> None:
    """Megatron-LM's `validate_args` rules that megatron-core's dataclasses do not repeat
    (megatron/training/arguments.py, core_r0.16)."""
    s = facts(plan).strategy
    if args.get("overlap_param_gather"):
        assert args.get("use_distributed_optimizer") and args.get("overlap_grad_reduce")
    if args.get("optimizer_cpu_offload"):
        assert args.get("use_precision_aware_optimizer") and args.get("use_distributed_optimizer")
        assert not args.get("fp8_param_gather") or args.get("fp8_recipe") == "delayed"
    if args.get("fp8_param_gather"):  # "only supported with distributed optimizer, torch fsdp2, megatron fsdp, ..."
        assert args.get("use_distributed_optimizer") or args.get("use_megatron_fsdp")
    if args.get("use_megatron_fsdp"):
        assert args.get("ckpt_format") == "fsdp_dtensor" and args.get("use_distributed_optimizer")
    if args.get("decoder_first_pipeline_num_layers") or args.get("decoder_last_pipeline_num_layers"):
        assert "num_layers_per_virtual_pipeline_stage" not in args  # only --num-virtual-stages-per-pipeline-rank
    vpp_flags = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                 "pipeline_model_parallel_layout")
    assert sum(k in args for k in vpp_flags) <= 1  # "No more than one of the following arguments ..."
    if "pipeline_model_parallel_layout" in args:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        stages = PipelineParallelLayerLayout.get_num_stages_from_str(args["pipeline_model_parallel_layout"])
        assert stages % args["pipeline_model_parallel_size"] == 0 and stages == s.pp * s.vpp
    if s.cp > 1:
        assert args["seq_length"] % (2 * s.cp) == 0
    assert args["max_position_embeddings"] >= args["seq_length"]
    if args.get("recompute_granularity") == "selective":
        assert "recompute_method" not in args
    assert not (args.get("bf16") and args.get("fp16"))
    if args.get("expert_model_parallel_size", 1) > 1:
        assert args.get("num_experts") and args["num_experts"] % args["expert_model_parallel_size"] == 0
    if args.get("mtp_num_layers"):
        assert args["position_embedding_type"] in ("rope", "none")
    if args.get("multi_latent_attention"):
        assert not args.get("group_query_attention")
    for key in ("moe_layer_freq", "window_attn_skip_freq"):  # moe_freq_type: an int or a list expression
        if isinstance(args.get(key), str):
            assert not re.search(r"[^,\d\[\]\(\)\+\*]", args[key]), args[key]
            assert len(expand_pattern(args[key])) == plan.model.num_layers


def check_bridge(plan: Plan, overrides: list[str], bridge_version: str = "0.6") -> None:
    """Megatron-Bridge overrides: every key is a field of the megatron-core dataclass its section
    holds (Megatron-Bridge itself is not installed), and the dataclasses build from them. The dataset
    takes the sequence length in `seq_length` on 0.6.0 and in megatron-core's `sequence_length` on 0.3.1."""
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    sections: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, raw = item.split("=", 1)
        section, _, field = key.partition(".")
        sections.setdefault(section, {})[field or section] = _hydra(raw)
    model = dict(sections["model"])
    provider_extras = {k: model.pop(k) for k in ("seq_length", "position_embedding_type",
                                                 "share_embeddings_and_output_weights")}
    config_class = MLATransformerConfig if model.get("multi_latent_attention") else TransformerConfig
    fields = set(config_class.__dataclass_fields__)
    assert set(model) <= fields, set(model) - fields
    if "window_size" in model:
        model["window_size"] = tuple(model["window_size"])  # OmegaConf hands a list to the Tuple field
    recipe = sections["mixed_precision"]["mixed_precision"]
    dtype = torch.float16 if recipe.startswith("fp16") else torch.bfloat16
    model |= {"params_dtype": dtype, "pipeline_dtype": dtype, "bf16": dtype == torch.bfloat16,
              "fp16": dtype == torch.float16}
    if model.get("gated_linear_unit"):
        model["activation_func"] = F.silu
    tc = config_class(**model)
    ddp = DistributedDataParallelConfig(**sections["ddp"])
    if not (sections["optimizer"]["use_precision_aware_optimizer"]
            and importlib.util.find_spec("transformer_engine") is None):  # see megatron_configs
        OptimizerConfig(**sections["optimizer"], bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                        params_dtype=dtype)
    s, t = facts(plan).strategy, plan.train
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size, tc.context_parallel_size) == (s.tp, s.pp, s.cp)
    check_megatron_split(plan, tc)
    check_megatron_moe_and_attention(plan, tc)
    check_megatron_activation_offload(plan, tc)
    if s.offload_optimizer:
        assert sections["optimizer"]["optimizer_cpu_offload"] and sections["optimizer"]["optimizer_offload_fraction"] == 1.0
    assert tc.virtual_pipeline_model_parallel_size == (s.vpp if s.vpp > 1 else None)
    assert ddp.use_distributed_optimizer == (s.zero_stage >= 1)
    assert sections["train"] == {"micro_batch_size": s.micro_batch_size, "global_batch_size": t.global_batch_size}
    dataset_key = {"0.6": "seq_length", "0.3": "sequence_length"}[bridge_version]
    assert sections["dataset"] == {dataset_key: t.seq_len} and provider_extras["seq_length"] == t.seq_len


def _hydra(raw: str) -> Any:
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':  # a quoted string (Hydra's grammar)
        return raw[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    if raw in ("true", "false"):
        return raw == "true"
    if raw == "null":
        return None
    if raw.startswith("[") and raw.endswith("]"):  # a Hydra list of numbers
        return [_hydra(item) for item in raw[1:-1].split(",")] if raw != "[]" else []
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


# ---- DeepSpeed -------------------------------------------------------------------------------
class ModelParallelUnit:
    """The mpu interface DeepSpeed reads its data-parallel world size from (what Megatron-DeepSpeed passes)."""

    def __init__(self, dp: int, tp: int, pp: int) -> None:
        self.dp, self.tp, self.pp = dp, tp, pp

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_rank(self) -> int:
        return 0


class ProcessGroupUnit(ModelParallelUnit):
    """The mpu with process groups, for `deepspeed.initialize`: it reports the plan's degrees while
    every group is the one-process gloo world (the engine sizes its batch rules from the mpu's
    world sizes and builds its optimizer partitions on the groups)."""

    def get_data_parallel_group(self):
        import torch.distributed as dist

        return dist.group.WORLD

    def get_model_parallel_group(self):
        import torch.distributed as dist

        return dist.group.WORLD

    get_tensor_model_parallel_group = get_model_parallel_group


def check_deepspeed_initialize(plan: Plan, config: dict[str, Any]) -> Any:
    """`deepspeed.initialize` builds an engine from the config at the plan's data-parallel world size
    (a small model; the client optimizer is what the plan's training code passes: DeepSpeedCPUAdam
    with optimizer offload, AdamW otherwise) and the engine holds the plan's numbers. With pp > 1 the
    engine is the plain one: a PipelineEngine needs a PipelineModule over real pp ranks."""
    import deepspeed
    import torch

    f = facts(plan)
    s, t = f.strategy, plan.train
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    if s.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(model.parameters())
    else:
        optimizer = torch.optim.AdamW(model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=json.loads(json.dumps(config)),
                                           mpu=ProcessGroupUnit(f.dp, s.tp, s.pp))
    assert engine.dp_world_size == f.dp
    assert engine.train_batch_size() == t.global_batch_size
    assert engine.train_micro_batch_size_per_gpu() == s.micro_batch_size
    assert engine.gradient_accumulation_steps() == f.num_microbatches
    assert engine.zero_optimization_stage() == s.zero_stage
    assert engine.bfloat16_enabled() == (t.precision == "bf16") and engine.fp16_enabled() == (t.precision == "fp16")
    model_dtype, accum_dtype = engine.get_data_types()
    if t.precision == "bf16":
        assert accum_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[t.grad_precision]
    assert engine.communication_data_type == {"fp32": torch.float32, "bf16": torch.bfloat16,
                                              "fp16": torch.float16}[t.grad_precision]
    return engine


def check_deepspeed(plan: Plan, config: dict[str, Any], launcher_args: list[str] | None = None) -> None:
    """DeepSpeed's own config parser, for the plan's data-parallel world size, derives the plan's numbers."""
    from deepspeed.runtime.config import DeepSpeedConfig

    f = facts(plan)
    s, t = f.strategy, plan.train
    assert not s.offload_activation_layers  # DeepSpeed has no activation offloading without recomputation: refused
    parsed = DeepSpeedConfig(json.loads(json.dumps(config)), mpu=ModelParallelUnit(f.dp, s.tp, s.pp))
    assert parsed.world_size == f.dp
    assert parsed.train_batch_size == t.global_batch_size
    assert parsed.train_micro_batch_size_per_gpu == s.micro_batch_size
    assert parsed.gradient_accumulation_steps == f.num_microbatches
    assert parsed.zero_optimization_stage == s.zero_stage
    assert parsed.bfloat16_config.enabled == (t.precision == "bf16")
    assert parsed.float16_config.enabled == (t.precision == "fp16")
    offload = parsed.zero_config.offload_optimizer
    assert (offload is not None and str(offload.device).endswith("cpu")) == s.offload_optimizer
    if s.zero_stage:
        assert parsed.zero_config.overlap_comm == s.overlap_grad_reduce
    if s.pp > 1:
        assert parsed.pipeline["activation_checkpoint_interval"] == (1 if s.recompute == "full" else 0)
        assert s.zero_stage < 2  # DeepSpeed's PipelineEngine asserts this at start-up
    if launcher_args is not None:
        check_megatron_deepspeed_args(plan, launcher_args)


def check_megatron_deepspeed_args(plan: Plan, argv: list[str]) -> None:
    import deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    known, rest = parser.parse_known_args(argv)
    assert known.deepspeed and known.deepspeed_config == "ds_config.json"
    s = facts(plan).strategy
    pairs = dict(zip(rest, rest[1:]))
    assert int(pairs["--tensor-model-parallel-size"]) == s.tp and int(pairs["--pipeline-model-parallel-size"]) == s.pp
    assert int(pairs["--zero-stage"]) == s.zero_stage and int(pairs["--micro-batch-size"]) == s.micro_batch_size
    assert ("--no-pipeline-parallel" in rest) == (s.pp == 1)


# ---- Colossal-AI -----------------------------------------------------------------------------------
def colossalai_kwargs(spec: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The plugin class and its keyword arguments with the JSON placeholders made real."""
    import torch
    from colossalai.booster import plugin as plugins
    from colossalai.shardformer import PipelineGradientCheckpointConfig

    kwargs = dict(spec["kwargs"])
    if "communication_dtype" in kwargs:
        kwargs["communication_dtype"] = getattr(torch, kwargs["communication_dtype"])
    if "gradient_checkpoint_config" in kwargs:
        kwargs["gradient_checkpoint_config"] = PipelineGradientCheckpointConfig(
            **kwargs["gradient_checkpoint_config"]["PipelineGradientCheckpointConfig"])
    return getattr(plugins, spec["plugin"]), kwargs


def check_colossalai(plan: Plan, spec: dict[str, Any]) -> None:
    """Bind the kwargs to the real constructor (no unknown or missing argument), plus the
    constructor's own assertions that do not need a process group."""
    from colossalai.booster.plugin.hybrid_parallel_plugin import SUPPORT_SP_MODE

    cls, kwargs = colossalai_kwargs(spec)
    inspect.signature(cls.__init__).bind(object(), **kwargs)
    f = facts(plan)
    s = f.strategy
    assert not s.offload_activation_layers  # no plugin offloads activations: refused
    if spec["plugin"] in ("HybridParallelPlugin", "MoeHybridParallelPlugin"):
        assert (kwargs["tp_size"], kwargs["pp_size"]) == (s.tp, s.pp)
        if spec["plugin"] == "MoeHybridParallelPlugin":
            # the constructor's own rules: dp = world / (tp·pp·sp) divisible by ep_size; expert
            # tensors sharded over the whole tp group
            assert plan.model.is_moe and kwargs["ep_size"] == s.ep and s.etp == s.tp
            assert (plan.num_gpus // (s.tp * s.pp * (kwargs.get("sp_size") or 1))) % kwargs["ep_size"] == 0
            assert kwargs["moe_dp_outside"] is False
        else:
            assert s.ep == 1
        assert kwargs["zero_stage"] in (0, 1, 2) and kwargs["zero_stage"] == s.zero_stage
        if kwargs.get("enable_sequence_parallelism"):
            assert kwargs["sequence_parallelism_mode"] in SUPPORT_SP_MODE
        sp = kwargs.get("sp_size") or 1
        assert plan.num_gpus // (s.tp * s.pp * sp) == f.dp  # the plugin derives dp from the world size
        if s.pp > 1:
            assert kwargs["zero_stage"] <= 1
            assert kwargs["num_microbatches"] * kwargs["microbatch_size"] == f.local_batch_size()
            assert (kwargs.get("pp_style", "1f1b") == "interleaved") == (s.vpp > 1)
            assert kwargs.get("num_model_chunks", 1) == s.vpp
            if "num_layers_per_stage" in kwargs:
                assert len(kwargs["num_layers_per_stage"]) == s.pp
                assert sum(kwargs["num_layers_per_stage"]) == plan.model.num_layers
        ckpt = kwargs.get("gradient_checkpoint_config")
        if ckpt is not None:
            for stage in range(s.pp):
                for chunk in range(s.vpp):
                    n = ckpt.get_num_ckpt_layers(stage, s.pp, plan.model.num_layers, chunk, s.vpp)
                    assert 0 < n <= f.layers_per_chunk()[chunk * s.pp + stage]
    elif spec["plugin"] == "LowLevelZeroPlugin":
        assert kwargs["stage"] == s.zero_stage in (1, 2) and s.tp == s.pp == s.cp == 1 and s.ep == 1
        assert kwargs["cpu_offload"] == s.offload_optimizer
    else:
        assert spec["plugin"] == "GeminiPlugin" and s.zero_stage == 3 and kwargs["tp_size"] == s.tp and s.ep == 1
        assert kwargs["offload_optim_frac"] == (1.0 if s.offload_optimizer else 0.0)
    batch = spec["training"]["dataloader_batch_size"] * spec["training"]["gradient_accumulation_steps"]
    assert batch * f.dp == plan.train.global_batch_size


# ---- torchtitan ----------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def import_torchtitan_config():
    """torchtitan 0.2.x's ConfigManager and ParallelDims, or None when absent (or 0.3+, which has no TOML).

    torchtitan's package __init__ imports its MoE kernels (triton); the config and
    ParallelDims modules do not need them, so the package is entered without its __init__.
    """
    if importlib.util.find_spec("tyro") is None:
        return None
    if "torchtitan" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None or spec.submodule_search_locations is None:
            return None
        pkg = types.ModuleType("torchtitan")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["torchtitan"] = pkg
    try:
        from torchtitan.config import ConfigManager, JobConfig
        from torchtitan.distributed.parallel_dims import ParallelDims
    except ImportError:
        return None
    if not hasattr(ConfigManager, "_maybe_load_toml"):
        return None
    return ConfigManager, JobConfig, ParallelDims


@lru_cache(maxsize=1)
def torchtitan_fqn_split():
    """torchtitan's `generate_llm_fqn_per_model_part` (its default stage split), or None when
    torchtitan is absent. The function is pure; it is taken from torchtitan's own source file
    because the module around it imports the triton-backed MoE kernels."""
    import ast

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.submodule_search_locations is None:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "distributed" / "pipeline_parallel.py"
    if not path.exists():
        return None
    tree = ast.parse(path.read_text())
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "generate_llm_fqn_per_model_part"]
    if not fns:
        return None
    scope: dict[str, Any] = {}
    exec(compile(ast.Module(body=fns, type_ignores=[]), str(path), "exec"), scope)
    return scope["generate_llm_fqn_per_model_part"]


#: torchtitan 0.2.x JobConfig fields meshplan writes (torchtitan/config/job_config.py, documented
#: per field there and in docs/), with their types: the fallback check when torchtitan is absent.
DOCUMENTED_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "model": {"name": str, "flavor": str, "converters": list},
    "training": {"local_batch_size": int, "global_batch_size": int, "seq_len": int, "mixed_precision_param": str,
                 "mixed_precision_reduce": str, "enable_cpu_offload": bool},
    "parallelism": {"data_parallel_replicate_degree": int, "data_parallel_shard_degree": int,
                    "fsdp_reshard_after_forward": str, "tensor_parallel_degree": int, "context_parallel_degree": int,
                    "pipeline_parallel_degree": int, "pipeline_parallel_schedule": str,
                    "pipeline_parallel_microbatch_size": int, "pipeline_parallel_layers_per_stage": int,
                    "pipeline_parallel_first_stage_less_layers": int, "pipeline_parallel_last_stage_less_layers": int,
                    "module_fqns_per_model_part": list, "expert_parallel_degree": int,
                    "expert_tensor_parallel_degree": int},
    "activation_checkpoint": {"mode": str, "selective_ac_option": str},
    "compile": {"enable": bool, "components": list},
    "quantize.linear.float8": {"recipe_name": str},
}
DOCUMENTED_CHOICES = {("parallelism", "fsdp_reshard_after_forward"): {"default", "always", "never"},
                      ("activation_checkpoint", "mode"): {"selective", "full", "memory_budget", "none"},
                      ("training", "mixed_precision_param"): {"bfloat16", "float32"},
                      ("training", "mixed_precision_reduce"): {"float32"}}


def _flat_sections(doc: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            scalars = {k: v for k, v in value.items() if not isinstance(v, dict)}
            if scalars:
                out[name] = scalars
            out |= _flat_sections({k: v for k, v in value.items() if isinstance(v, dict)}, f"{name}.")
    return out


def check_torchtitan(plan: Plan, toml_text: str, tmp_dir: Path, full_parse: bool = True) -> str:
    """Parse with torchtitan's ConfigManager when importable, else against its documented fields.
    Returns which check ran ("torchtitan" or "documented-fields").

    `full_parse=False` runs only the TOML half of ConfigManager.parse_args (its TOML-to-JobConfig
    conversion, which rejects unknown fields and builds every section), skipping tyro's
    command-line merge, which costs ~70 ms a file."""
    doc = tomllib.loads(toml_text)
    f = facts(plan)
    s, t = f.strategy, plan.train
    assert not s.offload_activation_layers  # torchtitan has no activation offloading: refused
    par, training = doc["parallelism"], doc["training"]
    loaded = import_torchtitan_config()
    if loaded is not None:
        ConfigManager, _, ParallelDims = loaded
        if full_parse:
            path = tmp_dir / "job.toml"
            path.write_text(toml_text)
            job = ConfigManager().parse_args(["--job.config_file", str(path)])
        else:
            manager = ConfigManager.__new__(ConfigManager)  # __init__ only registers tyro rules
            job = manager._dict_to_dataclass(loaded[1], tomllib.loads(toml_text))
        p = job.parallelism
        dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                            ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=plan.num_gpus)
        assert dims.dp_replicate * dims.dp_shard == f.dp and (dims.tp, dims.pp, dims.cp) == (s.tp, s.pp, s.cp)
        assert t.seq_len % dims.seq_len_divisor == 0  # torchtitan's parallelize asserts this
        assert (dims.ep, dims.etp) == (s.ep, s.etp)
        # build_mesh's expert mesh: efsdp = dp_shard·cp·tp / (ep·etp) ranks, a whole number
        assert (dims.dp_shard * dims.cp * dims.tp) % (dims.ep * dims.etp) == 0
        assert not job.training.enable_cpu_offload  # offload_optimizer is refused, never mapped
        par, training = {k: getattr(p, k) for k in par}, {k: getattr(job.training, k) for k in training}
        which = "torchtitan"
    else:
        for section, table in _flat_sections(doc).items():
            assert section in DOCUMENTED_FIELDS, section
            for key, value in table.items():
                assert key in DOCUMENTED_FIELDS[section], f"{section}.{key}"
                assert isinstance(value, DOCUMENTED_FIELDS[section][key]), f"{section}.{key}={value!r}"
                choices = DOCUMENTED_CHOICES.get((section, key))
                assert choices is None or value in choices, f"{section}.{key}={value!r}"
        which = "documented-fields"
    # torchtitan's batch rules (train.py): gradient accumulation and pipeline micro-batches
    dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    assert dp == f.dp
    grad_accum = training["global_batch_size"] // (training["local_batch_size"] * dp)
    assert training["global_batch_size"] == t.global_batch_size
    if s.pp > 1:
        assert grad_accum == 1
        assert training["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == f.num_microbatches
        if par.get("module_fqns_per_model_part") is not None:
            parts = par["module_fqns_per_model_part"]
            assert len(parts) == s.pp * s.vpp
            assert sum(1 for part in parts for name in part if name.startswith("layers.")) == plan.model.num_layers
        else:
            # documented: num_virtual_stages = ceil((layers + first_less + last_less) / layers_per_stage)
            stages = -(-(plan.model.num_layers + par["pipeline_parallel_first_stage_less_layers"]
                         + par["pipeline_parallel_last_stage_less_layers"]) // par["pipeline_parallel_layers_per_stage"])
            assert stages == s.pp * s.vpp
            split = torchtitan_fqn_split()
            parts = None if split is None else split(stages, plan.model.num_layers,
                                                     par["pipeline_parallel_first_stage_less_layers"],
                                                     par["pipeline_parallel_last_stage_less_layers"])
        if parts is not None:  # the virtual stages torchtitan builds hold the layers ParallelLayout puts there
            assert [sum(n.startswith("layers.") for n in part) for part in parts] == f.layers_per_chunk()
            assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    else:
        assert grad_accum == f.num_microbatches and training["local_batch_size"] == s.micro_batch_size
    return which


# ---- launch scripts ------------------------------------------------------------------------------------
def check_shell(script: str, tmp_dir: Path) -> None:
    """bash parses the script (`bash -n`), without running it."""
    path = tmp_dir / "launch.sh"
    path.write_text(script)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def torchtitan_recomputed_layers(plan: Plan, toml_text: str) -> list[int]:
    """Layers torchtitan's own `apply_ac` wraps in activation checkpointing, per pipeline chunk (schedule
    order), when each rank applies it to its chunks in order, as torchtitan's pipeline does."""
    from torch import nn

    import_torchtitan_config()  # enters the package without its triton-importing __init__
    from torchtitan.config import ActivationCheckpoint
    from torchtitan.distributed import activation_checkpoint as ac
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    section = tomllib.loads(toml_text).get("activation_checkpoint", {})
    config = ActivationCheckpoint(**section)
    f = facts(plan)
    chunks, pp = f.layers_per_chunk(), f.strategy.pp
    counts = [0] * len(chunks)
    for rank in range(pp):
        ac._layer_sac_count = 0  # module state of one process: each rank counts from zero
        for c in range(rank, len(chunks), pp):
            part = nn.Module()
            part.layers = nn.ModuleDict({str(i): nn.Linear(1, 1) for i in range(chunks[c])})
            ac.apply_ac(part, config)
            counts[c] = sum(isinstance(layer, CheckpointWrapper) for layer in part.layers.values())
    return counts


# ---- MaxText ---------------------------------------------------------------------------------
#: Where scripts/test.sh downloads the MaxText wheel (MaxText needs Python >= 3.12 and is not installed).
MAXTEXT_WHEEL_DIR = Path(__file__).resolve().parents[2] / "build" / "maxtext"
MAXTEXT_BASE_YML = "maxtext/configs/base.yml"


def maxtext_wheel() -> Path:
    from planner.emit.maxtext import MAXTEXT_VERSION

    return MAXTEXT_WHEEL_DIR / f"maxtext-{MAXTEXT_VERSION}-py3-none-any.whl"


@lru_cache(maxsize=1)
def maxtext_base_config() -> dict[str, Any]:
    """MaxText's own configs/base.yml, read from the released wheel (the caller skips when it is absent)."""
    import zipfile

    import yaml

    with zipfile.ZipFile(maxtext_wheel()) as wheel:
        return yaml.safe_load(wheel.read(MAXTEXT_BASE_YML))


def _same_kind(ours: Any, theirs: Any) -> bool:
    """A value of the type MaxText's default has (an int where a float is, a list where a list is)."""
    if isinstance(theirs, bool) or isinstance(ours, bool):
        return isinstance(ours, bool) and isinstance(theirs, bool)
    if isinstance(theirs, (int, float)):
        return isinstance(ours, (int, float))
    if theirs is None:
        return True
    return isinstance(ours, type(theirs))


def check_maxtext(plan: Plan, data: dict[str, Any], text: str) -> None:
    """Every key the config sets exists in MaxText's base.yml with a value of its type (base_config is the
    inheritance key MaxText's pyconfig reads), the YAML text is the data form, and the degrees multiply to
    the plan's chips."""
    import yaml

    from planner.emit.maxtext import BASE_CONFIG_KEY

    base = maxtext_base_config()
    config = data["config"]
    assert yaml.safe_load(text) == config
    unknown = [k for k in config if k != BASE_CONFIG_KEY and k not in base]
    assert not unknown, f"keys MaxText's base.yml does not have: {unknown}"
    wrong = [k for k, v in config.items() if k != BASE_CONFIG_KEY and not _same_kind(v, base[k])]
    assert not wrong, [(k, config[k], base[k]) for k in wrong]
    product = 1
    for key, value in config.items():
        if key.endswith("_parallelism"):
            product *= value
    assert product == plan.num_gpus, (product, plan.num_gpus)
    mesh = data["mesh"]
    assert set(mesh["axis_names"]) <= set(base["mesh_axes"])
    shown = [a for a in base["mesh_axes"] if a in mesh["axis_names"]]
    assert shown == mesh["axis_names"]  # MaxText's order, outermost first
