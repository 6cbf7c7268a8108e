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

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cost_models.arrays import StrategyArrays
from cost_models.blocks import Micro, ModelBlocks, model_blocks, padded_vocab
from cost_models.comm import CommModel, TierCommModel
from cost_models.compute import LayerTimes, head_times, layer_times
from cost_models.layout import ParallelLayout
from cost_models.memory import layer_params_per_rank, model_state_bytes, stage_activation_bytes, stage_params, zero3_working_bytes
from cost_models.units import DTYPE_BYTES, WEIGHT_BYTES, optimizer_step_traffic_bytes

if TYPE_CHECKING:  # specs are read by attribute only; no import of the planner package at run time
    from planner.specs import ClusterSpec, GpuSpec, ModelSpec, TrainSpec

MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "recompute_working", "embedding_activations",
                "logits", "zero3_buffers", "comm_buffers", "framework_reserve")
TIME_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "pp_bubble", "dp_comm", "optimizer")
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

    @property
    def fits(self) -> np.ndarray:
        return self.peak_memory_bytes <= self.memory_capacity_bytes

    @cached_property
    def comm_hidden_fraction(self) -> np.ndarray:
        """Share of the step's communication the prediction assumes hidden behind compute."""
        exposed = sum(self.time_s[k] for k in COMM_TERMS)
        total = self.comm_total_s
        return np.where(total > 0, 1 - exposed / np.where(total > 0, total, 1), 0.0)


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
    _params: np.ndarray | None = None

    @property
    def gpu(self) -> GpuSpec:
        return self.cluster.gpu

    @property
    def params(self) -> np.ndarray:
        """Parameters of one rank of each stage row (S, N), elements (computed once)."""
        if self._params is None:
            self._params = stage_params(self.blocks, self.lay)
        return self._params


def _pick(stacked: np.ndarray, index: np.ndarray) -> np.ndarray:
    return np.take_along_axis(stacked, index[None, :], axis=0)[0]


def micro_of(train: TrainSpec, st: StrategyArrays) -> Micro:
    """One micro-batch on one rank of every candidate."""
    return Micro(train.seq_len, st.micro_batch_size, st.tp, st.cp, st.sequence_parallel, train.precision,
                 train.attention_kernel)


def setup(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, st: StrategyArrays, comm: CommModel | None = None) -> Setup:
    lay = ParallelLayout.of(st, model.num_layers)
    x = micro_of(train, st)
    return Setup(model, cluster, train, st, comm or TierCommModel(cluster), model_blocks(model), lay, x,
                 lay.num_microbatches(train.global_batch_size, st.micro_batch_size))


def evaluate_arrays(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, st: StrategyArrays, comm: CommModel | None = None) -> CostArrays:
    """Score every candidate in `st`; validity is the caller's job (planner.rules)."""
    s = setup(model, cluster, train, st, comm)
    mem_rows = stage_memory(s)
    total = sum(mem_rows.values())
    binding = np.argmax(total, axis=0)
    pl = per_layer_times(model, train, s.gpu, s.comm, st, cluster.comm_overlap, s)
    mb = microbatch_times(s, pl)
    slow = np.argmax(sum(mb.values()), axis=0)
    t_mb = _pick(sum(mb.values()), slow)
    pp_comm = pipeline_comm(s)
    tail, tail_raw = data_parallel_tail(s, pl)
    tail_stage = np.argmax(tail["dp_comm"] + tail["optimizer"], axis=0)
    m, lay = s.num_microbatches, s.lay
    time = {
        "compute": m * _pick(mb["compute"], slow),
        "recompute": m * _pick(mb["recompute"], slow),
        "tp_comm": m * _pick(mb["tp_comm"], slow),
        "cp_comm": m * _pick(mb["cp_comm"], slow),
        "ep_comm": np.zeros(len(st)),
        "pp_comm": pp_comm,
        "pp_bubble": (lay.pp - 1) / lay.vpp * t_mb,
        "dp_comm": _pick(tail["dp_comm"], tail_stage),
        "optimizer": _pick(tail["optimizer"], tail_stage),
    }
    cp_raw = lay.rows.layers * 3 * pl.cp_raw_s
    comm_total = (time["tp_comm"] + m * _pick(cp_raw, slow) + pp_comm + _pick(tail_raw, tail_stage))
    model_flop, hardware_flop = step_flops(s)
    return CostArrays(
        step_time_s=sum(time[k] for k in TIME_TERMS), memory_bytes={k: _pick(v, binding) for k, v in mem_rows.items()},
        time_s=time, peak_memory_bytes=_pick(total, binding), binding_stage=_pick(lay.rows.kind, binding),
        binding_pipeline_rank=_pick(lay.rows.rank, binding), num_microbatches=m,
        bubble_fraction=lay.bubble_fraction(m), model_flop_per_step=np.broadcast_to(model_flop, m.shape).astype(float),
        hardware_flop_per_step=hardware_flop, comm_total_s=comm_total, memory_capacity_bytes=s.gpu.memory_bytes,
        peak_flop_per_s=s.gpu.peak(train.precision),
    )


def stage_memory(s: Setup) -> dict[str, np.ndarray]:
    """Every memory term of one rank of each stage row (S, N), bytes."""
    st, train, lay, x = s.st, s.train, s.lay, s.x
    params = s.params
    mem = model_state_bytes(params, st.zero_stage, lay.shard, st.offload_optimizer, train.precision,
                            train.grad_precision, train.optimizer)
    mem |= stage_activation_bytes(s.blocks, x, st, lay, s.num_microbatches)
    # Pipeline send and receive buffers of one micro-batch's activations, forward and backward.
    p2p_buffers = np.where(lay.pp > 1, 2 * 2 * x.tokens * s.model.hidden_size * x.act / lay.tp, 0.0)
    mem["zero3_buffers"] = zero3_working_bytes(s.blocks, st, train.precision, train.grad_precision) * (lay.rows.layers > 0)
    mem["comm_buffers"] = p2p_buffers
    mem["framework_reserve"] = np.full(params.shape, s.gpu.framework_reserve_bytes)
    return {k: np.broadcast_to(mem[k], params.shape) for k in MEMORY_TERMS}


@dataclass
class PerLayerTimes:
    """One layer, one micro-batch, one rank (arrays over candidates)."""

    layer: LayerTimes
    tp_all_reduce_s: np.ndarray  # one TP all-reduce of the layer's activations
    tp_fwd_s: np.ndarray  # TP communication of the forward (an all-reduce, or AG + RS with SP, per exchange)
    cp_fwd_s: np.ndarray  # exposed ring-attention KV exchange of the forward
    cp_raw_s: np.ndarray  # the whole KV exchange of the forward, hidden or not
    recompute_s: np.ndarray  # what the layer repeats in backward under its recompute mode
    head_fwd_s: np.ndarray  # output layer + loss, forward
    head_bwd_s: np.ndarray

    @property
    def fwd_s(self) -> np.ndarray:
        return self.layer.fwd_s + self.tp_fwd_s + self.cp_fwd_s

    @property
    def bwd_s(self) -> np.ndarray:
        """Backward including recomputation (as Korthikanti Table 4 reports it)."""
        return self.layer.bwd_s + self.tp_fwd_s + 2 * self.cp_fwd_s + self.recompute_s


def exposed_s(comm_s, window_s, overlap: float):
    """Communication time left on the critical path when it is overlapped with
    `window_s` of compute: all of it past the window, and the share of the rest
    that does not really run concurrently (1 - cluster.comm_overlap)."""
    return comm_s - overlap * np.minimum(comm_s, window_s)


def per_layer_times(model: ModelSpec, train: TrainSpec, gpu: GpuSpec, comm: CommModel, st: StrategyArrays, comm_overlap: float = 1.0,
                    s: Setup | None = None) -> PerLayerTimes:
    """Per-layer compute and exposed TP/CP communication for every candidate."""
    blocks = s.blocks if s else model_blocks(model)
    lay = s.lay if s else ParallelLayout.of(st, model.num_layers)
    x = s.x if s else micro_of(train, st)
    lt = layer_times(blocks, x, gpu)
    tp_size, tp_stride = lay.group("tp")
    cp_size, cp_stride = lay.group("cp")
    emb = blocks.embedding.comm(x)
    tp_ar = comm.all_reduce_s(emb.tp_bytes, tp_size, tp_stride)

    def layer_comm(layer):
        # Each exchange is an all-reduce, or with SP an all-gather before and a reduce-scatter
        # after (the same volume, but their own bandwidth).
        tp, hop = 0.0, 0.0
        for c in layer.comms(x):
            tp = tp + c.tp_exchanges * np.where(st.sequence_parallel, 2 * comm.gather_scatter_s(c.tp_bytes, tp_size, tp_stride),
                                                comm.all_reduce_s(c.tp_bytes, tp_size, tp_stride))
            if np.any(c.cp_hop_bytes):
                hop = hop + comm.p2p_s(c.cp_hop_bytes, cp_stride, cp_size * cp_stride)
        return tp, hop

    kinds = [(layer_comm(layer), n) for layer, n in blocks.layers]
    tp_fwd = sum(n * tp for (tp, _), n in kinds) / blocks.num_layers
    cp_hop = sum(n * hop for (_, hop), n in kinds) / blocks.num_layers
    cp_raw = np.where(st.cp > 1, (st.cp - 1) * cp_hop, 0.0)
    cp_fwd = np.where(st.cp > 1, exposed_s(cp_raw, lt.attn_core_fwd_s, comm_overlap), 0.0)
    rc = st.recompute
    recompute = np.where(rc == 2, lt.fwd_s + tp_fwd + cp_fwd, np.where(rc == 1, lt.attn_core_fwd_s, 0.0))
    head_f, head_b, _ = head_times(blocks.head, x, gpu)
    return PerLayerTimes(layer=lt, tp_all_reduce_s=tp_ar, tp_fwd_s=tp_fwd, cp_fwd_s=cp_fwd, cp_raw_s=cp_raw,
                         recompute_s=recompute, head_fwd_s=head_f, head_bwd_s=head_b)


def _recomputed_fraction(s: Setup) -> np.ndarray:
    """Share of each stage row's layers that full recompute repeats (S, N)."""
    rows, n = s.lay.rows, s.st.recompute_num_layers
    chunk = np.where(rows.chunk_layers > 0, rows.chunk_layers, 1)
    return np.where(n > 0, np.minimum(n, rows.chunk_layers) / chunk, 1.0)


def microbatch_times(s: Setup, pl: PerLayerTimes) -> dict[str, np.ndarray]:
    """Time of one micro-batch on each stage row (S, N), by term."""
    rows, rc, lt = s.lay.rows, s.st.recompute, pl.layer
    rc_layers = np.where(rc == 2, rows.layers * _recomputed_fraction(s), np.where(rc == 1, rows.layers, 0.0))
    return {
        "compute": rows.layers * (lt.fwd_s + lt.bwd_s) + rows.has_head * (pl.head_fwd_s + pl.head_bwd_s),
        "recompute": rc_layers * pl.recompute_s,
        "tp_comm": rows.layers * 2 * pl.tp_fwd_s + rows.has_embedding * pl.tp_all_reduce_s,
        "cp_comm": rows.layers * 3 * pl.cp_fwd_s,  # forward + backward (KV and dKV)
    }


def pipeline_comm(s: Setup) -> np.ndarray:
    """Point-to-point activation transfers of the schedule, plus the all-reduce of the tied
    word-embedding gradients between the first and last pipeline ranks."""
    lay, x, m = s.lay, s.x, s.num_microbatches
    h = s.model.hidden_size
    p2p = s.comm.p2p_s(x.tokens * h * x.act / lay.tp, lay.stride("pp"), lay.num_gpus)
    grad_b = DTYPE_BYTES[s.train.grad_precision]
    emb_size, emb_stride = lay.embedding_group()
    embedding_grads = padded_vocab(s.model.vocab_size, lay.tp) * h / lay.tp * grad_b
    tied_sync = np.where(s.model.tie_embeddings & (lay.pp > 1),
                         s.comm.all_reduce_s(embedding_grads, emb_size, emb_stride), 0.0)
    return lay.pipeline_transfers(m) * p2p + tied_sync


def data_parallel_tail(s: Setup, pl: PerLayerTimes) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Exposed data parallel communication and the optimizer step of each stage row (S, N),
    and the data parallel communication before any overlap."""
    st, lay, train, comm, gpu = s.st, s.lay, s.train, s.comm, s.gpu
    rows, lt, m, zero = lay.rows, pl.layer, s.num_microbatches, st.zero_stage
    shard, shard_stride = lay.group("cp", "dp")
    tp = lay.tp
    params = s.params
    grad_b, weight_b = DTYPE_BYTES[train.grad_precision], WEIGHT_BYTES[train.precision]
    fwd_mb = rows.layers * lt.fwd_s
    bwd_mb = rows.layers * lt.bwd_s + rows.has_head * pl.head_bwd_s
    grad_reduce = np.where(zero == 0, comm.all_reduce_s(params * grad_b, shard, shard_stride),
                           comm.gather_scatter_s(params * grad_b, shard, shard_stride))
    param_gather = np.where((zero == 1) | (zero == 2), comm.gather_scatter_s(params * weight_b, shard, shard_stride), 0.0)
    overlap = s.cluster.comm_overlap
    exposed = np.where(st.overlap_grad_reduce, exposed_s(grad_reduce, bwd_mb, overlap), grad_reduce)
    exposed = exposed + np.where(st.overlap_param_gather, exposed_s(param_gather, fwd_mb, overlap), param_gather)
    # ZeRO-3 gathers each layer's weights before its forward and again before its backward and
    # reduce-scatters its gradients after, every micro-batch; prefetching hides it behind the
    # layer's own compute, the first gather of a step excepted.
    layer_params = layer_params_per_rank(s.blocks, tp)
    z3_gather = comm.gather_scatter_s(layer_params * weight_b, shard, shard_stride)
    z3_reduce = comm.gather_scatter_s(layer_params * grad_b, shard, shard_stride)
    hideable = np.where(st.overlap_param_gather, 2 * z3_gather, 0.0) + np.where(st.overlap_grad_reduce, z3_reduce, 0.0)
    z3_layer = exposed_s(hideable, lt.fwd_s + lt.bwd_s + np.where(st.recompute > 0, pl.recompute_s, 0.0), overlap)
    z3_layer = z3_layer + (2 * z3_gather + z3_reduce - hideable)
    ends = rows.has_embedding | rows.has_head
    z3_ends = np.where(ends, m * comm.gather_scatter_s((params - rows.layers * layer_params) * weight_b, shard,
                                                       shard_stride), 0.0)
    z3 = m * rows.layers * z3_layer + z3_gather + z3_ends
    z3_raw = m * rows.layers * (2 * z3_gather + z3_reduce) + z3_gather + z3_ends
    opt_params = params / np.where(zero >= 1, shard, 1)
    traffic = optimizer_step_traffic_bytes(train.optimizer, train.precision, train.grad_precision)
    optimizer = opt_params * traffic / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency)
    tail = {"dp_comm": np.where(zero == 3, z3, exposed), "optimizer": np.where(st.offload_optimizer, 0.0, optimizer)}
    return tail, np.where(zero == 3, z3_raw, grad_reduce + param_gather)


def step_flops(s: Setup) -> tuple[np.ndarray, np.ndarray]:
    """(model FLOPs, hardware FLOPs) of one step, whole job. Model FLOPs count the
    unpadded vocabulary and no recompute (3 × forward); hardware FLOPs add what
    recompute repeats (Korthikanti Sec. 5: 'hardware FLOPs')."""
    train, model, blocks = s.train, s.model, s.blocks
    B, seq = train.global_batch_size, train.seq_len
    one = np.ones(1, dtype=np.int64)
    whole = Micro(seq, B * one, one, one, np.zeros(1, dtype=bool), train.precision, train.attention_kernel)
    layer_fwd = blocks.mean(lambda layer: layer.forward_flop(whole))
    core_fwd = blocks.mean(lambda layer: layer.attention().core(whole).flop)
    head_fwd = 2 * B * seq * model.hidden_size * model.vocab_size
    L = blocks.num_layers
    model_flop = 3 * (L * layer_fwd + head_fwd)
    rc = s.st.recompute
    extra = np.where(rc == 2, _recomputed_fraction(s)[0] * L * layer_fwd, np.where(rc == 1, L * core_fwd, 0.0))
    return model_flop, model_flop + extra
