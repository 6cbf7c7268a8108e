"""How the training IR's aten ops map onto the graph's vocabulary (`planner.autoshard.ops`): each op's kind,
attributes and forward FLOPs. `planner.autoshard.export_graph` calls `classify` and `flop_of` for every op it
walks; nothing here imports torch at module import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from planner.autoshard.ops import OpNode, ParamUse, Tensor

#: Forward FLOPs per output element of the ops that are not matrix products. They are small next to the
#: matrix products and only rank strategies that differ in redundant point-wise work, so each is a round count
#: of the arithmetic in one element's formula: elementwise 1 (one operation; casts, dropout and constants
#: included), layer_norm 8 (mean 1, centre 1, square-and-sum 2, normalise 2, affine 2), rms_norm 6 (square-and-sum
#: 2, normalise 2, weight 2), batch_norm 8 (as layer_norm), softmax 5 (max, subtract, exp, sum, divide).
FLOP_PER_ELEMENT = {"elementwise": 1, "layer_norm": 8, "rms_norm": 6, "batch_norm": 8, "softmax": 5}
#: Forward FLOPs per *input* element of the ops whose output is small: a reduction reads each element once (1),
#: a loss applies a log-softmax or a difference to each prediction element and reduces it (5).
FLOP_PER_INPUT_ELEMENT = {"reduce": 1, "loss": 5}

_ELEMENTWISE = frozenset("""
    abs add addcdiv addcmul alpha_dropout bitwise_and bitwise_not bitwise_or bitwise_xor ceil clamp clamp_max
    clamp_min clip cos cosh div dropout elu eq erf exp exp2 expand expand_as expm1 feature_dropout floor
    floor_divide fmod ge gelu gt hardsigmoid hardswish hardtanh isinf isnan le leaky_relu lerp log log1p log2
    logical_and logical_not logical_or logit lt masked_fill maximum minimum mish mul nan_to_num native_dropout ne
    neg pow reciprocal relu relu6 remainder round rsqrt rsub selu sigmoid sign silu sin sinh softplus sqrt square
    sub tan tanh true_divide trunc type_as where to _to_copy _assert_scalar
""".split())
_CONSTANT = frozenset("""
    arange empty empty_like empty_strided eye full full_like linspace new_empty new_full new_ones new_zeros ones
    ones_like rand rand_like randint randint_like randn randn_like scalar_tensor zeros zeros_like lift_fresh_copy
""".split())
_VIEW = frozenset("""
    view reshape _unsafe_view _reshape_alias flatten unflatten unsqueeze squeeze contiguous clone alias detach
    view_as reshape_as
""".split())
_PERMUTE = frozenset({"permute", "transpose", "t", "swapaxes", "swapdims", "movedim", "numpy_T"})
PIECES = frozenset({"split", "split_with_sizes", "chunk", "unbind", "tensor_split", "unsafe_split",
                    "unsafe_split_with_sizes", "unsafe_chunk"})
_MATMUL = frozenset({"mm", "bmm", "matmul"})
_BATCH_NORM = frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                         "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
                         "cudnn_batch_norm"})
_POOL = {"max_pool2d": "max", "max_pool2d_with_indices": "max", "avg_pool2d": "avg",
         "adaptive_avg_pool2d": "adaptive_avg", "adaptive_max_pool2d": "adaptive_max"}
#: Reductions a shard can do in part and combine (a sum, mean or maximum of partial results); max / min over a
#: dim are written as amax / amin (their values; the indices output is `unknown`).
_REDUCE = {"sum": "sum", "mean": "mean", "amax": "amax", "amin": "amin", "max": "amax", "min": "amin"}
_SOFTMAX = {"softmax": "softmax", "_softmax": "softmax", "log_softmax": "log_softmax",
            "_log_softmax": "log_softmax"}
#: aten's losses -> the name the graph gives them.
_LOSS = {"cross_entropy_loss": "cross_entropy", "nll_loss": "nll_loss", "nll_loss_nd": "nll_loss",
         "nll_loss2d": "nll_loss", "mse_loss": "mse_loss", "l1_loss": "l1_loss", "smooth_l1_loss": "smooth_l1_loss",
         "huber_loss": "huber_loss", "binary_cross_entropy": "binary_cross_entropy",
         "binary_cross_entropy_with_logits": "binary_cross_entropy_with_logits", "kl_div": "kl_div"}
#: aten's loss reduction codes.
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


@dataclass(frozen=True)
class Param:
    fqn: str


@dataclass(frozen=True)
class Buffer:
    fqn: str


def tensor_of(val: Any) -> Tensor:
    return Tensor(tuple(int(d) for d in val.shape), str(val.dtype).removeprefix("torch."))


def is_tensor(val: Any) -> bool:
    import torch

    return isinstance(val, torch.Tensor)


def pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (list, tuple)):
        return (int(value[0]), int(value[-1])) if value else (0, 0)
    return int(value), int(value)


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def packet_name(target: Any) -> str:
    schema = getattr(target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else getattr(target, "__name__", str(target))


def arg_names(target: Any) -> list[str]:
    schema = getattr(target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def bind_args(node: Any) -> list[tuple[str, Any]]:
    """(name, value) of every schema argument of an aten op, in schema order, defaults filled in."""
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        else:
            value = arg.default_value if arg.has_default_value() else None
        out.append((arg.name, value))
    return out


def param_role(fqn: str, names: list[str], pos: int) -> str:
    arg = names[pos] if pos < len(names) else ""
    return "bias" if arg == "bias" or (arg != "weight" and fqn.rsplit(".", 1)[-1].startswith("bias")) else "weight"


def fx_shape(arg: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in arg.meta["val"].shape)


def classify(node: Any, bound: list[tuple[str, Any]], val: Any, reads: list[tuple[int, Any]],
             b: Any) -> tuple[str, dict, list[tuple[int, Any]]]:
    """The kind and attributes of one aten op (see `planner.autoshard.ops`) and the reads it keeps. `bound` is
    `bind_args(node)`, `val` the op's output (a fake tensor), `reads` what `Builder._reads` found, and `b` the
    builder: its ``params`` ({fqn: Tensor}) and its checks."""
    name = packet_name(node.target)
    args = dict(bound)
    ndim = len(val.shape)
    target = str(node.target)
    unknown = ("unknown", {"target": target}, reads)
    kinds = {pos: type(v) for pos, v in reads}

    def in_ndim(key: str = "self") -> int:
        value = args.get(key)
        return len(value.meta["val"].shape) if hasattr(value, "meta") else ndim

    if name in _CONSTANT:
        attrs = {"op": "constant", "from": name}
        if name == "arange" and int(args.get("step", 1) or 1) == 1:
            attrs["range"] = (int(args.get("start", 0) or 0), int(args["end"]))
        return "elementwise", attrs, []
    if name == "linear":
        if kinds.get(1) is not Param or kinds.get(2, Param) is not Param or kinds.get(0) is not str:
            return unknown
        return "linear", {}, reads
    if name in _MATMUL:
        return "matmul", {"op": name, "k": fx_shape(args["self"])[-1]}, reads
    if name == "addmm":
        if kinds.get(0, Param) is not Param or 0 not in kinds:
            return unknown
        uses = [ParamUse(v.fqn, b.params[v.fqn], "weight", pos - 1) for pos, v in reads
                if isinstance(v, Param) and pos in (1, 2)]
        bias = next(v for pos, v in reads if pos == 0)
        uses.append(ParamUse(bias.fqn, b.params[bias.fqn], "bias", 2))
        return "matmul", {"op": "addmm", "k": fx_shape(args["mat1"])[-1], "_params": uses}, reads
    if name == "embedding":
        if kinds.get(0) is not Param:
            return unknown
        b.check_positions(reads, fx_shape(args["weight"])[0], b.module_of(node))
        return "embedding", {"padding_idx": int(args.get("padding_idx", -1))}, reads
    if name == "layer_norm":
        return "layer_norm", {"normalized_ndim": len(args["normalized_shape"]), "eps": args.get("eps")}, reads
    if name == "rms_norm":
        return "rms_norm", {"normalized_ndim": len(args["normalized_shape"]), "eps": args.get("eps")}, reads
    if name in _SOFTMAX:
        return "softmax", {"op": _SOFTMAX[name], "dim": norm_dim(int(args["dim"]), ndim)}, reads
    if name == "scaled_dot_product_attention":
        return "sdpa", {"causal": bool(args.get("is_causal")), "dropout_p": float(args.get("dropout_p") or 0.0),
                        "scale": args.get("scale"), "enable_gqa": bool(args.get("enable_gqa"))}, reads
    if name in _ELEMENTWISE:
        return "elementwise", {"op": name[:-1] if name.endswith("_") else name}, reads
    if name.endswith("_") and name[:-1] in _ELEMENTWISE:
        return "elementwise", {"op": name[:-1], "inplace": True}, reads
    if name in _VIEW:
        return "view", {"op": name}, reads
    if name in _PERMUTE:
        dims = _permutation(name, args, in_ndim())
        return ("permute", {"dims": dims}, reads) if dims is not None else unknown
    if name in ("slice", "narrow", "select"):
        return _slice(name, args, val, reads, target)
    if name == "cat":
        return "cat", {"dim": norm_dim(int(args.get("dim", 0)), ndim)}, reads
    if name in ("conv2d", "convolution"):
        weight = args.get("weight")
        if (kinds.get(1) is not Param or ndim != 4 or len(fx_shape(weight)) != 4 or args.get("transposed")
                or kinds.get(2, Param) is not Param):
            return unknown
        kh, kw = fx_shape(weight)[2:]
        dilation = pair(args.get("dilation", 1))
        padding = args.get("padding", 0)
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            padding = (dilation[0] * (kh - 1) // 2, dilation[1] * (kw - 1) // 2)
        return "conv2d", {"stride": pair(args.get("stride", 1)), "padding": pair(padding), "dilation": dilation,
                          "groups": int(args.get("groups", 1))}, reads
    if name in _BATCH_NORM:
        if ndim != 4:
            return unknown
        return "batch_norm", {"training": bool(args.get("training", False)), "momentum": args.get("momentum"),
                              "eps": args.get("eps")}, reads
    if name in _POOL:
        return _pool(name, args, reads)
    if name in _REDUCE:
        dims = args.get("dim")
        dims = list(range(in_ndim())) if dims is None or dims == [] else (
            [dims] if isinstance(dims, int) else list(dims))
        return "reduce", {"op": _REDUCE[name], "dims": tuple(sorted(norm_dim(int(d), in_ndim()) for d in dims)),
                          "keepdim": bool(args.get("keepdim", False))}, reads
    if name in _LOSS:
        attrs = {"op": _LOSS[name], "reduction": _REDUCTION.get(args.get("reduction", 1), str(args.get("reduction")))}
        if name in ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"):
            attrs["class_dim"] = 1 if in_ndim() >= 2 else 0
            attrs["ignore_index"] = args.get("ignore_index")
        if name == "cross_entropy_loss":
            attrs["label_smoothing"] = args.get("label_smoothing")
        return "loss", attrs, reads
    return unknown


def _permutation(name: str, args: dict, ndim: int) -> tuple[int, ...] | None:
    dims = list(range(ndim))
    if name == "permute":
        return tuple(norm_dim(int(d), ndim) for d in args["dims"])
    if name in ("transpose", "swapaxes", "swapdims"):
        keys = [k for k in args if k not in ("self",)]
        a, c = (norm_dim(int(args[k]), ndim) for k in keys[:2])
        dims[a], dims[c] = dims[c], dims[a]
        return tuple(dims)
    if name in ("t", "numpy_T"):
        return tuple(reversed(dims))
    if name == "movedim":
        src, dst = args["source"], args["destination"]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [norm_dim(int(s), ndim) for s in src], [norm_dim(int(d), ndim) for d in dst]
        rest = iter(d for d in dims if d not in src)
        placed = dict(zip(dst, src, strict=True))
        return tuple(placed[i] if i in placed else next(rest) for i in range(ndim))
    return None


def _slice(name: str, args: dict, val: Any, reads: list, target: str) -> tuple[str, dict, list]:
    """The piece slice / narrow / select keep. select drops the dim: it is marked ``squeeze`` here and becomes
    a size-1 slice node ``<name>.slice`` followed by the view ``<name>`` (see `Builder._op`), so that every
    slice node keeps its input's rank."""
    src = args["self"]
    shape = fx_shape(src)
    dim = norm_dim(int(args.get("dim", 0)), len(shape))
    size = shape[dim]
    if name == "slice":
        if int(args.get("step", 1) or 1) != 1:
            return "unknown", {"target": target}, reads
        start = args.get("start")
        stop = args.get("end")
        start = 0 if start is None else int(start)
        stop = size if stop is None else int(stop)
        start = min(max(start + size if start < 0 else start, 0), size)
        stop = min(max(stop + size if stop < 0 else stop, start), size)
    elif name == "narrow":
        start = norm_dim(int(args["start"]), size)
        stop = start + int(args["length"])
    else:
        start = norm_dim(int(args["index"]), size)
        stop = start + 1
        return "slice", {"dim": dim, "start": start, "stop": stop, "squeeze": True}, reads
    return "slice", {"dim": dim, "start": start, "stop": stop}, reads


def _pool(name: str, args: dict, reads: list) -> tuple[str, dict, list]:
    op = _POOL[name]
    if op.startswith("adaptive"):
        out = pair(args["output_size"])
        h, w = fx_shape(args["self"])[-2:]
        attrs = {"op": op, "output_size": out, "kernel": (-(-h // out[0]), -(-w // out[1]))}
    else:
        kernel = pair(args["kernel_size"])
        stride = args.get("stride") or kernel
        attrs = {"op": op, "kernel": kernel, "stride": pair(stride), "padding": pair(args.get("padding", 0)),
                 "ceil_mode": bool(args.get("ceil_mode", False))}
        if op == "max":
            attrs["dilation"] = pair(args.get("dilation", 1))
    return "pool", attrs, reads


def flop_of(op: OpNode) -> float:
    """Forward FLOPs of the whole op. Matrix products count 2 per multiply-add; a bias counts as one more
    input column of ones (2·M·N·(K+1)), so that a layer's FLOPs are 2 per parameter per row, the convention
    behind 6·N·tokens. Attention counts its two products, 2·Sq·Sk·(D + Dv) per batch and head, halved when causal
    (the masked half is skipped by the kernels). Views, permutes, slices, concatenations, embeddings (a gather),
    constants and unknown ops count 0."""
    out = op.output.numel
    bias = any(p.role == "bias" for p in op.params)
    if op.kind == "linear":
        k = next(p.tensor.shape[1] for p in op.params if p.role == "weight")
        return 2 * out * (k + bias)
    if op.kind == "matmul":
        return 2 * out * (op.attrs["k"] + bias)
    if op.kind == "conv2d":
        weight = next(p.tensor for p in op.params if p.role == "weight")
        return 2 * out * (math.prod(weight.shape[1:]) + bias)
    if op.kind == "sdpa" and len(op.input_tensors) >= 3:
        q, k, v = op.input_tensors[:3]
        rows = math.prod(q.shape[:-1])
        flop = 2 * rows * k.shape[-2] * (q.shape[-1] + v.shape[-1])
        return flop / 2 if op.attrs.get("causal") else flop
    if op.kind == "pool":
        if op.attrs["op"].startswith("adaptive"):
            return op.input_tensors[0].numel if op.input_tensors else 0
        return out * math.prod(op.attrs["kernel"])
    if op.kind in FLOP_PER_INPUT_ELEMENT:
        return FLOP_PER_INPUT_ELEMENT[op.kind] * (op.input_tensors[0].numel if op.input_tensors else out)
    if op.kind == "elementwise" and op.attrs.get("op") == "constant":
        return 0
    return FLOP_PER_ELEMENT.get(op.kind, 0) * out
