"""What the PyTorch executor can run, decided before anything is launched (no torch).

`unsupported_reasons` returns a list of sentences; empty means the worker can
run the strategy. Each sentence names the field, the rule and the value, so a
plan the executor cannot run is reported as `unsupported` with a reason rather
than crashing a process group.

The stage split (even, uneven first/last, explicit `stage_layers` per pipeline
rank or per virtual stage, embedding or loss counted as a layer) and the batch
rules are the plan's `ParallelLayout`'s; a middle virtual stage without a
transformer layer (which Megatron's layouts allow) is refused: it would hold no module.
The pipeline schedules are torch.distributed.pipelining's, whose micro-batch
rules differ from Megatron's (`ParallelLayout.torch_schedule_ok`): Schedule1F1B
needs num_microbatches >= pp; ScheduleInterleaved1F1B needs num_microbatches to
be a multiple of max(1, num_microbatches // pp), so it runs m < pp or m = 6 on
pp = 4, which Megatron's interleaved schedule (m a multiple of pp) refuses, and
the planner, which ranks plans by Megatron's rule, never proposes.
"""

from __future__ import annotations

import importlib.util

from cost_models.layout import ParallelLayout
from planner.specs import ModelSpec, Strategy, TrainSpec

CPU_ONLY_MISSING = {
    "cp": "cp ({cp}) > 1: torch's context_parallel implements ring attention for the CUDA flash/efficient/cuDNN "
          "SDPA kernels only (on cpu: 'aten._scaled_dot_product_flash_attention_for_cpu does not have a sharding "
          "strategy registered'); not supported by this executor on cpu",
}


def unsupported_reasons(model: ModelSpec, train: TrainSpec, st: Strategy, device: str = "cpu",
                        hsdp_replicate: int = 1) -> list[str]:
    """Why the torch executor cannot run `st` for `model`/`train` on `device` (empty: it can)."""
    reasons: list[str] = []
    if st.dp == "auto":
        return ["dp is 'auto'; resolve the strategy for a GPU count first"]
    dp, tp, pp, cp = st.dp, st.tp, st.pp, st.cp
    reasons += moe_reasons(model, st)
    reasons += attention_reasons(model)
    reasons += adapter_reasons(model, train, st)
    if model.qk_norm != "none" and tp > 1:
        reasons.append(f"qk_norm {model.qk_norm!r} with tp ({tp}) > 1: the query/key norm weights are replicated over "
                       "the tensor-parallel ranks, whose gradients this executor does not all-reduce over tp "
                       "(megatron-core's finalize_model_grads does)")
    if cp > 1 and device != "cuda":
        reasons.append(CPU_ONLY_MISSING["cp"].format(cp=cp))
    if st.offload_optimizer:
        reasons.append("offload_optimizer is not supported by the torch executor (use the deepspeed engine)")
    if st.offload_activation_layers:
        reasons.append(f"offload_activation_layers ({st.offload_activation_layers}) is not supported: activation "
                       "offloading (Megatron's --cpu-offloading-num-layers) copies activations between GPU and host "
                       "memory on Transformer Engine's CUDA streams, which this executor does not run; on cpu there is "
                       "no device memory to offload from")
    if st.recompute_modules and st.recompute_modules != ["core_attn"]:
        reasons.append(f"recompute_modules {st.recompute_modules}: the torch executor recomputes whole layers or "
                       "the attention core only")
    if st.overlap_moe_comm:
        reasons.append("overlap_moe_comm: the torch executor does not overlap the expert all-to-all with another "
                       "micro-batch")
    if tp > 1 and dp > 1 and st.zero_stage == 1:
        reasons.append("zero_stage 1 with tp > 1 and dp > 1: ZeroRedundancyOptimizer does not take DTensor "
                       "parameters; not supported by this executor (zero_stage 0, 2 or 3 are)")
    if hsdp_replicate > 1 and (st.zero_stage < 2 or dp % hsdp_replicate):
        reasons.append(f"hsdp_replicate ({hsdp_replicate}) needs zero_stage >= 2 (is {st.zero_stage}) "
                       f"and must divide dp ({dp})")
    if model.num_attention_heads % tp or model.kv_heads % tp:
        reasons.append(f"tp ({tp}) must divide num_attention_heads ({model.num_attention_heads}) "
                       f"and num_kv_heads ({model.kv_heads})")
    if model.ffn_hidden_size % tp:
        reasons.append(f"tp ({tp}) must divide ffn_hidden_size ({model.ffn_hidden_size})")
    if model.vocab_size % tp:
        reasons.append(f"tp ({tp}) must divide vocab_size ({model.vocab_size}) (vocab-parallel embedding)")
    if st.sequence_parallel and train.seq_len % (tp * cp):
        reasons.append(f"sequence_parallel: tp·cp ({tp * cp}) must divide seq_len ({train.seq_len})")
    if cp > 1 and train.seq_len % (2 * cp):
        reasons.append(f"2·cp ({2 * cp}) must divide seq_len ({train.seq_len}) (load-balanced context parallel)")
    if model.position_embedding == "learned" and train.seq_len > model.max_position_embeddings:
        reasons.append(f"seq_len ({train.seq_len}) exceeds max_position_embeddings ({model.max_position_embeddings})")
    lay = ParallelLayout.of_strategy(st, model.num_layers)
    if not lay.batch_ok(train.global_batch_size, st.micro_batch_size)[0]:
        reasons.append(f"micro_batch_size·dp ({st.micro_batch_size}·{dp}) must divide global_batch_size "
                       f"({train.global_batch_size})")
    elif pp > 1:
        m = int(lay.num_microbatches(train.global_batch_size, st.micro_batch_size)[0])
        schedule = lay.torch_schedule_message(m)
        if schedule:
            reasons.append(schedule + " (torch.distributed.pipelining)")
    chunks = lay.layers_per_chunk() if pp > 1 else []
    empty = [j for j, n in enumerate(chunks[1:-1], start=1) if n == 0]
    if not lay.split_ok()[0]:
        reasons.append(lay.split_message())
    elif empty:
        reasons.append(f"stage_layers {st.stage_layers}: virtual stages {empty} hold no module (no transformer layer, "
                       "embedding or output layer); this executor builds every pipeline chunk from its modules")
    return reasons


ADAPTER_LIBRARIES = {"lora": ("peft",), "qlora": ("peft", "bitsandbytes")}
"""finetune mode -> the libraries its runs import (executors.lora)."""


def adapter_reasons(model: ModelSpec, train: TrainSpec, st: Strategy) -> list[str]:
    """What the executor's LoRA and QLoRA runs (executors.lora: peft on the executor's model, a bitsandbytes
    NF4 base for qlora) do not cover: model parallelism (peft's lora.Linear wraps the linear layers the
    tensor-parallel plan and the pipeline split name), adapters on layers the shortened model lacks, and a
    missing library. Data parallel with DDP, ZeRO-1 and FSDP2 (ZeRO-2/3, HSDP) is run."""
    if not train.adapters:
        return []
    reasons = []
    missing = [lib for lib in ADAPTER_LIBRARIES[train.finetune] if importlib.util.find_spec(lib) is None]
    if missing:
        reasons.append(f"finetune {train.finetune!r} needs {' and '.join(missing)}, which is not installed here")
    parallel = {name: getattr(st, name) for name in ("tp", "pp", "cp", "ep") if getattr(st, name) > 1}
    if parallel:
        reasons.append(f"finetune {train.finetune!r} with {', '.join(f'{k} ({v})' for k, v in parallel.items())} "
                       "> 1: adapter plans run data parallel only (tp = pp = cp = ep = 1)")
    if train.lora_layers is not None and max(train.lora_layers) >= model.num_layers:
        reasons.append(f"lora_layers {train.lora_layers} names layer {max(train.lora_layers)}, beyond the "
                       f"{model.num_layers} layers built (raise --num-layers)")
    return reasons


def moe_reasons(model: ModelSpec, st: Strategy) -> list[str]:
    """What the executor's MoE layers and expert parallelism (executors.moe) do not cover."""
    reasons: list[str] = []
    dp, tp, pp, cp, ep = st.dp, st.tp, st.pp, st.cp, st.ep
    if ep > 1 and not model.is_moe:
        reasons.append(f"ep ({ep}) > 1 needs an MoE model (num_experts is 0)")
    if st.etp > 1:
        reasons.append(f"etp ({st.etp}) > 1: expert tensor parallelism is not built by this executor (etp 1 is)")
    if model.is_moe and tp > 1:
        reasons.append(f"tp ({tp}) > 1 with MoE layers: this executor's tensor parallel plan covers dense MLPs "
                       "only (tp 1 is supported)")
    if ep == 1 or not model.is_moe:
        return reasons
    if model.num_experts % ep:
        reasons.append(f"ep ({ep}) must divide num_experts ({model.num_experts})")
    if dp % ep:
        reasons.append(f"ep ({ep}) must divide dp ({dp}) (the ep group is folded over the data parallel ranks)")
    if st.zero_stage:
        reasons.append(f"zero_stage ({st.zero_stage}) > 0 with ep ({ep}) > 1: ZeRO over the dense and the "
                       "expert-data-parallel groups is not built by this executor (zero_stage 0 is)")
    if pp > 1 or cp > 1:
        reasons.append(f"pp ({pp}) / cp ({cp}) > 1 with ep ({ep}) > 1: not supported by this executor "
                       "(expert parallelism over data parallel ranks only)")
    return reasons


def attention_reasons(model: ModelSpec) -> list[str]:
    """Attention kinds the executor's model does not build (it would silently build standard attention)."""
    reasons = []
    if model.is_mla:
        reasons.append(f"multi-head latent attention (kv_lora_rank {model.kv_lora_rank}) is not built by this "
                       "executor")
    if model.sliding_window is not None:
        reasons.append(f"sliding-window attention (sliding_window {model.sliding_window}) is not built by this "
                       "executor")
    return reasons


def executed_model(model: ModelSpec, st: Strategy, num_layers: int | None = None) -> tuple[ModelSpec, list[str]]:
    """The model the worker builds for `st`, and the deviations from `model` in words.

    - `num_layers` (optional) shortens the model, keeping every per-layer shape.
    - Tied embeddings are untied when pp > 1: torch.distributed.pipelining has
      no cross-stage weight tying (Megatron keeps and all-reduces a copy instead;
      the memory per rank is the same).
    - Dropout is off: parity with the reference needs a deterministic forward.
    - Multi-token-prediction modules are not built (the main model's loss only).
    """
    update: dict = {}
    notes: list[str] = []
    if num_layers is not None and num_layers != model.num_layers:
        update["num_layers"] = num_layers
        notes.append(f"num_layers {model.num_layers} -> {num_layers} (per-layer shapes kept)")
    if model.tie_embeddings and st.pp > 1:
        update["tie_embeddings"] = False
        notes.append("embeddings untied (pp > 1: no cross-stage weight tying in torch.distributed.pipelining)")
    if model.dropout:
        update["dropout"] = False
        notes.append("dropout off (loss parity needs a deterministic forward)")
    if model.num_mtp_layers:
        update["num_mtp_layers"] = 0
        notes.append(f"num_mtp_layers {model.num_mtp_layers} -> 0 (multi-token prediction is not built)")
    if "num_layers" in update:  # explicit layer indices beyond the shortened model are dropped
        for key in ("moe_dense_layers", "global_attention_layers"):
            if getattr(model, key) is not None:
                update[key] = [i for i in getattr(model, key) if i < num_layers]
    # validated again: a shortened model must still be a valid one (e.g. keep an MoE layer)
    return (ModelSpec.model_validate(model.model_dump() | update) if update else model), notes
