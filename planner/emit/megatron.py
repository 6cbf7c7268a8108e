"""Megatron-LM: `pretrain_gpt.py` (`pretrain_mamba.py` for hybrid stacks) command-line flags (Megatron-LM core_r0.16 /
megatron-core 0.16).

The plan becomes a dict of Megatron-LM argparse destinations (`settings`), and
the mapping table `FLAGS` turns each into its flag. `parse_args` reads flags
back through the same table, and `core_config_kwargs` repeats what Megatron-LM's
`core_transformer_config_from_args` does, so the tests can build megatron-core's
own `ModelParallelConfig`, `TransformerConfig`, `DistributedDataParallelConfig`
and `OptimizerConfig` from exactly the flags a user pastes.

Choices an experienced Megatron user would make, and why:
- zero_stage 1 is the distributed optimizer; 2 and 3 are Megatron-FSDP
  (`--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads[_params]`,
  which also needs the distributed optimizer, no gradient-accumulation fusion
  and the `fsdp_dtensor` checkpoint format).
- Full recompute of every layer is `--recompute-method uniform
  --recompute-num-layers 1`; of the first k layers per chunk, `block` with k.
- vpp is `--num-virtual-stages-per-pipeline-rank` (the only vpp flag Megatron
  allows together with uneven first/last stages).
- The stage split: first/last-stage counts are `--decoder-first/last-pipeline-num-layers`;
  embedding/loss counted as layers are `--account-for-embedding/loss-in-pipeline-split`;
  an explicit split (`stage_layers`, per pipeline rank or per virtual stage) is
  `--pipeline-model-parallel-layout`, one `|`-separated entry per virtual stage in schedule
  order (`Et*3|(t*4|)*30,t*3L`: E the embedding, t a transformer layer, m an MTP layer,
  L the loss; the MTP layers sit in the last virtual stage before the loss, where the cost
  model puts them: DeepSeek-V3's Megatron-Bridge layout is `Et*4|(t*4|)*14,tmL`), which
  also fixes vpp, so `--num-virtual-stages-per-pipeline-rank` is left out (Megatron-LM
  allows only one of them).
- fp8 is Transformer Engine delayed scaling, hybrid format (E4M3 forward,
  E5M2 backward), amax history 1024 with the max algorithm, on top of bf16.
  fp8_param_gather is `--fp8-param-gather` (FP8 parameters, gathered in FP8), which
  Megatron-LM allows with the distributed optimizer or Megatron-FSDP only (zero_stage
  >= 1) and, with the CPU-offloaded optimizer, with the delayed recipe only; mxfp8 adds
  `--reuse-grad-buf-for-mxfp8-param-ag` on the distributed optimizer (megatron-core's
  OptimizerConfig warns of "significant" extra memory without it; Megatron-LM turns it
  off under Megatron-FSDP).
- `--norm-epsilon` is always the model's `norm_epsilon` (megatron-core's `layernorm_epsilon`):
  Megatron's default 1e-5 is not every model's (Qwen3, DeepSeek, Gemma: 1e-6).
- rope models get `--max-position-embeddings max(table, seq_len)`; Megatron
  requires it to be at least the sequence length. `--rotary-base` is the model's
  `rope_theta` where its spec holds one (Llama 3: 500000); where it does not,
  Megatron's default 10000 would apply silently, so the text output names the
  missing base (`omissions`) and `meshplan emit` exits 2 unless `--allow-partial`.
- MoE: `--num-experts`, `--moe-router-topk`, `--moe-ffn-hidden-size` (one
  expert's width), `--moe-shared-expert-intermediate-size` (all shared experts
  together) with `--moe-shared-expert-overlap` (the shared experts run during
  the token all-to-all, as the cost model assumes), the all-to-all dispatcher,
  grouped GEMM, and Megatron's default `aux_loss` load balancing (ModelSpec
  does not say a model balances otherwise; the loss coefficient is the user's).
  A dense/MoE layer mix is `--moe-layer-freq` as a per-layer list expression
  (`([0]*3+[1]*58)`): Megatron's integer form N puts MoE on layers 0, N, 2N, ...,
  which is not ModelSpec's rule. ep and etp are always both written, since
  Megatron-LM's default etp is tp. Megatron-core refuses to train MoE with
  tp > 1 without sequence parallelism, so such a plan is refused. Megatron has
  one bias switch for attention, MLP, experts and router.
- MLA: `--multi-latent-attention` with the ranks and head widths
  (`--qk-head-dim` is the non-rotary part); the RoPE variant and its scaling
  stay Megatron's MLA defaults (ModelSpec does not describe them).
- Sliding windows: `--window-size W-1,0` (a causal window of W tokens), and
  global layers by `--window-attn-skip-freq` (N: every N-th layer global, the
  same rule as `global_attention_every`; otherwise a per-layer list, 1 = local).
- Tensor-parallel communication overlap: `--tp-comm-overlap` (Transformer Engine userbuffers)
  with sequence parallelism and tp > 1 where the cluster profile's `tp_comm_overlap` is above 0,
  as the cost model then assumes (NVIDIA's H100/B200 recipes turn it on; Megatron-LM requires
  sequence parallelism for it).
- overlap_p2p_comm: Megatron-LM overlaps an interleaved schedule's steady-state transfers unless
  `--no-overlap-p2p-communication` (written when the plan turns it off with vpp > 1; without
  interleaving Megatron-LM turns the overlap off itself).
- offload_optimizer: `--optimizer-cpu-offload --optimizer-offload-fraction 1.0`
  with the precision-aware optimizer Megatron-LM requires for it and the
  distributed optimizer (zero_stage >= 1).
- Hybrid Mamba-Transformer stacks (ModelSpec.hybrid_override_pattern; Nemotron-H): Megatron-LM's
  `pretrain_mamba.py` with `--hybrid-override-pattern` (megatron-core's symbols, one per layer),
  `--is-hybrid-model`, `--mamba-num-heads`, `--mamba-head-dim`, `--mamba-state-dim` and
  `--mamba-num-groups`; MoE layers are the pattern's E, so `--moe-layer-freq` is not written. megatron-core
  0.16 builds the Mamba-2 mixer with a 4-wide convolution and chunk 128 (MambaMixer's defaults, no config
  field), runs no interleaved pipeline for it (MambaStack asserts vpp is unset) and splits its layers by
  the first/last-stage counts only (no `--pipeline-model-parallel-layout`, no embedding or loss counted as
  a layer): plans asking otherwise are refused. A plain MLP with squared ReLU is `--squared-relu`.
- offload_activation_layers: `--cpu-offloading-num-layers N`, the activations of the first
  N layers copied to the host (megatron-core's `cpu_offloading_activations` default; its
  weights stay: `cpu_offloading_weights` False). Megatron-LM core_r0.16 generates the flag
  from TransformerConfig.cpu_offloading_num_layers and its validate_args sets
  `cpu_offloading` when N > 0; it has no `--cpu-offloading` switch (argparse would refuse
  one). Megatron-core refuses offloading with pp > 1, with any recomputation and with N not
  below num_layers, and so does the emitter; no CUDA graphs are emitted, which it also refuses.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

from planner.emit.base import REGISTRY, EmitOptions, NotExpressibleError, PlanFacts, check_plan, describe, shell_array
from planner.emit.quoting import SHELL_IDENTIFIER, check_name, clip, comment, one_line, shell_word
from planner.specs import Plan

FRAMEWORK = "Megatron-LM"
RUNS = "megatron"  # the TrainSpec.framework whose costs describe its run


@dataclass(frozen=True)
class Flag:
    """One Megatron-LM argument: its flag and how its value is written.

    kind: `int`, `float`, `str` (flag VALUE), `switch` (store_true: flag when
    True), `negswitch` (store_false: flag when False), `pattern` (an integer or a
    per-layer list expression, Megatron-LM's `moe_freq_type`), `pair` (two integers
    `a,b`, Megatron-LM's `tuple_type`), `list` (nargs='*': the flag then one token per value).
    """

    flag: str
    kind: str


# ---- mapping table: argparse destination -> flag --------------------------------
FLAGS: dict[str, Flag] = {
    # parallel layout
    "tensor_model_parallel_size": Flag("--tensor-model-parallel-size", "int"),
    "pipeline_model_parallel_size": Flag("--pipeline-model-parallel-size", "int"),
    "num_virtual_stages_per_pipeline_rank": Flag("--num-virtual-stages-per-pipeline-rank", "int"),
    "decoder_first_pipeline_num_layers": Flag("--decoder-first-pipeline-num-layers", "int"),
    "decoder_last_pipeline_num_layers": Flag("--decoder-last-pipeline-num-layers", "int"),
    "pipeline_model_parallel_layout": Flag("--pipeline-model-parallel-layout", "str"),
    "account_for_embedding_in_pipeline_split": Flag("--account-for-embedding-in-pipeline-split", "switch"),
    "account_for_loss_in_pipeline_split": Flag("--account-for-loss-in-pipeline-split", "switch"),
    "context_parallel_size": Flag("--context-parallel-size", "int"),
    "expert_model_parallel_size": Flag("--expert-model-parallel-size", "int"),
    "expert_tensor_parallel_size": Flag("--expert-tensor-parallel-size", "int"),
    "sequence_parallel": Flag("--sequence-parallel", "switch"),
    "tp_comm_overlap": Flag("--tp-comm-overlap", "switch"),
    "overlap_p2p_comm": Flag("--no-overlap-p2p-communication", "negswitch"),
    "use_tp_pp_dp_mapping": Flag("--use-tp-pp-dp-mapping", "switch"),
    # batch and sequence
    "micro_batch_size": Flag("--micro-batch-size", "int"),
    "global_batch_size": Flag("--global-batch-size", "int"),
    "seq_length": Flag("--seq-length", "int"),
    # activation recomputation and offloading
    "recompute_granularity": Flag("--recompute-granularity", "str"),
    "recompute_method": Flag("--recompute-method", "str"),
    "recompute_num_layers": Flag("--recompute-num-layers", "int"),
    "recompute_modules": Flag("--recompute-modules", "list"),
    "cpu_offloading_num_layers": Flag("--cpu-offloading-num-layers", "int"),
    # data parallel, ZeRO, optimizer
    "use_distributed_optimizer": Flag("--use-distributed-optimizer", "switch"),
    "use_megatron_fsdp": Flag("--use-megatron-fsdp", "switch"),
    "data_parallel_sharding_strategy": Flag("--data-parallel-sharding-strategy", "str"),
    "gradient_accumulation_fusion": Flag("--no-gradient-accumulation-fusion", "negswitch"),
    "ckpt_format": Flag("--ckpt-format", "str"),
    "overlap_grad_reduce": Flag("--overlap-grad-reduce", "switch"),
    "overlap_param_gather": Flag("--overlap-param-gather", "switch"),
    "optimizer": Flag("--optimizer", "str"),
    "optimizer_cpu_offload": Flag("--optimizer-cpu-offload", "switch"),
    "optimizer_offload_fraction": Flag("--optimizer-offload-fraction", "float"),
    "use_precision_aware_optimizer": Flag("--use-precision-aware-optimizer", "switch"),
    # precision
    "bf16": Flag("--bf16", "switch"),
    "fp16": Flag("--fp16", "switch"),
    "grad_reduce_in_bf16": Flag("--grad-reduce-in-bf16", "switch"),
    "accumulate_allreduce_grads_in_fp32": Flag("--accumulate-allreduce-grads-in-fp32", "switch"),
    "fp8": Flag("--fp8-format", "str"),
    "fp8_recipe": Flag("--fp8-recipe", "str"),
    "fp8_amax_history_len": Flag("--fp8-amax-history-len", "int"),
    "fp8_amax_compute_algo": Flag("--fp8-amax-compute-algo", "str"),
    "fp8_param_gather": Flag("--fp8-param-gather", "switch"),
    "reuse_grad_buf_for_mxfp8_param_ag": Flag("--reuse-grad-buf-for-mxfp8-param-ag", "switch"),
    # NVFP4 (megatron-core 0.16 TransformerConfig.fp4 / fp4_recipe / first_last_layers_bf16 /
    # num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16, whose argparse names these are)
    "fp4": Flag("--fp4-format", "str"),
    "fp4_recipe": Flag("--fp4-recipe", "str"),
    "first_last_layers_bf16": Flag("--first-last-layers-bf16", "switch"),
    "num_layers_at_start_in_bf16": Flag("--num-layers-at-start-in-bf16", "int"),
    "num_layers_at_end_in_bf16": Flag("--num-layers-at-end-in-bf16", "int"),
    "cuda_graph_impl": Flag("--cuda-graph-impl", "str"),
    "cuda_graph_scope": Flag("--cuda-graph-scope", "list"),
    "cross_entropy_loss_fusion": Flag("--cross-entropy-loss-fusion", "switch"),
    "cross_entropy_fusion_impl": Flag("--cross-entropy-fusion-impl", "str"),
    # model shape
    "num_layers": Flag("--num-layers", "int"),
    "hidden_size": Flag("--hidden-size", "int"),
    "ffn_hidden_size": Flag("--ffn-hidden-size", "int"),
    "num_attention_heads": Flag("--num-attention-heads", "int"),
    "kv_channels": Flag("--kv-channels", "int"),
    "group_query_attention": Flag("--group-query-attention", "switch"),
    "num_query_groups": Flag("--num-query-groups", "int"),
    "swiglu": Flag("--swiglu", "switch"),
    "quick_geglu": Flag("--quick-geglu", "switch"),
    "squared_relu": Flag("--squared-relu", "switch"),
    "normalization": Flag("--normalization", "str"),
    "norm_epsilon": Flag("--norm-epsilon", "float"),
    "qk_layernorm": Flag("--qk-layernorm", "switch"),
    "position_embedding_type": Flag("--position-embedding-type", "str"),
    "max_position_embeddings": Flag("--max-position-embeddings", "int"),
    "rotary_base": Flag("--rotary-base", "int"),
    "untie_embeddings_and_output_weights": Flag("--untie-embeddings-and-output-weights", "switch"),
    "add_bias_linear": Flag("--disable-bias-linear", "negswitch"),
    "add_qkv_bias": Flag("--add-qkv-bias", "switch"),
    "attention_dropout": Flag("--attention-dropout", "float"),
    "hidden_dropout": Flag("--hidden-dropout", "float"),
    "attention_backend": Flag("--attention-backend", "str"),
    # mixture of experts
    "num_experts": Flag("--num-experts", "int"),
    "moe_layer_freq": Flag("--moe-layer-freq", "pattern"),
    "moe_router_topk": Flag("--moe-router-topk", "int"),
    "moe_ffn_hidden_size": Flag("--moe-ffn-hidden-size", "int"),
    "moe_shared_expert_intermediate_size": Flag("--moe-shared-expert-intermediate-size", "int"),
    "moe_shared_expert_overlap": Flag("--moe-shared-expert-overlap", "switch"),
    "overlap_moe_expert_parallel_comm": Flag("--overlap-moe-expert-parallel-comm", "switch"),
    "moe_grouped_gemm": Flag("--moe-grouped-gemm", "switch"),
    "moe_token_dispatcher_type": Flag("--moe-token-dispatcher-type", "str"),
    "moe_flex_dispatcher_backend": Flag("--moe-flex-dispatcher-backend", "str"),
    "moe_deepep_num_sms": Flag("--moe-deepep-num-sms", "int"),
    "moe_hybridep_num_sms": Flag("--moe-hybridep-num-sms", "int"),
    "moe_router_padding_for_quantization": Flag("--moe-router-padding-for-quantization", "switch"),
    "moe_router_num_groups": Flag("--moe-router-num-groups", "int"),
    "moe_router_group_topk": Flag("--moe-router-group-topk", "int"),
    "moe_router_load_balancing_type": Flag("--moe-router-load-balancing-type", "str"),
    "moe_router_pre_softmax": Flag("--moe-router-pre-softmax", "switch"),
    "mtp_num_layers": Flag("--mtp-num-layers", "int"),
    # hybrid Mamba-Transformer stacks (pretrain_mamba.py)
    "is_hybrid_model": Flag("--is-hybrid-model", "switch"),
    "hybrid_override_pattern": Flag("--hybrid-override-pattern", "str"),
    "mamba_num_heads": Flag("--mamba-num-heads", "int"),
    "mamba_head_dim": Flag("--mamba-head-dim", "int"),
    "mamba_state_dim": Flag("--mamba-state-dim", "int"),
    "mamba_num_groups": Flag("--mamba-num-groups", "int"),
    # multi-head latent attention
    "multi_latent_attention": Flag("--multi-latent-attention", "switch"),
    "q_lora_rank": Flag("--q-lora-rank", "int"),
    "kv_lora_rank": Flag("--kv-lora-rank", "int"),
    "qk_head_dim": Flag("--qk-head-dim", "int"),
    "qk_pos_emb_head_dim": Flag("--qk-pos-emb-head-dim", "int"),
    "v_head_dim": Flag("--v-head-dim", "int"),
    # windowed attention and attention sinks
    "window_size": Flag("--window-size", "pair"),
    "window_attn_skip_freq": Flag("--window-attn-skip-freq", "pattern"),
    "softmax_type": Flag("--softmax-type", "str"),
}

#: Flags Megatron-LM's parser generates from megatron-core's TransformerConfig fields (its
#: ArgumentGroupFactory: `--` + field name with `-`, a bool field defaulting to False a switch);
#: the others above are written out in megatron/training/arguments.py (core_v0.16.1).
TRANSFORMER_CONFIG_FLAGS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                            "moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm", "moe_grouped_gemm",
                            "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_router_num_groups",
                            "moe_router_group_topk",
                            "moe_router_pre_softmax", "mtp_num_layers", "multi_latent_attention", "softmax_type",
                            "cpu_offloading_num_layers", "moe_deepep_num_sms", "moe_hybridep_num_sms",
                            "cross_entropy_fusion_impl", "moe_router_padding_for_quantization", "is_hybrid_model",
                            "mamba_num_heads", "mamba_head_dim", "mamba_state_dim", "mamba_num_groups")
#: megatron-core 0.16's MambaMixer defaults, which no config field or flag changes: the convolution width (d_conv)
#: and the SSD chunk length (chunk_size)
MAMBA_CONV_KERNEL, MAMBA_CHUNK_SIZE = 4, 128

# planner vocabulary -> Megatron values
_ZERO_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}
_NORM = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
_POSITION = {"learned": "learned_absolute", "rope": "rope", "none": "none"}
#: --attention-backend (megatron/core/models/common/language_module/language_module.py, core_v0.16.1): `flash` sets
#: NVTE_FLASH_ATTN=1, NVTE_FUSED_ATTN=0 (the flash-attn package: FlashAttention-2, or 3 where flash-attn 3 is
#: installed on Hopper); `auto` lets Transformer Engine choose, which prefers its cuDNN FusedAttention on Hopper and
#: newer: the kernel the plan's `flash` is timed as (profiles/kernels/attention/*.yaml).
_ATTENTION = {"flash": "auto", "flash2": "flash", "unfused": "unfused"}
OFFLOAD_FRACTION = 1.0  # share of the optimizer states and step on the CPU (offload_optimizer: all)
_DROPOUT_P = 0.1  # GPT-2/3 style dropout probability where ModelSpec.dropout is set
FP8_SETTINGS = {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max"}
#: MoE choices for a plan (see the module docstring): all-to-all token dispatch, one grouped GEMM
#: for a rank's local experts, Megatron's default router load balancing
MOE_SETTINGS = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall",
                "moe_router_load_balancing_type": "aux_loss"}


def settings(plan: Plan) -> dict[str, Any]:
    """The plan as Megatron-LM argparse destinations, in the order the flags are printed."""
    f = check_plan(plan, FRAMEWORK)
    s, t = f.strategy, plan.train
    out: dict[str, Any] = {
        "tensor_model_parallel_size": s.tp,
        "pipeline_model_parallel_size": s.pp,
    }
    if s.stage_layers is not None:
        out["pipeline_model_parallel_layout"] = pipeline_layout(f.layers_per_chunk(), plan.model.num_mtp_layers)
    elif s.vpp > 1:
        out["num_virtual_stages_per_pipeline_rank"] = s.vpp
    if s.num_layers_in_first_stage is not None:
        out["decoder_first_pipeline_num_layers"] = s.num_layers_in_first_stage
    if s.num_layers_in_last_stage is not None:
        out["decoder_last_pipeline_num_layers"] = s.num_layers_in_last_stage
    if s.vpp > 1 and not s.overlap_p2p_comm:  # Megatron-LM overlaps an interleaved schedule's transfers by default
        out["overlap_p2p_comm"] = False
    if s.embedding_as_layer:
        out["account_for_embedding_in_pipeline_split"] = True
    if s.loss_as_layer:
        out["account_for_loss_in_pipeline_split"] = True
    out["context_parallel_size"] = s.cp
    if s.rank_order == "tp-cp-ep-pp-dp":  # Megatron-LM's initialize: order "tp-cp-ep-pp-dp" under this switch
        out["use_tp_pp_dp_mapping"] = True
    if plan.model.is_moe:  # always both: Megatron-LM's default etp is tp, not 1
        out["expert_model_parallel_size"] = s.ep
        out["expert_tensor_parallel_size"] = s.etp
    if s.sequence_parallel:
        out["sequence_parallel"] = True
        if s.tp > 1 and plan.cluster.tp_comm_overlap > 0:  # the cost model pipelines TP comm with the GEMMs
            out["tp_comm_overlap"] = True
    out |= {"micro_batch_size": s.micro_batch_size, "global_batch_size": t.global_batch_size, "seq_length": t.seq_len}
    out |= _recompute(f)
    out |= _activation_offload(f)
    out |= _data_parallel(f)
    out |= _precision(f)
    out |= _model_shape(f)
    out |= _moe(f)
    out |= _attention_variants(f)
    out |= _hybrid(f)
    return out


def _hybrid(f: PlanFacts) -> dict[str, Any]:
    """pretrain_mamba.py's hybrid-stack flags (see the module docstring), or nothing for a transformer stack."""
    m, s = f.model, f.strategy
    if not m.is_hybrid:
        return {}

    def refuse(reason: str) -> None:
        raise NotExpressibleError(FRAMEWORK, f"hybrid model {one_line(clip(m.name))}: {reason}")

    if s.vpp > 1:
        refuse(f"vpp ({s.vpp}) > 1; megatron-core 0.16's MambaStack runs no interleaved pipeline")
    if s.stage_layers is not None or s.embedding_as_layer or s.loss_as_layer:
        refuse("an explicit stage split or the embedding/loss counted as a layer; megatron-core 0.16's MambaStack "
               "splits a hybrid stack by the first/last-stage layer counts only")
    out: dict[str, Any] = {"is_hybrid_model": True, "hybrid_override_pattern": m.hybrid_override_pattern}
    if "M" in m.hybrid_override_pattern:
        for name, value, fixed in (("mamba_conv_kernel", m.mamba_conv_kernel, MAMBA_CONV_KERNEL),
                                   ("mamba_chunk_size", m.mamba_chunk_size, MAMBA_CHUNK_SIZE)):
            if value != fixed:
                refuse(f"{name} {value}; megatron-core 0.16's MambaMixer uses {fixed} and has no setting for it")
        out |= {"mamba_num_heads": m.mamba_heads, "mamba_head_dim": m.mamba_head_dim,
                "mamba_state_dim": m.mamba_state_dim, "mamba_num_groups": m.mamba_num_groups}
    return out


# Megatron-core's layout alphabet (transformer/pipeline_parallel_layer_layout.py) and the two
# repeat forms its `parse_str_to_list` unrolls, `(...)*n` and `x*n`, in that order.
LAYOUT_EMBEDDING, LAYOUT_LAYER, LAYOUT_MTP, LAYOUT_LOSS = "E", "t", "m", "L"
_LAYOUT_REPEATS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")


def pipeline_layout(layers_per_chunk: list[int], num_mtp_layers: int = 0) -> str:
    """`--pipeline-model-parallel-layout` for per-virtual-stage layer counts in schedule order
    (stage c·pp + r on pipeline rank r, the order megatron-core reads): the embedding before the
    first stage's layers, the MTP layers and the loss after the last's, runs of three or more
    equal stages as `(t*n|)*k`.

    >>> pipeline_layout([3] + [4] * 30 + [3])
    'Et*3|(t*4|)*30,t*3L'
    >>> pipeline_layout([1, 2, 2, 3])
    'Et|t*2|t*2|t*3L'
    >>> pipeline_layout([4] * 15 + [1], num_mtp_layers=1)  # DeepSeek-V3, Megatron-Bridge
    'Et*4|(t*4|)*14,tmL'
    """
    stages = [LAYOUT_LAYER * n if n < 2 else f"{LAYOUT_LAYER}*{n}" for n in layers_per_chunk]
    stages[0] = LAYOUT_EMBEDDING + stages[0]
    stages[-1] += LAYOUT_MTP * num_mtp_layers + LAYOUT_LOSS
    runs = [(stage, len(list(same))) for stage, same in itertools.groupby(stages)]
    text = ""
    for k, (stage, run) in enumerate(runs):
        final = k == len(runs) - 1
        text += f"({stage}|)*{run}," if run >= 3 and not final else "|".join([stage] * run) + ("" if final else "|")
    return text


def layout_stages(layout: str) -> list[str]:
    """The virtual stages of a layout string, unrolled as megatron-core's `parse_str_to_list` does
    (commas are cosmetic)."""
    text = layout.replace(",", "")
    for pattern in _LAYOUT_REPEATS:
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def _recompute(f: PlanFacts) -> dict[str, Any]:
    s = f.strategy
    if s.recompute == "none":
        return {}
    if s.recompute == "selective":
        modules = {"recompute_modules": list(s.recompute_modules)} if s.recompute_modules else {}
        return {"recompute_granularity": "selective"} | modules
    if s.recompute_num_layers is None:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": s.recompute_num_layers}


def _activation_offload(f: PlanFacts) -> dict[str, Any]:
    """`--cpu-offloading-num-layers N` and megatron-core's own rules for it (TransformerConfig.__post_init__,
    core_v0.16.1), which the Strategy checks too, except the bound that needs the model."""
    s, layers = f.strategy, f.model.num_layers
    n = s.offload_activation_layers
    if not n:
        return {}
    if n >= layers:
        raise NotExpressibleError(FRAMEWORK, f"offload_activation_layers ({n}) must be below num_layers ({layers}); "
                                             "megatron-core offloads the activations of fewer layers than the model has")
    if s.pp > 1 or s.recompute != "none":
        raise NotExpressibleError(FRAMEWORK, f"offload_activation_layers ({n}) with pp ({s.pp}) and recompute "
                                             f"{s.recompute!r}; megatron-core offloads activations with pp 1 and no "
                                             "recomputation only")
    return {"cpu_offloading_num_layers": n}


def _data_parallel(f: PlanFacts) -> dict[str, Any]:
    s = f.strategy
    out: dict[str, Any] = {}
    if s.zero_stage >= 1:
        out["use_distributed_optimizer"] = True
    if s.zero_stage >= 2:
        out |= {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": _ZERO_SHARDING[s.zero_stage],
                "gradient_accumulation_fusion": False, "ckpt_format": "fsdp_dtensor"}
    if s.overlap_grad_reduce:
        out["overlap_grad_reduce"] = True
        # Megatron gathers parameters only when they are sharded, and only with overlapped reduction.
        if s.overlap_param_gather and s.zero_stage >= 1:
            out["overlap_param_gather"] = True
    out["optimizer"] = f.train.optimizer
    if s.offload_optimizer:
        if f.train.optimizer != "adam":
            raise NotExpressibleError(FRAMEWORK, f"offload_optimizer with optimizer {f.train.optimizer!r}; "
                                                 "Megatron's CPU-offloaded (precision-aware) optimizer is Adam only")
        # the whole optimizer on the host (Megatron-LM's default fraction is 1.0, megatron-core's 0.0)
        out |= {"optimizer_cpu_offload": True, "optimizer_offload_fraction": OFFLOAD_FRACTION,
                "use_precision_aware_optimizer": True}
    return out


def _precision(f: PlanFacts) -> dict[str, Any]:
    precision, grads = f.train.precision, f.train.grad_precision
    compute = "fp16" if precision == "fp16" else "bf16"
    out: dict[str, Any] = {compute: True}
    if grads not in ("fp32", compute):
        raise NotExpressibleError(FRAMEWORK, f"grad_precision {grads!r} with precision {precision!r}; Megatron reduces "
                                             f"gradients in fp32 or in the {compute} compute type")
    if grads == "bf16":
        out["grad_reduce_in_bf16"] = True
    if grads == "fp32" and compute == "fp16":
        out["accumulate_allreduce_grads_in_fp32"] = True
    if precision == "fp8":  # the amax history settings belong to the delayed recipe only
        recipe = f.train.fp8_recipe
        out |= {k: v for k, v in FP8_SETTINGS.items() if recipe == "delayed" or not k.startswith("fp8_amax")}
        out["fp8_recipe"] = recipe
        out |= _fp8_param_gather(f)
    if precision == "nvfp4":  # NVFP4BlockScaling: FP4 E2M1 data, the recipe's own scales
        out |= {"fp4": "e2m1", "fp4_recipe": "nvfp4"}
        start, end = f.train.fp4_bf16_layers_start, f.train.fp4_bf16_layers_end
        if start or end:  # megatron-core's defaults are 1 and 1: both written
            out |= {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": start,
                    "num_layers_at_end_in_bf16": end}
    if f.train.cuda_graph_impl != "none":  # megatron-core's TransformerConfig fields (cuda_graph_impl, cuda_graph_scope)
        out["cuda_graph_impl"] = f.train.cuda_graph_impl
        if f.train.cuda_graph_scope:  # an empty scope is the whole layer, megatron-core's default
            out["cuda_graph_scope"] = list(f.train.cuda_graph_scope)
    if f.train.cross_entropy_fusion:
        out["cross_entropy_loss_fusion"] = True
        if f.train.cross_entropy_fusion_impl != "native":  # megatron-core's default (ModelParallelConfig)
            out["cross_entropy_fusion_impl"] = f.train.cross_entropy_fusion_impl
    return out


def _fp8_param_gather(f: PlanFacts) -> dict[str, Any]:
    """`--fp8-param-gather` and what it needs (Megatron-LM core_v0.16.1 arguments.py validate_args)."""
    s, t = f.strategy, f.train
    if not t.fp8_param_gather:
        return {}
    if s.zero_stage < 1:
        raise NotExpressibleError(FRAMEWORK, "fp8_param_gather with zero_stage 0; --fp8-param-gather needs the "
                                             "distributed optimizer or Megatron-FSDP (zero_stage >= 1)")
    if s.offload_optimizer and t.fp8_recipe != "delayed":
        raise NotExpressibleError(FRAMEWORK, f"fp8_param_gather with offload_optimizer and fp8_recipe {t.fp8_recipe!r}; "
                                             "Megatron-LM allows the CPU-offloaded optimizer with FP8 parameters "
                                             "of the delayed recipe only")
    out: dict[str, Any] = {"fp8_param_gather": True}
    if t.fp8_recipe == "mxfp8" and s.zero_stage == 1:
        out["reuse_grad_buf_for_mxfp8_param_ag"] = True
    return out


def _model_shape(f: PlanFacts) -> dict[str, Any]:
    m, t = f.model, f.train
    out: dict[str, Any] = {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads,
    }
    if m.head_size * m.num_attention_heads != m.hidden_size:
        out["kv_channels"] = m.head_size
    if m.kv_heads != m.num_attention_heads:
        out |= {"group_query_attention": True, "num_query_groups": m.kv_heads}
    if m.gated_mlp:  # megatron-core 0.16 has flags for SwiGLU and quick-GEGLU only (glu_omissions says the rest)
        if m.glu_activation == "quick_gelu" and (not all(m.moe_layer_mask()) or m.num_shared_experts):
            raise NotExpressibleError(FRAMEWORK, f"model {one_line(clip(m.name))}'s quick-GEGLU in a dense MLP "
                                      "(dense layers or shared experts): megatron-core 0.16 fuses quick-GEGLU only in the "
                                      "grouped experts, "
                                      "its dense MLP raises with Megatron-LM's default bias-activation fusion, and "
                                      "--no-bias-gelu-fusion would run the experts' activation unfused, which the "
                                      "plan was not costed with")
        out["quick_geglu" if m.glu_activation == "quick_gelu" else "swiglu"] = True
    elif m.mlp_activation == "squared_relu":
        out["squared_relu"] = True
    out["normalization"] = _NORM[m.norm]
    out["norm_epsilon"] = m.norm_epsilon  # always: Megatron-LM's default (1e-5) is not every model's (Qwen: 1e-6)
    if m.qk_norm == "per_head":  # megatron-core's q_layernorm / k_layernorm: hidden_size_per_attention_head wide
        out["qk_layernorm"] = True
    out["position_embedding_type"] = _POSITION[m.position_embedding]
    table = m.max_position_embeddings
    out["max_position_embeddings"] = table if m.position_embedding == "learned" else max(table, t.seq_len)
    base = rope_base(m)
    if base is not None:
        out["rotary_base"] = base
    if not m.tie_embeddings:
        out["untie_embeddings_and_output_weights"] = True
    if not m.linear_bias:
        out["add_bias_linear"] = False
        if m.qkv_bias:
            out["add_qkv_bias"] = True
    p = _DROPOUT_P if m.dropout else 0.0
    if t.attention_kernel not in _ATTENTION:
        raise NotExpressibleError(FRAMEWORK, f"attention_kernel {t.attention_kernel!r}; Transformer Engine's attention "
                                  "backends are cuDNN (auto), flash-attn 2 or 3 (flash) and unfused, none of them "
                                  "FlashAttention v1: plan with attention_kernel flash or flash2")
    out |= {"attention_dropout": p, "hidden_dropout": p, "attention_backend": _ATTENTION[t.attention_kernel]}
    return out


def _moe(f: PlanFacts) -> dict[str, Any]:
    m, s = f.model, f.strategy

    def refuse(reason: str) -> None:
        raise NotExpressibleError(FRAMEWORK, reason)

    if m.num_mtp_layers and m.position_embedding == "learned":
        refuse(f"num_mtp_layers ({m.num_mtp_layers}) with learned position embeddings; Megatron-LM's "
               "multi-token prediction takes rope or none")
    if not m.is_moe:
        return {"mtp_num_layers": m.num_mtp_layers} if m.num_mtp_layers else {}
    if s.tp > 1 and not s.sequence_parallel:
        refuse(f"MoE with tp ({s.tp}) > 1 and no sequence_parallel; megatron-core's MoE layer refuses to train "
               "tensor-parallel without sequence parallelism")
    biases = {"linear_bias": m.linear_bias, "moe_expert_bias": m.moe_expert_bias, "moe_router_bias": m.moe_router_bias}
    if len(set(biases.values())) > 1:
        refuse(", ".join(f"{k}={v}" for k, v in biases.items()) + "; Megatron's one --disable-bias-linear switch "
               "sets the attention, MLP, expert and router biases together")
    if m.linear_bias and s.etp > 1:
        refuse(f"expert biases with etp ({s.etp}) > 1; megatron-core supports MoE biases only with etp 1")
    out: dict[str, Any] = {"num_experts": m.num_experts, "moe_router_topk": m.moe_top_k,
                           "moe_ffn_hidden_size": m.expert_ffn}
    mask = m.moe_layer_mask()
    if not all(mask) and not m.is_hybrid:  # a hybrid stack's MoE layers are its pattern's E
        out["moe_layer_freq"] = layer_pattern([int(x) for x in mask])
    if m.num_shared_experts:
        # the total width of the shared experts, run beside the all-to-all (the cost model hides them there),
        # unless the all-to-all overlaps another micro-batch (megatron-core allows one overlap or the other)
        # megatron-core overlaps the shared experts with the all-to-all dispatcher only (transformer_config.py:
        # "moe_shared_expert_overlap only works with alltoall token dispatcher")
        out |= {"moe_shared_expert_intermediate_size": m.num_shared_experts * m.shared_expert_ffn,
                "moe_shared_expert_overlap": not s.overlap_moe_comm and f.train.moe_dispatcher == "alltoall"}
    if s.overlap_moe_comm:
        out["overlap_moe_expert_parallel_comm"] = True
    out |= MOE_SETTINGS
    if f.train.moe_dispatcher != "alltoall":  # the flex dispatcher and its backend (cost_models.dispatch)
        out |= {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": f.train.moe_dispatcher}
        if f.train.moe_flex_num_sms is not None:  # the SMs the plan's dispatch rates were read at
            out[f"moe_{f.train.moe_dispatcher}_num_sms"] = f.train.moe_flex_num_sms
    if f.train.moe_router_padding_for_quantization:  # the grouped MLP's padding copies are then not costed
        out["moe_router_padding_for_quantization"] = True
    if m.moe_router_num_groups:
        out |= {"moe_router_num_groups": m.moe_router_num_groups, "moe_router_group_topk": m.moe_router_group_topk}
    if m.moe_top_k == 1:  # megatron-core: softmax over one selected expert has no gradient
        out["moe_router_pre_softmax"] = True
    if m.num_mtp_layers:
        out["mtp_num_layers"] = m.num_mtp_layers
    return out


def _attention_variants(f: PlanFacts) -> dict[str, Any]:
    m = f.model
    out: dict[str, Any] = {}
    if m.is_mla:
        out["multi_latent_attention"] = True
        if m.q_lora_rank is not None:  # unset: a full query projection (Megatron-LM's default None)
            out["q_lora_rank"] = m.q_lora_rank
        out |= {"kv_lora_rank": m.kv_lora_rank, "qk_head_dim": m.qk_nope_head_dim,
                "qk_pos_emb_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim}
    local = m.local_attention_mask()
    if any(local):
        # (left, right) tokens besides the query itself: a causal window of W tokens is (W-1, 0)
        out["window_size"] = (m.sliding_window - 1, 0)
        n = m.global_attention_every
        if not all(local):
            # megatron-core: layer number l (1-based) is local when l % n != 0, or when list[l-1] is 1
            regular = m.global_attention_layers is None and n > 0
            out["window_attn_skip_freq"] = n if regular else layer_pattern([int(x) for x in local])
    if m.attention_sinks:
        out["softmax_type"] = "learnable"
    return out


# ---- per-layer patterns: Megatron-LM's `([0]*3+[1]*58)` list expressions ------------------
def layer_pattern(bits: list[int]) -> str:
    """A per-layer 0/1 list as the Python list expression Megatron-LM's `--moe-layer-freq` and
    `--window-attn-skip-freq` accept (digits, `[`, `]`, `,`, `(`, `)`, `+`, `*` only): runs of
    equal values as `[v]*n`, repeated groups of runs as `(...)*k`.

    >>> layer_pattern([0] * 3 + [1] * 58)
    '([0]*3+[1]*58)'
    >>> layer_pattern([0, 1] * 24)
    '([0]+[1])*24'
    >>> expand_pattern(layer_pattern([1, 1, 0, 1, 0, 1, 0, 0]))
    [1, 1, 0, 1, 0, 1, 0, 0]
    """
    runs = [f"[{v}]" + (f"*{n}" if n > 1 else "") for v, n in
            ((v, len(list(g))) for v, g in itertools.groupby(bits))]
    terms: list[str] = []
    i = 0
    while i < len(runs):
        best = (1, 1)  # (group length, repeats)
        for k in range(1, min(4, len(runs) - i) + 1):
            reps = 1
            while runs[i + reps * k:i + (reps + 1) * k] == runs[i:i + k]:
                reps += 1
            if reps > 1 and k * (reps - 1) > best[0] * (best[1] - 1):
                best = (k, reps)
        k, reps = best
        group = "+".join(runs[i:i + k])
        terms.append(f"({group})*{reps}" if reps > 1 else group)
        i += k * reps
    text = "+".join(terms)
    return text if len(terms) == 1 and text.startswith("(") else f"({text})"


_PATTERN_TOKEN = re.compile(r"\s*(\d+|[\[\](),+*])")


def expand_pattern(text: str) -> int | list[int]:
    """Read a `--moe-layer-freq` / `--window-attn-skip-freq` value back: an integer, or a list
    expression of `[..]` lists, `+` and `*` (parsed here, never evaluated)."""
    if text.strip().isdigit():
        return int(text)
    tokens = _PATTERN_TOKEN.findall(text)
    if "".join(tokens) != re.sub(r"\s", "", text):
        raise ValueError(f"not a layer pattern: {text!r}")
    pos = 0

    def take(expected: str | None = None) -> str:
        nonlocal pos
        if pos >= len(tokens) or (expected is not None and tokens[pos] != expected):
            raise ValueError(f"not a layer pattern: {text!r}")
        pos += 1
        return tokens[pos - 1]

    def expr() -> list[int]:
        out = term()
        while pos < len(tokens) and tokens[pos] == "+":
            take("+")
            out = out + term()
        return out

    def term() -> list[int]:
        if tokens[pos] == "(":
            take("(")
            out = expr()
            take(")")
        else:
            take("[")
            out = [int(take())]
            while tokens[pos] == ",":
                take(",")
                out.append(int(take()))
            take("]")
        while pos < len(tokens) and tokens[pos] == "*":
            take("*")
            out = out * int(take())
        return out

    result = expr()
    if pos != len(tokens):
        raise ValueError(f"not a layer pattern: {text!r}")
    return result


# ---- flags <-> settings ------------------------------------------------------------
def to_args(values: dict[str, Any]) -> list[str]:
    """Render settings as argv tokens through the mapping table."""
    argv: list[str] = []
    for dest, value in values.items():
        flag = FLAGS[dest]
        if flag.kind == "switch":
            if value:
                argv.append(flag.flag)
        elif flag.kind == "negswitch":
            if not value:
                argv.append(flag.flag)
        elif flag.kind == "list":
            argv += [flag.flag, *map(str, value)]
        else:
            argv += [flag.flag, _format(value)]
    return argv


def _format(value: Any) -> str:
    if isinstance(value, tuple):  # Megatron-LM's tuple_type: "a,b"
        return ",".join(map(str, value))
    return repr(value) if isinstance(value, float) else str(value)


_BY_FLAG = {flag.flag: (dest, flag) for dest, flag in FLAGS.items()}
_CASTS = {"int": int, "float": float, "str": str, "pattern": expand_pattern,
          "pair": lambda text: tuple(int(v) for v in text.strip("()").split(","))}


def parse_args(argv: list[str]) -> dict[str, Any]:
    """Read argv tokens back into argparse destinations through the mapping table."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token not in _BY_FLAG:
            raise ValueError(f"unknown Megatron-LM flag {token!r} (not in the mapping table)")
        dest, flag = _BY_FLAG[token]
        if flag.kind in ("switch", "negswitch"):
            out[dest] = flag.kind == "switch"
            i += 1
        elif flag.kind == "list":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            out[dest] = list(argv[i + 1:j])
            i = j
        else:
            out[dest] = _CASTS[flag.kind](argv[i + 1])
            i += 2
    return out


# ---- argparse destinations -> megatron-core config kwargs ---------------------------
_PARALLEL_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
                    "tp_comm_overlap")
_TRANSFORMER_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
                       "normalization", "qk_layernorm", "add_bias_linear", "add_qkv_bias", "attention_dropout",
                       "hidden_dropout", "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
                       "fp8", "fp8_recipe", "fp4", "fp4_recipe", "first_last_layers_bf16",
                       "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
                       "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
                       "fp8_amax_history_len", "fp8_amax_compute_algo", "attention_backend",
                       "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                       "account_for_loss_in_pipeline_split",
                       "moe_layer_freq", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                       "moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm", "moe_grouped_gemm",
                       "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_router_num_groups",
                       "moe_router_group_topk", "moe_deepep_num_sms", "moe_hybridep_num_sms",
                       "moe_router_padding_for_quantization", "moe_router_load_balancing_type", "moe_router_pre_softmax", "mtp_num_layers",
                       "window_size", "window_attn_skip_freq", "softmax_type", "multi_latent_attention",
                       "is_hybrid_model", "mamba_num_heads", "mamba_head_dim", "mamba_state_dim", "mamba_num_groups",
                       "cuda_graph_impl", "cuda_graph_scope")
#: MLATransformerConfig fields, with Megatron-LM's argument defaults (arguments.py `_add_mla_args`)
_MLA_FIELDS = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
_RENAMED = {"decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
            "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
            "num_experts": "num_moe_experts"}


def core_config_kwargs(args: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Megatron-LM's translation of its arguments into megatron-core configs.

    Returns kwargs for `parallel` (ModelParallelConfig), `initialize` (initialize_model_parallel's rank
    `order`), `transformer`
    (TransformerConfig), `ddp` (DistributedDataParallelConfig), `optimizer`
    (OptimizerConfig), `gpt` (GPTModel arguments) and `training` (batch and
    sequence). Dtypes are names (`bfloat16`); `swiglu` is `gated_linear_unit`
    plus `activation_func="silu"`, which the caller resolves to `F.silu`. With
    `multi_latent_attention` the transformer kwargs are an MLATransformerConfig's
    (Megatron-LM's `core_transformer_config_from_args` switches the class).
    """
    bf16, fp16 = bool(args.get("bf16")), bool(args.get("fp16"))
    dtype = "bfloat16" if bf16 else "float16" if fp16 else "float32"
    parallel = {k: args[k] for k in _PARALLEL_FIELDS if k in args}
    vpp = args.get("num_virtual_stages_per_pipeline_rank")
    if args.get("pipeline_model_parallel_layout"):  # the layout fixes vpp (Megatron-LM's validate_args)
        vpp = len(layout_stages(args["pipeline_model_parallel_layout"])) // args["pipeline_model_parallel_size"]
    parallel["virtual_pipeline_model_parallel_size"] = vpp if vpp and vpp > 1 else None
    # validate_args turns the p2p overlap off without an interleaved schedule; kw_args['batch_p2p_comm'] =
    # not args.overlap_p2p_comm (arguments.py core_v0.16.1)
    overlap_p2p = bool(args.get("overlap_p2p_comm", True)) and bool(vpp and vpp > 1)
    parallel |= {"overlap_p2p_comm": overlap_p2p, "batch_p2p_comm": not overlap_p2p}
    parallel |= {"params_dtype": dtype, "pipeline_dtype": dtype, "bf16": bf16, "fp16": fp16}
    if "gradient_accumulation_fusion" in args:
        parallel["gradient_accumulation_fusion"] = args["gradient_accumulation_fusion"]
    transformer = dict(parallel)
    transformer |= {k: args[k] for k in _TRANSFORMER_FIELDS if k in args}
    transformer |= {new: args[old] for old, new in _RENAMED.items() if old in args}
    # core_transformer_config_from_args: kw_args['layernorm_epsilon'] = args.norm_epsilon
    transformer["layernorm_epsilon"] = args.get("norm_epsilon", MEGATRON_NORM_EPSILON)
    if args.get("fp8_param_gather"):  # Megatron-LM: kw_args['fp8_param'] = args.fp8_param_gather
        transformer["fp8_param"] = True
    if args.get("cpu_offloading_num_layers"):  # validate_args: args.cpu_offloading = True when N > 0
        transformer |= {"cpu_offloading": True, "cpu_offloading_num_layers": args["cpu_offloading_num_layers"]}
    if args.get("add_bias_linear", True):
        transformer["add_qkv_bias"] = True  # Megatron keeps the two bias switches in sync
    transformer["num_query_groups"] = args["num_query_groups"] if args.get("group_query_attention") else None
    for key in ("moe_layer_freq", "window_attn_skip_freq"):
        if isinstance(transformer.get(key), str):
            transformer[key] = expand_pattern(transformer[key])
    if args.get("multi_latent_attention"):  # Megatron-LM then builds an MLATransformerConfig
        transformer |= {k: args.get(k, default) for k, default in _MLA_FIELDS.items()}
    if args.get("swiglu"):
        transformer |= {"gated_linear_unit": True, "activation_func": "silu"}
    elif args.get("quick_geglu"):  # Megatron-LM: gated_linear_unit and megatron-core's quick_gelu
        transformer |= {"gated_linear_unit": True, "activation_func": "quick_gelu"}
    elif args.get("squared_relu"):  # Megatron-LM: megatron-core's squared_relu, no gate
        transformer["activation_func"] = "squared_relu"
    grads_fp32 = bool(args.get("accumulate_allreduce_grads_in_fp32")) or (bf16 and not args.get("grad_reduce_in_bf16"))
    ddp = {
        "use_distributed_optimizer": bool(args.get("use_distributed_optimizer")),
        "overlap_grad_reduce": bool(args.get("overlap_grad_reduce")),
        "overlap_param_gather": bool(args.get("overlap_param_gather")),
        "grad_reduce_in_fp32": grads_fp32,
        "use_megatron_fsdp": bool(args.get("use_megatron_fsdp")),
        "data_parallel_sharding_strategy": args.get("data_parallel_sharding_strategy", "no_shard"),
        "fp8_param_gather": bool(args.get("fp8_param_gather")),
        "reuse_grad_buf_for_mxfp8_param_ag": bool(args.get("reuse_grad_buf_for_mxfp8_param_ag")),
    }
    optimizer = {
        "optimizer": args.get("optimizer", "adam"), "bf16": bf16, "fp16": fp16, "params_dtype": dtype,
        "use_distributed_optimizer": ddp["use_distributed_optimizer"],
        "optimizer_cpu_offload": bool(args.get("optimizer_cpu_offload")),
        "optimizer_offload_fraction": args.get("optimizer_offload_fraction", 1.0),
        "use_precision_aware_optimizer": bool(args.get("use_precision_aware_optimizer")),
        "reuse_grad_buf_for_mxfp8_param_ag": ddp["reuse_grad_buf_for_mxfp8_param_ag"],
    }
    gpt = {
        "position_embedding_type": args.get("position_embedding_type", "learned_absolute"),
        "max_sequence_length": args["max_position_embeddings"],
        "rotary_base": args.get("rotary_base", MEGATRON_ROTARY_BASE),
        "share_embeddings_and_output_weights": not args.get("untie_embeddings_and_output_weights", False),
    }
    if args.get("hybrid_override_pattern"):  # pretrain_mamba.py passes it to MambaModel, not to the config
        gpt["hybrid_override_pattern"] = args["hybrid_override_pattern"]
    training = {k: args[k] for k in ("micro_batch_size", "global_batch_size", "seq_length")}
    # megatron/training/initialize.py: initialize_model_parallel(order=...) from --use-tp-pp-dp-mapping
    initialize = {"order": "tp-cp-ep-pp-dp" if args.get("use_tp_pp_dp_mapping") else "tp-cp-ep-dp-pp"}
    return {"parallel": parallel, "transformer": transformer, "ddp": ddp, "optimizer": optimizer, "gpt": gpt,
            "training": training, "initialize": initialize}


#: Megatron-LM's --rotary-base default (and megatron-core GPTModel's rotary_base)
MEGATRON_ROTARY_BASE = 10000
#: Megatron-LM's --norm-epsilon default (and megatron-core TransformerConfig's layernorm_epsilon)
MEGATRON_NORM_EPSILON = 1e-5


def rope_base(model) -> int | None:
    """The model's RoPE base (`rope_theta` of its Hugging Face config) when the spec holds one;
    None for a model without RoPE or a spec that does not say."""
    if model.position_embedding != "rope":
        return None
    theta = getattr(model, "rope_theta", None)
    if theta is None:
        return None
    if float(theta) != int(theta):
        raise NotExpressibleError(FRAMEWORK, f"rope_theta ({theta}) is not an integer; --rotary-base takes an int")
    return int(theta)


def qk_norm_omissions(plan: Plan, switch: str) -> list[str]:
    """Query/key norms over all heads together (OLMo 2), which megatron-core's `switch` (q_layernorm / k_layernorm,
    hidden_size_per_attention_head wide) does not build: the output builds the model without them."""
    m = plan.model
    if m.qk_norm != "full":
        return []
    return [f"query/key norms: model {m.name} normalises all query heads together and all key heads together "
            f"(qk_norm full, OLMo 2); megatron-core's {switch} normalises each head on its own, so the model is "
            "built without query/key norms"]


def glu_omissions(plan: Plan, where: str) -> list[str]:
    """What of a gated MLP's activation `where` (Megatron-LM's flags) cannot say: a GeGLU gate (no flag; built as
    SwiGLU, same shapes and cost), and gpt-oss's linear offset and clamp (megatron-core's glu_linear_offset and
    activation_func_clamp_value have no flag in Megatron-LM 0.16; built without them)."""
    m = plan.model  # a model without a gated MLP has none of these (ModelSpec refuses them)
    out = []
    if m.glu_activation in ("gelu", "gelu_tanh"):
        out.append(f"GeGLU: model {m.name}'s gated MLP gates with {m.glu_activation}, for which {where} have no switch "
                   "(--swiglu and --quick-geglu only), so they build SwiGLU (same shapes, parameters and cost)")
    parts = [f"{k} {v:g}" for k, v in m.glu_settings().items() if k != "glu_activation"]
    if parts:
        out.append(f"{' and '.join(parts)}: model {m.name}'s gated MLP adds an offset to its linear branch and/or "
                   f"clamps its branches, which {where} cannot carry (megatron-core's glu_linear_offset and "
                   "activation_func_clamp_value have no Megatron-LM 0.16 flag), so they build it without; "
                   "Megatron-Bridge's recipe for the model sets them itself")
    return out


def flag_omissions(plan: Plan) -> list[str]:
    """What of the model the flags cannot say: query/key norms over all heads together (OLMo 2), which
    megatron-core's --qk-layernorm (one head wide) does not build; a gated MLP's gate they have no switch for
    (`glu_omissions`); the RoPE base, when the model spec cannot say it (Megatron would use its default silently);
    and YaRN scaling of standard attention (they would run plain RoPE)."""
    m = plan.model
    out = qk_norm_omissions(plan, "--qk-layernorm") + glu_omissions(plan, "these flags")
    if m.position_embedding == "rope" and not m.is_mla and rope_base(m) is None:
        out.append(f"--rotary-base: model {m.name} has no rope_theta in its spec, so Megatron's default "
                   f"{MEGATRON_ROTARY_BASE} would apply; add --rotary-base <rope_theta of its config.json>")
    if m.rope_scaling == "yarn" and not m.is_mla:
        out.append(f"YaRN rotary scaling: model {m.name}'s rotary embedding is YaRN-scaled, which these flags do not "
                   "carry: megatron-core 0.16's pretrain_gpt.py has no yarn position embedding for standard attention "
                   "(--rope-type yarn is multi-latent attention's; Megatron-LM core_v0.19 adds --position-embedding-type "
                   "yarn with --yarn-* factors, which the model spec does not hold), so they run plain RoPE; "
                   "Megatron-Bridge's recipe for the model sets YaRN itself")
    return out


def environment(plan: Plan) -> dict[str, str]:
    """Environment Megatron-LM needs for this plan on every rank."""
    s = check_plan(plan, FRAMEWORK).strategy
    # TP/CP communication must be issued in order (Hopper and older); Megatron-FSDP wants the opposite.
    if (s.tp > 1 or s.cp > 1) and s.zero_stage < 2:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def megatron_args(plan: Plan) -> list[str]:
    return to_args(settings(plan))


class MegatronEmitter:
    name = "megatron"
    framework = FRAMEWORK
    runs = RUNS
    syntax = "shell"

    def data(self, plan: Plan, options: EmitOptions) -> dict[str, Any]:
        return {"args": megatron_args(plan), "env": environment(plan)}

    def render(self, plan: Plan, options: EmitOptions) -> str:
        args = megatron_args(plan)
        env = environment(plan)
        script = "pretrain_mamba.py" if plan.model.is_hybrid else "pretrain_gpt.py"
        head = (comment("# Megatron-LM ", describe(plan, RUNS)) + "\n"
                "# Add your data, tokenizer, learning-rate and checkpoint flags, then run\n"
                f"#   torchrun ... {script} \"${{MEGATRON_ARGS[@]}}\" ...\n")
        exports = "".join(f"export {check_name('environment variable', k, SHELL_IDENTIFIER)}={shell_word(v)}\n"
                          for k, v in env.items())
        return head + exports + shell_array("MEGATRON_ARGS", args)

    def omissions(self, plan: Plan, options: EmitOptions) -> list[str]:
        megatron_args(plan)
        return flag_omissions(plan)


REGISTRY.register(MegatronEmitter())
