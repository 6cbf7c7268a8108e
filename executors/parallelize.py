"""Apply a Strategy to the model with PyTorch's own parallel APIs (imports torch).

Mesh: one DeviceMesh whose axes are the plan's `ParallelLayout.mesh_dims()`, the
dense dimensions of its rank order outermost first — for Megatron's default order
"tp-cp-ep-dp-pp" (tp innermost, then cp, then dp, pp outermost) the axes
(pp, dp_replicate, dp_shard, cp, tp) — with dp split in two (replicate outside
shard) only for HSDP (`RunConfig.hsdp_replicate`; 1 otherwise). A DeviceMesh
numbers its ranks row-major over its shape, so each rank's mesh coordinates are
`ParallelLayout.coords(rank)` (tests/executors/test_layout.py checks this on
torch's own `init_device_mesh`). Example, 8 ranks with tp=2, dp=2, pp=2: ranks
{0,1} are one TP group, {0,2} one DP group, {0,4} one pipeline.

Data parallelism, by zero_stage (dp > 1):
    0  DistributedDataParallel when tp = cp = 1; with tensor parallel weights
       (DTensors, which DDP does not take) a bucketed all-reduce of the local
       gradients after backward (`GradAllReduce`).
    1  DDP + ZeroRedundancyOptimizer (optimizer states sharded over dp).
    2  FSDP2 `fully_shard(reshard_after_forward=False)`: gradients and optimizer
       states sharded, parameters gathered once per micro-batch and kept until
       its backward.
    3  FSDP2 `fully_shard(reshard_after_forward=True)`: parameters re-gathered in
       backward too. With hsdp_replicate > 1 both use a 2-D (replicate, shard)
       mesh (HSDP).
FSDP2 reduce-scatters every micro-batch's gradients (ZeRO-2/3 semantics); DDP
reduces once per step (`no_sync` on the other micro-batches).

Expert parallelism (MoE models, ep > 1, zero_stage 0, tp = pp = cp = 1): a second
DeviceMesh over the same ranks with the expert axes (pp, edp, ep, etp) of
Megatron-core's layout (`expert_mesh_shape`); `apply_ep` keeps each ep rank's block
of experts and gives the MoE layers the ep group for their all-to-all dispatch
(executors.moe); `expert_parallel_grad_syncs` reduces the dense gradients over dp and
the experts' over edp, both scaled by 1/dp. Example, 4 ranks with dp=4, ep=2: ep
groups {0,1} and {2,3}, expert-data-parallel groups {0,2} and {1,3}.

Tensor parallelism (Megatron-style, `parallelize_module`): q/k/v, w1/w3 and the
output head column-wise, wo and w2 row-wise, the word embedding vocab-parallel
(row-wise). With sequence parallelism the norms are `SequenceParallel` and the
residual stream between blocks is sharded along the sequence.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from cost_models.layout import ParallelLayout
from executors.model import Transformer
from executors.results import RunConfig

#: how the layout's dp dimension is split for HSDP: (replicate, shard), replicate outside
DP_AXES = ("dp_replicate", "dp_shard")
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def mesh_axes(cfg: RunConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(axis names, sizes) of the run's DeviceMesh, outermost first: the layout's `mesh_dims()`
    with dp split into `DP_AXES` (hsdp_replicate, dp / hsdp_replicate)."""
    lay = ParallelLayout.of_strategy(cfg.strategy, cfg.model.num_layers)
    names: list[str] = []
    shape: list[int] = []
    for dim, size in zip(lay.mesh_dims(), lay.mesh_shape()):
        if dim == "dp":
            names += DP_AXES
            shape += [cfg.hsdp_replicate, size // cfg.hsdp_replicate]
        else:
            names.append(dim)
            shape.append(size)
    return tuple(names), tuple(shape)


def build_mesh(cfg: RunConfig, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    names, shape = mesh_axes(cfg)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def mesh_coords(mesh) -> dict[str, int]:
    """This rank's coordinate on each mesh axis, plus `dp` (replicate and shard folded back:
    the layout's dp coordinate)."""
    names = mesh.mesh_dim_names
    coords = {name: mesh.get_local_rank(name) for name in names}
    replicate, shard = DP_AXES
    coords["dp"] = coords[replicate] * mesh.size(names.index(shard)) + coords[shard]
    return coords


def dp_mesh(mesh, cfg: RunConfig):
    """The mesh gradients are reduced over: 1-D dp_shard, 2-D (dp_replicate, dp_shard) for HSDP,
    or dp_shard and cp flattened when cp > 1 (context parallel ranks hold the same weights
    and see different tokens, so their gradients are averaged too, as in Megatron)."""
    if cfg.hsdp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    if cfg.strategy.cp > 1:
        return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_shard"]


# ---- tensor parallel ----------------------------------------------------------
def apply_tp(model: Transformer, tp_mesh, sequence_parallel: bool, vocab_parallel_loss: bool = True) -> None:
    """Megatron-style TP (+SP) on every part the (possibly partial, pipeline-stage) model has.

    `vocab_parallel_loss`: the output head returns logits sharded over the vocabulary
    (a DTensor) for `torch.distributed.tensor.parallel.loss_parallel`, Megatron's
    vocab-parallel cross entropy; otherwise the logits are all-gathered (used inside
    pipeline stages, whose outputs must be plain tensors)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    plan: dict = {}
    if model.embed is not None:
        learned = model.embed.pos is not None
        # Learned positions are added after the lookup, so with SP the sum is split afterwards.
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(),
                                            output_layouts=Replicate() if learned else stream)
        if learned and sp:
            plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    for name in model.layers:
        p = f"layers.{name}"
        plan.update({
            f"{p}.attn.wq": ColwiseParallel(), f"{p}.attn.wk": ColwiseParallel(), f"{p}.attn.wv": ColwiseParallel(),
            f"{p}.attn.wo": RowwiseParallel(output_layouts=stream),
            f"{p}.mlp.w1": ColwiseParallel(), f"{p}.mlp.w2": RowwiseParallel(output_layouts=stream),
        })
        if model.layers[name].mlp.w3 is not None:
            plan[f"{p}.mlp.w3"] = ColwiseParallel()
        if sp:
            plan.update({
                f"{p}.norm1": SequenceParallel(), f"{p}.norm2": SequenceParallel(),
                f"{p}.attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                f"{p}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
    if model.norm is not None and sp:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = (ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
                          if vocab_parallel_loss else ColwiseParallel(input_layouts=stream, output_layouts=Replicate()))
    tied = model.embed is not None and model.output is not None and model.output.weight is model.embed.tok.weight
    # Every rank built the same full weights from the seed: take local shards, no scatter.
    parallelize_module(model, tp_mesh, plan, src_data_rank=None)
    if tied:  # both are Shard(0) over the vocabulary: share one DTensor again
        model.output.weight = model.embed.tok.weight


# ---- data parallel ------------------------------------------------------------
def apply_fsdp(model: nn.Module, mesh, zero_stage: int, layers: list[nn.Module]) -> None:
    """FSDP2 per layer, then the rest. A QLoRA base's 4-bit weights (executors.lora.four_bit_params) are
    left whole on every rank (`ignored_params`): a shard of their storage would lose its quantisation
    constants."""
    from torch.distributed.fsdp import fully_shard

    from executors.lora import four_bit_params

    reshard = zero_stage >= 3
    ignored = four_bit_params(model) or None
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, ignored_params=ignored)


class GradAllReduce:
    """Sum local gradients over `group` in ~25 MiB flat buckets and divide by `divisor` (DDP's
    reduction without its hooks; used when the parameters are DTensors, and for the dense and
    the expert parameters of expert-parallel runs). `group` None: no collective, only the division."""

    def __init__(self, params: list[nn.Parameter], group, divisor: int):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.divisor = group, divisor

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def __call__(self) -> None:
        grads = [self._local(p.grad) for p in self.params if p.grad is not None]
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads + [None]:
            if g is not None:
                bucket.append(g)
                size += g.numel() * g.element_size()
            if bucket and (g is None or size >= BUCKET_BYTES):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                if self.group is not None:
                    dist.all_reduce(flat, group=self.group)
                flat.div_(self.divisor)
                offset = 0
                for b in bucket:
                    b.copy_(flat[offset: offset + b.numel()].view_as(b))
                    offset += b.numel()
                bucket, size = [], 0


# ---- expert parallel ----------------------------------------------------------
#: axes of the expert mesh, outermost first (Megatron-core's expert layout, cost_models.layout)
EXPERT_AXES = ("pp", "edp", "ep", "etp")

EXPERT_GRAD_FAULTS = ("expert_grad_edp_mean", "expert_grad_dense")
"""Wrong expert-gradient reductions, as test faults (`RunConfig.fault`):
expert_grad_edp_mean averages the expert gradients over the expert-data-parallel group
(÷ edp instead of ÷ dp: each expert's gradient ep times too large); expert_grad_dense
reduces them like the dense ones, over the whole dp group (it adds up the gradients
of different experts that sit at the same local index on different ep ranks)."""


def expert_mesh_shape(cfg: RunConfig) -> tuple[int, ...]:
    """Sizes along EXPERT_AXES: (pp, edp, ep, etp), row-major over the same ranks as the
    dense mesh. The strides are the layout's (`ParallelLayout.expert_group`): etp 1, ep etp,
    edp etp·ep, pp tp·cp·dp; with tp = cp = 1 the ep group is ep consecutive dp ranks."""
    lay = ParallelLayout.of_strategy(cfg.strategy, cfg.model.num_layers)
    (etp, etp_stride), (ep, ep_stride), (edp, edp_stride) = (
        (int(a[0]), int(b[0])) for a, b in (lay.expert_group(d) for d in ("etp", "ep", "edp")))
    assert (etp_stride, ep_stride, edp_stride) == (1, etp, etp * ep), (etp_stride, ep_stride, edp_stride)
    assert int(lay.stride("pp")[0]) == edp * ep * etp, "pp must be the outermost dimension"
    return int(lay.pp[0]), edp, ep, etp


def build_expert_mesh(cfg: RunConfig, device_type: str):
    """A second DeviceMesh over all ranks with the expert axes (its ep and edp groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    shape = expert_mesh_shape(cfg)
    ranks = torch.arange(cfg.num_gpus).reshape(shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=EXPERT_AXES)


def apply_ep(model: nn.Module, expert_mesh) -> None:
    """Shard the routed experts of every MoE layer over the mesh's ep group."""
    from executors.moe import moe_modules

    ep, ep_rank = expert_mesh.size(EXPERT_AXES.index("ep")), expert_mesh.get_local_rank("ep")
    group = expert_mesh["ep"].get_group()
    for moe in moe_modules(model):
        moe.enable_expert_parallel(ep, ep_rank, group)


def expert_parallel_grad_syncs(cfg: RunConfig, module: nn.Module, mesh, expert_mesh) -> list[GradAllReduce]:
    """Gradient reductions of an expert-parallel run (zero_stage 0), as Megatron-core's DDP
    (`distributed_data_parallel.py`, `average_in_collective=False`): every gradient is scaled
    by 1/dp and summed, the dense parameters' over the dp group, the routed experts' over the
    expert-data-parallel group (the ranks holding the same experts). An expert's local
    gradient already sums the tokens of the whole ep group, so summing over edp covers all dp
    replicas' tokens once, and 1/dp makes it the gradient of the mean loss."""
    from executors.moe import expert_parameters

    dp = cfg.strategy.dp
    experts = expert_parameters(module)
    ids = {id(p) for p in experts}
    dense = [p for p in module.parameters() if id(p) not in ids]
    dp_group = dp_mesh(mesh, cfg).get_group() if dp > 1 else None
    edp = expert_mesh.size(EXPERT_AXES.index("edp"))
    edp_group = expert_mesh["edp"].get_group() if edp > 1 else None
    if cfg.fault == "expert_grad_edp_mean":
        expert_sync = GradAllReduce(experts, edp_group, edp)
    elif cfg.fault == "expert_grad_dense":
        expert_sync = GradAllReduce(experts, dp_group, dp)
    else:
        expert_sync = GradAllReduce(experts, edp_group, dp)
    return [GradAllReduce(dense, dp_group, dp), expert_sync]


def wrap_data_parallel(cfg: RunConfig, module: nn.Module, mesh, layers: list[nn.Module], expert_mesh=None):
    """Apply the dp part of the strategy to `module` (the model or one pipeline stage);
    with ep > 1 (experts already sharded by `apply_ep`) the reductions of
    `expert_parallel_grad_syncs` over `expert_mesh`'s edp group.

    Returns (module, kind, grad_sync) where kind is 'none', 'ddp' or 'fsdp' and
    grad_sync is a callable to run after backward (manual all-reduce) or None.
    """
    st = cfg.strategy
    replicas = st.dp * st.cp
    if st.ep > 1:
        syncs = expert_parallel_grad_syncs(cfg, module, mesh, expert_mesh)
        return module, "none", lambda: [sync() for sync in syncs]
    if replicas == 1:
        return module, "none", None
    if st.zero_stage >= 2 and st.dp > 1:
        apply_fsdp(module, dp_mesh(mesh, cfg), st.zero_stage, layers)
        return module, "fsdp", None
    group = dp_mesh(mesh, cfg).get_group()
    if st.tp > 1 or st.cp > 1:
        return module, "none", GradAllReduce(list(module.parameters()), group, replicas)
    from torch.nn.parallel import DistributedDataParallel

    # Buffers (positions, rope tables) are identical on every rank: no per-forward sync.
    # gradient_as_bucket_view: the gradients live in the buckets (one copy, like Megatron's grad buffer).
    ddp = DistributedDataParallel(module, process_group=group, forward_sync_buffers=False,
                                  gradient_as_bucket_view=True,
                                  device_ids=None if cfg.device == "cpu" else [torch.cuda.current_device()])
    return ddp, "ddp", None


def no_sync(module: nn.Module, kind: str, last_microbatch: bool):
    """DDP reduces only on the last micro-batch of a step."""
    if kind == "ddp" and not last_microbatch:
        return module.no_sync()
    return nullcontext()
