"""ZeRO-3 / FSDP: the parameter gathers and gradient reduce-scatters of fully sharded data
parallelism, and how much of them the layers' compute hides.

Every micro-batch, each layer's weights are all-gathered before its forward and again before
its backward (the forward's copy was freed: FSDP2's `reshard_after_forward`, DeepSpeed's
default), and its gradients are reduce-scattered after its backward (Rajbhandari et al. SC'20
Sec. 5.3; Zhao et al. VLDB 2023 Sec. 3). Both frameworks prefetch: the gather of the next layer
runs on a side stream while the current layer computes (FSDP2: one module ahead, implicit in
forward and explicit in backward; DeepSpeed: parameters in trace order up to
`stage3_prefetch_bucket_size`). In steady state the prefetch depth does not change what sticks
out, only the ratio of the traffic to the compute does, so per layer and micro-batch:

    forward   max(0, G - F)           G: one layer's gather, F: its forward
    backward  max(0, G + R - B)       R: its reduce-scatter, B: its backward (+ recompute);
                                      the next layer's gather and the previous layer's
                                      reduce-scatter share the links during this layer's backward

(each through `exposed_s`, so the cluster's `overlap_efficiency` applies: `comm_overlap` less the
compute slowdown while NCCL shares the SMs, as for every other overlapped collective), plus what nothing hides:
the first layer's gather and the embedding/head gathers at the start of every micro-batch's
forward, and the last reduce-scatters after the step's final backward. The tier a group crosses
is the comm model's: a group inside an NVLink domain runs at NVLink rate, one that spans NVLink
domains (servers on DGX/HGX systems, racks on NVL72) at the NICs its members reach.

The implementations differ (profiles/frameworks/zero3.yaml, `profiles.frameworks.Zero3Impl`, which the
GPU's resolved tables carry: `GpuSpec.tables.zero3`):
- FSDP2 copies the gathered buffer into the unsharded parameters on the compute stream
  (`split_with_sizes_copy`): a read and a write of the gathered bytes at HBM speed, per gather.
- DeepSpeed ZeRO-3 (as measured in 2021, SC'21 Table 2) moved its traffic across nodes far
  slower than NCCL rings allow: a fitted fraction of one NIC per rank, applied to a group that
  spans NVLink domains (`collective_s`; the measured nodes were each one domain).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cost_models import finetune
from cost_models.arrays import spread
from cost_models.comm import exposed_s
from cost_models.memory import kind_expert_params_per_rank, kind_params_per_rank, param_gather_saving_per_element
from cost_models.units import DTYPE_BYTES, WEIGHT_BYTES
from profiles.frameworks import Zero3Impl

if TYPE_CHECKING:  # read by attribute only
    from cost_models.step import PerLayerTimes, Setup

#: Bytes an element copy moves: one read and one write.
READ_PLUS_WRITE = 2


def collective_s(s: Setup, impl: Zero3Impl, nbytes, size, stride) -> np.ndarray:
    """One ZeRO-3 all-gather or reduce-scatter of `nbytes` (full size) over `size` ranks
    `stride` apart, seconds, as `impl` runs it."""
    t = s.comm.gather_scatter_s(nbytes, size, stride)
    if impl.cross_node_nic_fraction is None:
        return t
    domain = s.cluster.domain_size
    crosses = s.comm.crosses_domain(size, stride)
    # stride >= domain: one member per domain, so the comm model's rate is one NIC per rank
    per_nic = s.comm.gather_scatter_s(nbytes, size, np.maximum(stride, domain)) / impl.cross_node_nic_fraction
    return np.where(crosses, np.maximum(t, per_nic), t)


def per_layer_exposed_s(gather_s, reduce_s, fwd_s, bwd_s, overlap_gather, overlap_reduce, overlap: float):
    """Exposed ZeRO-3 communication of one layer and micro-batch (forward + backward), seconds.

    Never negative and never more than the layer's whole traffic 2·G + R:

    >>> float(per_layer_exposed_s(1.0, 2.0, 0.5, 4.0, True, True, 1.0))  # forward 0.5 out, backward hidden
    0.5
    >>> float(per_layer_exposed_s(1.0, 2.0, 0.5, 4.0, False, True, 1.0))  # no prefetch: both gathers out
    2.0
    """
    fwd = np.where(overlap_gather, exposed_s(gather_s, fwd_s, overlap), gather_s)
    hide = np.where(overlap_gather, gather_s, 0.0) + np.where(overlap_reduce, reduce_s, 0.0)
    bwd = exposed_s(hide, bwd_s, overlap) + (gather_s + reduce_s - hide)
    return fwd + bwd


def zero3_comm_s(s: Setup, pl: PerLayerTimes, recompute_share: np.ndarray, impl_name: str = "fsdp2"
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, raw) ZeRO-3 time of one step on each stage row (S, N), seconds.

    `recompute_share` (S, N): share of each row's layers whose backward repeats the forward
    (a longer window for the backward's traffic). Exposed includes FSDP2's copy-out, which is
    compute-stream work caused by the sharding; raw is the traffic before any overlap.
    """
    impl = s.gpu.tables.zero3[impl_name]
    st, lay, train, gpu = s.st, s.lay, s.train, s.gpu
    rows, m = lay.rows, s.num_microbatches
    shard, shard_stride = lay.group("cp", "dp")
    grad_b, weight_b = DTYPE_BYTES[train.grad_precision], WEIGHT_BYTES[train.precision]
    z3 = st.zero_stage == 3  # only those candidates' traffic is used: the others' is zero

    classes = s.layout_zero_classes

    def timed(nbytes, size, stride):  # the bytes (ZeRO-3 candidates' only) and groups: per (layout, ZeRO stage)
        return spread(classes, len(st), lambda b, n, d: collective_s(s, impl, b, n, d), nbytes * z3, size, stride)

    dense_k = kind_params_per_rank(s.blocks, lay.tp)
    fp8_saving = param_gather_saving_per_element(train)  # FP8 parameters (fp8_param_gather) gather fewer bytes
    gathered = dense_k * weight_b  # one layer's weights, bytes, (K, N)
    if fp8_saving:
        gathered = gathered - fp8_saving * s.quantised_kinds[0]
    if s.adapters:  # frozen layers gathered in their stored width; only the adapters' gradients reduced
        gathered = np.broadcast_to(finetune.layer_base_bytes(s.model, train, dense_k), dense_k.shape) * 1.0
        grads = finetune.adapter_params_per_layer(s.model, train) * finetune.adapter_state_bytes(train).grad
        reduce = timed(np.broadcast_to(float(grads), dense_k.shape), shard, shard_stride)
    else:
        reduce = timed(dense_k * grad_b, shard, shard_stride)
    gather = timed(gathered, shard, shard_stride)
    if s.has_experts:
        edp, edp_stride = lay.expert_group("edp")
        expert_k = kind_expert_params_per_rank(s.blocks, lay.ep, lay.etp)
        expert_gathered = expert_k * weight_b - (fp8_saving * s.quantised_kinds[1] if fp8_saving else 0.0)
        gathered = gathered + expert_gathered
        gather = gather + np.where(expert_k > 0, timed(expert_gathered, edp, edp_stride), 0.0)
        reduce = reduce + np.where(expert_k > 0, timed(expert_k * grad_b, edp, edp_stride), 0.0)
    end_params = s.params - s.per_row(dense_k)  # embedding, final norm and output layer of each stage row
    dense_k, gathered = dense_k * z3, gathered * z3  # the copy-out: ZeRO-3 candidates only
    sharded = shard > 1  # a shard group of one rank gathers nothing, and copies nothing out
    copy_out = np.where(impl.copy_out & sharded,
                        READ_PLUS_WRITE * gathered / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency), 0.0)
    bwd_plain = pl.bwd_s - pl.recompute_s

    def layer(bwd_window):
        exposed = per_layer_exposed_s(gather, reduce, pl.fwd_s, bwd_window, st.overlap_param_gather,
                                      st.overlap_grad_reduce, s.cluster.overlap_efficiency)
        return exposed + 2 * copy_out  # a copy-out after the forward's gather and the backward's

    per_mb = recompute_share * s.per_row(layer(pl.bwd_s)) + (1 - recompute_share) * s.per_row(layer(bwd_plain))
    # Embedding, final norm and output layer: gathered at every micro-batch's start (with the
    # first layer), reduce-scattered after the last backward.
    ends = rows.has_embedding | rows.has_head
    end_gather = np.where(ends, timed(end_params * weight_b, shard, shard_stride), 0.0)
    end_reduce = np.where(ends & (not s.adapters), timed(end_params * grad_b, shard, shard_stride), 0.0)
    end_params = end_params * z3
    end_copy = np.where(ends & impl.copy_out & sharded, READ_PLUS_WRITE * end_params * weight_b
                        / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency), 0.0)
    has_layers = rows.layers > 0
    # The first layer's gather has no earlier layer to hide behind (every micro-batch); the
    # last reduce-scatter none after it (the step's final backward; earlier micro-batches'
    # hide behind the next forward).
    fwd_exposed = np.where(st.overlap_param_gather, gather - np.minimum(gather, pl.fwd_s) * s.cluster.overlap_efficiency, gather)
    first_extra = np.where(has_layers, (gather - fwd_exposed).max(axis=0), 0.0)
    last_reduce = np.where(has_layers, reduce.max(axis=0), 0.0)
    exposed = m * (per_mb + first_extra + end_gather + end_copy) + last_reduce + end_reduce
    raw = m * (s.per_row(2 * gather + reduce + 2 * copy_out) + end_gather + end_copy) + end_reduce
    # The step's last reduce-scatter is counted whole; it cannot add more than the traffic itself.
    return np.minimum(exposed, raw), raw
