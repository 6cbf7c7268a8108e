"""Sharding strategies of each operator on a device mesh, with their costs, and the resharding cost of every edge.

A tensor's layout on a mesh is one placement per mesh axis, as DTensor writes them: ``"R"`` (replicated),
an int d (sharded along dimension d) or ``"P"`` (a partial sum: each device holds a summand). An operator's
strategy fixes the layout it reads each activation input in, the layout of its output, the layout of each
parameter, and - for the backward - the layout of the gradient it hands back to each input and of each
parameter's gradient. Strategies are built one mesh axis at a time from the operator's algebra (an einsum's
batch, column, row and contraction splits; a point-wise op's any dim; a norm's dims outside the normalised ones,
...) and combined over the axes where every sharded dimension divides evenly.

Costs (seconds on one device, bytes per device) reuse the transformer planner's models:

- compute: GEMM-like ops (linear, matmul, conv as its implicit GEMM) are timed by `cost_models.compute.gemm_time`
  and `gemm_backward_time` at their local shapes; the attention core by `cost_models.attention_kernels`'s
  measured flash tables where the GPU has one (else as its two batched GEMMs and a softmax); everything else
  moves its local bytes through the GPU's element-wise model (`cost_models.elementwise`), its backward
  `BACKWARD_ELEMENTWISE_FACTOR` times that.
- communication: the cluster's model (`cost_models.collectives.comm_model_for`) per mesh axis (its size and its
  stride in the device numbering): all-reduce, all-gather / reduce-scatter and all-to-all.
- memory: each parameter's share with its gradient and optimizer state (`cost_models.units`), and the
  activations the op keeps for its backward (its saved inputs; a tensor several ops save is shared among them).

Resharding an edge costs the forward conversion of the producer's output into the consumer's input layout,
plus, when the tensor needs a gradient, the backward conversion of the gradient the consumer hands back into the
layout the producer expects (its output's layout, a partial output expecting a replicated gradient). Per axis:
shard -> replicate is an all-gather, partial -> replicate an all-reduce, partial -> shard a reduce-scatter,
shard -> another dim an all-to-all; replicate -> shard or partial is a local slice (free).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from math import prod

import networkx as nx
import numpy as np

from cost_models.attention_kernels import flash_core_times
from cost_models.blocks import Attention, Gemm, Micro
from cost_models.collectives import comm_model_for
from cost_models.compute import BACKWARD_ELEMENTWISE_FACTOR, gemm_backward_time, gemm_time
from cost_models.elementwise import elementwise_model
from cost_models.units import ACTIVATION_BYTES, FP32, WEIGHT_BYTES, optimizer_state_bytes
from planner.autoshard.ops import OpNode, Tensor
from planner.errors import SpecError

R, P = "R", "P"

#: Point-wise ops that are linear in their inputs, so a partial sum passes through them (a sum of partial sums,
#: a cast, a negation, a scale by a replicated factor).
LINEAR_POINTWISE = {"add", "sub", "neg", "to", "_to_copy", "type_as", "clone", "alias", "mul", "div", "scale"}

#: Ops that keep their inputs for the backward (the weight gradient needs the GEMM's input, a norm its input, a
#: non-linear point-wise op its input); the others keep nothing or only what their neighbours keep.
SAVES_INPUTS = {"linear", "matmul", "conv2d", "layer_norm", "rms_norm", "batch_norm", "pool", "loss", "sdpa",
                "embedding", "unknown"}
#: Point-wise ops whose backward needs no saved tensor (linear ones) - the rest keep their inputs.
POINTWISE_NOTHING_SAVED = {"add", "sub", "neg", "to", "_to_copy", "type_as", "clone", "alias", "constant"}


@dataclass(frozen=True)
class Mesh:
    """One pipeline stage's devices as a 1-D or 2-D mesh: `shape` innermost axis first; axis i's groups are
    `stride[i]` devices apart in the device numbering (the inner axis on NVLink, the outer across nodes)."""

    shape: tuple[int, ...]

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(prod(self.shape[:i]) for i in range(len(self.shape)))

    @property
    def size(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class AxisOption:
    """How one mesh axis splits an op: placements of its inputs, output, parameters and their gradients, and the
    exchanges the op itself makes on that axis (``inner``: (collective, tensor, direction) triples, the tensor
    named "out", "rows" (the output's rows, fp32: a vocabulary-parallel softmax's max and sum) or "channels")."""

    name: str
    ins: tuple
    out: object
    grads: tuple
    params: tuple = ()
    param_grads: tuple = ()
    inner: tuple = ()


@dataclass(frozen=True)
class OpStrategy:
    """One strategy of an op on the whole mesh (one AxisOption per axis) with its costs on one device."""

    name: str
    ins: tuple  # per activation input: a layout (one placement per axis)
    out: tuple
    grads: tuple  # per input: the layout of the gradient handed back
    params: tuple  # per ParamUse: its layout
    param_grads: tuple
    compute_s: float  # forward + backward kernels, one micro-batch
    comm_s: float  # the op's own exchanges, one micro-batch
    grad_sync_s: float  # parameter-gradient reduction, once per step
    optimizer_s: float  # the optimizer step over its parameters' share, once per step
    param_bytes: float  # parameters, gradients and optimizer state on one device
    activation_bytes: float  # kept for the backward, one micro-batch


@dataclass(frozen=True)
class CostContext:
    """What the costs depend on: the GPU, the mesh's communication, the training precision and optimizer."""

    cluster: object
    mesh: Mesh
    precision: str = "bf16"
    optimizer: str = "adam"
    dtensor: bool = False  # only the strategies DTensor computes correctly (DTENSOR_UNSUPPORTED left out)

    @property
    def gpu(self):
        return self.cluster.gpu

    def __post_init__(self):
        object.__setattr__(self, "_comm", comm_model_for(self.cluster))
        object.__setattr__(self, "_ew", elementwise_model(self.cluster.gpu))
        object.__setattr__(self, "memo", {})  # (collective, axis, bytes) and reshard results: shapes repeat

    # --- communication on one mesh axis ---------------------------------------------------------------------
    def _collective(self, name: str, axis: int, nbytes: float) -> float:
        key = (name, axis, nbytes)
        if key not in self.memo:
            fn = getattr(self._comm, name)
            self.memo[key] = float(fn(nbytes, self.mesh.shape[axis], self.mesh.strides[axis]))
        return self.memo[key]

    def all_reduce_s(self, axis: int, nbytes: float) -> float:
        return self._collective("all_reduce_s", axis, nbytes)

    def gather_s(self, axis: int, nbytes: float) -> float:
        """All-gather into (or reduce-scatter from) `nbytes` per device after (before) the exchange."""
        return self._collective("gather_scatter_s", axis, nbytes)

    def all_to_all_s(self, axis: int, nbytes: float) -> float:
        return self._collective("all_to_all_s", axis, nbytes)

    def p2p_s(self, nbytes: float, stride: int, span: int) -> float:
        """One send between pipeline neighbours `stride` devices apart in a pipeline of `span` devices."""
        return float(self._comm.p2p_s(nbytes, stride, span)) if nbytes > 0 else 0.0

    # --- kernels ----------------------------------------------------------------------------------------------
    def memory_bound_s(self, nbytes: float) -> float:
        """Forward seconds of one memory-bound kernel moving `nbytes`."""
        if self._ew is not None:
            return float(self._ew.time_s(nbytes, 1))
        gpu = self.gpu
        return nbytes / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency) + gpu.kernel_overhead_s

    def gemm_s(self, m: float, n: float, k: float) -> tuple[float, float]:
        """(forward, backward) seconds of an (m×k)·(k×n) GEMM at the training precision (never quantised: the
        graph planner runs every GEMM at bf16/fp16/fp32)."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0, 0.0
        g = Gemm(2.0 * m * n * k, m, n, k, quantised=False)
        return float(gemm_time(g, self.gpu, self.precision)), float(gemm_backward_time(g, self.gpu, self.precision))

    def whole_gemm_s(self, flop: float) -> float:
        """Forward + backward seconds of `flop` GEMM FLOPs whose shape the rules do not read (an op kept whole):
        at the GPU's calibrated GEMM efficiency, the backward twice the forward."""
        return 3 * flop / (self.gpu.peak(self.precision) * self.gpu.gemm_efficiency)

    def optimizer_s(self, params: float) -> float:
        per_param = WEIGHT_BYTES[self.precision] + FP32 + optimizer_state_bytes(self.optimizer, self.precision)
        per_param *= 2  # read and write every state
        if self._ew is not None:
            return float(self._ew.optimizer_step_s(params, per_param, FP32))
        return params * per_param / (self.gpu.hbm_bw_bytes_per_s * self.gpu.hbm_efficiency)

    @property
    def state_bytes_per_param(self) -> int:
        """Weight + fp32 gradient + optimizer state bytes per parameter."""
        return WEIGHT_BYTES[self.precision] + FP32 + optimizer_state_bytes(self.optimizer, self.precision)

    def bytes_of(self, t: Tensor) -> float:
        """A tensor's bytes in training: floating tensors at the training precision's activation width."""
        return t.numel * (ACTIVATION_BYTES[self.precision] if t.floating else t.nbytes / max(t.numel, 1))


# --- layouts ------------------------------------------------------------------------------------------------

def shard_factor(layout: tuple, mesh: Mesh) -> int:
    """How many pieces a tensor of `layout` is cut into (partial axes do not cut it)."""
    return prod(mesh.shape[a] for a, p in enumerate(layout) if isinstance(p, int))


def local_shape(shape: tuple[int, ...], layout: tuple, mesh: Mesh) -> tuple[float, ...]:
    out = list(shape)
    for a, p in enumerate(layout):
        if isinstance(p, int):
            out[p] = out[p] / mesh.shape[a]
    return tuple(out)


def divides(shape: tuple[int, ...], layout: tuple, mesh: Mesh) -> bool:
    """Whether every sharded dimension splits evenly over the axes that shard it."""
    for d in set(p for p in layout if isinstance(p, int)):
        if d >= len(shape):
            return False
        pieces = prod(mesh.shape[a] for a, p in enumerate(layout) if p == d)
        if shape[d] % pieces:
            return False
    return True


def grad_layout(layout: tuple) -> tuple:
    """The gradient layout a producer expects for an output of `layout`: a partial output's gradient is
    replicated (every summand receives the whole upstream gradient)."""
    return tuple(R if p == P else p for p in layout)


def reshard_s(src: tuple, dst: tuple, nbytes: float, ctx: CostContext) -> float:
    """Seconds to convert a tensor of `nbytes` (whole) from layout `src` to `dst`, axis by axis. Each axis's
    exchange moves the tensor as sharded by the other axes' finer layout (slices, which are free, are taken
    first and gathers last)."""
    key = ("reshard", src, dst, nbytes)
    if key in ctx.memo:
        return ctx.memo[key]
    mesh = ctx.mesh
    total = 0.0
    for a, (s, d) in enumerate(zip(src, dst)):
        if s == d or s == R:  # replicate -> shard / partial: take the local slice
            continue
        others = prod(mesh.shape[b] for b in range(len(src)) if b != a
                      and (isinstance(src[b], int) or isinstance(dst[b], int)))
        local = nbytes / others
        if s == P:
            total += ctx.all_reduce_s(a, local) if d == R else ctx.gather_s(a, local)
        elif d == R or d == P:  # shard -> replicate (and -> partial through replicate)
            total += ctx.gather_s(a, local)
        else:  # shard along one dim -> another
            total += ctx.all_to_all_s(a, local / mesh.shape[a])
    ctx.memo[key] = total
    return total


def to_dtensor(layout: tuple) -> list[str]:
    """A layout written as DTensor placements."""
    return ["Replicate()" if p == R else "Partial()" if p == P else f"Shard({p})" for p in layout]


# --- per-axis options by kind -------------------------------------------------------------------------------

def _pointwise(op: OpNode) -> list[AxisOption]:
    """Any output dim; each input (and parameter, e.g. a norm's weight written out point-wise) split along the same
    dim where it has it at full size, replicated where it is broadcast (its gradient then partial)."""
    out = op.output.shape
    nd = len(out)
    tensors = list(op.input_tensors) + [p.tensor for p in op.params]
    k = len(op.inputs)
    whole = tuple(R for _ in tensors)
    opts = [AxisOption("R", whole[:k], R, whole[:k], whole[k:], whole[k:])]
    for d in range(nd):
        if out[d] <= 1:
            continue
        ins, grads = [], []
        for t in tensors:
            i = d - (nd - len(t.shape))
            sharded = i >= 0 and t.shape[i] == out[d]
            ins.append(i if sharded else R)
            grads.append(i if sharded else P)  # a broadcast input's gradient sums over the split dim: partial
        opts.append(AxisOption(f"S{d}", tuple(ins[:k]), d, tuple(grads[:k]), tuple(ins[k:]), tuple(grads[k:])))
    name = op.attrs.get("op", "")
    if op.inputs and name in LINEAR_POINTWISE:
        n = len(tensors)
        if name in ("mul", "div", "scale") and n > 1:
            # a product is linear in one activation factor: that one partial, the others (parameters too)
            # replicated
            for j in range(k if name == "mul" else 1):
                place = tuple(P if i == j else R for i in range(n))
                opts.append(AxisOption(f"P{j}", place[:k], P, whole[:k], place[k:], whole[k:]))
        elif not op.params:  # a sum of partial sums (a parameter added to a partial sum would count n times)
            opts.append(AxisOption("P", (P,) * k, P, whole[:k]))
    return opts


def _view_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Input dim -> output dim a shard can follow through a reshape: the leading dim of each group of dims whose
    products match (a merge keeps the shard on the merged dim, a split on the first piece)."""
    mapping, i, j = {}, 0, 0
    while i < len(src) and j < len(dst):
        if src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            i += 1
            continue
        if dst[j] == 1 and src[i] != 1:
            j += 1
            continue
        gi, gj = [i], [j]
        a, b = src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                if i >= len(src):
                    return mapping
                gi.append(i)
                a *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return mapping
                gj.append(j)
                b *= dst[j]
        mapping[gi[0]] = gj[0]
        i, j = i + 1, j + 1
    return mapping


def _view(op: OpNode) -> list[AxisOption]:
    src, dst = op.input_tensors[0].shape, op.output.shape
    opts = [AxisOption("R", (R,), R, (R,)), AxisOption("P", (P,), P, (R,))]
    for i, j in _view_map(src, dst).items():
        if src[i] > 1:
            opts.append(AxisOption(f"S{i}", (i,), j, (i,)))
    return opts


def _permute(op: OpNode) -> list[AxisOption]:
    dims = tuple(op.attrs["dims"])
    opts = [AxisOption("R", (R,), R, (R,)), AxisOption("P", (P,), P, (R,))]
    for j, i in enumerate(dims):
        if op.input_tensors[0].shape[i] > 1:
            opts.append(AxisOption(f"S{i}", (i,), j, (i,)))
    return opts


def _slice(op: OpNode) -> list[AxisOption]:
    dim = op.attrs["dim"] % len(op.input_tensors[0].shape)
    opts = [AxisOption("R", (R,), R, (R,)), AxisOption("P", (P,), P, (R,))]
    for d, size in enumerate(op.input_tensors[0].shape):
        if d != dim and size > 1:
            opts.append(AxisOption(f"S{d}", (d,), d, (d,)))
    return opts


def _cat(op: OpNode) -> list[AxisOption]:
    n = len(op.inputs)
    dim = op.attrs["dim"] % len(op.output.shape)
    opts = [AxisOption("R", (R,) * n, R, (R,) * n), AxisOption("P", (P,) * n, P, (R,) * n)]
    for d, size in enumerate(op.output.shape):
        if d != dim and size > 1:
            opts.append(AxisOption(f"S{d}", (d,) * n, d, (d,) * n))
    return opts


def _linear(op: OpNode) -> list[AxisOption]:
    x = op.input_tensors[0].shape
    nd = len(x)
    bias = len(op.params) > 1
    w_r = (R,) * len(op.params)
    opts = [AxisOption("R", (R,), R, (R,), w_r, w_r)]
    for d in range(nd - 1):
        if x[d] > 1:
            opts.append(AxisOption(f"batch{d}", (d,), d, (d,), w_r, (P,) * len(op.params)))
    col = (0, 0) if bias else (0,)
    opts.append(AxisOption("column", (R,), nd - 1, (P,), col, col))
    if not bias:
        opts.append(AxisOption("row", (nd - 1,), P, (nd - 1,), (1,), (1,)))
    else:  # the bias is added once, after the reduction: the op reduces its own output
        opts.append(AxisOption("row", (nd - 1,), R, (nd - 1,), (1, R), (1, R), (("all_reduce", "out", "fwd"),)))
        for d in range(nd - 1):
            if x[d] > 1:
                opts.append(AxisOption(f"row-rs{d}", (nd - 1,), d, (nd - 1,), (1, R), (1, P),
                                       (("reduce_scatter", "out", "fwd"), ("all_gather", "out", "bwd"))))
    return opts


def _matmul(op: OpNode) -> list[AxisOption]:
    """a[..., m, k] @ b[..., k, n] with one operand possibly a parameter (``params[i].arg`` 0 or 1), plus a bias
    parameter over n (``arg`` 2: Conv1D's addmm), added after the op's own reduction where k is split."""
    shapes: list = [None, None]
    operands = [p for p in op.params if p.arg in (0, 1)]
    bias = [p for p in op.params if p.arg == 2]
    act = [i for i in range(2) if not any(p.arg == i for p in operands)]
    for i, t in zip(act, op.input_tensors):
        shapes[i] = t.shape
    for p in operands:
        shapes[p.arg] = p.tensor.shape
    a, b = shapes
    out = op.output.shape
    nd = len(out)
    if a is None or b is None or len(a) < 2 or len(b) < 2 or len(bias) > 1:
        return _replicated(op)
    m_dim, k_a, k_b, n_dim = len(a) - 2, len(a) - 1, len(b) - 2, len(b) - 1

    def option(name, pa, pb, po, ga, gb, bias_place=R, bias_grad=R, inner=()):
        place, grad = {0: pa, 1: pb, 2: bias_place}, {0: ga, 1: gb, 2: bias_grad}
        return AxisOption(name, tuple(place[i] for i in act), po, tuple(grad[i] for i in act),
                          tuple(place[p.arg] for p in op.params), tuple(grad[p.arg] for p in op.params), inner)

    opts = [option("R", R, R, R, R, R)]
    for d in range(nd - 2):  # batch dims (broadcast operands stay replicated, their gradient partial)
        if out[d] <= 1:
            continue
        da, db = d - (nd - len(a)), d - (nd - len(b))
        sa = da >= 0 and a[da] == out[d]
        sb = db >= 0 and b[db] == out[d]
        opts.append(option(f"batch{d}", da if sa else R, db if sb else R, d, da if sa else P, db if sb else P,
                           R, P))
    if a[m_dim] > 1:
        opts.append(option("m", m_dim, R, nd - 2, m_dim, P, R, P))
    if b[n_dim] > 1:
        opts.append(option("n", R, n_dim, nd - 1, P, n_dim, 0, 0))
    if a[k_a] > 1:
        if bias:  # the bias is added once, after the op reduces its own output
            opts.append(option("k", k_a, k_b, R, k_a, k_b, R, R, (("all_reduce", "out", "fwd"),)))
        else:
            opts.append(option("k", k_a, k_b, P, k_a, k_b))
    return opts


def _embedding(op: OpNode) -> list[AxisOption]:
    idx = op.input_tensors[0].shape
    nd = len(op.output.shape)
    opts = [AxisOption("R", (R,), R, (R,), (R,), (R,)),
            AxisOption("column", (R,), nd - 1, (R,), (1,), (1,)),
            AxisOption("vocab", (R,), P, (R,), (0,), (0,))]
    for d, size in enumerate(idx):
        if size > 1:
            opts.append(AxisOption(f"batch{d}", (d,), d, (d,), (R,), (P,)))
    return opts


def _norm(op: OpNode) -> list[AxisOption]:
    x = op.input_tensors[0].shape
    k = op.attrs.get("normalized_ndim", 1)
    w = (R,) * len(op.params)
    opts = [AxisOption("R", (R,), R, (R,), w, w)]
    for d in range(len(x) - k):
        if x[d] > 1:
            opts.append(AxisOption(f"S{d}", (d,), d, (d,), w, (P,) * len(op.params)))
    return opts


def _batch_norm(op: OpNode) -> list[AxisOption]:
    x = op.input_tensors[0].shape
    w = (R,) * len(op.params)
    stats = (("all_reduce", "channels", "fwd"), ("all_reduce", "channels", "bwd"))
    opts = [AxisOption("R", (R,), R, (R,), w, w),
            AxisOption("channel", (1,), 1, (1,), (0,) * len(op.params), (0,) * len(op.params))]
    for d in (0, 2, 3):  # batch or spatial split: synchronised statistics (SyncBatchNorm's all-reduces)
        if d < len(x) and x[d] > 1:
            opts.append(AxisOption(f"S{d}", (d,), d, (d,), w, (P,) * len(op.params), stats))
    return opts


def _softmax(op: OpNode) -> list[AxisOption]:
    x = op.input_tensors[0].shape
    dim = op.attrs["dim"] % len(x)
    opts = [AxisOption("R", (R,), R, (R,))]
    for d in range(len(x)):
        if x[d] > 1 and d != dim:
            opts.append(AxisOption(f"S{d}", (d,), d, (d,)))
    # split along the softmax dim (a vocabulary-parallel log-softmax): max and sum all-reduced per row
    opts.append(AxisOption(f"S{dim}", (dim,), dim, (dim,),
                           inner=(("all_reduce", "rows", "fwd"), ("all_reduce", "rows", "fwd"),
                                  ("all_reduce", "rows", "bwd"))))
    return opts


def _sdpa(op: OpNode) -> list[AxisOption]:
    q = op.input_tensors[0].shape
    n = len(op.inputs)
    opts = [AxisOption("R", (R,) * n, R, (R,) * n)]
    for d, name in ((0, "batch"), (1, "heads")):
        if d >= len(q) - 2 or q[d] <= 1:
            continue
        ins = []
        for t in op.input_tensors:
            i = d - (len(q) - len(t.shape))
            ins.append(i if i >= 0 and t.shape[i] > 1 else R)
        grads = tuple(i if i != R else P for i in ins)
        opts.append(AxisOption(name, tuple(ins), d, grads))
    return opts


def _conv(op: OpNode) -> list[AxisOption]:
    x = op.input_tensors[0].shape
    bias = len(op.params) > 1
    groups = op.attrs.get("groups", 1)
    w = (R,) * len(op.params)
    opts = [AxisOption("R", (R,), R, (R,), w, w)]
    if x[0] > 1:
        opts.append(AxisOption("batch", (0,), 0, (0,), w, (P,) * len(op.params)))
    if groups == 1:
        opts.append(AxisOption("out-channel", (R,), 1, (P,), (0,) * len(op.params), (0,) * len(op.params)))
        if not bias:
            opts.append(AxisOption("in-channel", (1,), P, (1,), (1,), (1,)))
    return opts


def _pool(op: OpNode) -> list[AxisOption]:
    x = op.input_tensors[0].shape
    opts = [AxisOption("R", (R,), R, (R,))]
    for d in (0, 1):
        if d < len(x) and x[d] > 1:
            opts.append(AxisOption(f"S{d}", (d,), d, (d,)))
    return opts


def _reduce(op: OpNode) -> list[AxisOption]:
    x = op.input_tensors[0].shape
    dims = sorted(d % len(x) for d in op.attrs.get("dims", range(len(x))))
    keep = op.attrs.get("keepdim", False)
    opts = [AxisOption("R", (R,), R, (R,))]
    for d in range(len(x)):
        if x[d] <= 1:
            continue
        if d in dims:
            if op.attrs.get("op") in ("sum", "mean"):  # a sum over a split dim is a partial sum
                opts.append(AxisOption(f"S{d}", (d,), P, (d,)))
        else:
            out_d = d if keep else d - sum(1 for r in dims if r < d)
            opts.append(AxisOption(f"S{d}", (d,), out_d, (d,)))
    return opts


def _loss(op: OpNode) -> list[AxisOption]:
    pred = op.input_tensors[0].shape
    n = len(op.inputs)
    opts = [AxisOption("R", (R,) * n, R, (R,) * n)]
    cls = op.attrs.get("class_dim")
    for d in range(len(pred)):
        if pred[d] <= 1:
            continue
        if cls is not None and d == cls % len(pred):  # class split: each device picks its classes' targets
            ins = (d,) + (R,) * (n - 1)
            opts.append(AxisOption(f"class{d}", ins, P, ins[:1] + (R,) * (n - 1)))
            continue
        ins = [d]
        for t in op.input_tensors[1:]:  # targets: the same dim, minus the class dim they do not have
            td = d if cls is None or d < cls % len(pred) else d - 1
            ins.append(td if td < len(t.shape) and t.shape[td] == pred[d] else R)
        opts.append(AxisOption(f"S{d}", tuple(ins), P, tuple(ins)))
    return opts


def _replicated(op: OpNode) -> list[AxisOption]:
    n, k = len(op.inputs), len(op.params)
    return [AxisOption("R", (R,) * n, R, (R,) * n, (R,) * k, (R,) * k)]


def _input(op: OpNode) -> list[AxisOption]:
    opts = [AxisOption("R", (), R, ())]
    for d, size in enumerate(op.output.shape):
        if size > 1:
            opts.append(AxisOption(f"S{d}", (), d, ()))
    return opts


#: Per-axis options DTensor (torch 2.13) does not compute as one process would, left out when a plan is to run
#: with it: a convolution with a sharded weight convolves each shard as if it were the whole weight and calls the
#: result replicated (measured: ranks disagree), and a batch norm over a split batch normalises with each
#: device's own statistics (data parallel's semantics, not one process's).
DTENSOR_UNSUPPORTED = {"conv2d": {"out-channel", "in-channel"}, "batch_norm": {"channel", "S0", "S2", "S3"}}

AXIS_OPTIONS = {"input": _input, "linear": _linear, "matmul": _matmul, "embedding": _embedding,
                "layer_norm": _norm, "rms_norm": _norm, "batch_norm": _batch_norm, "softmax": _softmax,
                "sdpa": _sdpa, "elementwise": _pointwise, "view": _view, "permute": _permute, "slice": _slice,
                "cat": _cat, "conv2d": _conv, "pool": _pool, "reduce": _reduce, "loss": _loss,
                "unknown": _replicated}


#: Kinds that rearrange one tensor: when that tensor is a parameter (a weight transposed before a matmul, as
#: `x @ w.t()` or a decomposed linear writes it), the parameter is laid out as the op's input would be.
REARRANGING = ("view", "permute", "slice")


def axis_options(op: OpNode) -> list[AxisOption]:
    try:
        rule = AXIS_OPTIONS[op.kind]
    except KeyError:
        raise SpecError(f"op {op.name}: kind {op.kind!r} has no sharding rule") from None
    if op.kind == "elementwise" and not op.inputs and not op.params:  # a constant made from nothing
        return [AxisOption("R", (), R, ())]
    if op.kind in REARRANGING and not op.inputs and len(op.params) == 1:
        as_input = replace(op, inputs=(op.params[0].fqn,), input_tensors=(op.params[0].tensor,), params=())
        return [AxisOption(o.name, (), o.out, (), o.ins, o.grads, o.inner) for o in rule(as_input) if P not in o.ins]
    return rule(op)


# --- costs of one strategy ----------------------------------------------------------------------------------

def _compute_s(op: OpNode, ins: tuple, out: tuple, params: tuple, ctx: CostContext) -> float:
    mesh = ctx.mesh
    kind = op.kind
    if kind in ("input", "view", "permute", "slice") or (kind == "elementwise" and not op.inputs):
        return 0.0
    if kind == "linear":
        x = local_shape(op.input_tensors[0].shape, ins[0], mesh)
        w = local_shape(op.params[0].tensor.shape, params[0], mesh)
        f, b = ctx.gemm_s(prod(x[:-1]), w[0], w[1])
        return f + b
    if kind == "matmul":
        shapes = {}
        act = [i for i in range(2) if not any(p.arg == i for p in op.params)]
        if len(act) < len(op.input_tensors):  # more activations than two operands: kept whole, priced by FLOPs
            return ctx.whole_gemm_s(op.flop)
        for i, t, lay in zip(act, op.input_tensors, ins):
            shapes[i] = local_shape(t.shape, lay, mesh)
        for p, lay in zip(op.params, params):
            if p.arg in (0, 1):
                shapes[p.arg] = local_shape(p.tensor.shape, lay, mesh)
        if 0 not in shapes or 1 not in shapes:  # kept whole (`_matmul` found no split)
            return ctx.whole_gemm_s(op.flop)
        a, bb = shapes[0], shapes[1]
        o = local_shape(op.output.shape, tuple(R if p == P else p for p in out), mesh)
        batch = prod(o[:-2]) if len(o) > 2 else 1
        f, b = ctx.gemm_s(batch * a[-2], bb[-1], a[-1])
        return f + b
    if kind == "conv2d":
        x = local_shape(op.input_tensors[0].shape, ins[0], mesh)
        w = local_shape(op.params[0].tensor.shape, params[0], mesh)
        o = local_shape(op.output.shape, tuple(R if p == P else p for p in out), mesh)
        groups = op.attrs.get("groups", 1)
        f, b = ctx.gemm_s(o[0] * o[2] * o[3] * groups, w[0] / groups, w[1] * w[2] * w[3])
        return f + b
    if kind == "sdpa":
        return _sdpa_s(op, ins, ctx)
    # memory-bound: read the inputs (and the parameters), write the output
    nbytes = sum(ctx.bytes_of(t) / shard_factor(lay, mesh) for t, lay in zip(op.input_tensors, ins))
    nbytes += ctx.bytes_of(op.output) / shard_factor(out, mesh)
    if kind == "embedding":  # a gather reads the rows it writes, not the table
        nbytes = 2 * ctx.bytes_of(op.output) / shard_factor(out, mesh)
    fwd = ctx.memory_bound_s(nbytes)
    return fwd * (1 + BACKWARD_ELEMENTWISE_FACTOR)


def _sdpa_s(op: OpNode, ins: tuple, ctx: CostContext) -> float:
    """The attention core at its local shape: the GPU's flash table where it has one (the transformer planner's
    `flash_core_times`), else its two batched GEMMs and a softmax over the scores."""
    mesh = ctx.mesh
    q = local_shape(op.input_tensors[0].shape, ins[0], mesh)
    k = local_shape(op.input_tensors[1].shape, ins[1], mesh)
    *lead, heads, sq, d = q
    batch = prod(lead) if lead else 1
    kv_heads, sk = k[-3] if len(k) >= 3 else heads, k[-2]
    if sq == sk and ctx.precision in ("bf16", "fp16"):
        att = Attention(hidden=int(heads * d), num_heads=int(max(heads, 1)), q_width=int(heads * d),
                        kv_width=int(kv_heads * d), bias=0, rope=False, dropout=False)
        micro = Micro(seq_len=int(sq), micro_batch_size=np.asarray(float(batch)), tp=np.asarray(1.0),
                      cp=np.asarray(1.0), sequence_parallel=np.asarray(False), precision=ctx.precision,
                      attention_kernel="flash")
        times = flash_core_times(att, micro, ctx.gpu)
        if times is not None:
            return float(times[0]) + float(times[1])
    f1, b1 = ctx.gemm_s(batch * heads * sq, sk, d)
    f2, b2 = ctx.gemm_s(batch * heads * sq, d, sk)
    scores = batch * heads * sq * sk * ACTIVATION_BYTES[ctx.precision]
    return f1 + b1 + f2 + b2 + ctx.memory_bound_s(2 * scores) * (1 + BACKWARD_ELEMENTWISE_FACTOR)


def _inner_s(op: OpNode, inner: tuple, axis: int, out: tuple, ctx: CostContext) -> float:
    """Seconds of the op's own exchanges on `axis`."""
    mesh = ctx.mesh
    total = 0.0
    for collective, tensor, _direction in inner:
        others = prod(mesh.shape[b] for b in range(len(out)) if b != axis and isinstance(out[b], int))
        if tensor == "out":
            nbytes = ctx.bytes_of(op.output) / others
        elif tensor == "rows":
            nbytes = FP32 * op.output.numel / op.output.shape[op.attrs["dim"] % len(op.output.shape)] / others
        else:  # channels: a batch norm's mean and variance (or their gradients)
            nbytes = 2 * FP32 * op.output.shape[1]
        total += ctx.all_reduce_s(axis, nbytes) if collective == "all_reduce" else ctx.gather_s(axis, nbytes)
    return total


def saves_inputs(op: OpNode) -> bool:
    """Whether the op keeps its activation inputs for the backward."""
    return op.kind in SAVES_INPUTS or (op.kind == "elementwise" and op.attrs.get("op") not in POINTWISE_NOTHING_SAVED)


def saved_bytes(op: OpNode, ins: tuple, out: tuple, ctx: CostContext, shares: tuple[float, ...] = ()) -> float:
    """Bytes of its inputs (or output) the op keeps for the backward; `shares[i]`: its share of input i (a
    tensor several ops keep is stored once: each keeper counts 1/keepers of it)."""
    mesh = ctx.mesh
    if op.kind == "softmax":  # the backward needs the output
        return ctx.bytes_of(op.output) / shard_factor(out, mesh)
    if saves_inputs(op):
        shares = shares or tuple(1.0 for _ in op.inputs)
        total = sum(ctx.bytes_of(t) / shard_factor(lay, mesh) * w
                    for t, lay, w in zip(op.input_tensors, ins, shares))
        if op.kind == "sdpa":  # and its output (and the log-sum-exp, negligible)
            total += ctx.bytes_of(op.output) / shard_factor(out, mesh)
        return total
    return 0.0


def op_strategies(op: OpNode, ctx: CostContext, owns: tuple[bool, ...] = (), shares: tuple[float, ...] = ()
                  ) -> list[OpStrategy]:
    """Every strategy of `op` on `ctx.mesh` with its costs. `owns[i]`: whether the op counts parameter i's
    memory, gradient reduction and optimizer step (a parameter read by several ops is counted by its first);
    `shares[i]`: its share of saved input i (`saved_bytes`)."""
    mesh = ctx.mesh
    owns = owns or tuple(True for _ in op.params)
    per_axis = axis_options(op)
    if ctx.dtensor:
        per_axis = [o for o in per_axis if o.name not in DTENSOR_UNSUPPORTED.get(op.kind, ())]
    # a rule that does not place the op's parameters (a kind read with parameters it does not expect) keeps only
    # its replicated option, with the parameters replicated too
    per_axis = [o if len(o.params) == len(op.params) else
                AxisOption(o.name, o.ins, o.out, o.grads, (R,) * len(op.params), (R,) * len(op.params), o.inner)
                for o in per_axis if len(o.params) == len(op.params) or o.name == "R"]
    result = []
    for combo in product(per_axis, repeat=len(mesh.shape)):
        ins = tuple(tuple(c.ins[i] for c in combo) for i in range(len(op.inputs)))
        out = tuple(c.out for c in combo)
        params = tuple(tuple(c.params[i] for c in combo) for i in range(len(op.params)))
        if not all(divides(t.shape, lay, mesh) for t, lay in zip(op.input_tensors, ins)):
            continue
        if not divides(op.output.shape, tuple(p for p in out), mesh):
            continue
        if not all(divides(p.tensor.shape, lay, mesh) for p, lay in zip(op.params, params)):
            continue
        grads = tuple(tuple(c.grads[i] for c in combo) for i in range(len(op.inputs)))
        pgrads = tuple(tuple(c.param_grads[i] for c in combo) for i in range(len(op.params)))
        compute = _compute_s(op, ins, out, params, ctx)
        comm = sum(_inner_s(op, c.inner, a, out, ctx) for a, c in enumerate(combo) if c.inner)
        sync = opt = pbytes = 0.0
        for p, lay, glay, own in zip(op.params, params, pgrads, owns):
            if not own:
                continue
            local = p.tensor.numel / shard_factor(lay, mesh)
            pbytes += local * ctx.state_bytes_per_param
            opt += ctx.optimizer_s(local)
            sync += sum(ctx.all_reduce_s(a, FP32 * local) for a, g in enumerate(glay) if g == P)
        act = saved_bytes(op, ins, out, ctx, shares)
        result.append(OpStrategy("|".join(c.name for c in combo), ins, out, grads, params, pgrads, compute, comm,
                                 sync, opt, pbytes, act))
    if not result:  # nothing divides: keep the op whole on every device
        reps = _replicated(op)[0]
        combo = (reps,) * len(mesh.shape)
        ins = tuple(tuple(R for _ in combo) for _ in op.inputs)
        out = tuple(R for _ in combo)
        params = tuple(tuple(R for _ in combo) for _ in op.params)
        compute = _compute_s(op, ins, out, params, ctx)
        pbytes = sum(p.tensor.numel * ctx.state_bytes_per_param for p, o in zip(op.params, owns) if o)
        opt = sum(ctx.optimizer_s(p.tensor.numel) for p, o in zip(op.params, owns) if o)
        result.append(OpStrategy("|".join("R" for _ in combo), ins, out, ins, params, params, compute, 0.0, 0.0,
                                 opt, pbytes, saved_bytes(op, ins, out, ctx, shares)))
    return result


def requires_grad(graph: nx.DiGraph) -> dict[str, bool]:
    """Which node outputs need a gradient: floating outputs that depend on a parameter."""
    need = {}
    for name in nx.topological_sort(graph):
        op: OpNode = graph.nodes[name]["op"]
        need[name] = op.output.floating and (bool(op.params) or any(need.get(u, False) for u in op.inputs))
    return need


def edge_cost_matrix(u: list[OpStrategy], v: list[OpStrategy], arg: int, tensor: Tensor, grad: bool,
                     ctx: CostContext) -> np.ndarray:
    """Seconds (one micro-batch) of resharding producer strategies `u` -> consumer strategies `v`, input `arg`."""
    nbytes = ctx.bytes_of(tensor)
    cache: dict[tuple, float] = {}

    def cost(src, dst):
        key = (src, dst)
        if key not in cache:
            cache[key] = reshard_s(src, dst, nbytes, ctx)
        return cache[key]

    out = np.zeros((len(u), len(v)))
    for i, su in enumerate(u):
        expected = grad_layout(su.out)
        for j, sv in enumerate(v):
            c = cost(su.out, sv.ins[arg])
            if grad:
                c += cost(sv.grads[arg], expected)
            out[i, j] = c
    return out


def tensor_layouts(tensor: Tensor, mesh: Mesh, partial: bool) -> list[tuple]:
    """Every layout of `tensor` on `mesh` whose shards divide evenly (with partial sums where `partial`)."""
    per_axis = [R] + [d for d, size in enumerate(tensor.shape) if size > 1] + ([P] if partial else [])
    return [lay for lay in product(per_axis, repeat=len(mesh.shape)) if divides(tensor.shape, lay, mesh)]


def layout_strategies(tensor: Tensor, mesh: Mesh, partial: bool) -> list[OpStrategy]:
    """A shared tensor's layout choices as cost-free strategies (`problem`'s fan-out nodes)."""
    return [OpStrategy("|".join(str(p) for p in lay), (), lay, (), (), (), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
            for lay in tensor_layouts(tensor, mesh, partial)]


def layout_matrix(src: list[tuple], dst: list[tuple], nbytes: float, ctx: CostContext) -> np.ndarray:
    """Seconds of converting each layout of `src` into each of `dst`."""
    cache: dict[tuple, float] = {}
    out = np.zeros((len(src), len(dst)))
    for i, a in enumerate(src):
        for j, b in enumerate(dst):
            if (a, b) not in cache:
                cache[a, b] = reshard_s(a, b, nbytes, ctx)
            out[i, j] = cache[a, b]
    return out
