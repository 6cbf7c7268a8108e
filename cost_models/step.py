"""Step time and peak memory of every candidate at once.

The step of a pipeline of p stages with m micro-batches and v chunks per stage
(SC'21 Eq. 1, generalised to interleaving):

    step = m · t_mb + (p - 1)/v · t_mb + pp_comm + max over stages (dp_comm + optimizer)

where t_mb is the slowest stage's time for one micro-batch (compute,
recompute, exposed TP and CP communication). Data parallel communication is
overlapped with the backward (gradients) and forward (ZeRO parameter gathers)
of one micro-batch when the strategy asks for it; only what sticks out counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models.arrays import StrategyArrays
from cost_models.comm import CommModel, TierCommModel
from cost_models.compute import LayerTimes, head_times, layer_flops, layer_times
from cost_models.memory import layer_params_per_rank, model_state_bytes, stage_activation_bytes, stage_params, zero3_working_bytes
from cost_models.schedule import FIRST, bubble_fraction, layout
from cost_models.units import ACTIVATION_BYTES, DTYPE_BYTES, WEIGHT_BYTES, optimizer_step_traffic_bytes

MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "recompute_working", "embedding_activations",
                "logits", "zero3_buffers", "comm_buffers", "framework_reserve")
TIME_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "pp_bubble", "dp_comm", "optimizer")


@dataclass
class CostArrays:
    """What the cost model says about N candidates (arrays of length N)."""

    step_time_s: np.ndarray
    memory_bytes: dict[str, np.ndarray]  # binding stage, by term
    time_s: dict[str, np.ndarray]  # exposed time, by term
    peak_memory_bytes: np.ndarray
    binding_stage: np.ndarray  # 0 first, 1 middle, 2 last
    num_microbatches: np.ndarray
    bubble_fraction: np.ndarray
    model_flop_per_step: np.ndarray
    hardware_flop_per_step: np.ndarray
    memory_capacity_bytes: float
    peak_flop_per_s: float

    @property
    def fits(self) -> np.ndarray:
        return self.peak_memory_bytes <= self.memory_capacity_bytes


def _pick(stacked: np.ndarray, index: np.ndarray) -> np.ndarray:
    return np.take_along_axis(stacked, index[None, :], axis=0)[0]


def evaluate_arrays(model, cluster, train, st: StrategyArrays, comm: CommModel | None = None) -> CostArrays:
    """Score every candidate in `st`; divisibility is the caller's job (planner.rules)."""
    comm = comm or TierCommModel(cluster)
    gpu = cluster.gpu
    tp, pp, cp, dp, vpp = st.tp, st.pp, st.cp, st.dp, st.vpp
    b, sp, rc, zero = st.micro_batch_size, st.sequence_parallel, st.recompute, st.zero_stage
    act = ACTIVATION_BYTES[train.precision]
    m = np.maximum(train.global_batch_size // (b * dp), 1)
    lay = layout(model.num_layers, pp, vpp, st.num_layers_in_first_stage, st.num_layers_in_last_stage, m)
    shard = dp * cp
    tokens = train.seq_len / cp * b

    # ---- memory of each stage kind (3, N) --------------------------------
    params = stage_params(model, tp, pp, lay)
    mem = model_state_bytes(params, zero, shard, st.offload_optimizer, train.precision, train.grad_precision,
                            train.optimizer)
    mem |= stage_activation_bytes(model, train, st, lay)
    p2p_buffers = np.where(pp > 1, 2 * 2 * tokens * model.hidden_size * act / tp, 0.0)  # send + recv, fwd + bwd
    mem["zero3_buffers"] = zero3_working_bytes(model, st, train.precision, train.grad_precision) * (lay.layers > 0)
    mem["comm_buffers"] = np.broadcast_to(p2p_buffers, params.shape)
    mem["framework_reserve"] = np.full(params.shape, gpu.framework_reserve_bytes)
    total = sum(np.broadcast_to(mem[k], params.shape) for k in MEMORY_TERMS)
    binding = np.argmax(total, axis=0)
    peak = _pick(total, binding)
    memory = {k: _pick(np.broadcast_to(mem[k], params.shape), binding) for k in MEMORY_TERMS}

    # ---- time of one micro-batch on each stage kind (3, N) ----------------
    pl = per_layer_times(model, train, gpu, comm, st, cluster.comm_overlap)
    lt = pl.layer
    head_f, head_b, _ = head_times(model, train, gpu, b, tp, cp, sp)
    layer_act_bytes = tokens * model.hidden_size * act
    tp_ar, tp_fwd, cp_fwd = pl.tp_all_reduce_s, pl.tp_fwd_s, pl.cp_fwd_s
    rc_frac = np.where(st.recompute_num_layers > 0,
                       np.minimum(st.recompute_num_layers, lay.chunk_layers) / lay.chunk_layers, 1.0)
    rc_layers = np.where(rc == 2, lay.layers * rc_frac, np.where(rc == 1, lay.layers, 0.0))
    rc_layer_s = pl.recompute_s

    compute_mb = lay.layers * (lt.fwd_s + lt.bwd_s) + lay.has_head * (head_f + head_b)
    recompute_mb = rc_layers * rc_layer_s
    tp_mb = lay.layers * 2 * tp_fwd + lay.has_embedding * tp_ar
    cp_mb = lay.layers * 3 * cp_fwd  # forward + backward (KV and dKV)
    stage_mb = compute_mb + recompute_mb + tp_mb + cp_mb
    slow = np.argmax(stage_mb, axis=0)
    t_mb = _pick(stage_mb, slow)

    p2p = comm.p2p_s(layer_act_bytes / tp, tp * cp * dp, tp * cp * dp * pp)
    grad_b, weight_b = DTYPE_BYTES[train.grad_precision], WEIGHT_BYTES[train.precision]
    tied_sync = np.where(model.tie_embeddings & (pp > 1),
                         comm.all_reduce_s(model.vocab_size * model.hidden_size / tp * grad_b, 2, tp * cp * dp), 0.0)
    pp_comm = np.where(pp > 1, 2 * (m * vpp + pp - 1) * p2p, 0.0) + tied_sync

    # ---- data parallel communication and optimizer, per stage kind ------
    fwd_mb = lay.layers * lt.fwd_s
    bwd_mb = lay.layers * lt.bwd_s + lay.has_head * head_b
    grads_all = params * grad_b
    weights_all = params * weight_b
    grad_reduce = np.where(zero == 0, comm.all_reduce_s(grads_all, shard, tp), comm.gather_scatter_s(grads_all, shard, tp))
    param_gather = np.where((zero == 1) | (zero == 2), comm.gather_scatter_s(weights_all, shard, tp), 0.0)
    overlap = cluster.comm_overlap
    exposed = np.where(st.overlap_grad_reduce, exposed_s(grad_reduce, bwd_mb, overlap), grad_reduce)
    exposed += np.where(st.overlap_param_gather, exposed_s(param_gather, fwd_mb, overlap), param_gather)
    # ZeRO-3 gathers each layer's weights before its forward and again before its backward and
    # reduce-scatters its gradients after, every micro-batch; prefetching hides it behind the
    # layer's own compute, the first gather of a step excepted.
    layer_params = layer_params_per_rank(model, tp)
    z3_gather = comm.gather_scatter_s(layer_params * weight_b, shard, tp)
    z3_reduce = comm.gather_scatter_s(layer_params * grad_b, shard, tp)
    hideable = np.where(st.overlap_param_gather, 2 * z3_gather, 0.0) + np.where(st.overlap_grad_reduce, z3_reduce, 0.0)
    z3_layer = exposed_s(hideable, lt.fwd_s + lt.bwd_s + np.where(rc > 0, pl.recompute_s, 0.0), overlap)
    z3_layer = z3_layer + (2 * z3_gather + z3_reduce - hideable)
    z3 = m * lay.layers * z3_layer + z3_gather
    z3 = z3 + np.where(lay.has_embedding | lay.has_head, m * comm.gather_scatter_s(
        (params - lay.layers * layer_params) * weight_b, shard, tp), 0.0)
    dp_comm = np.where(zero == 3, z3, exposed)
    opt_params = params / np.where(zero >= 1, shard, 1)
    traffic = optimizer_step_traffic_bytes(train.optimizer, train.precision, train.grad_precision)
    optimizer = opt_params * traffic / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency)
    optimizer = np.where(st.offload_optimizer, 0.0, optimizer)
    tail = dp_comm + optimizer
    tail_stage = np.argmax(tail, axis=0)

    time = {
        "compute": m * _pick(compute_mb, slow),
        "recompute": m * _pick(recompute_mb, slow),
        "tp_comm": m * _pick(tp_mb, slow),
        "cp_comm": m * _pick(cp_mb, slow),
        "ep_comm": np.zeros(len(st)),
        "pp_comm": pp_comm,
        "pp_bubble": (pp - 1) / vpp * t_mb,
        "dp_comm": _pick(dp_comm, tail_stage),
        "optimizer": _pick(optimizer, tail_stage),
    }
    step = sum(time[k] for k in TIME_TERMS)

    # ---- FLOPs per step, whole job ----------------------------------------
    full = layer_flops(model, train.seq_len, train.global_batch_size, 1, 1)
    layer_fwd = full["qkv"] + full["core"] + full["out"] + full["mlp"]
    head_fwd = 2 * train.global_batch_size * train.seq_len * model.hidden_size * model.vocab_size
    model_flop = 3 * (model.num_layers * layer_fwd + head_fwd)
    extra = np.where(rc == 2, rc_frac[FIRST] * model.num_layers * layer_fwd,
                     np.where(rc == 1, model.num_layers * full["core"], 0.0))
    return CostArrays(
        step_time_s=step, memory_bytes=memory, time_s=time, peak_memory_bytes=peak, binding_stage=binding,
        num_microbatches=m, bubble_fraction=bubble_fraction(pp, vpp, m),
        model_flop_per_step=np.broadcast_to(model_flop, step.shape).astype(float),
        hardware_flop_per_step=model_flop + extra, memory_capacity_bytes=gpu.memory_bytes,
        peak_flop_per_s=gpu.peak(train.precision),
    )


@dataclass
class PerLayerTimes:
    """One layer, one micro-batch, one rank (arrays over candidates)."""

    layer: LayerTimes
    tp_all_reduce_s: np.ndarray  # one TP all-reduce of the layer's activations
    tp_fwd_s: np.ndarray  # TP communication of the forward (two all-reduces, or AG + RS pairs with SP)
    cp_fwd_s: np.ndarray  # exposed ring-attention KV exchange of the forward
    recompute_s: np.ndarray  # what the layer repeats in backward under its recompute mode

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


def per_layer_times(model, train, gpu, comm: CommModel, st: StrategyArrays,
                    comm_overlap: float = 1.0) -> PerLayerTimes:
    """Per-layer compute and exposed TP/CP communication for every candidate."""
    tp, cp, b = st.tp, st.cp, st.micro_batch_size
    act = ACTIVATION_BYTES[train.precision]
    tokens = train.seq_len / cp * b
    lt = layer_times(model, train, gpu, b, tp, cp, st.sequence_parallel)
    layer_bytes = tokens * model.hidden_size * act
    tp_ar = comm.all_reduce_s(layer_bytes, tp, 1)
    # Two exchanges per layer forward (attention and MLP): an all-reduce each, or with SP an
    # all-gather before and a reduce-scatter after (the same volume, but their own bandwidth).
    tp_fwd = 2 * np.where(st.sequence_parallel, 2 * comm.gather_scatter_s(layer_bytes, tp, 1), tp_ar)
    kv_bytes = tokens * 2 * model.kv_width * act / tp
    cp_hop = comm.p2p_s(kv_bytes, tp, tp * cp)
    cp_fwd = np.where(cp > 1, exposed_s((cp - 1) * cp_hop, lt.attn_core_fwd_s, comm_overlap), 0.0)
    rc = st.recompute
    recompute = np.where(rc == 2, lt.fwd_s + tp_fwd + cp_fwd, np.where(rc == 1, lt.attn_core_fwd_s, 0.0))
    return PerLayerTimes(layer=lt, tp_all_reduce_s=tp_ar, tp_fwd_s=tp_fwd, cp_fwd_s=cp_fwd, recompute_s=recompute)
