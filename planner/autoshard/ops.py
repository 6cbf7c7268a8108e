"""The operator graph's vocabulary: what a traced node says about itself.

`planner.autoshard.trace` turns an `nn.Module` into a networkx DiGraph whose nodes are named by the traced
program's node names and carry one `OpNode` each under the attribute ``"op"``; an edge u -> v means v reads
u's output. Everything here is plain data (no torch): the sharding strategies and the solver read only these
fields, so a graph can also be written by hand in tests.

Kinds (`KINDS`) and the fields each uses:

- ``input``: a user input of the model (``attrs["index"]``: its position in the example inputs, positional ones
  first; ``attrs["keyword"]``: its name, for an input given by keyword).
- ``linear``: y[..., n] = x[..., k] · W[n, k]ᵀ (+ b[n]); inputs [x]; params [weight, (bias)].
- ``matmul``: y = a @ b with torch.matmul's broadcasting (mm, bmm, matmul); inputs [a, b] where both are
  activations; when one operand is a parameter it is in ``params`` with ``arg`` its position (0 or 1).
  ``attrs["op"]``: mm, bmm, matmul or addmm; ``attrs["k"]``: the contracted size. addmm (a Hugging Face
  Conv1D: bias + a @ b) lists its bias in ``params`` with role "bias" and ``arg`` 2.
- ``embedding``: y[..., h] = W[idx]; inputs [indices]; params [weight (V, h)]; ``attrs["padding_idx"]``.
- ``layer_norm`` / ``rms_norm``: over the last ``attrs["normalized_ndim"]`` dims; params [weight, (bias)];
  ``attrs["eps"]``.
- ``softmax``: softmax or log-softmax over ``attrs["dim"]`` (non-negative); ``attrs["op"]`` names which.
- ``sdpa``: scaled-dot-product attention, q/k/v [..., heads, seq, head_dim]; inputs [q, k, v, (mask)];
  ``attrs["causal"]``, ``attrs["dropout_p"]``, ``attrs["scale"]`` (None: 1/sqrt(head_dim)),
  ``attrs["enable_gqa"]``.
- ``elementwise``: point-wise ops, unary or n-ary with broadcasting (gelu, silu, relu, add, mul, dropout, casts,
  ...); ``attrs["op"]`` names it. Scalars are not inputs. ``expand`` is here: a broadcast of its one input.
  ``attrs["inplace"]`` marks an in-place form (``relu_``). ``attrs["op"] == "constant"``: a tensor made from
  nothing or from buffers only (arange, zeros, full, a slice of a registered mask), with no inputs;
  ``attrs["from"]`` names the op that made it and, for an arange of step 1, ``attrs["range"]`` is (start, stop).
- ``view``: reshape / view / flatten / unsqueeze / squeeze / contiguous / clone / expand-free copies: the element
  order is kept and only the shape changes (output shape in ``output``); ``attrs["op"]`` names it.
- ``permute``: ``attrs["dims"]`` (a transpose is written as the equivalent permutation).
- ``slice``: a contiguous piece of one input along ``attrs["dim"]`` from ``attrs["start"]`` to ``attrs["stop"]``
  (split / chunk / narrow / slice / unbind's pieces, one node each, named after the traced ``getitem``). A
  piece that drops the dim (unbind, select) is a size-1 slice named ``<name>.slice`` followed by a ``view``
  named ``<name>`` (``attrs["op"] == "squeeze"``).
- ``cat``: concatenation along ``attrs["dim"]``.
- ``conv2d``: inputs [x (N, C, H, W)]; params [weight (O, C/groups, kh, kw), (bias)];
  ``attrs``: stride, padding, dilation (pairs), groups.
- ``batch_norm``: 2-D batch norm in training mode over (N, H, W) per channel; params [weight, bias] of C;
  ``attrs["training"]``, ``attrs["momentum"]``, ``attrs["eps"]``; the running statistics in
  ``attrs["buffers"]``.
- ``pool``: max / avg / adaptive-avg 2-D pooling over the last two dims; ``attrs["op"]`` (max, avg, adaptive_avg,
  adaptive_max), ``attrs["kernel"]``; max and avg also ``stride``, ``padding``, ``ceil_mode`` (max:
  ``dilation``), pairs; adaptive ones ``output_size`` and, as ``kernel``, the largest window
  (ceil(H / out_h), ceil(W / out_w)).
- ``reduce``: sum / mean / amax over ``attrs["dims"]`` with ``attrs["keepdim"]``; ``attrs["op"]`` (also amin;
  max / min over a dim are written amax / amin).
- ``loss``: a loss reducing to a scalar: ``attrs["op"]`` (nll_loss, cross_entropy, mse_loss, ...), inputs
  [prediction, target]; ``attrs["reduction"]`` ("mean", "sum", "none"); ``attrs["class_dim"]`` and
  ``attrs["ignore_index"]`` for classification losses (cross_entropy also ``label_smoothing``).
- ``unknown``: anything else; it is kept replicated by the strategies and listed in the result
  (``attrs["target"]`` names the op; ``attrs["output"]``: which output, for an op with several).

Any op may read parameters and buffers, which are not nodes: a parameter is in ``params`` with ``arg`` its
position among the traced op's arguments (embedding's weight 0, linear's weight 1 and bias 2, layer_norm's 2
and 3), and a buffer (running statistics, a registered mask) in ``attrs["buffers"]`` ({position: fqn}). An op
whose only data input is a parameter (a view of a weight) has no inputs, only params.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

KINDS = ("input", "linear", "matmul", "embedding", "layer_norm", "rms_norm", "softmax", "sdpa", "elementwise",
         "view", "permute", "slice", "cat", "conv2d", "batch_norm", "pool", "reduce", "loss", "unknown")

#: Bytes per element of the dtypes a traced graph carries (torch dtype names without "torch.").
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


@dataclass(frozen=True)
class Tensor:
    """Shape and dtype of one tensor (no data)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def floating(self) -> bool:
        return self.dtype.startswith("float") or self.dtype == "bfloat16"


@dataclass(frozen=True)
class ParamUse:
    """A parameter an op reads: its fully qualified name in the module, shape, dtype and role."""

    fqn: str
    tensor: Tensor
    role: str  # "weight" | "bias"
    arg: int = 1  # the op's positional argument it is (matmul: 0 or 1)


@dataclass(frozen=True)
class OpNode:
    """One operator of the traced forward pass (see the module docstring for the kinds)."""

    name: str  # the traced node's name, unique in the graph
    kind: str  # one of KINDS
    target: str  # the traced op, e.g. "aten.linear.default"
    inputs: tuple[str, ...]  # producer node names of the activation arguments, in argument order
    input_tensors: tuple[Tensor, ...]  # their shapes and dtypes, in the same order
    output: Tensor  # the output (an op with several outputs is split into one node per output)
    params: tuple[ParamUse, ...] = ()
    flop: float = 0.0  # forward FLOPs of the whole op (all devices together)
    module: str = ""  # the innermost nn.Module's qualified name ("" for the root)
    module_type: str = ""  # that module's class name
    attrs: dict = field(default_factory=dict, hash=False, compare=False)
