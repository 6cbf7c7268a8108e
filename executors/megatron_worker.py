"""Megatron-core executor: GPTModel with Megatron's parallel state and schedules (CUDA only).

Used for `RunConfig.engine == "megatron"`. The model and parallel settings are
the megatron-core config kwargs the Megatron emitter derives from the plan
(`planner.emit.megatron.core_config_kwargs`, carried in
`RunConfig.engine_config`), so the run exercises exactly the emitted
configuration. Weights are initialised on the CPU (`use_cpu_initialization`),
which makes them independent of tp and pp; the parity reference is the same
executor on one GPU (`reference_engine_config`).

Optimizers, as in the torch engine (executors.parity): the parity steps take
Megatron's SGD with no momentum on batch 0 (the reference sizes the step from
its step-1 gradient), then the plan's optimizer is built on the updated
weights for the warm-up and timed steps. The schedule hooks are wired as
Megatron-LM's training loop wires them (`finalize_model_grads` for the data
parallel and tied-weight reductions, `no_sync` across micro-batches when the
gradient reduction overlaps backward, the optimizer's loss scale).

Not exercised in CI (no GPU there): tests carrying the `gpu` marker run it
where CUDA is present.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from executors.parity import batch_index, parity_failure, parity_learning_rate
from executors.timing import run_timed_steps
from executors.results import GRADIENT_FAULTS, ParityReference, RankResult, RunConfig, is_oom, write_json_atomic

DTYPES = ("float32", "bfloat16", "float16")
SINGLE_GPU = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
              "virtual_pipeline_model_parallel_size": None, "sequence_parallel": False}
#: TransformerConfig fields of the stage split, which a one-GPU reference drops
STAGE_SPLIT = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
               "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
               "account_for_loss_in_pipeline_split")


def reference_engine_config(kw: dict[str, Any]) -> dict[str, Any]:
    """The same model on one GPU: every parallel degree 1, no distributed optimizer."""
    out = {k: dict(v) for k, v in kw.items()}
    for section in ("parallel", "transformer"):
        out[section].update({k: v for k, v in SINGLE_GPU.items() if k in out[section] or section == "parallel"})
        for key in STAGE_SPLIT:
            out[section].pop(key, None)
    out["ddp"]["use_distributed_optimizer"] = False
    out["optimizer"]["use_distributed_optimizer"] = False
    return out


def _resolve(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Dtype names -> torch dtypes, activation names -> functions."""
    import torch
    import torch.nn.functional as F

    out = dict(kwargs)
    for key in ("params_dtype", "pipeline_dtype"):
        if isinstance(out.get(key), str) and out[key] in DTYPES:
            out[key] = getattr(torch, out[key])
    if out.get("activation_func") == "silu":
        out["activation_func"] = F.silu
    elif out.get("activation_func") == "quick_gelu":  # Megatron-LM's --quick-geglu
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        out["activation_func"] = quick_gelu
    return out


def build(cfg: RunConfig, kw: dict[str, Any]):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    par = kw["parallel"]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.get("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=par.get("pipeline_model_parallel_size", 1),
        virtual_pipeline_model_parallel_size=par.get("virtual_pipeline_model_parallel_size"),
        context_parallel_size=par.get("context_parallel_size", 1))
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    tkw = _resolve(kw["transformer"]) | {"hidden_dropout": 0.0, "attention_dropout": 0.0,
                                         "use_cpu_initialization": True}
    config = TransformerConfig(**tkw)
    spec = get_gpt_layer_local_spec(qk_layernorm=bool(tkw.get("qk_layernorm")), normalization=tkw.get("normalization"))
    vpp = par.get("virtual_pipeline_model_parallel_size") or 1
    models = []
    for v in range(vpp):
        vp = v if vpp > 1 else None
        module = GPTModel(
            config, spec, vocab_size=cfg.model.vocab_size, max_sequence_length=kw["gpt"]["max_sequence_length"],
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=kw["gpt"]["share_embeddings_and_output_weights"],
            position_embedding_type=kw["gpt"]["position_embedding_type"], vp_stage=vp).cuda()
        models.append(DistributedDataParallel(config, DistributedDataParallelConfig(**kw["ddp"]), module))
    return models, config


def wire_schedule(config, models, kw: dict[str, Any], current: dict[str, Any]) -> None:
    """The schedule hooks Megatron-LM's `setup_model_and_optimizer`/`train` set on the model config;
    `current["optimizer"]` is the optimizer of the step being run (it changes after the parity steps)."""
    from megatron.core.distributed import finalize_model_grads

    def one_or_list(fns):
        return fns[0] if len(fns) == 1 else fns

    if kw["ddp"].get("overlap_grad_reduce"):  # with Megatron-LM's default --align-grad-reduce
        config.no_sync_func = one_or_list([m.no_sync for m in models])
        config.grad_sync_func = one_or_list([m.start_grad_sync for m in models])
    if kw["ddp"].get("overlap_param_gather") and kw["ddp"].get("align_param_gather"):
        config.param_sync_func = one_or_list([m.start_param_sync for m in models])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = lambda loss: current["optimizer"].scale_loss(loss)


def make_optimizer(cfg: RunConfig, kw: dict[str, Any], models, parity: bool):
    """Megatron's optimizer: plain SGD at the parity step size, or the plan's (emitted) optimizer."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    okw = _resolve(kw["optimizer"]) | {"lr": cfg.learning_rate, "weight_decay": 0.0, "clip_grad": 0.0}
    if parity:
        okw |= {"optimizer": "sgd", "sgd_momentum": 0.0, "lr": cfg.parity_learning_rate or cfg.learning_rate}
    return get_megatron_optimizer(OptimizerConfig(**okw), models)


def _main_grads(models):
    return [p.main_grad for m in models for p in m.parameters() if getattr(p, "main_grad", None) is not None]


def run_rank(cfg: RunConfig, out: Path, reference: bool = False) -> int:
    """One rank of a Megatron-core run (or, with `reference`, the one-GPU reference)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from executors.memory import MemoryMeter
    from executors.model import synthetic_batch

    if cfg.engine_config is None:
        raise SystemExit("engine 'megatron' needs RunConfig.engine_config (the emitter's megatron-core kwargs)")
    kw = reference_engine_config(cfg.engine_config) if reference else cfg.engine_config
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", timeout=timedelta(seconds=cfg.timeout_s))
    meter = MemoryMeter("cuda")
    meter.start()
    models, config = build(cfg, kw)
    current = {"optimizer": make_optimizer(cfg, kw, models, parity=True)}
    wire_schedule(config, models, kw, current)
    meter.model_built()
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    mbs = 1 if reference else cfg.strategy.micro_batch_size
    rows = cfg.train.global_batch_size // dp
    m = rows // mbs
    seq = cfg.train.seq_len
    fwd_bwd = get_forward_backward_func()

    def forward_step(data_iterator, model):
        x, y = next(data_iterator)
        pos = torch.arange(seq, device=x.device).unsqueeze(0).expand_as(x)
        output = model(x, pos, None, labels=y)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    grad_factor = GRADIENT_FAULTS.get(cfg.fault, 1.0)

    def step(i: int) -> float:
        tokens, targets = synthetic_batch(cfg.model, cfg.train.global_batch_size, seq, cfg.seed, batch_index(cfg, i))
        x, y = tokens[dp_rank * rows: (dp_rank + 1) * rows].cuda(), targets[dp_rank * rows: (dp_rank + 1) * rows].cuda()
        batches = [(x[j * mbs:(j + 1) * mbs], y[j * mbs:(j + 1) * mbs]) for j in range(m)]
        for model in models:
            model.zero_grad_buffer()
        current["optimizer"].zero_grad()
        iters = [iter(batches) for _ in models]
        losses = fwd_bwd(forward_step_func=forward_step, data_iterator=iters if len(models) > 1 else iters[0],
                         model=models if len(models) > 1 else models[0], num_microbatches=m, seq_length=seq,
                         micro_batch_size=mbs, forward_only=False)
        local = torch.stack([d["loss"] for d in losses]).mean() if losses else None
        owner = local is not None and parallel_state.get_tensor_model_parallel_rank() == 0
        t = torch.tensor([float(local) if owner else 0.0, 1.0 if owner else 0.0], device="cuda", dtype=torch.float64)
        dist.all_reduce(t)
        loss = float(t[0] / t[1])
        if reference and i == 0:  # one GPU: every gradient is local
            lr = parity_learning_rate(loss, sum(float(g.double().pow(2).sum()) for g in _main_grads(models)))
            for group in current["optimizer"].param_groups:
                group["lr"] = lr
        if i < cfg.parity_steps and grad_factor != 1.0:
            for g in _main_grads(models):
                g.mul_(grad_factor)
        current["optimizer"].step()
        if i == cfg.parity_steps - 1 and not reference:  # the plan's optimizer, on the updated weights
            current["optimizer"] = None
            current["optimizer"] = make_optimizer(cfg, kw, models, parity=False)
        return loss

    result = RankResult(rank=rank, status="ok")
    try:
        result.losses = [step(i) for i in range(cfg.parity_steps)]
        if reference:
            if rank == 0:
                lr = current["optimizer"].param_groups[0]["lr"]
                write_json_atomic(out / "reference.json",
                                  ParityReference(losses=result.losses, learning_rate=lr).model_dump_json())
            return 0
        failure = parity_failure(cfg, result.losses) if cfg.reference_losses else ""
        if failure:
            result.status, result.error = "wrong", failure
            return 0
        result.step_times_s = run_timed_steps(step, cfg.parity_steps, cfg.warmup_steps, cfg.timed_steps,
                                              torch.cuda.synchronize)
        result.peak_memory_bytes, result.reserved_memory_bytes = meter.peak()
    except Exception as exc:  # reported in the rank's JSON and through the exit status

        result.status = "oom" if is_oom(exc) else "error"
        result.error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if not reference:
            write_json_atomic(out / f"rank{rank}.json", result.model_dump_json())
    dist.destroy_process_group()
    return 0
