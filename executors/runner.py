"""Build the parallel model for one RunConfig and run optimizer steps (imports torch).

`Runner.step(i)` runs optimizer step i on its synthetic batch (batch 0 for every
parity step, `executors.parity.batch_index`) and returns this replica's mean
loss where this rank holds it (None elsewhere); `global_loss` averages it over
the data (and context) parallel replicas. The optimizer is plain SGD for the
parity steps and the plan's after (`executors.optim`), over the parameters that
train: all of them, or under `finetune: lora` the adapters that `executors.lora`
adds to the frozen 16-bit base (the same in the reference).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from executors.lora import prepare_adapters, trainable_numel
from executors.model import build_model, loss_fn, synthetic_batch
from executors.optim import make_optimizer
from executors.parallelize import apply_ep, apply_tp, build_expert_mesh, no_sync, wrap_data_parallel
from executors.moe import expert_parameters
from executors.parity import GRAD_GROUPS, batch_index, parity_learning_rate
from executors.pipeline import build_stage_modules, make_schedule, run_pipeline_step
from executors.results import ParityReference, RunConfig

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(cfg: RunConfig, cache_weights: bool = True):
    """Mixed precision for bf16/fp16 plans (fp32 weights and optimizer, as Megatron's
    main params); fp32 plans run in full precision.

    `cache_weights`: autocast's cache of the low-precision copy of each weight, kept
    for the whole step (one cast per weight and step, as Megatron's bf16 weights).
    FSDP2 runs switch it off: with FSDP2 (ZeRO-2/3) and several micro-batches in one
    step the cached copies carry the gradients of the later micro-batches wrongly —
    measured in bf16 with benchmarks/parity_tolerance.py, the step-2 loss change was
    21% off the reference with 2 micro-batches per rank (dp2, ZeRO-3) and 11% with 4
    (tp2 x dp2, ZeRO-3); without the cache 2e-4 and 1e-3, as the other plans."""
    dtype = AUTOCAST_DTYPES.get(cfg.train.precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(cfg.device, dtype=dtype, cache_enabled=cache_weights)


class Runner:
    def __init__(self, cfg: RunConfig, mesh, coords: dict[str, int], device: torch.device):
        self.cfg, self.mesh, self.coords, self.device = cfg, mesh, coords, device
        st = cfg.strategy
        self.st = st
        self.rows = cfg.train.global_batch_size // st.dp  # sequences per data parallel replica
        self.num_microbatches = self.rows // st.micro_batch_size
        full = build_model(cfg.model, cfg.train.seq_len, cfg.seed)
        prepare_adapters(full, cfg.model, cfg.train, cfg.seed)
        self.num_trainable_params = trainable_numel(full)
        if st.pp > 1:
            chunks = build_stage_modules(full, coords["pp"], st.pp, st.vpp, st)
            del full
        else:
            chunks = [(0, full)]
        modules = []
        self.grad_syncs = []
        kinds = set()
        expert_mesh = build_expert_mesh(cfg, device.type) if st.ep > 1 else None
        for _, module in chunks:
            module.set_recompute(st.recompute, st.recompute_num_layers)
            module.to(device)
            if st.tp > 1:
                apply_tp(module, mesh["tp"], st.sequence_parallel, vocab_parallel_loss=st.pp == 1)
            if expert_mesh is not None:
                apply_ep(module, expert_mesh)
            wrapped, kind, sync = wrap_data_parallel(cfg, module, mesh, list(module.layers.values()), expert_mesh)
            modules.append(wrapped)
            kinds.add(kind)
            if sync is not None:
                self.grad_syncs.append(sync)
        self.kind = kinds.pop()
        params = [p for m in modules for p in m.parameters()]
        self.num_params_local = sum(_local_numel(p) for p in params)
        params = [p for p in params if p.requires_grad]  # LoRA: the adapters only (the base is frozen)
        zero1 = mesh["dp_shard"].get_group() if st.zero_stage == 1 and self.kind == "ddp" else None
        self.optimizer = make_optimizer(cfg, params, zero1)
        self.modules = modules
        self.num_stages = st.pp * st.vpp
        self.first_grad_sq_norms: dict[str, float] | None = None
        if st.pp > 1:
            stage_modules = [(idx, m) for (idx, _), m in zip(chunks, modules)]
            self.stages, self.schedule = make_schedule(
                stage_modules, mesh["pp"].get_group(), self.num_stages, self.num_microbatches, device, st.vpp)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = synthetic_batch(self.cfg.model, self.cfg.train.global_batch_size,
                                          self.cfg.train.seq_len, self.cfg.seed, batch_index(self.cfg, step))
        lo = self.coords["dp"] * self.rows
        return tokens[lo: lo + self.rows].to(self.device), targets[lo: lo + self.rows].to(self.device)

    def _cp_context(self, tensors: list[torch.Tensor], module):
        if self.st.cp == 1:
            return nullcontext()
        from torch.distributed.tensor.experimental import context_parallel

        bufs = [b for name, b in module.named_buffers() if name in ("positions", "rope_cos", "rope_sin")]
        return context_parallel(self.mesh["cp"], buffers=tensors + bufs,
                                buffer_seq_dims=[1] * len(tensors) + [0] * len(bufs),
                                no_restore_buffers=set(tensors))

    def step(self, step: int) -> torch.Tensor | None:
        tokens, targets = self.batch(step)
        with autocast_context(self.cfg, cache_weights=self.kind != "fsdp"):
            if self.st.pp > 1:
                loss = run_pipeline_step(self.schedule, self.stages, self.num_stages, tokens, targets)
            else:
                loss = self._step_plain(tokens, targets)
        for sync in self.grad_syncs:
            sync()
        if step == 0:
            self.first_grad_sq_norms = self.grad_sq_norms()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _loss_context(self):
        if self.st.tp == 1:
            return nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _step_plain(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model = self.modules[0]
        mbs, m = self.st.micro_batch_size, self.num_microbatches
        total = torch.zeros((), device=self.device)
        for i in range(m):
            x = tokens[i * mbs: (i + 1) * mbs]
            y = targets[i * mbs: (i + 1) * mbs]
            with no_sync(model, self.kind, i == m - 1), self._cp_context([x, y], model), self._loss_context():
                loss = loss_fn(model(x), y) / m
                loss.backward()
            value = loss.detach()
            total += value.full_tensor() if hasattr(value, "full_tensor") else value
        return total

    def grad_sq_norms(self) -> dict[str, float] | None:
        """Squared L2 norm of the reduced gradient per group (executors.parity.GRAD_GROUPS), for
        MoE models on layouts where every rank holds whole parameters (tp = pp = cp = 1, no
        FSDP): summed over all ranks, each group divided by the ranks holding a copy of each of
        its parameters (dense: dp; experts: dp / ep). None elsewhere."""
        st = self.st
        if not self.cfg.model.is_moe or st.tp > 1 or st.pp > 1 or st.cp > 1 or self.kind == "fsdp":
            return None
        module = self.modules[0]
        experts = {id(p) for p in expert_parameters(module)}
        local = torch.zeros(2, dtype=torch.float64, device=self.device)
        for p in module.parameters():
            if p.grad is not None:
                local[1 if id(p) in experts else 0] += p.grad.double().pow(2).sum()
        dist.all_reduce(local)
        return {"dense": float(local[0]) / st.dp, "experts": float(local[1]) / (st.dp // st.ep)}

    def global_loss(self, local: torch.Tensor | None) -> float:
        """Mean loss over the replicas: the ranks holding a loss with tp index 0 contribute."""
        owner = local is not None and self.coords["tp"] == 0
        t = torch.tensor([float(local) if owner else 0.0, 1.0 if owner else 0.0],
                         dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t[0] / t[1])


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def reference(cfg: RunConfig, chunk_rows: int = 4) -> ParityReference:
    """Single-process parity steps: the full model, the full global batch (accumulated in
    chunks of `chunk_rows` sequences), plain SGD (torch.optim.SGD, no momentum) with the
    step size `parity_learning_rate` sets from this run's own step-1 loss and gradient."""
    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    model = build_model(cfg.model, cfg.train.seq_len, cfg.seed)
    prepare_adapters(model, cfg.model, cfg.train, cfg.seed)
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None
    gbs = cfg.train.global_batch_size
    losses = []
    for step in range(cfg.parity_steps):
        tokens, targets = synthetic_batch(cfg.model, gbs, cfg.train.seq_len, cfg.seed, batch_index(cfg, step))
        total = 0.0
        with autocast_context(cfg):
            for lo in range(0, gbs, chunk_rows):
                x, y = tokens[lo: lo + chunk_rows].to(device), targets[lo: lo + chunk_rows].to(device)
                loss = loss_fn(model(x), y) * (x.shape[0] / gbs)
                loss.backward()
                total += float(loss.detach())
        if optimizer is None:
            norms = group_sq_norms(model)
            optimizer = torch.optim.SGD(params, lr=parity_learning_rate(total, sum(norms.values())))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return ParityReference(losses=losses, learning_rate=optimizer.param_groups[0]["lr"],
                           grad_sq_norms=norms if cfg.model.is_moe else None)


def group_sq_norms(model: torch.nn.Module) -> dict[str, float]:
    """Squared L2 norm of the gradient of each group of GRAD_GROUPS (one process, whole model)."""
    experts = {id(p) for p in expert_parameters(model)}
    norms = dict.fromkeys(GRAD_GROUPS, 0.0)
    for p in model.parameters():
        if p.grad is not None:
            norms["experts" if id(p) in experts else "dense"] += float(p.grad.double().pow(2).sum())
    return norms
