"""The operator graph's vocabulary: what a traced node says about itself.

`planner.autoshard.trace` turns an `nn.Module` into a networkx DiGraph whose nodes are named by the traced
program's node names and carry one `OpNode` each under the attribute ``"op"``; an edge u -> v means v reads
u's output. Everything here is plain data (no torch): the sharding strategies and the solver read only these
fields, so a graph can also be written by hand in tests.

Kinds (`KINDS`) and the fields each uses:

- ``input``: a user input of the model (``attrs["index"]``: its position in the example inputs).
- ``linear``: y[..., n] = x[..., k] · W[n, k]ᵀ (+ b[n]); inputs [x]; params [weight, (bias)].
- ``matmul``: y = a @ b with torch.matmul's broadcasting (mm, bmm, matmul); inputs [a, b] where both are
  activations; when one operand is a parameter it is in ``params`` with ``arg`` its position (0 or 1).
- ``embedding``: y[..., h] = W[idx]; inputs [indices]; params [weight (V, h)].
- ``layer_norm`` / ``rms_norm``: over the last ``attrs["normalized_ndim"]`` dims; params [weight, (bias)].
- ``softmax``: softmax or log-softmax over ``attrs["dim"]`` (non-negative); ``attrs["op"]`` names which.
- ``sdpa``: scaled-dot-product attention, q/k/v [..., heads, seq, head_dim]; inputs [q, k, v, (mask)];
  ``attrs["causal"]``.
- ``elementwise``: point-wise ops, unary or n-ary with broadcasting (gelu, silu, relu, add, mul, dropout, casts,
  ...); ``attrs["op"]`` names it. Scalars are not inputs.
- ``view``: reshape / view / flatten / unsqueeze / squeeze / contiguous / clone / expand-free copies: the element
  order is kept and only the shape changes (output shape in ``output``).
- ``permute``: ``attrs["dims"]`` (a transpose is written as the equivalent permutation).
- ``slice``: a contiguous piece of one input along ``attrs["dim"]`` from ``attrs["start"]`` to ``attrs["stop"]``
  (split / chunk / narrow / slice / unbind's pieces, one node each).
- ``cat``: concatenation along ``attrs["dim"]``.
- ``conv2d``: inputs [x (N, C, H, W)]; params [weight (O, C/groups, kh, kw), (bias)];
  ``attrs``: stride, padding, dilation (pairs), groups.
- ``batch_norm``: 2-D batch norm in training mode over (N, H, W) per channel; params [weight, bias] of C.
- ``pool``: max / avg / adaptive-avg 2-D pooling over the last two dims; ``attrs["op"]``, ``attrs["kernel"]``.
- ``reduce``: sum / mean / amax over ``attrs["dims"]`` with ``attrs["keepdim"]``; ``attrs["op"]``.
- ``loss``: a loss reducing to a scalar: ``attrs["op"]`` (nll_loss, cross_entropy, mse_loss, ...), inputs
  [prediction, target]; ``attrs["class_dim"]`` for classification losses.
- ``unknown``: anything else; it is kept replicated by the strategies and listed in the result
  (``attrs["target"]`` names the op).
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
