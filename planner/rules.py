"""Which strategies are valid for a model, batch and GPU count: one place, vectorised.

Each rule is a `Rule(key, ok, message)`: `ok(ctx, st)` returns a boolean array
over candidates, `message(ctx, row)` explains one failing row, naming the field,
the rule and the values. The search counts rejections by `key`; `evaluate()`
lists every failing rule's message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np

from cost_models.arrays import StrategyArrays, modules_mask
from cost_models.elementwise import elementwise_model
from cost_models.layout import ParallelLayout
from cost_models.params import num_params
from cost_models.frameworks import cannot_run_masks, framework_of
from cost_models.torus import torus_groups_ok, torus_groups_message
from profiles import list_presets, load_model


@dataclass(frozen=True)
class Context:
    model: object
    train: object
    num_gpus: int
    cluster: object = None  # the offload and framework rules read it (its GPU's resolved tables)


_MLA_BITS = modules_mask(["mla_up_proj"])
_MOE_BITS = modules_mask(["moe_act", "shared_experts", "moe"])


def _moe(ctx: Context) -> bool:
    return bool(getattr(ctx.model, "num_experts", 0))


def _hybrid(ctx: Context) -> bool:
    return getattr(ctx.model, "hybrid_override_pattern", None) is not None


def _mamba(ctx: Context) -> bool:
    return _hybrid(ctx) and "M" in ctx.model.hybrid_override_pattern


def _mamba_heads(ctx: Context) -> int:
    return ctx.model.mamba_heads if _mamba(ctx) else 1


def _has_stage_layers(st: StrategyArrays) -> np.ndarray:
    """Whether each candidate has an explicit stage split (`stage_layers`, -1-padded rows)."""
    layers = np.asarray(st.stage_layers)
    return (layers >= 0).any(axis=1) if layers.ndim == 2 and layers.shape[1] else np.zeros(len(st), dtype=bool)


def _mamba_cp_ok(ctx: Context, st: StrategyArrays) -> np.ndarray:
    """megatron-core's Mamba context parallelism (ssm/mamba_context_parallel.py, core_v0.16.1) hands each CP rank
    whole heads: cp divides heads/tp, and either cp divides groups/tp or groups/tp divides cp (the groups' B and C
    are then repeated over the CP ranks)."""
    if not _mamba(ctx):
        return np.ones(len(st), dtype=bool)
    heads, groups = _mamba_heads(ctx), ctx.model.mamba_num_groups
    tp, cp = np.asarray(st.tp), np.asarray(st.cp)
    local_heads, local_groups = heads // tp, np.maximum(groups // tp, 1)
    groups_ok = np.where(local_groups < cp, cp % local_groups == 0, local_groups % cp == 0)
    return (cp == 1) | ((local_heads % cp == 0) & groups_ok)


def _mamba_cp_msg(ctx: Context, r: dict) -> str:
    heads, groups, tp = _mamba_heads(ctx), ctx.model.mamba_num_groups, r["tp"]
    return (f"cp ({r['cp']}) must divide the Mamba heads per TP rank ({heads}/{tp}) and divide, or be a multiple "
            f"of, mamba_num_groups per TP rank ({groups}/{tp}) (megatron-core's Mamba context parallelism gives "
            "each CP rank whole heads)")


def _expert_ranks_ok(ctx: Context, st: StrategyArrays) -> np.ndarray:
    """Megatron-core folds etp·ep over the tp·cp·dp ranks of a pipeline stage."""
    return (st.tp * st.cp * st.dp) % (st.etp * st.ep) == 0


def host_known(cluster) -> bool:
    """Whether offloading has a host to go to: the cluster profile's `host:` section and the GPU's
    `host_link_gb_per_s` (no cluster: not checked)."""
    return cluster is None or (cluster.host is not None and cluster.gpu.host_link_bw_bytes_per_s is not None)


def _offload_ok(ctx: Context, st: StrategyArrays) -> np.ndarray:
    return ~st.offload_optimizer | host_known(ctx.cluster)


def _activation_offload_ok(ctx: Context, st: StrategyArrays) -> np.ndarray:
    """Megatron-core's TransformerConfig checks (0.16: cpu_offloading_num_layers below num_layers, no
    pipeline parallelism, no recomputation) and a known host to offload to."""
    n = st.offload_activation_layers
    return (n == 0) | ((n < ctx.model.num_layers) & (st.pp == 1) & (st.recompute == 0) & host_known(ctx.cluster))


def _activation_offload_msg(ctx: Context, r: dict) -> str:
    host = "" if host_known(ctx.cluster) else (f"; cluster {ctx.cluster.name} has no `host:` section or GPU "
                                               "`host_link_gb_per_s` in its profile")
    return (f"offload_activation_layers ({r['offload_activation_layers']}) must be below num_layers "
            f"({ctx.model.num_layers}) and needs pp 1 (is {r['pp']}) and recompute 'none' (is {r['recompute']!r}): "
            "Megatron-core offloads activations without pipeline parallelism or recomputation only" + host)


def _offload_msg(ctx: Context, r: dict) -> str:
    return (f"offload_optimizer needs the host's DRAM and the GPU-host link: cluster {ctx.cluster.name} has no "
            "`host:` section or GPU `host_link_gb_per_s` in its profile")


def cuda_graph_problem(train, model) -> str | None:
    """Why megatron-core 0.16 cannot capture the CUDA graphs `train` asks for on `model`, or None
    (TransformerConfig.__post_init__, core_v0.16.1): a dropless MoE layer's experts have token counts known
    only on the host, so a whole-layer or whole-iteration graph of an MoE model is refused (megatron-core
    captures experts only with drop-and-pad); the router scopes need experts and the MLP scope dense layers;
    the dispatcher's preprocessing cannot be captured where the alltoall dispatcher copies the token counts to
    the host for FP8 padding. Hybrid Mamba stacks' graphs are not modelled."""
    impl = getattr(train, "cuda_graph_impl", "none")
    if impl == "none":
        return None
    scope = list(getattr(train, "cuda_graph_scope", None) or [])
    if getattr(model, "is_hybrid", False):
        return "cuda_graph_impl on a hybrid Mamba-Transformer stack is not modelled (its mamba scope's kernels)"
    moe = model.num_experts > 0
    if not moe:
        if {"moe_router", "moe_preprocess"} & set(scope):
            return f"cuda_graph_scope {scope}: the router scopes need an MoE model ({model.name} has no experts)"
        return None
    if not scope or "full_iteration" in scope:
        return (f"cuda_graph_scope {scope or '[] (the whole layer)'} on MoE model {model.name}: its dropless experts "
                "cannot be captured (megatron-core 0.16 captures experts only with drop-and-pad); capture attn, "
                "moe_router and moe_preprocess")
    if "mlp" in scope and not (model.moe_first_k_dense or model.moe_layer_freq > 1):
        return f"cuda_graph_scope {scope}: mlp captures dense MLP layers, and every layer of {model.name} is MoE"
    if ("moe_preprocess" in scope and getattr(train, "moe_dispatcher", "alltoall") == "alltoall"
            and getattr(train, "moe_router_padding_for_quantization", False)):
        return (f"cuda_graph_scope {scope}: moe_preprocess with the alltoall dispatcher and the router's FP8 padding, "
                "whose token counts are copied to the host before the wait (megatron-core refuses it)")
    return None


def graphs_capturable(s: StrategyArrays, impl: str, scope) -> np.ndarray:
    """Candidates megatron-core 0.16 captures CUDA graphs `impl` over `scope` for (TransformerConfig): no
    activation offloading, no full recompute outside `full_iteration`, and no recompute of the moe module under a
    Transformer Engine router graph. The planner's own graphs (planner.knobs) are judged by the same test."""
    scope = list(scope or [])
    ok = (s.offload_activation_layers == 0) & ((s.recompute != 2) | ("full_iteration" in scope))
    if impl == "transformer_engine" and "moe_router" in scope:
        ok &= (s.recompute_modules & modules_mask(("moe",))) == 0
    return ok


def fp8_gather_allowed(s: StrategyArrays, fp8_recipe: str) -> np.ndarray:
    """Candidates Megatron runs --fp8-param-gather for (Megatron-LM core_v0.16.1 arguments.py validate_args): the
    distributed optimizer or Megatron-FSDP (zero_stage >= 1), and with the CPU-offloaded optimizer only the delayed
    recipe's FP8 parameters. The planner turns the gather on exactly there (planner.knobs)."""
    return (s.zero_stage >= 1) & ~(s.offload_optimizer & (fp8_recipe != "delayed"))


def _cuda_graph_ok(c: Context, s: StrategyArrays) -> np.ndarray:
    impl = getattr(c.train, "cuda_graph_impl", "none")
    if impl == "none":
        return np.ones(len(s.tp), dtype=bool)
    return graphs_capturable(s, impl, getattr(c.train, "cuda_graph_scope", None))


def _cuda_graph_msg(c: Context, r: dict) -> str:
    return (f"cuda_graph_impl {c.train.cuda_graph_impl!r} (scope {c.train.cuda_graph_scope or []}) needs no "
            f"activation offloading (offload_activation_layers is {r['offload_activation_layers']}), no full "
            f"recompute without the full_iteration scope (recompute is {r['recompute']!r}) and, with moe_router "
            f"under Transformer Engine, no recompute of the moe module (recompute_modules {r['recompute_modules']}): "
            "megatron-core 0.16's TransformerConfig refuses them")


def fp8_recipe_problem(train, gpu) -> str | None:
    """Why the training's FP8 recipe cannot run on `gpu`, or None. The GPU's element-wise kernel table
    lists the recipes its kernels run (mxfp8 needs Blackwell tensor cores); a GPU without one runs
    the per-tensor and block-scaled recipes only."""
    if getattr(train, "precision", None) != "fp8":
        return None
    recipe = train.fp8_recipe
    table = elementwise_model(gpu)
    supported = table.fp8_recipes if table is not None else ("delayed", "tensorwise", "blockwise")
    if recipe in supported:
        return None
    return (f"fp8_recipe {recipe!r} is not supported on {gpu.name} (it runs {', '.join(supported)}); "
            "mxfp8 needs a Blackwell GPU (B200, B300, GB200, GB300)")


def nvfp4_problem(train, gpu) -> str | None:
    """Why precision nvfp4 cannot be planned on `gpu`, or None: it needs FP4 tensor cores (an `fp4` peak in the
    GPU profile: Blackwell), and a GEMM table with the NVFP4 rate and an element-wise table whose kernels run
    it, which time its GEMMs and quantisation."""
    if getattr(train, "precision", None) != "nvfp4":
        return None
    if "fp4" not in gpu.peak_flop_per_s:
        return (f"precision 'nvfp4' needs FP4 tensor cores (Blackwell: B200, B300, GB200, GB300); {gpu.name} has "
                "none (no fp4 peak in its profile)")
    gemm, table = gpu.tables.gemm, elementwise_model(gpu)
    if gemm is None or "nvfp4" not in dict(gemm.recipe_rates) or table is None or "nvfp4" not in table.fp8_recipes:
        return (f"precision 'nvfp4' on {gpu.name}: its kernel tables have no NVFP4 GEMM rate (gemm recipe_rates.nvfp4) "
                "or no NVFP4 quantisation (elementwise fp8_recipes), so the plan cannot be timed")
    return None


def _rank_order_msg(ctx: Context, r: dict) -> str:
    why = []  # the other frameworks refuse the order itself (their profiles' cannot_run)
    if r["cp"] != 1:
        why.append(f"cp 1 (is {r['cp']}: with context parallelism the data-parallel group of this order is not a "
                   "strided range of ranks, which the cost model does not price)")
    if r["zero_stage"] == 3:
        why.append("zero_stage below 3 (Megatron-FSDP, Megatron's zero_stage 3, does not take the mapping)")
    if _moe(ctx) and r["etp"] * r["ep"] != r["tp"] * r["cp"]:
        why.append(f"etp·ep = tp·cp for an MoE model ({r['etp']}·{r['ep']} vs {r['tp']}·{r['cp']}: Megatron-core "
                   "requires the expert and dense pipeline groups to coincide)")
    return f"rank_order {r['rank_order']!r} (Megatron's --use-tp-pp-dp-mapping) needs " + "; ".join(why)


@dataclass(frozen=True)
class Rule:
    key: str
    ok: Callable[[Context, StrategyArrays], np.ndarray]
    message: Callable[[Context, dict], str]


def eager_problem(train, model) -> str | None:
    """Why `torch_compile` false cannot be costed for this plan, or None: the eager operator counts are
    torchtitan's (its Llama-style decoder layer), and its latent-attention eager code is not counted."""
    if train.torch_compile:
        return None
    if train.framework != "torchtitan" and not getattr(train, "transformers", False):  # an HF model runs eager
        return (f"torch_compile false with framework {train.framework!r}: eager element-wise work is costed for "
                "framework torchtitan only (its PyTorch operators); the other frameworks run their own fused kernels")
    if model.is_mla:
        return ("torch_compile false with latent attention: torchtitan's eager operators of an MLA layer are not "
                "costed; plan it with torch_compile true")
    return None


#: Frameworks a LoRA / QLoRA plan runs under: the Hugging Face model with peft, sharded by DeepSpeed's ZeRO
#: (framework deepspeed) or by PyTorch FSDP2 (framework torchtitan: FSDP2's costs), what Axolotl and LLaMA-Factory run.
ADAPTER_FRAMEWORKS = ("deepspeed", "torchtitan")


def finetune_problem(train, model) -> str | None:
    """Why this plan of Hugging Face Transformers' layers (model_code transformers; every LoRA and QLoRA plan)
    cannot be costed for `model`, or None. They are costed for the Llama family's decoder layer (RMSNorm, rotary
    attention, gated MLP: cost_models.finetune.layer_activation_bytes counts its saved tensors from Transformers'
    code, and peft's target names are its linear layers), run under DeepSpeed or FSDP2."""
    if not getattr(train, "transformers", False):
        return None
    what_runs = f"finetune {train.finetune!r}" if train.adapters else "model_code 'transformers'"
    if train.framework not in ADAPTER_FRAMEWORKS:
        return (f"{what_runs} with framework {train.framework!r}: the Hugging Face model runs under framework "
                f"deepspeed (ZeRO) or torchtitan (FSDP2)")
    for what, bad in (("an MoE model (num_experts > 0)", model.is_moe),
                      ("latent attention (kv_lora_rank is set)", model.is_mla),
                      ("Mamba or hybrid layers (hybrid_override_pattern)", model.is_hybrid),
                      ("sliding-window attention", any(model.local_attention_mask())),
                      ("multi-token prediction (num_mtp_layers)", bool(model.num_mtp_layers)),
                      ("LayerNorm (norm layernorm)", model.norm != "rmsnorm"),
                      ("a plain MLP (gated_mlp false)", not model.gated_mlp),
                      (f"{model.position_embedding} position embeddings", model.position_embedding != "rope")):
        if bad:
            return (f"{what_runs} of {what}: the Hugging Face layers are costed for the Llama family's decoder layer "
                    "only (RMSNorm, rotary attention, a gated MLP)")
    targets = train.lora_target_modules or ()
    if "gate_proj" in targets and not model.gated_mlp:
        return (f"lora_target_modules names gate_proj, which model {model.name!r} has not got (its MLP is not gated: "
                "up_proj and down_proj only)")
    layers = train.lora_layers or ()
    if layers and max(layers) >= model.num_layers:
        return (f"lora_layers names layer {max(layers)}, which model {model.name!r} has not got (layers 0-"
                f"{model.num_layers - 1})")
    return None


def _layout(ctx: Context, st: StrategyArrays) -> ParallelLayout:
    return ParallelLayout.of(st, ctx.model.num_layers)


def _microbatches(ctx: Context, st: StrategyArrays) -> np.ndarray:
    return _layout(ctx, st).num_microbatches(ctx.train.global_batch_size, st.micro_batch_size)


def _row_layout(ctx: Context, r: dict) -> ParallelLayout:
    """The layout of one row (Strategy keyword arguments), for messages."""
    return ParallelLayout.of_strategy(SimpleNamespace(**r), ctx.model.num_layers)


def _row_microbatches(ctx: Context, r: dict) -> int:
    return int(_row_layout(ctx, r).num_microbatches(ctx.train.global_batch_size, np.array([r["micro_batch_size"]]))[0])


def _layers_msg(ctx: Context, r: dict) -> str:
    return _row_layout(ctx, r).split_message()


def _recompute_layers_ok(ctx: Context, st: StrategyArrays) -> np.ndarray:
    """recompute_num_layers needs full recompute and at most the layers of the largest chunk
    (stage rows are built only for the candidates that set it)."""
    ok = st.recompute_num_layers == 0
    need = np.flatnonzero(~ok)
    if len(need):
        sub = st.take(need)
        largest = _layout(ctx, sub).largest_chunk()
        ok[need] = (sub.recompute == 2) & (sub.recompute_num_layers <= largest)
    return ok


RULES: tuple[Rule, ...] = (
    Rule("gpus",
         lambda c, s: _layout(c, s).num_gpus == c.num_gpus,
         lambda c, r: f"dp·tp·cp·pp ({r['dp']}·{r['tp']}·{r['cp']}·{r['pp']}) must equal the number of GPUs ({c.num_gpus})"),
    Rule("tp_heads",
         lambda c, s: c.model.num_attention_heads % s.tp == 0,
         lambda c, r: f"tp ({r['tp']}) must divide num_attention_heads ({c.model.num_attention_heads})"),
    Rule("tp_kv_heads",
         lambda c, s: c.model.kv_heads % s.tp == 0,
         lambda c, r: f"tp ({r['tp']}) must divide num_kv_heads ({c.model.kv_heads})"),
    Rule("tp_mamba",
         lambda c, s: ~np.bool_(_mamba(c)) | ((_mamba_heads(c) % s.tp == 0)
                                              & (getattr(c.model, "mamba_num_groups", None) or 1) % s.tp == 0),
         lambda c, r: f"tp ({r['tp']}) must divide the Mamba heads ({_mamba_heads(c)}) and mamba_num_groups "
                      f"({c.model.mamba_num_groups}) (megatron-core's MambaMixer splits both over TP)"),
    Rule("cp_mamba", _mamba_cp_ok, _mamba_cp_msg),
    Rule("hybrid_framework",
         lambda c, s: np.broadcast_to(not _hybrid(c) or getattr(c.train, "framework", "megatron") == "megatron",
                                      (len(s),)),
         lambda c, r: f"model {c.model.name} is a hybrid Mamba-Transformer stack (hybrid_override_pattern), which "
                      f"only Megatron-LM runs here (framework is {getattr(c.train, 'framework', 'megatron')!r})"),
    Rule("hybrid_pipeline",
         lambda c, s: ~np.bool_(_hybrid(c)) | ((s.vpp == 1) & ~_has_stage_layers(s) & ~s.embedding_as_layer
                                               & ~s.loss_as_layer),
         lambda c, r: f"model {c.model.name} is a hybrid stack: megatron-core 0.16's MambaStack runs no interleaved "
                      f"pipeline (vpp {r['vpp']} must be 1) and splits layers by the first/last-stage counts only "
                      "(no stage_layers, embedding_as_layer or loss_as_layer)"),
    Rule("layers", lambda c, s: _layout(c, s).split_ok(), _layers_msg),
    Rule("batch",
         lambda c, s: _layout(c, s).batch_ok(c.train.global_batch_size, s.micro_batch_size),
         lambda c, r: f"micro_batch_size·dp ({r['micro_batch_size']}·{r['dp']}) must divide global_batch_size "
                      f"({c.train.global_batch_size})"),
    Rule("vpp_pp",
         lambda c, s: (s.vpp == 1) | (s.pp > 1),
         lambda c, r: f"vpp ({r['vpp']}) > 1 requires pp > 1"),
    Rule("interleave_microbatches",
         lambda c, s: _layout(c, s).megatron_schedule_ok(_microbatches(c, s)),
         lambda c, r: f"with vpp > 1, num_microbatches ({_row_microbatches(c, r)}) "
                      f"must be a multiple of pp ({r['pp']})"),
    Rule("cp_seq",
         lambda c, s: (s.cp == 1) | (c.train.seq_len % (2 * s.cp) == 0),
         lambda c, r: f"seq_len ({c.train.seq_len}) must be divisible by 2·cp ({2 * r['cp']}) for load-balanced context parallelism"),
    Rule("sp_tp",
         lambda c, s: ~s.sequence_parallel | (s.tp > 1),
         lambda c, r: "sequence_parallel requires tp > 1"),
    Rule("sp_seq",
         lambda c, s: ~s.sequence_parallel | ((c.train.seq_len // s.cp) % s.tp == 0),
         lambda c, r: f"with sequence_parallel, seq_len/cp ({c.train.seq_len // r['cp']}) must be divisible by tp ({r['tp']})"),
    Rule("ep_dense",
         lambda c, s: _moe(c) | ((s.ep == 1) & (s.etp == 1)),
         lambda c, r: f"ep ({r['ep']}) and etp ({r['etp']}) must be 1: model {c.model.name} is dense (no experts)"),
    Rule("ep_experts",
         lambda c, s: ~np.bool_(_moe(c)) | (c.model.num_experts % s.ep == 0),
         lambda c, r: f"ep ({r['ep']}) must divide num_experts ({c.model.num_experts})"),
    Rule("ep_ranks",
         _expert_ranks_ok,
         lambda c, r: f"etp·ep ({r['etp']}·{r['ep']} = {r['etp'] * r['ep']}) must divide the tp·cp·dp ranks of a "
                      f"pipeline stage that hold the experts ({r['tp']}·{r['cp']}·{r['dp']} = "
                      f"{r['tp'] * r['cp'] * r['dp']})"),
    Rule("rank_order",
         lambda c, s: (s.rank_order == 0) | ((s.cp == 1) & (s.zero_stage < 3)
                                            & (~np.bool_(_moe(c)) | (s.etp * s.ep == s.tp * s.cp))),
         lambda c, r: _rank_order_msg(c, r)),
    Rule("etp_ffn",
         lambda c, s: ~np.bool_(_moe(c)) | (c.model.expert_ffn % s.etp == 0),
         lambda c, r: f"etp ({r['etp']}) must divide moe_ffn_hidden_size ({c.model.expert_ffn})"),
    Rule("moe_sp",
         lambda c, s: ~np.bool_(_moe(c)) | (s.tp == 1) | s.sequence_parallel,
         lambda c, r: f"an MoE model with tp ({r['tp']}) > 1 needs sequence_parallel (Megatron-core's rule for tensor "
                      "with expert parallelism; the cost model assumes each rank routes its own tokens)"),
    Rule("recompute_layers",
         _recompute_layers_ok,
         lambda c, r: f"recompute_num_layers ({r['recompute_num_layers']}) needs recompute='full' and must not exceed "
                      f"the layers of the largest pipeline chunk"),
    Rule("recompute_modules_mode",
         lambda c, s: (s.recompute_modules == 0) | (s.recompute == 1),
         lambda c, r: f"recompute_modules {r['recompute_modules']} need recompute='selective' (is {r['recompute']!r})"),
    Rule("recompute_modules",
         lambda c, s: ~(((s.recompute_modules & _MLA_BITS) > 0) & ~np.bool_(bool(getattr(c.model, "is_mla", False))))
         & ~(((s.recompute_modules & _MOE_BITS) > 0) & ~np.bool_(_moe(c))),
         lambda c, r: f"recompute_modules {r['recompute_modules']}: mla_up_proj needs a model with latent attention, "
                      f"moe_act / shared_experts / moe an MoE model (model {c.model.name} has "
                      f"{'latent' if getattr(c.model, 'is_mla', False) else 'no latent'} attention and "
                      f"{'experts' if _moe(c) else 'no experts'})"),
    Rule("overlap_moe_comm",
         lambda c, s: ~s.overlap_moe_comm | ((s.ep > 1) & ((s.pp == 1) | (s.vpp > 1)) & (s.recompute != 2)
                                             & ((getattr(c.model, "num_mtp_layers", 0) == 0) | (s.pp > 1))),
         lambda c, r: f"overlap_moe_comm (Megatron's --overlap-moe-expert-parallel-comm) needs ep > 1 (is {r['ep']}), "
                      f"vpp > 1 when pp > 1 (pp {r['pp']}, vpp {r['vpp']}), no full recompute (is {r['recompute']!r}), "
                      "and pp > 1 for a model with an MTP layer"),
    Rule("offload", _offload_ok, _offload_msg),
    Rule("activation_offload", _activation_offload_ok, _activation_offload_msg),
    Rule("zero_offload",
         lambda c, s: ~s.offload_optimizer | (s.zero_stage >= 1),
         lambda c, r: "offload_optimizer needs zero_stage >= 1"),
    Rule("cuda_graph", _cuda_graph_ok, _cuda_graph_msg),
    Rule("fp8_param_gather",
         lambda c, s: np.full(len(s.tp), not getattr(c.train, "fp8_param_gather", False))
         | fp8_gather_allowed(s, getattr(c.train, "fp8_recipe", "delayed")),
         lambda c, r: f"fp8_param_gather needs zero_stage >= 1 (is {r['zero_stage']}) and, with offload_optimizer, "
                      f"fp8_recipe 'delayed' (is {getattr(c.train, 'fp8_recipe', 'delayed')!r}): Megatron's "
                      "--fp8-param-gather runs with the distributed optimizer or Megatron-FSDP only"),
)


def _framework_failures(ctx: Context, st: StrategyArrays) -> list:
    """The `cannot_run` rules of the framework the plan runs on (profiles/frameworks/<name>.yaml)."""
    return cannot_run_masks(framework_of(ctx.train, ctx.cluster.gpu.tables), ctx.model, ctx.train, st)


def _framework_msg(ctx: Context, r: dict) -> str:
    hits = [rule.reason for rule, hit in _framework_failures(ctx, StrategyArrays.from_strategies([SimpleNamespace(**r)]))
            if hit[0]]
    return f"not expressible in {getattr(ctx.train, 'framework', 'megatron')}: " + "; ".join(hits)


#: On a TPU cluster every parallel group must tile the slice's torus (cost_models.torus): a tp of 3 on a 4x4x8
#: slice has no ring of ICI links to run on.
def _adapter_layout_ok(c: Context, s: StrategyArrays) -> np.ndarray:
    """An adapter plan (finetune lora / qlora) is data parallel with ZeRO 0-3: the Hugging Face model under
    DeepSpeed or FSDP2 has no tensor, pipeline, context or expert parallel layout, and runs no interleaving,
    activation offloading or CUDA graphs."""
    if not getattr(c.train, "transformers", False):
        return np.ones(len(s), dtype=bool)
    return ((s.tp == 1) & (s.pp == 1) & (s.cp == 1) & (s.ep == 1) & (s.etp == 1) & (s.vpp == 1)
            & (s.offload_activation_layers == 0) & (s.recompute != 1) & (s.recompute_num_layers == 0))


def _adapter_layout_msg(c: Context, r: dict) -> str:
    what = f"finetune {c.train.finetune!r}" if c.train.adapters else "model_code 'transformers'"
    return (f"{what} runs the Hugging Face model, data parallel with ZeRO only: "
            f"tp, pp, cp, ep, etp and vpp must be 1, no activations offloaded, and recompute none or full over every "
            f"layer (gradient checkpointing; got tp {r['tp']}, pp {r['pp']}, cp {r['cp']}, ep {r['ep']}, etp "
            f"{r['etp']}, vpp {r['vpp']}, offload_activation_layers {r['offload_activation_layers']}, recompute "
            f"{r['recompute']}, recompute_num_layers {r['recompute_num_layers']})")


ADAPTER_RULE = Rule("finetune_layout", _adapter_layout_ok, _adapter_layout_msg)

TORUS_RULE = Rule("torus_tiling",
                  lambda c, s: torus_groups_ok(c.cluster, _layout(c, s), _moe(c)),
                  lambda c, r: torus_groups_message(c.cluster, _row_layout(c, r), _moe(c)) or "")

FRAMEWORK_RULE = Rule("framework",
                      lambda c, s: ~np.any([hit for _, hit in _framework_failures(c, s)] or [np.zeros(len(s), bool)],
                                           axis=0),
                      _framework_msg)
RULES = RULES + (ADAPTER_RULE, TORUS_RULE, FRAMEWORK_RULE)


def check(ctx: Context, st: StrategyArrays) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(valid mask, per-rule failure masks). A candidate is valid when no rule fails."""
    failures = {rule.key: ~np.asarray(rule.ok(ctx, st), dtype=bool) for rule in RULES}
    invalid = np.zeros(len(st), dtype=bool)
    for mask in failures.values():
        invalid |= mask
    return ~invalid, failures


def first_failure_counts(failures: dict[str, np.ndarray]) -> dict[str, int]:
    """Count each rejected candidate once, under the first rule it breaks."""
    counts: dict[str, int] = {}
    taken = None
    for key, mask in failures.items():
        new = mask if taken is None else mask & ~taken
        n = int(new.sum())
        if n:
            counts[key] = n
        taken = mask if taken is None else taken | mask
    return counts


def messages(ctx: Context, st: StrategyArrays, i: int) -> list[str]:
    """Every rule row i breaks, as messages."""
    _, failures = check(ctx, st.take(slice(i, i + 1)))
    row = st.row(i)
    return [rule.message(ctx, row) for rule in RULES if failures[rule.key][0]]


# ---- input warnings: accepted, but probably not what was meant -----------------------------
def batch_warning(train, num_gpus: int) -> str | None:
    """Megatron needs micro_batch_size·dp to divide global_batch_size, and dp divides the GPU
    count: when the two share no factor only dp = 1 is possible, every GPU goes to tp·cp·pp."""
    gbs = train.global_batch_size
    if num_gpus > 1 and math.gcd(gbs, num_gpus) == 1:
        return (f"global_batch_size ({gbs}) shares no factor with the number of GPUs ({num_gpus}): micro_batch_size·dp "
                f"must divide global_batch_size and dp must divide the GPU count, so only dp=1 layouts are possible "
                f"(all {num_gpus} GPUs in tp·cp·pp); a global batch that is a multiple of the data-parallel degree "
                "you want allows more")
    return None


def node_warning(cluster, num_gpus: int) -> str | None:
    """A job larger than one node that does not fill whole nodes: launchers (torchrun
    --nproc-per-node, Slurm) start the same number of ranks on every node."""
    per_node = cluster.gpus_per_node
    if num_gpus > per_node and num_gpus % per_node:
        return (f"num_gpus ({num_gpus}) is not a multiple of gpus_per_node ({per_node}) on cluster {cluster.name}: "
                f"{num_gpus // per_node} full node(s) and {num_gpus % per_node} GPU(s) of another; launchers start "
                "the same number of ranks on every node, and the cost model places ranks on full nodes first")
    return None


def context_warning(model, train) -> str | None:
    """A sequence longer than the context the model was trained for (its max_position_embeddings,
    when given; a learned position table has no rows beyond it)."""
    limit = model.max_position_embeddings
    given = "max_position_embeddings" in model.model_fields_set or model.position_embedding == "learned"
    if not given or train.seq_len <= limit:
        return None
    how = ("its learned position table has only that many rows" if model.position_embedding == "learned"
           else "longer sequences need a context extension (rope scaling) the plan does not model")
    return (f"seq_len ({train.seq_len}) exceeds model {model.name}'s context (max_position_embeddings "
            f"{limit}): {how}")


#: Fields that make a model of a known shape a different architecture; compared with the preset of the same
#: shape by `family_warning` (effective values: kv_heads and head_size fill in their defaults).
FAMILY_FIELDS = ("kv_heads", "head_size", "gated_mlp", "tie_embeddings", "position_embedding", "norm",
                 "linear_bias", "qkv_bias", "num_experts", "moe_top_k", "expert_ffn", "num_shared_experts",
                 "moe_first_k_dense", "kv_lora_rank", "q_lora_rank", "sliding_window")
#: What identifies a model's shape.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")


def _shape(model) -> tuple:
    return tuple(getattr(model, f) for f in SHAPE_FIELDS)


def _preset_shapes() -> dict[tuple, object]:
    return {_shape(m): m for m in (load_model(name) for name in list_presets("models"))}


def family_warning(model, presets: dict[tuple, object] | None = None) -> str | None:
    """A hand-built model with the exact shape (layers, widths, heads, vocabulary) of a preset that
    disagrees with it in architecture fields: ModelSpec's defaults (plain MLP, tied embeddings, MHA)
    silently describe a different model; a Llama 3 8B shape with those defaults counts 28% fewer
    parameters."""
    preset = (presets if presets is not None else _preset_shapes()).get(_shape(model))
    if preset is None:
        return None
    differ = [f for f in FAMILY_FIELDS if getattr(model, f) != getattr(preset, f)]
    if not differ:
        return None
    mine, theirs = num_params(model), num_params(preset)
    shown = ", ".join(f"{f} ({getattr(model, f)}; the preset: {getattr(preset, f)})" for f in differ)
    return (f"model {model.name} has the shape of preset {preset.name} ({', '.join(SHAPE_FIELDS)} equal) but differs "
            f"in {shown}: {mine / 1e9:.2f}B parameters against the preset's {theirs / 1e9:.2f}B "
            f"({100 * (mine / theirs - 1):+.0f}%); use the preset, or set these fields if the difference is meant")
