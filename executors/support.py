"""What the PyTorch executor can run, decided before anything is launched (no torch).

`unsupported_reasons` returns a list of sentences; empty means the worker can
run the strategy. Each sentence names the field, the rule and the value, so a
plan the executor cannot run is reported as `unsupported` with a reason rather
than crashing a process group.

The stage split (even, uneven first/last, explicit `stage_layers`, embedding or
loss counted as a layer) and the batch rules are the plan's `ParallelLayout`'s.
The pipeline schedules are torch.distributed.pipelining's, whose micro-batch
rules differ from Megatron's (`ParallelLayout.torch_schedule_ok`): Schedule1F1B
needs num_microbatches >= pp; ScheduleInterleaved1F1B needs num_microbatches to
be a multiple of max(1, num_microbatches // pp), so it runs m < pp or m = 6 on
pp = 4, which Megatron's interleaved schedule (m a multiple of pp) refuses, and
the planner, which ranks plans by Megatron's rule, never proposes.
"""

from __future__ import annotations

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
    if st.ep > 1 or st.etp > 1:
        reasons.append(f"ep ({st.ep}) / etp ({st.etp}) > 1: the model is dense and this executor builds no MoE layers")
    if cp > 1 and device != "cuda":
        reasons.append(CPU_ONLY_MISSING["cp"].format(cp=cp))
    if st.offload_optimizer:
        reasons.append("offload_optimizer is not supported by the torch executor (use the deepspeed engine)")
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
    if not lay.split_ok()[0]:
        reasons.append(lay.split_message())
    return reasons


def executed_model(model: ModelSpec, st: Strategy, num_layers: int | None = None) -> tuple[ModelSpec, list[str]]:
    """The model the worker builds for `st`, and the deviations from `model` in words.

    - `num_layers` (optional) shortens the model, keeping every per-layer shape.
    - Tied embeddings are untied when pp > 1: torch.distributed.pipelining has
      no cross-stage weight tying (Megatron keeps and all-reduces a copy instead;
      the memory per rank is the same).
    - Dropout is off: parity with the reference needs a deterministic forward.
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
    return (model.model_copy(update=update) if update else model), notes
