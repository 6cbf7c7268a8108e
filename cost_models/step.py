"""Step time and peak memory of every candidate at once.

The step of a pipeline of p stages with m micro-batches and v chunks per stage
(SC'21 Eq. 1, generalised to interleaving):

    step = m · t_mb + (p - 1)/v · t_mb + pp_comm + max over stages (dp_comm + optimizer)

where t_mb is the slowest stage's time for one micro-batch (compute,
recompute, exposed TP and CP communication). Data parallel communication is
overlapped with the backward (gradients) and forward (ZeRO parameter gathers)
of one micro-batch when the strategy asks for it; only what sticks out counts.

`evaluate_arrays` runs five parts, each a function below: the setup (blocks,
layout, micro-batch shape), the memory of each stage, the time of one
micro-batch on each stage, the pipeline's point-to-point traffic, and the data
parallel tail (gradient reduction, ZeRO gathers, optimizer step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass, replace
from types import SimpleNamespace
from functools import cached_property, partial

import numpy as np

from cost_models.arrays import RECOMPUTE_MODULES, StrategyArrays, spread
from cost_models.blocks import (Attention, DenseMLP, Gemm, Micro, ModelBlocks, graph_scopes, model_blocks,
                                padded_vocab)
from cost_models.collectives import comm_model_for
from cost_models.comm import CommModel, exposed_s
from cost_models.dispatch import DispatchTable, dispatch_table, tier_scales
from cost_models.compute import LayerTimes, gemm_time, head_times, layer_times, selective_recompute_s
from cost_models.elementwise import elementwise_model
from cost_models.layout import ParallelLayout
from cost_models.frameworks import framework_of, zero3_impl_of
from profiles.frameworks import Framework
from cost_models.sharding import zero3_comm_s
from cost_models import finetune
from cost_models.memory import (RUNTIME_TERMS, dispatcher_buffer_bytes, fp8_weight_memory, kind_params_per_rank,
                                kind_quantised_weights,
                                model_state_bytes, param_gather_saving_per_element, per_row, runtime_memory_bytes,
                                offloaded_activation_bytes, offloaded_layers, stage_activation_bytes,
                                stage_expert_params, stage_kind_counts, stage_params,
                                zero3_head_bytes, zero3_working_bytes)
from cost_models.units import (FP32, DTYPE_BYTES, QUANTISED_PRECISIONS, WEIGHT_BYTES, optimizer_state_bytes,
                               optimizer_step_traffic_bytes)

if TYPE_CHECKING:  # specs are read by attribute only; no import of the planner package at run time
    from planner.specs import ClusterSpec, GpuSpec, ModelSpec, TrainSpec

MEMORY_TERMS = ("params", "adapters", "grads", "optimizer", "fp8_weights", "dequant_buffer", "activations",
                "recompute_working",
                "embedding_activations", "logits", "zero3_buffers", "comm_buffers", "cuda_graph_buffers") + RUNTIME_TERMS
TIME_TERMS = ("compute", "recompute", "activation_offload", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "pp_bubble",
              "dp_comm", "optimizer")
COMM_TERMS = ("tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm")


@dataclass
class CostArrays:
    """What the cost model says about N candidates (arrays of length N)."""

    step_time_s: np.ndarray
    memory_bytes: dict[str, np.ndarray]  # binding stage, by term
    time_s: dict[str, np.ndarray]  # exposed time, by term
    peak_memory_bytes: np.ndarray
    binding_stage: np.ndarray  # 0 first, 1 middle, 2 last
    binding_pipeline_rank: np.ndarray  # pipeline rank of the binding stage
    num_microbatches: np.ndarray
    bubble_fraction: np.ndarray
    model_flop_per_step: np.ndarray
    hardware_flop_per_step: np.ndarray
    comm_total_s: np.ndarray  # all communication of the step, hidden or not
    memory_capacity_bytes: float
    peak_flop_per_s: float
    host_memory_bytes: np.ndarray  # host DRAM one rank's offloaded optimizer uses (0 without offload)
    host_capacity_bytes: float  # host DRAM per GPU (inf when the profile does not say)

    @property
    def fits(self) -> np.ndarray:
        return (self.peak_memory_bytes <= self.memory_capacity_bytes) & (self.host_memory_bytes <= self.host_capacity_bytes)

    @cached_property
    def comm_hidden_fraction(self) -> np.ndarray:
        """Share of the step's communication the prediction assumes hidden behind compute."""
        exposed = sum(self.time_s[k] for k in COMM_TERMS)
        total = self.comm_total_s
        return np.where(total > 0, 1 - exposed / np.where(total > 0, total, 1), 0.0)


def concat_costs(parts: list[CostArrays]) -> CostArrays:
    """The costs of several candidate sets, one after the other (same cluster and GPU)."""
    first = parts[0]
    out = {}
    for name in CostArrays.__dataclass_fields__:
        value = getattr(first, name)
        if isinstance(value, dict):
            out[name] = {k: np.concatenate([np.broadcast_to(getattr(p, name)[k], (len(p.step_time_s),)) for p in parts])
                         for k in value}
        elif isinstance(value, np.ndarray):
            out[name] = np.concatenate([np.broadcast_to(getattr(p, name), (len(p.step_time_s),)) for p in parts])
        else:
            out[name] = value
    return CostArrays(**out)


@dataclass
class Setup:
    """The question in the shapes every part needs (arrays over candidates)."""

    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    st: StrategyArrays
    comm: CommModel
    blocks: ModelBlocks
    lay: ParallelLayout
    x: Micro
    num_microbatches: np.ndarray

    @property
    def gpu(self) -> GpuSpec:
        return self.cluster.gpu

    @cached_property
    def framework(self) -> Framework:
        """The profile of the framework the plan runs on (`cost_models.frameworks.framework_of`)."""
        return framework_of(self.train, self.gpu.tables)

    @cached_property
    def counts(self) -> np.ndarray:
        """Layers of each kind (`blocks.all_kinds`) on each stage row: (K, S, N)."""
        return stage_kind_counts(self.blocks, self.lay)

    @cached_property
    def params(self) -> np.ndarray:
        """Parameters outside the routed experts of one rank of each stage row (S, N), elements."""
        return stage_params(self.blocks, self.lay, self.counts)

    @cached_property
    def has_experts(self) -> bool:
        return any(k.is_moe for k in self.blocks.all_kinds)

    @cached_property
    def expert_params(self) -> np.ndarray:
        """Routed-expert parameters of one rank of each stage row (S, N), elements."""
        if not self.has_experts:
            return np.zeros_like(self.params)
        return stage_expert_params(self.blocks, self.lay, self.counts)

    @cached_property
    def adapters(self) -> bool:
        """Whether the run trains adapters over a frozen base (cost_models.finetune)."""
        return bool(getattr(self.train, "adapters", False))

    @cached_property
    def transformers(self) -> bool:
        """Whether the layers are Hugging Face Transformers' (TrainSpec.model_code; every adapter plan)."""
        return bool(getattr(self.train, "transformers", False))

    @cached_property
    def trainable_params(self) -> np.ndarray:
        """Parameters outside the routed experts whose gradients one rank of each stage row reduces and whose
        optimizer step it runs (S, N), elements: all of them, or with adapters the adapters of its layers (an
        adapter plan holds whole layers; the adapted ones spread evenly for the count)."""
        if not self.adapters:
            return self.params
        per_layer = finetune.adapter_params(self.model, self.train) / self.model.num_layers
        return np.broadcast_to(self.lay.rows.layers * per_layer, self.params.shape) * 1.0

    @cached_property
    def optimizer_params(self) -> np.ndarray:
        """Parameters whose optimizer states and step one rank of each stage row holds (S, N):
        with ZeRO >= 1 its shard of the dense ones (over dp·cp) and of the experts (over the
        expert-data-parallel group); with adapters, its shard of the adapters."""
        sharded = self.st.zero_stage >= 1
        out = self.trainable_params / np.where(sharded, self.lay.shard, 1)
        if self.has_experts:
            out = out + self.expert_params / np.where(sharded, self.lay.expert_dp, 1)
        return out

    def per_row(self, per_kind: np.ndarray) -> np.ndarray:
        """A per-layer quantity of each kind (K, N) summed over each stage row's layers: (S, N)."""
        return per_row(self.counts, per_kind)

    @cached_property
    def layout_zero_classes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The distinct (layout, ZeRO stage) pairs, as `spread` takes them: the data parallel traffic's
        bytes depend on the layout and on which collectives the ZeRO stage runs (the others get zero
        bytes, which the curves skip)."""
        return layout_and(self.lay, self.st.zero_stage)

    @cached_property
    def offloaded_activations(self) -> np.ndarray:
        """Bytes of activations one rank of each stage row offloads to the host per micro-batch (S, N)
        (`cost_models.memory.offloaded_activation_bytes`)."""
        return offloaded_activation_bytes(self.blocks, self.x, self.st, self.counts)

    @cached_property
    def quantised_kinds(self) -> tuple[np.ndarray, np.ndarray]:
        """Weight elements of the FP8 GEMMs of one layer of each kind on one rank, outside the routed
        experts and of them: ((K, N), (K, N)) (`cost_models.memory.kind_quantised_weights`)."""
        return kind_quantised_weights(self.blocks, self.x)


def _pick(stacked: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Row `index[j]` of column j of an (S, N) array."""
    stacked = np.broadcast_to(stacked, (stacked.shape[0], index.shape[0])) if stacked.ndim == 2 else stacked
    return stacked[index, np.arange(index.shape[0])]


def micro_of(train: TrainSpec, st: StrategyArrays, cluster: ClusterSpec | None = None) -> Micro:
    """One micro-batch on one rank of every candidate."""
    imbalance = getattr(train, "moe_load_imbalance", None) or getattr(cluster, "moe_load_imbalance", 1.0)
    return Micro(train.seq_len, st.micro_batch_size, st.tp, st.cp, st.sequence_parallel, train.precision,
                 train.attention_kernel, st.ep, st.etp, float(imbalance),
                 getattr(train, "cross_entropy_fusion", True),
                 "nvfp4" if train.precision == "nvfp4" else getattr(train, "fp8_recipe", "delayed"),
                 getattr(train, "moe_dispatcher", "alltoall"), getattr(train, "framework", "megatron"),
                 not getattr(train, "torch_compile", True), getattr(train, "cross_entropy_fusion_impl", "native"),
                 getattr(train, "moe_flex_num_sms", None), getattr(train, "moe_router_padding_for_quantization", False),
                 graph_scopes(getattr(train, "cuda_graph_impl", "none"), getattr(train, "cuda_graph_scope", None)),
                 bool(getattr(train, "adapters", False)))


def setup(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, st: StrategyArrays, comm: CommModel | None = None) -> Setup:
    lay = ParallelLayout.of(st, model.num_layers)
    x = micro_of(train, st, cluster)
    comm = (comm or comm_model_for(cluster)).with_world(lay.num_gpus)  # where groups sit depends on the job
    return Setup(model, cluster, train, st, comm, model_blocks(model), lay, x,
                 lay.num_microbatches(train.global_batch_size, st.micro_batch_size))


def _memory_fields(s: Setup, mem_rows: dict[str, np.ndarray]) -> dict:
    """The CostArrays fields that memory decides (the binding stage row's terms and peak, host memory, capacity)
    and those of the layout alone, shared by `memory_arrays` and `evaluate_arrays`."""
    total = sum(mem_rows.values())
    binding = np.argmax(total, axis=0)
    lay, m, cluster = s.lay, s.num_microbatches, s.cluster
    host = cluster.host
    return dict(
        host_memory_bytes=offloaded_bytes(s).max(axis=0),
        host_capacity_bytes=host.memory_bytes / cluster.gpus_per_node if host is not None else float("inf"),
        memory_bytes={k: _pick(v, binding) for k, v in mem_rows.items()}, peak_memory_bytes=_pick(total, binding),
        binding_stage=_pick(lay.rows.kind, binding), binding_pipeline_rank=_pick(lay.rows.rank, binding),
        num_microbatches=m, bubble_fraction=lay.bubble_fraction(m), memory_capacity_bytes=s.gpu.memory_bytes,
        peak_flop_per_s=s.gpu.peak(s.train.precision))


def memory_arrays(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, st: StrategyArrays,
                  comm: CommModel | None = None) -> tuple[CostArrays, dict[str, np.ndarray]]:
    """The memory of every candidate in `st` (the first part of `evaluate_arrays`, the same numbers), with no
    time: the step time is infinite and the time terms zero. The search scores the time of the candidates that
    fit only (a plan that does not fit is never ranked; its memory says why and what it would take). Also returns
    the memory of every stage row (`stage_memory`), which `evaluate_arrays` takes for a subset of the columns."""
    s = setup(model, cluster, train, st, comm)
    mem_rows = stage_memory(s)
    zeros = np.zeros(len(st))
    return CostArrays(step_time_s=np.full(len(st), np.inf), time_s={k: zeros for k in TIME_TERMS},
                      model_flop_per_step=zeros, hardware_flop_per_step=zeros, comm_total_s=zeros,
                      **_memory_fields(s, mem_rows)), mem_rows


def evaluate_arrays(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, st: StrategyArrays, comm: CommModel | None = None,
                    mem_rows: dict[str, np.ndarray] | None = None) -> CostArrays:
    """Score every candidate in `st`; validity is the caller's job (planner.rules). `mem_rows`: their stage rows'
    memory already computed (`memory_arrays`), not computed again."""
    s = setup(model, cluster, train, st, comm)
    mem_rows = stage_memory(s) if mem_rows is None else mem_rows
    pl = per_layer_times(model, train, s.gpu, s.comm, st, cluster.overlap_efficiency, s, cluster.tp_comm_overlap,
                         cluster.ep_overlap_efficiency)
    mb = microbatch_times(s, pl)
    slow = np.argmax(sum(mb.values()), axis=0)
    t_mb = _pick(sum(mb.values()), slow)
    # the slowest stage row's forward of one chunk: what a steady-state transfer hides behind
    chunk_fwd = _pick(s.per_row(pl.fwd_s), slow) / np.maximum(s.lay.vpp, 1)
    pp_comm = pipeline_comm(s, chunk_fwd)
    tail, tail_raw = data_parallel_tail(s, pl)
    tail_stage = np.argmax(tail["dp_comm"] + tail["optimizer"], axis=0)
    m, lay = s.num_microbatches, s.lay
    time = {
        "compute": m * _pick(mb["compute"], slow),
        "recompute": m * _pick(mb["recompute"], slow),
        "tp_comm": m * _pick(mb["tp_comm"], slow),
        "cp_comm": m * _pick(mb["cp_comm"], slow),
        "ep_comm": m * _pick(mb["ep_comm"], slow),
        "activation_offload": m * _pick(mb["activation_offload"], slow),
        "pp_comm": pp_comm,
        "pp_bubble": (lay.pp - 1) / lay.vpp * t_mb,
        "dp_comm": _pick(tail["dp_comm"], tail_stage),
        "optimizer": _pick(tail["optimizer"], tail_stage),
    }
    moe_raw = s.per_row(3 * pl.cp_raw_s - pl.cp_a2a_s + pl.ep_raw_s)
    tp_hidden = s.per_row(2 * pl.tp_raw_s - pl.tp_fwd_s - pl.tp_bwd_s)
    comm_total = (time["tp_comm"] + m * _pick(moe_raw + tp_hidden, slow) + pp_comm + _pick(tail_raw, tail_stage))
    model_flop, hardware_flop = step_flops(s)
    return CostArrays(
        step_time_s=sum(time[k] for k in TIME_TERMS), time_s=time,
        model_flop_per_step=np.broadcast_to(model_flop, m.shape).astype(float), hardware_flop_per_step=hardware_flop,
        comm_total_s=comm_total, **_memory_fields(s, mem_rows))


def stage_breakdown(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, st: StrategyArrays,
                    comm: CommModel | None = None) -> list[list[dict]]:
    """Per candidate, per pipeline rank (first to last): its transformer layers, one micro-batch's forward and
    backward seconds there (all its chunks; the backward with recomputation and every exposed exchange of the
    layers, as `microbatch_times` adds them; the forward is the rank's `PerLayerTimes.fwd_s` with the output
    layer's), and its memory by term with the peak. What the schedule picture and the memory-per-stage picture
    draw, from the same functions `evaluate_arrays` ranks with.

    Without an explicit split the cost model keeps three stage rows (first, heaviest middle, last). Each such
    candidate is scored again with its split written out rank by rank (`stage_layers`, every rank its own row),
    which gives every middle rank its own in-flight micro-batches; that copy is used only where its first,
    second and last ranks agree with the three rows (else every middle rank shows the heaviest one's figures,
    an upper bound on their activations, exact for their times)."""
    own = _stage_breakdown(model, cluster, train, st, comm)
    implicit = (st.stage_layers < 0).all(axis=1) if st.stage_layers.shape[1] else np.ones(len(st), dtype=bool)
    spelled = [i for i in range(len(st)) if len(own[i]) > 3 and implicit[i]]
    if not spelled:
        return own
    rows = []
    for i in spelled:
        row = st.row(i)
        row.update(stage_layers=[r["layers"] for r in own[i]], num_layers_in_first_stage=None,
                   num_layers_in_last_stage=None, embedding_as_layer=False, loss_as_layer=False)
        rows.append(SimpleNamespace(**row))
    again = _stage_breakdown(model, cluster, train, StrategyArrays.from_strategies(rows), comm)
    for i, ranks in zip(spelled, again):
        if all(_same_stage(own[i][r], ranks[r]) for r in (0, 1, -1)):
            own[i] = ranks
    return own


def adapter_breakdown(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, st: StrategyArrays,
                      comm: CommModel | None = None) -> list[dict]:
    """Per candidate of an adapter plan (cost_models.finetune), what the frozen base and the adapters cost in one
    step on one rank, seconds (compute only, recomputation apart), and the parameters: the base's forward, the
    input-gradient backward of the frozen layers from the lowest adapted one up, the weight-gradient GEMMs that
    backward skips (what full training would add), the adapters' forward and backward, QLoRA's dequantisation
    (forward and backward passes). Empty dicts without adapters."""
    if not getattr(train, "adapters", False):
        return [{} for _ in range(len(st))]
    s = setup(model, cluster, train, st, comm)
    x, gpu = s.x, s.gpu
    frozen = layer_times(s.blocks, x, gpu)
    trained = layer_times(s.blocks, replace(x, frozen_base=False), gpu)
    L = model.num_layers
    share = finetune.backward_share(model, train)
    adapted = len(finetune.adapted_layers(model, train))
    a_fwd, a_bwd = finetune.adapter_layer_s(model, train, x.tokens, x.act, gpu)
    deq = finetune.dequant_layer_s(model, train, gpu)
    m = s.num_microbatches
    kind = 0  # adapter plans have one dense layer kind
    out = []
    for i in range(len(st)):
        fwd, bwd, full_bwd = (float(np.broadcast_to(t[kind], (len(st),))[i])
                              for t in (frozen.fwd_s, frozen.bwd_s, trained.bwd_s))
        mi = float(m[i])
        out.append({"trainable_params": float(finetune.adapter_params(model, train)),
                    "layers_without_backward": int(min(finetune.adapted_layers(model, train))),
                    "base_forward_s": mi * L * fwd,
                    "input_gradients_s": mi * L * share * bwd,
                    "weight_gradients_skipped_s": mi * L * share * max(full_bwd - bwd, 0.0),
                    "adapters_s": mi * adapted * float(np.broadcast_to(a_fwd + a_bwd, (len(st),))[i]),
                    "dequantisation_s": mi * L * (1 + share) * deq})
    return out


def _same_stage(a: dict, b: dict, rel: float = 1e-9) -> bool:
    keys = ("layers", "forward_s", "backward_s", "peak_memory_bytes")
    return all(abs(a[k] - b[k]) <= rel * max(abs(a[k]), abs(b[k]), 1e-30) for k in keys)


def _stage_breakdown(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, st: StrategyArrays,
                     comm: CommModel | None) -> list[list[dict]]:
    """`stage_breakdown` from the candidates' own stage rows."""
    s = setup(model, cluster, train, st, comm)
    mem = stage_memory(s)
    pl = per_layer_times(model, train, s.gpu, s.comm, st, cluster.overlap_efficiency, s, cluster.tp_comm_overlap,
                         cluster.ep_overlap_efficiency)
    mb = microbatch_times(s, pl)
    rows = s.lay.rows
    total = np.broadcast_to(sum(mb.values()), rows.rank.shape)
    forward = (s.per_row(pl.fwd_s) + rows.has_head * s.blocks.head_passes * pl.head_fwd_s
               + rows.has_embedding * pl.tp_all_reduce_s)
    forward = np.minimum(np.broadcast_to(forward, total.shape), total)
    out = []
    for i in range(len(st)):
        pp = int(s.lay.pp[i])
        layers = s.lay.layers_per_stage(i)
        ranks = []
        for r in range(pp):
            hits = np.flatnonzero(rows.rank[:, i] == r)
            k = int(hits[0]) if len(hits) else 1  # an implicit middle rank: the middle row
            memory = {t: float(np.broadcast_to(v, total.shape)[k, i]) for t, v in mem.items()}
            ranks.append({"pipeline_rank": r, "layers": int(layers[r]), "forward_s": float(forward[k, i]),
                          "backward_s": float(total[k, i] - forward[k, i]), "memory_bytes": memory,
                          "peak_memory_bytes": float(sum(memory.values()))})
        out.append(ranks)
    return out


def stage_memory(s: Setup) -> dict[str, np.ndarray]:
    """Every memory term of one rank of each stage row (S, N), bytes."""
    st, train, lay, x = s.st, s.train, s.lay, s.x
    params = s.params
    master = s.framework.zero3_param_is_master
    if s.adapters:
        mem = adapter_state_memory(s)
    else:
        mem = model_state_bytes(params, st.zero_stage, lay.shard, st.offload_optimizer, train.precision,
                                train.grad_precision, train.optimizer, master)
        if s.has_experts:  # expert states are sharded over the expert-data-parallel group (Megatron's expert DP)
            experts = model_state_bytes(s.expert_params, st.zero_stage, lay.expert_dp, st.offload_optimizer,
                                        train.precision, train.grad_precision, train.optimizer, master)
            mem = {k: mem[k] + experts[k] for k in mem}
        mem["adapters"] = np.zeros_like(params)
    mem |= stage_fp8_weight_bytes(s, mem["params"])
    mem |= stage_activation_bytes(s.blocks, x, st, lay, s.num_microbatches, s.framework,
                                  s.counts)
    mem["dequant_buffer"] = np.zeros_like(params)
    if s.transformers:  # the Hugging Face model's own saved tensors, not Megatron's
        mem |= transformers_activation_memory(s)
    # Pipeline send and receive buffers of one micro-batch's activations, forward and backward.
    p2p_buffers = np.where(lay.pp > 1, 2 * 2 * x.tokens * s.model.hidden_size * x.act / lay.tp, 0.0)
    mem["zero3_buffers"] = (zero3_working_bytes(s.blocks, st, train.precision, train.grad_precision) * (lay.rows.layers > 0)
                            + zero3_head_bytes(s.blocks, st, lay, train.precision, s.framework.zero3_head_unsharded))
    if s.adapters:  # ZeRO-3 gathers the frozen layers in their stored width, with one layer's adapter gradients
        layer = finetune.layer_base_bytes(s.model, train, float(kind_params_per_rank(s.blocks, lay.tp).max()))
        grads = finetune.adapter_params_per_layer(s.model, train) * finetune.adapter_state_bytes(train).grad
        mem["zero3_buffers"] = np.where(st.zero_stage >= 3, (2 * layer + grads) * (lay.rows.layers > 0), 0.0) + (
            zero3_head_bytes(s.blocks, st, lay, train.precision, s.framework.zero3_head_unsharded))
    mem["comm_buffers"] = p2p_buffers
    mem["cuda_graph_buffers"] = cuda_graph_buffer_bytes(s)
    tensors = sum(np.broadcast_to(v, params.shape) for v in mem.values())
    dispatcher = getattr(train, "moe_dispatcher", "alltoall")
    flex = None
    if s.has_experts and dispatcher != "alltoall":  # DeepEP's or HybridEP's own buffers, on ranks with MoE layers
        ep_size, ep_stride = lay.expert_group("ep")
        flex = dispatcher_buffer_bytes(dispatcher, x.tokens / x.seq_split, s.model.hidden_size, s.model.num_experts,
                                       ep_size, s.comm.domain_members(ep_size, ep_stride), x.moe_flex_sms)
        flex = np.where(s.expert_params > 0, flex, 0.0)  # a stage of dense layers only never calls the dispatcher
    mem |= runtime_memory_bytes(tensors, st, s.gpu, s.cluster.domain_size, alltoall=dispatcher == "alltoall",
                                dispatcher_bytes=flex)
    return {k: np.broadcast_to(mem[k], params.shape) for k in MEMORY_TERMS}


def adapter_state_memory(s: Setup) -> dict[str, np.ndarray]:
    """Model states of one rank of each stage row with adapters over a frozen base (S, N), bytes: the frozen
    weights (`params`: the layers' linear weights at `finetune.base_weight_bytes_per_param`, 16-bit elsewhere;
    sharded under ZeRO-3), the adapters' weights (`adapters`, sharded under ZeRO-3), their gradients (`grads`,
    sharded from ZeRO-2) and optimizer states (`optimizer`, sharded from ZeRO-1; on the host when offloaded).
    The frozen weights have no gradients and no optimizer states."""
    st, lay, train, model = s.st, s.lay, s.train, s.model
    linear = lay.rows.layers * finetune.linear_weights_per_layer(model) / lay.tp
    base = linear * finetune.base_weight_bytes_per_param(train) + (s.params - linear) * WEIGHT_BYTES[train.precision]
    states = finetune.adapter_state_bytes(train)
    trainable = s.trainable_params
    optimizer = trainable * states.optimizer / np.where(st.zero_stage >= 1, lay.shard, 1)
    return {"params": base / np.where(st.zero_stage >= 3, lay.shard, 1),
            "adapters": trainable * states.weight / np.where(st.zero_stage >= 3, lay.shard, 1),
            "grads": trainable * states.grad / np.where(st.zero_stage >= 2, lay.shard, 1),
            "optimizer": np.where(st.offload_optimizer, 0.0, optimizer)}


def transformers_activation_memory(s: Setup) -> dict[str, np.ndarray]:
    """Activations of one rank of each stage row of Hugging Face Transformers' layers (S, N), bytes: their saved
    tensors (`finetune.layer_activation_bytes`) on the layers with a backward (with adapters, from the lowest adapted
    one up: below it nothing needs a gradient and autograd keeps nothing); with gradient checkpointing (recompute
    full) those layers keep their 16-bit input only, and one layer's tensors are live while its backward recomputes
    it (`recompute_working`). And QLoRA's dequantised weight buffer."""
    st, lay, train, model, x = s.st, s.lay, s.train, s.model, s.x
    rows = lay.rows
    layers = rows.layers * finetune.backward_share(model, train)  # an adapter plan holds every layer (pp = 1)
    one = finetune.layer_activation_bytes(model, train, x.tokens, x.act)
    full = st.recompute == 2
    activations = np.where(full, layers * x.tokens * model.hidden_size * x.act, layers * one)
    working = np.where(full, one, 0.0) * (rows.layers > 0)
    deq = finetune.dequant_buffer_bytes(model, train) * (rows.layers > 0)
    shape = np.broadcast(activations, working, s.params).shape
    return {"activations": np.broadcast_to(activations, shape) * 1.0,
            "recompute_working": np.broadcast_to(working, shape) * 1.0,
            "dequant_buffer": np.broadcast_to(deq, shape) * 1.0}


#: Static tensors a captured CUDA graph keeps per layer, in units of the layer's 16-bit hidden-state tensor (one
#: micro-batch on one rank): each captured scope's output, held for every (micro-batch, chunk) in flight until its
#: backward graph runs. ASSUMED from how Transformer Engine's make_graphed_callables keeps static outputs per
#: captured callable and megatron-core captures one graph per layer and micro-batch of the schedule; the graphs'
#: private memory pool beyond these outputs is not modelled.
GRAPH_OUTPUTS_PER_SCOPE = 1


def cuda_graph_buffer_bytes(s: Setup) -> np.ndarray:
    """Bytes one rank of each stage row (S, N) keeps for its layers' CUDA graphs (`GRAPH_OUTPUTS_PER_SCOPE` per
    captured scope, layer and in-flight micro-batch chunk); 0 without graphs. `full_iteration` keeps both
    sub-layers' outputs."""
    scopes, x, lay = s.x.cuda_graph, s.x, s.lay
    rows = lay.rows
    if not scopes:
        return np.zeros(np.shape(rows.layers))
    per_layer = 2 if "full_iteration" in scopes else len(scopes & {"attn", "mlp", "moe_router"})
    hidden = x.tokens * s.model.hidden_size * x.act / lay.tp  # as the pipeline buffers: one micro-batch's output
    chunks = lay.inflight_chunks(rows.rank, s.num_microbatches)
    return GRAPH_OUTPUTS_PER_SCOPE * per_layer * hidden * chunks * rows.layers / lay.vpp


def stage_fp8_weight_bytes(s: Setup, params: np.ndarray) -> dict[str, np.ndarray]:
    """The FP8 weight copies of one rank of each stage row and its params term with them (S, N), bytes
    (`cost_models.memory.fp8_weight_memory`); none without FP8 training. A GPU without an element-wise
    table is assumed to need the transposed copy (Hopper's rule, the larger)."""
    train = s.train
    if train.precision not in QUANTISED_PRECISIONS:
        return {"params": params, "fp8_weights": np.zeros_like(params)}
    table = elementwise_model(s.gpu)
    dense_k, expert_k = s.quantised_kinds
    fp8 = fp8_weight_memory(s.per_row(dense_k), s.per_row(expert_k), s.st.zero_stage, s.lay.shard, s.lay.expert_dp,
                            s.x.fp8_recipe, table.fp8_transpose if table is not None else True,
                            bool(getattr(train, "fp8_param_gather", False)), s.framework.fp8_weight_cache,
                            WEIGHT_BYTES[train.precision])
    return {"params": params + fp8["params"], "fp8_weights": fp8["fp8_weights"]}


@dataclass
class PerLayerTimes:
    """One layer of each kind, one micro-batch, one rank: (K, N) arrays over the kinds of
    `blocks.all_kinds` and the candidates (the head's terms are (N,))."""

    layer: LayerTimes
    tp_all_reduce_s: np.ndarray  # one TP all-reduce of the embedding output
    tp_fwd_s: np.ndarray  # exposed TP communication of the forward (an all-reduce, or AG + RS with SP, per exchange)
    tp_bwd_s: np.ndarray  # exposed TP communication of the backward
    tp_raw_s: np.ndarray  # TP communication of one direction, hidden or not
    cp_fwd_s: np.ndarray  # exposed ring-attention KV exchange of the forward, and Mamba's all-to-alls (cp_a2a_s)
    cp_raw_s: np.ndarray  # the whole KV exchange of the forward, hidden or not, and Mamba's all-to-alls
    ep_fwd_s: np.ndarray  # exposed MoE token dispatch + combine of the forward
    ep_bwd_s: np.ndarray  # exposed MoE dispatch + combine of the backward
    ep_raw_s: np.ndarray  # the whole MoE exchange, forward + backward, hidden or not
    recompute_s: np.ndarray  # what the layer repeats in backward under its recompute mode
    head_fwd_s: np.ndarray  # output layer + loss, forward
    head_bwd_s: np.ndarray
    cp_a2a_s: np.ndarray | float = 0.0  # Mamba layers' CP all-to-alls of the forward (in cp_fwd_s; never hidden)

    @property
    def cp_both_s(self) -> np.ndarray:
        """Exposed CP communication of forward and backward: the ring's backward passes K, V and their gradients
        (twice the forward's), Mamba's all-to-alls carry the gradients back once."""
        return 3 * self.cp_fwd_s - self.cp_a2a_s

    def mean(self, field: str, blocks: ModelBlocks) -> np.ndarray:
        """The main stack's average layer of a (K, N) field (MTP modules excluded)."""
        values = getattr(self, field) if hasattr(self, field) else getattr(self.layer, field)
        return sum(n * values[blocks.kinds.index(kind)] for kind, n in blocks.layers) / blocks.num_layers

    @property
    def fwd_s(self) -> np.ndarray:
        return self.layer.fwd_s + self.tp_fwd_s + self.cp_fwd_s + self.ep_fwd_s

    @property
    def bwd_s(self) -> np.ndarray:
        """Backward including recomputation (as Korthikanti Table 4 reports it)."""
        return (self.layer.bwd_s + self.tp_bwd_s + (self.cp_both_s - self.cp_fwd_s) + self.ep_bwd_s
                + self.recompute_s)


def _moe_exchange_s(layer, x: Micro, comm: CommModel, lay: ParallelLayout,
                    pairs: tuple[np.ndarray, np.ndarray] | None = None, table: DispatchTable | None = None
                    ) -> np.ndarray:
    """One direction's token exchange of an MoE layer (forward, or the same again in backward):
    the dispatch and the combine over ep, and with etp > 1 the all-gather before the experts and
    the reduce-scatter after, over etp. A flex dispatcher (DeepEP, HybridEP) whose calls the GPU's
    dispatch table measured on the group's tier runs at those rates (`DispatchTable.exchange_s`);
    otherwise the exchange is the collective curves' all-to-all of the dispatcher's copies."""
    ep_size, ep_stride = lay.expert_group("ep")
    etp_size, etp_stride = lay.expert_group("etp")
    moe = layer.moe()
    members = comm.domain_members(ep_size, ep_stride)
    intra, inter = tier_scales(x.moe_dispatcher, moe.num_experts, moe.top_k, ep_size, members,
                               moe.router_groups, moe.router_group_topk)
    measured = table is not None and x.moe_dispatcher != "alltoall"
    total, n = 0.0, len(lay)
    for c in layer.comms(x):  # `pairs`: the distinct (layout, shape) pairs, whose bytes and groups these are
        if np.any(c.ep_a2a_bytes):
            nbytes = np.broadcast_to(c.ep_a2a_bytes, (n,))
            a2a = 2 * spread(pairs, n, comm.all_to_all_s, nbytes, ep_size, ep_stride, intra, inter)
            if measured:
                flex = spread(pairs, n, partial(table.exchange_s, x.moe_dispatcher), nbytes, ep_size, members,
                              intra, inter)
                a2a = np.where(np.isnan(flex), a2a, flex)
            total = total + a2a
            total = total + 2 * spread(pairs, n, comm.gather_scatter_s, np.broadcast_to(c.etp_bytes, (n,)),
                                       etp_size, etp_stride)
    return np.broadcast_to(total, (len(lay),))


def amax_reductions(x: Micro, st: StrategyArrays) -> np.ndarray:
    """1 where a candidate's FP8 casts all-reduce their amax over the TP group (Transformer Engine's per-tensor
    current scaling, Megatron's --fp8-recipe tensorwise, with sequence parallelism and tp > 1), else 0."""
    # NVFP4's per-tensor amax is reduced the same way (NVFP4Quantizer's with_amax_reduction over the amax group)
    on = x.precision in QUANTISED_PRECISIONS and x.fp8_recipe in ("tensorwise", "nvfp4") and x.framework == "megatron"
    return np.where(on & (np.asarray(st.tp) > 1) & np.asarray(st.sequence_parallel, dtype=bool), 1.0, 0.0)


def adapter_layer_times(model: ModelSpec, train: TrainSpec, lt, x: Micro, gpu: GpuSpec):
    """A frozen base with adapters (cost_models.finetune): each layer's forward gains its adapters' kernels (on
    the adapted layers' share of the layers) and QLoRA's dequantisation; its backward (input gradients only,
    `Micro.frozen_base`) gains the adapters' backward and a second dequantisation, and runs on the layers from
    the lowest adapted one up only. Returns the new times (the per-kind means the stage sums use; every kind is
    the same dense layer) and that backward share, which recomputation takes too."""
    adapted = len(finetune.adapted_layers(model, train)) / model.num_layers
    a_fwd, a_bwd = finetune.adapter_layer_s(model, train, x.tokens, x.act, gpu)
    deq = finetune.dequant_layer_s(model, train, gpu)
    share = finetune.backward_share(model, train)
    fwd = lt.fwd_s + adapted * a_fwd + deq
    bwd = share * (lt.bwd_s + deq) + adapted * a_bwd
    return replace(lt, fwd_s=fwd, bwd_s=bwd), share


def per_layer_times(model: ModelSpec, train: TrainSpec, gpu: GpuSpec, comm: CommModel, st: StrategyArrays, comm_overlap: float = 1.0,
                    s: Setup | None = None, tp_overlap: float = 0.0, ep_overlap: float | None = None
                    ) -> PerLayerTimes:
    """Per-layer compute and exposed TP/CP/EP communication of every layer kind and candidate.

    MoE: the dispatch and combine are on the critical path (Megatron-core's all-to-all
    dispatcher runs them between the router and the experts), except that with shared
    experts Megatron's `--moe-shared-expert-overlap` runs the shared experts' GEMMs
    concurrently with them (the emitters set that flag); with `overlap_moe_comm` (Megatron's
    `--overlap-moe-expert-parallel-comm`) they hide behind another micro-batch's compute of the
    layer instead, of which `ep_overlap` (cluster.ep_comm_overlap, measured end to end; None:
    `comm_overlap`) is hidden. DeepSeek's DualPipe is not modelled: for such runs the prediction is
    pessimistic by up to the whole `ep_comm` term.

    TP: with sequence parallelism and `tp_overlap` > 0 (cluster.tp_comm_overlap: Transformer
    Engine userbuffers, Megatron's --tp-comm-overlap) that share of each direction's all-gathers
    and reduce-scatters is pipelined with the layer's GEMMs (forward: the layer's time outside
    the attention core; backward: backward_gemm_ratio times that) and hides behind them as far
    as they last, at `comm_overlap`; the rest stays on the critical path.
    """
    blocks = s.blocks if s else model_blocks(model)
    lay = s.lay if s else ParallelLayout.of(st, model.num_layers)
    x = s.x if s else micro_of(train, st)
    lt = layer_times(blocks, x, gpu)
    share = 1.0
    if getattr(train, "adapters", False):
        lt, share = adapter_layer_times(model, train, lt, x, gpu)
    n = len(st)
    tp_size, tp_stride = lay.group("tp")
    cp_size, cp_stride = lay.group("cp")
    emb = blocks.embedding.comm(x)
    tp_ar = comm.all_reduce_s(emb.tp_bytes, tp_size, tp_stride)

    pairs = layout_and_shape(lay, x) if s else None  # the bytes and groups below depend on these alone

    def exchange_s(nbytes, sp, size, stride):
        # each collective gets the bytes of the candidates that run it
        return np.where(sp, 2 * comm.gather_scatter_s(nbytes * sp, size, stride),
                        comm.all_reduce_s(nbytes * ~sp, size, stride))

    def layer_comm(layer):
        # Each exchange is an all-reduce, or with SP an all-gather before and a reduce-scatter
        # after (the same volume, but their own bandwidth).
        tp, hop, a2a, exchanges = 0.0, 0.0, 0.0, 0
        for c in layer.comms(x):
            if c.tp_exchanges:
                exchanges += c.tp_exchanges
                tp = tp + c.tp_exchanges * spread(pairs, n, exchange_s, np.broadcast_to(c.tp_bytes, (n,)),
                                                  st.sequence_parallel, tp_size, tp_stride)
            if np.any(c.cp_hop_bytes):
                hop = hop + spread(pairs, n, comm.p2p_s, np.broadcast_to(c.cp_hop_bytes, (n,)), cp_stride,
                                   cp_size * cp_stride)
            if np.any(c.cp_a2a_bytes):  # Mamba's context parallelism: two all-to-alls over the CP group
                a2a = a2a + spread(pairs, n, comm.all_to_all_s, np.broadcast_to(c.cp_a2a_bytes, (n,)), cp_size,
                                   cp_stride)
        return np.broadcast_to(tp, (n,)), np.broadcast_to(hop, (n,)), exchanges, np.broadcast_to(a2a, (n,))

    kinds = [layer_comm(layer) for layer in blocks.all_kinds]
    tp_raw = np.stack([k[0] for k in kinds])
    tp_fwd = tp_bwd = tp_raw
    if tp_overlap > 0:
        pipelined = np.where(st.sequence_parallel & (st.tp > 1), tp_overlap * tp_raw, 0.0)
        gemm_fwd = lt.fwd_s - lt.attn_core_fwd_s
        tp_fwd = tp_raw - pipelined + exposed_s(pipelined, gemm_fwd, comm_overlap)
        tp_bwd = tp_raw - pipelined + exposed_s(pipelined, gpu.backward_gemm_ratio * gemm_fwd, comm_overlap)
    # FP8 current scaling with sequence parallelism: Transformer Engine all-reduces each column-parallel
    # input's amax (forward) and each row-parallel output gradient's (backward) over the TP group before
    # the cast (`with_amax_reduction`, Linear._customize_quantizers_float8_current_scaling and
    # Float8CurrentScalingQuantizer::quantize_impl at v2.9): one 4-byte all-reduce per exchange and
    # direction, on the compute stream, not pipelined with the GEMMs.
    reduces = amax_reductions(x, st)
    if reduces.any():  # only current-scaling FP8 plans with sequence-parallel TP pay the extra collective
        amax = reduces * comm.all_reduce_s(FP32, tp_size, tp_stride)
        amax_s = np.array([k[2] for k in kinds], dtype=float)[:, None] * np.broadcast_to(amax, (n,))[None, :]
        tp_raw, tp_fwd, tp_bwd = tp_raw + amax_s, tp_fwd + amax_s, tp_bwd + amax_s
    cp_hop = np.stack([k[1] for k in kinds])
    cp_a2a = np.where(st.cp > 1, np.stack([k[3] for k in kinds]), 0.0)
    cp_raw = np.where(st.cp > 1, (st.cp - 1) * cp_hop, 0.0)
    cp_fwd = np.where(st.cp > 1, exposed_s(cp_raw, lt.attn_core_fwd_s, comm_overlap), 0.0) + cp_a2a
    cp_raw = cp_raw + cp_a2a
    table = dispatch_table(gpu.tables.dispatch, x.moe_dispatcher, x.moe_flex_sms)
    ep_one = np.stack([_moe_exchange_s(layer, x, comm, lay, pairs, table) if layer.is_moe else np.zeros(n)
                       for layer in blocks.all_kinds])
    # the shared experts hide the dispatch with the all-to-all dispatcher only (megatron-core refuses
    # --moe-shared-expert-overlap with the flex dispatcher)
    shared = lt.shared_expert_fwd_s * (x.moe_dispatcher == "alltoall")
    ep_fwd = exposed_s(ep_one, shared, comm_overlap)
    ep_bwd = exposed_s(ep_one, gpu.backward_gemm_ratio * shared, comm_overlap)
    # Megatron's --overlap-moe-expert-parallel-comm runs one micro-batch's forward beside another's
    # backward, layer by layer: each layer's dispatch and combine (both directions) hide behind the
    # other micro-batch's compute of that layer instead of the shared experts.
    # The share hidden is measured (cluster.ep_comm_overlap): the schedule pairs each exchange with one
    # sub-module of the other micro-batch and its kernels contend for the SMs, so less hides than fits.
    across = exposed_s(2 * ep_one, lt.fwd_s + lt.bwd_s, comm_overlap if ep_overlap is None else ep_overlap) / 2
    ep_fwd = np.where(st.overlap_moe_comm, across, ep_fwd)
    ep_bwd = np.where(st.overlap_moe_comm, across, ep_bwd)
    rc = st.recompute
    # Selective recompute repeats its modules' forward (Megatron's --recompute-modules; by default the
    # attention core); the `moe` module repeats the dispatch too.
    moe_bit = 1 << RECOMPUTE_MODULES.index("moe")
    selective = np.stack([np.broadcast_to(selective_recompute_s(layer, x, gpu, lt.attn_core_fwd_s[k],
                                                                st.recompute_modules), (n,))
                          for k, layer in enumerate(blocks.all_kinds)])
    selective = selective + np.where(st.recompute_modules & moe_bit, ep_fwd, 0.0)
    policy = framework_of(train, gpu.tables).selective_recompute
    if policy == "none":  # the framework checkpoints nothing for selective (see its profile)
        selective = np.zeros_like(selective)
    elif policy == "op_sac":
        # torchtitan's op policy also repeats the forward's TP all-gathers (their outputs are not
        # saved; the reduce-scatters' are): half of each exchange with sequence parallelism.
        ag = np.where((st.tp > 1) & st.sequence_parallel, tp_fwd / 2, 0.0)
        sac = [op_sac_recompute_s(layer, x, gpu) for layer in blocks.all_kinds]
        selective = np.stack([np.broadcast_to(t + ag[k], (n,)) if t is not None else selective[k]
                              for k, t in enumerate(sac)])
    recompute = np.where(rc == 2, lt.fwd_s + tp_fwd + cp_fwd + ep_fwd, np.where(rc == 1, selective, 0.0))
    recompute = share * recompute  # adapters: the layers below the lowest adapted one run no backward
    head_f, head_b, _ = head_times(blocks.head, x, gpu)
    return PerLayerTimes(layer=lt, tp_all_reduce_s=tp_ar, tp_fwd_s=tp_fwd, tp_bwd_s=tp_bwd, tp_raw_s=tp_raw, cp_fwd_s=cp_fwd, cp_raw_s=cp_raw,
                         ep_fwd_s=ep_fwd, ep_bwd_s=ep_bwd, ep_raw_s=2 * ep_one, recompute_s=recompute,
                         head_fwd_s=head_f, head_bwd_s=head_b, cp_a2a_s=cp_a2a)


def op_sac_gemms(layer, x: Micro) -> list[Gemm] | None:
    """The GEMMs torchtitan's op-level selective checkpointing repeats in one dense layer's backward
    (profiles/frameworks/torchtitan.yaml): its policy saves the output of every odd-numbered
    `aten.mm` of a layer and recomputes every even-numbered one. A torchtitan layer calls them as
    wq, wk, wv, wo, then w1, w3, w2 (gated) or fc1, fc2 (plain): it repeats wk, wo and w3 (fc2).
    None for a layer the policy is not costed for (latent attention, MoE)."""
    att = layer.attention()
    mlps = [b for b in layer.blocks if isinstance(b, DenseMLP)]
    if not isinstance(att, Attention) or layer.is_moe or len(mlps) != 1:
        return None
    mlp, h, t, n = mlps[0], att.hidden, x.tp, x.tokens
    wq = Gemm(2 * n * h * att.q_width / t, n, att.q_width / t, h)
    wkv = Gemm(2 * n * h * att.kv_width / t, n, att.kv_width / t, h)
    wo = att.gemms(x)[1]
    up, down = mlp.gemms(x)
    ffn = [Gemm(up.flop / 2, n, mlp.ffn / t, h)] * 2 + [down] if mlp.gated else [up, down]
    return [wq, wkv, wkv, wo, *ffn][1::2]


def op_sac_recompute_s(layer, x: Micro, gpu: GpuSpec) -> np.ndarray | None:
    """Forward seconds torchtitan's op-level selective checkpointing repeats for one layer: the
    GEMMs of `op_sac_gemms` and every element-wise op of the layer (norms, RoPE, activation, gate
    product, residual adds: none is on its save list); the attention kernel is saved. The TP
    all-gathers it repeats are the caller's to add."""
    gemms = op_sac_gemms(layer, x)
    if gemms is None:
        return None
    small, index = x.distinct
    if index is not None:
        return op_sac_recompute_s(layer, small, gpu)[..., index]
    gemm_s = sum(gemm_time(g, gpu, x.precision, x.fp8_recipe) for g in gemms)
    ew = layer.elementwise(x)
    table = elementwise_model(gpu)
    if table is not None:
        ew_s = table.time_s(ew.bytes, ew.num_kernels)
    else:
        ew_s = ew.bytes / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency) + ew.num_kernels * gpu.kernel_overhead_s
    return np.broadcast_to(gemm_s + ew_s, np.shape(x.tokens)) * 1.0


def _recomputed_fraction(s: Setup) -> np.ndarray:
    """Share of each stage row's layers that full recompute repeats (S, N)."""
    rows, n = s.lay.rows, s.st.recompute_num_layers
    chunk = np.where(rows.chunk_layers > 0, rows.chunk_layers, 1)
    return np.where(n > 0, np.minimum(n, rows.chunk_layers) / chunk, 1.0)


def microbatch_times(s: Setup, pl: PerLayerTimes) -> dict[str, np.ndarray]:
    """Time of one micro-batch on each stage row (S, N), by term."""
    rows, rc, lt = s.lay.rows, s.st.recompute, pl.layer
    share = np.where(rc == 2, _recomputed_fraction(s), np.where(rc == 1, 1.0, 0.0))
    heads = s.blocks.head_passes
    return {
        "compute": (s.per_row(lt.fwd_s + lt.bwd_s) + rows.has_head * heads * (pl.head_fwd_s + pl.head_bwd_s)
                    + fp4_bf16_layers_s(s, pl)),
        "recompute": share * s.per_row(pl.recompute_s),
        "tp_comm": s.per_row(pl.tp_fwd_s + pl.tp_bwd_s) + rows.has_embedding * pl.tp_all_reduce_s,
        "cp_comm": s.per_row(pl.cp_both_s),  # forward + backward (KV and dKV; Mamba's all-to-alls twice)
        "ep_comm": s.per_row(pl.ep_fwd_s + pl.ep_bwd_s),
        "activation_offload": activation_offload_s(s, pl),
    }


def fp4_bf16_layers_s(s: Setup, pl: PerLayerTimes) -> np.ndarray:
    """Extra compute time of one micro-batch on each stage row (S, N) for the layers an NVFP4 run keeps in bf16
    (TrainSpec.fp4_bf16_layers_start / _end; megatron-core 0.16 fp4_utils.get_fp4_context runs them without the
    FP4 autocast): the first ones on pipeline rank 0, the last ones on rank pp-1, each costing what the stage's
    average layer costs in bf16 over NVFP4 (forward and backward; exact for a model of one layer kind, the
    stage's mean otherwise; their recomputation, if any, is left at the NVFP4 time). Zero otherwise."""
    train = s.train
    start, end = getattr(train, "fp4_bf16_layers_start", 0), getattr(train, "fp4_bf16_layers_end", 0)
    if train.precision != "nvfp4" or not (start or end):
        return np.zeros(s.lay.rows.rank.shape)
    bf16 = layer_times(s.blocks, replace(s.x, precision="bf16", fp8_recipe="delayed"), s.gpu)
    extra = s.per_row(bf16.fwd_s + bf16.bwd_s - pl.layer.fwd_s - pl.layer.bwd_s)  # every layer of the row in bf16
    rows = s.lay.rows
    layers = np.maximum(rows.layers, 1e-9)
    kept = (np.minimum(np.where(rows.rank == 0, start, 0) + np.where(rows.rank == s.lay.pp - 1, end, 0), rows.layers))
    return extra * kept / layers


def offload_stall_s(copy_s, layer_s, offloaded, layers) -> np.ndarray:
    """Seconds the compute waits, per pass, for the copies of `offloaded` layers' activations out of
    `layers` equal layers of `layer_s` each, every copy taking `copy_s` on one copy stream.

    Transformer Engine's schedule (cpu_offload.py, OffloadSynchronizer._default_offload_sync_init, TE
    commit 00382b96) starts the copy of offloaded layer i when layer i's forward ends and waits for it
    before layer L - N + i starts; the backward starts reloading layer i when layer L - 1 - N + i starts
    its backward and waits for it before layer i's. Copies queue on the stream, so with copies no longer
    than a layer the last one waits c - (L - N - 1)·t; with longer copies the queue grows and the last
    one waits N·c - (L - 2)·t (each delay moves every later deadline alike, so the largest one is the
    pass's stall). Both vanish while the copies hide behind the other layers:

    >>> [round(float(offload_stall_s(c, 1.0, 40, 80)), 1) for c in (1.0, 1.9, 2.0, 3.0)]
    [0.0, 0.0, 2.0, 42.0]
    >>> float(offload_stall_s(5.0, 1.0, 1, 4))  # one layer of four: its copy waits 5 - 2 layers
    3.0
    """
    c, t, n, L = (np.asarray(v, dtype=float) for v in (copy_s, layer_s, offloaded, layers))
    short = c - (L - n - 1) * t
    long = n * c - (L - 2) * t
    return np.where(n > 0, np.maximum(np.where(c <= t, short, long), 0.0), 0.0)


def host_copy_bw(gpu, host) -> float:
    """Bytes/s one GPU copies to or from the host while every GPU of the server copies at once: its
    host link, shared with the other GPUs behind the same uplink (`HostSpec.gpus_per_host_link`, two
    behind each PCIe switch of a DGX A100); infinite where the GPU profile gives no link.

    >>> from types import SimpleNamespace as S
    >>> host_copy_bw(S(host_link_bw_bytes_per_s=25e9), S(gpus_per_host_link=2)) / 1e9
    12.5
    """
    link = gpu.host_link_bw_bytes_per_s or np.inf
    return link / host.gpus_per_host_link if host is not None else link


def activation_offload_s(s: Setup, pl: PerLayerTimes) -> np.ndarray:
    """Exposed time of activation offloading in one micro-batch on each stage row (S, N): the forward's
    copies to the host and the backward's copies back (`offload_stall_s`), at the slower of the GPU's
    share of its host link (`host_copy_bw`, one direction each) and its share of the host's DRAM bandwidth (the copies are DMA, so
    the DRAM's peak, not a CPU kernel's share of it). The offloaded layers are the model's first ones
    (one stage: pp 1); each is the stage's average layer."""
    st = s.st
    if not np.any(st.offload_activation_layers):
        return np.zeros(s.params.shape)
    host = s.cluster.host
    link = host_copy_bw(s.gpu, host)
    if host is not None:
        link = min(link, host.memory_bw_bytes_per_s / s.cluster.gpus_per_node)
    layers = s.counts.sum(axis=0)
    n = offloaded_layers(st, layers)
    per_layer = s.offloaded_activations / np.maximum(n, 1)
    copy = per_layer / link
    fwd = s.per_row(pl.fwd_s) / np.maximum(layers, 1)
    bwd = s.per_row(pl.bwd_s) / np.maximum(layers, 1)
    return offload_stall_s(copy, fwd, n, layers) + offload_stall_s(copy, bwd, n, layers)


def pipeline_comm(s: Setup, chunk_s: np.ndarray | None = None) -> np.ndarray:
    """Point-to-point activation transfers of the schedule on its critical path, plus the all-reduce of
    the tied word-embedding gradients between the first and last pipeline ranks.

    Every transfer blocks (`ParallelLayout.pipeline_transfers`) unless the schedule is interleaved and
    overlaps them (`Strategy.overlap_p2p_comm` on a framework whose profile says `p2p_overlap`): then
    the warm-up and cool-down transfers still block (`ParallelLayout.blocking_transfers`) and each
    steady-state one is exposed only past the compute of the chunk beside it (`chunk_s`, the slowest
    stage row's forward of one chunk, the shorter of its two passes)."""
    lay, x, m = s.lay, s.x, s.num_microbatches
    h = s.model.hidden_size
    p2p = s.comm.p2p_s(x.tokens * h * x.act / lay.tp, lay.stride("pp"), lay.stride("pp") * lay.pp)
    grad_b = DTYPE_BYTES[s.train.grad_precision]
    emb_size, emb_stride = lay.embedding_group()
    embedding_grads = padded_vocab(s.model.vocab_size, lay.tp) * h / lay.tp * grad_b
    tied_sync = np.where(s.model.tie_embeddings & (lay.pp > 1),
                         s.comm.all_reduce_s(embedding_grads, emb_size, emb_stride), 0.0)
    every = lay.pipeline_transfers(m)
    overlapped = s.st.overlap_p2p_comm & (lay.vpp > 1) & s.framework.p2p_overlap
    if chunk_s is None or not np.any(overlapped):
        return every * p2p + tied_sync
    blocking = lay.blocking_transfers(m)
    steady = every - blocking
    hidden = blocking * p2p + steady * exposed_s(p2p, chunk_s, s.cluster.overlap_efficiency)
    return np.where(overlapped, hidden, every * p2p) + tied_sync


def layout_and(lay: ParallelLayout, other: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """The distinct (layout, `other`) pairs among the candidates, as `spread` takes them; `other` is a class
    index of small non-negative integers per candidate (None: every candidate its own)."""
    n = len(lay)
    if n < 2:
        return None
    by_lay = lay.distinct
    a = by_lay[1] if by_lay is not None else np.arange(n)
    b = np.broadcast_to(np.asarray(other, dtype=np.int64), (n,)) if other is not None else np.arange(n)
    _, first, index = np.unique(a * (int(b.max()) + 1) + b, return_index=True, return_inverse=True)
    return None if len(first) == n else (first, index.ravel())


def layout_and_shape(lay: ParallelLayout, x: Micro) -> tuple[np.ndarray, np.ndarray] | None:
    """The distinct (layout, micro-batch shape) pairs among the candidates: a layer's communication
    depends on both (its bytes on the shape, its groups on the layout)."""
    return layout_and(lay, x.distinct[1])


def data_parallel_tail(s: Setup, pl: PerLayerTimes) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Exposed data parallel communication and the optimizer step of each stage row (S, N),
    and the data parallel communication before any overlap.

    Dense parameters are reduced (and, under ZeRO, sharded and gathered) over the dp·cp
    ranks that hold them; routed-expert parameters over the expert-data-parallel group
    (Megatron-core's expert DP: the ranks of a stage left over by etp·ep)."""
    st, lay, train, comm, gpu = s.st, s.lay, s.train, s.comm, s.gpu
    rows, lt, zero = lay.rows, pl.layer, st.zero_stage
    shard, shard_stride = lay.group("cp", "dp")
    edp, edp_stride = lay.expert_group("edp") if s.has_experts else (1, 1)
    params, experts = s.params, s.expert_params
    grad_b, weight_b = DTYPE_BYTES[train.grad_precision], WEIGHT_BYTES[train.precision]

    # the bytes and groups below depend on the layout and the ZeRO stage alone: each collective is timed
    # once per distinct pair, and gets the bytes of the candidates that run it only (zero elsewhere: a
    # measured-curve model skips those; the tier model's answer there is discarded by the np.where)
    classes, n = s.layout_zero_classes, len(st)

    def reduce_s(nbytes, size, stride):
        return np.where(zero == 0, spread(classes, n, comm.all_reduce_s, nbytes * (zero == 0), size, stride),
                        spread(classes, n, comm.gather_scatter_s, nbytes * (zero != 0), size, stride))

    fwd_mb = s.per_row(lt.fwd_s)
    bwd_mb = s.per_row(lt.bwd_s) + rows.has_head * s.blocks.head_passes * pl.head_bwd_s
    sharded = (zero == 1) | (zero == 2)
    # FP8 parameters (fp8_param_gather) are gathered in fewer bytes than the 16-bit ones
    fp8_saving = param_gather_saving_per_element(train)
    if s.adapters:  # only the adapters have gradients to reduce and updated weights to gather
        states = finetune.adapter_state_bytes(train)
        grad_reduce = reduce_s(s.trainable_params * states.grad, shard, shard_stride)
        dense_gather = s.trainable_params * states.weight
    else:
        grad_reduce = reduce_s(params * grad_b, shard, shard_stride)
        dense_gather = params * weight_b - (fp8_saving * s.per_row(s.quantised_kinds[0]) if fp8_saving else 0.0)
    param_gather = np.where(sharded, spread(classes, n, comm.gather_scatter_s, dense_gather * sharded, shard,
                                            shard_stride), 0.0)
    if s.has_experts:
        grad_reduce = grad_reduce + reduce_s(experts * grad_b, edp, edp_stride)
        expert_gather = experts * weight_b - (fp8_saving * s.per_row(s.quantised_kinds[1]) if fp8_saving else 0.0)
        param_gather = param_gather + np.where(sharded, spread(classes, n, comm.gather_scatter_s,
                                                               expert_gather * sharded, edp, edp_stride), 0.0)
    overlap = s.cluster.overlap_efficiency
    # Whether the framework repeats the reduction (gather) every micro-batch (profiles/frameworks/):
    # the last micro-batch's reduction hides behind its backward only, earlier ones also behind the
    # next micro-batch's forward; a gather before every forward hides behind that forward.
    framework, m = s.framework, s.num_microbatches
    each_reduce = framework.reduces_each_microbatch(zero, lay.pp) & (zero != 3)
    each_gather = framework.gathers_each_microbatch(zero, lay.pp) & sharded
    last = np.where(st.overlap_grad_reduce, exposed_s(grad_reduce, bwd_mb, overlap), grad_reduce)
    earlier = np.where(st.overlap_grad_reduce, exposed_s(grad_reduce, fwd_mb + bwd_mb, overlap), grad_reduce)
    gather = np.where(st.overlap_param_gather, exposed_s(param_gather, fwd_mb, overlap), param_gather)
    exposed = np.where(each_reduce, (m - 1) * earlier + last, last) + np.where(each_gather, m * gather, gather)
    # ZeRO-3 / FSDP: per-layer gathers and reduce-scatters, hidden layer by layer (cost_models/sharding.py).
    share = np.where(st.recompute == 2, _recomputed_fraction(s), np.where(st.recompute == 1, 1.0, 0.0))
    z3, z3_raw = zero3_comm_s(s, pl, share, zero3_impl_of(train, gpu.tables))
    opt_params = s.optimizer_params
    traffic = optimizer_step_traffic_bytes(train.optimizer, train.precision, train.grad_precision)
    if s.adapters:  # the adapters' own weights are the master (finetune.adapter_state_bytes): fp32 traffic
        traffic = optimizer_step_traffic_bytes(train.optimizer, "fp32", "fp32")
    table = elementwise_model(gpu)
    weight_casts = 0.0
    if table is None:
        optimizer = opt_params * traffic / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency)
    else:  # fused multi-tensor kernels at the table's bandwidth, with the gradient-buffer passes
        optimizer = table.optimizer_step_s(opt_params, traffic, grad_b)
        if train.precision in QUANTISED_PRECISIONS:  # the FP8 (NVFP4) weight casts of each step's first micro-batch
            dense_k, expert_k = (s.per_row(k) for k in s.quantised_kinds)
            if getattr(train, "fp8_param_gather", False):
                # FP8 parameters: the optimizer quantises its master-weight shard once per step (megatron-core
                # fp8_utils.quantize_param_shard, after the distributed optimizer's step) and the FP8 shards are
                # all-gathered: each rank casts 1/shard of the weights, not all of them
                dense_k, expert_k = dense_k / shard, expert_k / edp
            weight_casts = table.fp8_weight_cast_s(dense_k + expert_k, s.x.fp8_recipe)
    offload = offload_step_s(s, opt_params, bwd_mb)
    tail = {"dp_comm": np.where(zero == 3, z3, exposed),
            "optimizer": np.where(st.offload_optimizer, offload, optimizer) + weight_casts}
    raw = np.where(each_reduce, m, 1) * grad_reduce + np.where(each_gather, m, 1) * param_gather
    return tail, np.where(zero == 3, z3_raw, raw)


def offload_step_s(s: Setup, opt_params: np.ndarray, bwd_mb: np.ndarray) -> np.ndarray:
    """The optimizer step of one rank with the optimizer offloaded to the host (ZeRO-Offload,
    Ren et al. 2021 Sec. 4; Megatron's `--optimizer-cpu-offload`), seconds.

    The rank's gradient shard goes to the host (device-to-host over PCIe or NVLink-C2C),
    the host runs Adam over its fp32 master weights and moments, and the updated 16-bit
    weights come back (host-to-device). Both frameworks copy gradients out as the backward
    produces them, so the device-to-host copy hides behind the last micro-batch's backward
    (as the gradient reduction does); the CPU step and the copy back are on the critical path
    (DeepSpeed's delayed parameter update, which hides them, changes the numerics and is
    not modelled). The host's DRAM bandwidth is shared by the GPUs of a server, and the host link by
    the GPUs behind one uplink (`host_copy_bw`).
    """
    gpu, host, train = s.gpu, s.cluster.host, s.train
    if not s.st.offload_optimizer.any():
        return np.zeros(opt_params.shape)
    if gpu.host_link_bw_bytes_per_s is None or host is None:
        return np.zeros(opt_params.shape)  # unknown host: the rules refuse offload, and say why
    link = host_copy_bw(gpu, host)
    d2h = opt_params * DTYPE_BYTES[train.grad_precision] / link
    h2d = opt_params * WEIGHT_BYTES[train.precision] / link
    traffic = optimizer_step_traffic_bytes(train.optimizer, train.precision, train.grad_precision)
    host_bw = host.memory_bw_bytes_per_s * host.memory_efficiency / s.cluster.gpus_per_node
    cpu = opt_params * traffic / host_bw
    hidden = np.where(s.st.overlap_grad_reduce, np.minimum(d2h, bwd_mb) * s.cluster.comm_overlap, 0.0)
    return d2h - hidden + cpu + h2d


def offloaded_bytes(s: Setup) -> np.ndarray:
    """Host DRAM of one rank of each stage row (S, N): with the optimizer offloaded, its shard's
    optimizer states (fp32 master weights and moments) and the fp32 gradients it steps on; with
    activations offloaded, theirs (`cost_models.memory.offloaded_activation_bytes`)."""
    st, train = s.st, s.train
    activations = s.offloaded_activations
    if not st.offload_optimizer.any():
        return np.broadcast_to(activations, s.params.shape) * 1.0
    per_param = optimizer_state_bytes(train.optimizer, train.precision) + FP32
    return np.where(st.offload_optimizer, s.optimizer_params * per_param, 0.0) + activations


def step_flops(s: Setup) -> tuple[np.ndarray, np.ndarray]:
    """(model FLOPs, hardware FLOPs) of one step, whole job. Model FLOPs count the
    unpadded vocabulary, the tokens' top-k experts (no load imbalance) and no recompute
    (3 × forward); hardware FLOPs add what recompute repeats (Korthikanti Sec. 5:
    'hardware FLOPs'). MTP modules and their extra head pass count as model FLOPs."""
    train, model, blocks = s.train, s.model, s.blocks
    B, seq = train.global_batch_size, train.seq_len
    one = np.ones(1, dtype=np.int64)
    whole = Micro(seq, B * one, one, one, np.zeros(1, dtype=bool), train.precision, train.attention_kernel)
    layer_fwd = blocks.mean(lambda layer: layer.forward_flop(whole))
    # the attention core (a Mamba layer's scan is not what selective recompute repeats)
    core_fwd = blocks.mean(lambda layer: layer.core(whole).flop if layer.attention() is not None else 0.0)
    mtp_fwd = sum(layer.forward_flop(whole) for layer in blocks.mtp)
    head_fwd = 2 * B * seq * model.hidden_size * model.vocab_size * blocks.head_passes
    L = blocks.num_layers
    model_flop = 3 * (L * layer_fwd + mtp_fwd + head_fwd)
    if s.adapters:  # forward, the input gradients above the lowest adapted layer, and the adapters' own three passes
        share = finetune.backward_share(model, train)
        adapted = len(finetune.adapted_layers(model, train))
        adapter_fwd = finetune.adapter_layer_work(model, train, B * seq, 2)[0] * adapted
        model_flop = L * layer_fwd * (1 + share) + 2 * head_fwd + 3 * adapter_fwd
    rc = s.st.recompute
    policy = s.framework.selective_recompute
    if policy == "none":
        core_fwd = 0.0
    elif policy == "op_sac":  # the GEMMs torchtitan's op policy repeats (the attention kernel is saved)
        core_fwd = blocks.mean(lambda layer: sum(g.flop for g in op_sac_gemms(layer, whole) or ()))
    extra = np.where(rc == 2, _recomputed_fraction(s)[0] * (L * layer_fwd + mtp_fwd), np.where(rc == 1, L * core_fwd, 0.0))
    if s.adapters:  # only the layers with a backward are recomputed
        extra = extra * finetune.backward_share(model, train)
    # (selective recompute of other modules repeats GEMMs too; hardware FLOPs count the attention core only)
    return model_flop, model_flop + extra
