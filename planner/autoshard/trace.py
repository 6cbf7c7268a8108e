"""Trace a PyTorch module into the operator graph the auto-parallel planner reads (`planner.autoshard.ops`).

The module runs once through ``torch.export.export(..., strict=False)`` on fake tensors: no weight is loaded and
no memory is used, so GPT-3-sized models trace on a laptop. The export's training IR is the level the sharding
strategies want: it keeps ``aten.linear``, ``aten.scaled_dot_product_attention``, ``aten.layer_norm``,
``aten.conv2d`` and ``aten.batch_norm`` as single ops, where the core ATen IR would split each into a dozen.

torch is imported inside the functions only: the planner core, this module included, imports without torch.

What the graph keeps and drops, and why:

- Parameters are not nodes: an op lists the ones it reads in ``params``, so the strategies place a weight with
  the op that uses it (a parameter read by two ops, e.g. tied embeddings, is listed by both).
- Buffers and lifted constants (batch norm's running statistics, a registered mask) are not nodes either: they
  carry no gradient and are placed with their reader; an op lists those it reads in ``attrs["buffers"]``.
- Ops whose output no returned value depends on are dropped: the in-place updates of running statistics
  (``add_`` / ``copy_`` of buffers), shape assertions, unused pieces of a split.
- Tensors made from nothing (``arange``, ``zeros``, ``full``, ...) and ops that read only buffers and literals
  are ``elementwise`` nodes with no inputs and ``attrs["op"] == "constant"`` (``attrs["from"]`` names the op):
  they cost nothing and are free to take any placement, and their consumers keep an edge to them.
- Anything the vocabulary does not know becomes ``unknown`` (``attrs["target"]``) and is listed in
  ``G.graph["unknown_ops"]``; an unknown op never fails the trace.
"""

from __future__ import annotations

import copy
import logging
import math
import operator
import re
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from planner.autoshard.ops import DTYPE_BYTES, OpNode, ParamUse, Tensor
from planner.errors import SpecError, escape_hidden, short_repr, unknown_name_message

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
_PIECES = frozenset({"split", "split_with_sizes", "chunk", "unbind", "tensor_split", "unsafe_split",
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
#: Higher-order ops that only change a mode around a subgraph (export wraps `torch.no_grad()` and autocast
#: regions in them): their subgraph is traced in place, as if the wrapper were not there.
_INLINED = frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast"})
#: aten's loss reduction codes.
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


@dataclass(frozen=True)
class InputSpec:
    """An example input given by shape and dtype instead of a tensor (nothing is allocated for it).

    ``high`` is the exclusive upper bound of an integer input's values (token ids below the vocabulary size,
    class labels below the class count): the trace ignores it, the runners that make real data need it.
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    high: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.shape, (tuple, list)) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in self.shape):
            raise SpecError(f"input shape: expected a tuple of positive integers, got {short_repr(self.shape)}")
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.dtype not in DTYPE_BYTES:
            raise SpecError(unknown_name_message("input dtype", str(self.dtype), sorted(DTYPE_BYTES)))
        if self.high is not None:
            if isinstance(self.high, bool) or not isinstance(self.high, int) or self.high < 1:
                raise SpecError(f"input high: expected a positive integer, got {short_repr(self.high)}")
            if self.dtype.startswith(("float", "bfloat")):
                raise SpecError(f"input high: only integer inputs take an upper bound (dtype {self.dtype})")


# -- values the walk keeps per traced node --------------------------------------------------------------------


@dataclass(frozen=True)
class _Param:
    fqn: str


@dataclass(frozen=True)
class _Buffer:
    fqn: str


@dataclass
class _Deferred:
    """An op with several outputs: its nodes are made when `getitem` picks an output (pieces of a split become
    slices; other ops one node per used output)."""

    fx: Any  # the torch.fx node
    names: dict[int, str] = field(default_factory=dict)  # output index -> graph node name


# -- entry points ---------------------------------------------------------------------------------------------


def trace(module: Any, example_inputs: Any, example_kwargs: dict[str, Any] | None = None) -> nx.DiGraph:
    """The operator graph of `module`'s forward on `example_inputs` (tensors or `InputSpec`s, positional) and
    `example_kwargs` (by keyword: a Hugging Face model takes ``input_ids=``, ``labels=``).

    `module` is an ``nn.Module`` or a zero-argument callable returning one; a callable is built under
    ``torch.device("meta")``, so no weight is allocated. The module is traced in the mode it is in (a new module
    trains: dropout and batch statistics as in training). Graph attributes: ``inputs`` (input node names in
    order: positional, then keyword), ``outputs`` (the node names the module returns), ``params`` ({fqn:
    Tensor}), ``buffers`` ({fqn: Tensor}), ``module_types`` ({module path: class name}), ``order`` (every node
    in traced topological order), ``unknown_ops`` (sorted distinct targets of the ``unknown`` nodes).

    Raises SpecError, one line, when the module cannot be built or traced (data-dependent control flow, an op
    export refuses) or the inputs do not fit it (their shapes, or a dtype name that does not exist).
    """
    import torch

    args = _as_inputs(example_inputs)
    kwargs = dict(example_kwargs or {})
    for key, value in kwargs.items():
        _check_input(value, f"example_kwargs[{key!r}]")
    module, fake_mode, device = _fake_module(module)
    with fake_mode:
        fargs = tuple(_fake_input(a, device) for a in args)
        fkwargs = {k: _fake_input(v, device) for k, v in kwargs.items()}
    shapes = ", ".join(str(tuple(_shape_of(a))) for a in (*args, *kwargs.values()))
    with _quiet():
        try:
            with fake_mode, torch.no_grad():
                module(*fargs, **fkwargs)
        except Exception as exc:  # the forward itself failed: a value-dependent branch, or inputs it rejects
            if _data_dependent(exc):
                raise SpecError(f"module: cannot be traced: its forward branches on tensor values "
                                f"({_where(exc)}); make the branch depend on shapes only") from None
            raise SpecError(f"input_shape: {shapes} does not fit the module: {_first_line(exc)}") from None
        try:
            exported = torch.export.export(module, fargs, kwargs=fkwargs or None, strict=False)
        except Exception as exc:  # the forward runs but export refuses it
            if _data_dependent(exc):
                raise SpecError(f"module: cannot be traced: its forward branches on tensor values "
                                f"({_where(exc)}); make the branch depend on shapes only") from None
            raise SpecError(f"module: torch.export cannot trace it: {_first_line(exc)}") from None
    return _Builder(exported, list(kwargs), shapes, _aliases(module)).build()


def _aliases(module: Any) -> dict[str, str]:
    """Each parameter's and buffer's name -> the name `named_parameters()` lists it under: export gives a tied
    tensor one placeholder per name (the head's and the embedding's), the graph names it once."""
    out: dict[str, str] = {}
    for named in (module.named_parameters, module.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            out[name] = first.setdefault(id(tensor), name)
    return out


def module_prefixes(path: str) -> Iterator[str]:
    """Every module path that contains `path`'s module, outermost first (``"a.b.c"`` -> a, a.b, a.b.c); the
    root ("") contains every module and is not listed."""
    parts = path.split(".") if path else []
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def in_module(op: OpNode, path: str) -> bool:
    """Whether `op` ran inside the module at `path` (a submodule counts; "" is the root and holds every op)."""
    return not path or op.module == path or op.module.startswith(path + ".")


def repeated_blocks(G: nx.DiGraph) -> list[list[list[str]]]:
    """Groups of structurally identical module instances, e.g. a GPT's 24 ``blocks.N``, so the solver can solve
    one instance and reuse its choice for every other.

    Candidates are the children named ``<parent>.<int>`` (a ModuleList or Sequential) of one parent with the same
    class; the outermost such unit is kept (``blocks.N``, not ``blocks.N.mlp``). Instances of a candidate are
    compared exactly: node by node in topological order, the same kind, target, shapes, dtypes, attributes,
    parameter shapes and roles (not names), the module path inside the instance, and the same wiring (which
    argument of which earlier node of the instance, or which outside producer, each input is). Instances are
    split into classes of equal structure and each class of two or more is a group: a block that differs is left
    out, and ResNet's stages (widths differ per stage) give one group per stage. Each group is a list of
    instances, each the instance's node names in topological order, aligned position by position.
    """
    order = G.graph["order"]
    types = G.graph.get("module_types", {})
    members: dict[str, list[str]] = {}
    for name in order:
        for prefix in module_prefixes(G.nodes[name]["op"].module):
            if prefix.rsplit(".", 1)[-1].isdigit():
                members.setdefault(prefix, []).append(name)
    candidates: dict[tuple[str, str], list[str]] = {}
    for path in members:
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        candidates.setdefault((parent, types.get(path, "")), []).append(path)
    claimed: set[str] = set()
    groups: list[tuple[int, list[list[str]]]] = []
    for (_parent, _type), paths in sorted(candidates.items(), key=lambda kv: kv[0][0].count(".") + bool(kv[0][0])):
        paths = [p for p in paths if not claimed.intersection(members[p])]
        classes: dict[tuple, list[str]] = {}
        for path in paths:
            classes.setdefault(_signature(G, path, members[path]), []).append(path)
        for same in classes.values():
            if len(same) >= 2:
                groups.append((order.index(members[same[0]][0]), [members[p] for p in same]))
                claimed.update(n for p in same for n in members[p])
    return [instances for _, instances in sorted(groups, key=lambda g: g[0])]


def _signature(G: nx.DiGraph, path: str, nodes: list[str]) -> tuple:
    """Everything two instances must share to be the same computation, with names replaced by positions."""
    index = {n: i for i, n in enumerate(nodes)}
    outside: dict[str, int] = {}
    buffers = G.graph.get("buffers", {})
    out = []
    for name in nodes:
        op: OpNode = G.nodes[name]["op"]
        wiring = tuple((("in", index[p]) if p in index else ("out", outside.setdefault(p, len(outside))),
                        tuple(G.edges[p, name]["args"])) for p in dict.fromkeys(op.inputs))
        attrs = {k: v for k, v in op.attrs.items() if k != "buffers"}
        attrs["buffers"] = tuple((pos, buffers.get(fqn)) for pos, fqn in sorted(op.attrs.get("buffers", {}).items()))
        params = tuple((p.tensor, p.role, p.arg) for p in op.params)
        out.append((op.kind, op.target, op.output, op.input_tensors, params, repr(sorted(attrs.items())),
                    op.module[len(path):], op.module_type, wiring, op.flop))
    return tuple(out)


# -- preparing the module and the inputs ----------------------------------------------------------------------


def _as_inputs(example_inputs: Any) -> tuple:
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    for i, value in enumerate(example_inputs):
        _check_input(value, f"example_inputs[{i}]")
    return tuple(example_inputs)


def _check_input(value: Any, where: str) -> None:
    import torch

    if isinstance(value, InputSpec):
        return
    if not isinstance(value, torch.Tensor):
        raise SpecError(f"{where}: expected a tensor or an InputSpec, got {type(value).__name__}")
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise SpecError(unknown_name_message("input dtype", dtype, sorted(DTYPE_BYTES)))


def _shape_of(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in value.shape)


def _fake_input(value: Any, device: Any) -> Any:
    """A fake tensor of `value`'s shape and dtype (call inside the fake mode)."""
    import torch

    dtype = getattr(torch, value.dtype) if isinstance(value, InputSpec) else value.dtype
    return torch.empty(_shape_of(value), dtype=dtype, device=device)


def _fake_module(module: Any) -> tuple[Any, Any, Any]:
    """The module to export, the fake mode to run it in and the device of its inputs.

    A module on the meta device gets fake CPU tensors in place of its parameters and buffers (a copy, when the
    caller owns it): code such as ``torch.autocast(device_type=x.device.type)`` refuses the meta device, and fake
    tensors behave as real ones of their device while holding no data. Tied parameters stay tied. A module with
    real weights is exported as it is (export fakes its tensors itself) with inputs on its device.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not isinstance(module, torch.nn.Module):
        if not callable(module):
            raise SpecError(f"module: expected an nn.Module or a callable returning one, got "
                            f"{type(module).__name__}")
        try:
            with torch.device("meta"):
                built = module()
        except Exception as exc:  # the factory's own failure, reported as the user's input
            raise SpecError(f"module: building it on the meta device failed: {_first_line(exc)}") from None
        if not isinstance(built, torch.nn.Module):
            raise SpecError(f"module: the callable returned {type(built).__name__}, not an nn.Module")
        module, owned = built, True
    else:
        owned = False
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tensors = [*module.parameters(), *module.buffers()]
    if not any(t.is_meta for t in tensors):
        return module, fake_mode, (tensors[0].device if tensors else torch.device("cpu"))
    if not owned:
        module = copy.deepcopy(module)
    memo: dict[int, Any] = {}
    with fake_mode:
        for sub in module.modules():
            for key, param in sub._parameters.items():
                if param is not None:
                    if id(param) not in memo:
                        memo[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                             requires_grad=param.requires_grad)
                    sub._parameters[key] = memo[id(param)]
            for key, buf in sub._buffers.items():
                if buf is not None:
                    if id(buf) not in memo:
                        memo[id(buf)] = torch.empty(buf.shape, dtype=buf.dtype)
                    sub._buffers[key] = memo[id(buf)]
    return module, fake_mode, torch.device("cpu")


class _quiet:
    """Silences torch's loggers and warnings while tracing: library code prints nothing, and what export logs
    on a failure is already in the SpecError."""

    def __enter__(self) -> None:
        self._levels = {}
        for name in [n for n in logging.root.manager.loggerDict if n == "torch" or n.startswith("torch.")]:
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            logger.setLevel(logging.CRITICAL)
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc: object) -> None:
        self._warnings.__exit__(*exc)
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)


def _data_dependent(exc: BaseException) -> bool:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kinds):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return escape_hidden(text[:300])


def _where(exc: BaseException) -> str:
    """The module's own source line that raised (the innermost frame outside torch), or the exception's line."""
    import torch

    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(torch_dir) and f.filename != __file__]
    if not frames:
        return _first_line(exc)
    last = frames[-1]
    return escape_hidden(f"{Path(last.filename).name}:{last.lineno}: {(last.line or '').strip()}"[:300])


# -- building the graph ---------------------------------------------------------------------------------------


def _tensor(val: Any) -> Tensor:
    return Tensor(tuple(int(d) for d in val.shape), str(val.dtype).removeprefix("torch."))


def _is_tensor(val: Any) -> bool:
    import torch

    return isinstance(val, torch.Tensor)


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (list, tuple)):
        return (int(value[0]), int(value[-1])) if value else (0, 0)
    return int(value), int(value)


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _short_type(value: Any) -> str:
    return (value.__name__ if isinstance(value, type) else str(value)).rsplit(".", 1)[-1]


class _Builder:
    """One pass over the exported program in its order, making graph nodes as it goes."""

    def __init__(self, exported: Any, keywords: list[str], shapes: str, aliases: dict[str, str]) -> None:
        self.ep = exported
        self.shapes = shapes
        self.aliases = aliases
        self.keywords = keywords
        self.G = nx.DiGraph()
        self.order: list[str] = []
        self.used = {n.name for n in exported.graph.nodes}
        self.module_types: dict[str, str] = {}
        self.prefixes: list[str] = []  # the inlined higher-order ops being walked, innermost last

    def build(self) -> nx.DiGraph:
        from torch.export.graph_signature import InputKind, OutputKind

        sig = self.ep.graph_signature
        specs = {s.arg.name: s for s in sig.input_specs}
        env: dict[Any, Any] = {}
        params: dict[str, Tensor] = {}
        buffers: dict[str, Tensor] = {}
        inputs: list[str] = []
        placeholders = [n for n in self.ep.graph.nodes if n.op == "placeholder"]
        for node in placeholders:
            spec = specs[node.name]
            val = node.meta.get("val")
            if spec.kind == InputKind.PARAMETER:
                fqn = self.aliases.get(spec.target, spec.target)
                env[node] = _Param(fqn)
                params[fqn] = _tensor(val)
            elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                fqn = self.aliases.get(spec.target, spec.target)
                env[node] = _Buffer(fqn)
                buffers[fqn] = _tensor(val)
            elif spec.kind == InputKind.USER_INPUT and _is_tensor(val):
                index = len(inputs)
                attrs = {"index": index}
                positional = sum(1 for s in sig.input_specs if s.kind == InputKind.USER_INPUT) - len(self.keywords)
                if index >= positional:
                    attrs["keyword"] = self.keywords[index - positional]
                self._add(OpNode(node.name, "input", "input", (), (), _tensor(val), attrs=attrs), [])
                env[node] = node.name
                inputs.append(node.name)
            else:
                env[node] = None
        self.params, self.buffers = params, buffers
        self._walk(self.ep.graph_module, env, ("", ""))
        output = next(n for n in self.ep.graph.nodes if n.op == "output")
        outputs = []
        for spec, value in zip(sig.output_specs, output.args[0], strict=True):
            if spec.kind == OutputKind.USER_OUTPUT and hasattr(value, "op") and isinstance(env.get(value), str):
                outputs.append(env[value])
        outputs = list(dict.fromkeys(outputs))
        keep = set(inputs).union(outputs)
        for name in outputs:
            keep |= nx.ancestors(self.G, name)
        self.G.remove_nodes_from([n for n in list(self.G) if n not in keep])
        G = self.G
        G.graph.update(inputs=inputs, outputs=outputs, params=params, buffers=buffers,
                       module_types=dict(sorted(self.module_types.items())),
                       order=[n for n in self.order if n in keep])
        G.graph["unknown_ops"] = sorted({G.nodes[n]["op"].attrs["target"] for n in G
                                         if G.nodes[n]["op"].kind == "unknown"})
        return G

    # -- the walk -------------------------------------------------------------------------------------------

    def _walk(self, gm: Any, env: dict, outer_module: tuple[str, str]) -> Any:
        """Trace `gm`'s call_function nodes into the graph; returns the values its output returns."""
        import torch

        result = None
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                env.setdefault(node, None)
                continue
            if node.op == "output":
                result = self._value(node.args[0], env)
                continue
            module = self._module(node, outer_module)
            if node.target is operator.getitem:
                env[node] = self._getitem(node, env, module)
            elif isinstance(node.target, torch._ops.HigherOrderOperator):
                env[node] = self._higher_order(gm, node, env, module)
            elif isinstance(node.target, torch._ops.OpOverload):
                env[node] = self._op(node, env, module)
            else:
                val = node.meta.get("val")
                env[node] = (self._make(node.name, node, str(node.target), "unknown", val, self._reads(
                    list(enumerate(node.args)), env), {"target": str(node.target)}, module)
                    if _is_tensor(val) else None)
        return result

    def _value(self, arg: Any, env: dict) -> Any:
        if isinstance(arg, (list, tuple)):
            return tuple(self._value(a, env) for a in arg)
        return env.get(arg) if hasattr(arg, "op") else None

    def _module(self, node: Any, outer: tuple[str, str]) -> tuple[str, str]:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return outer
        for path, kind in stack.values():
            path = re.sub(r"@\d+", "", str(path))
            self.module_types.setdefault(path, _short_type(kind))
        path, kind = list(stack.values())[-1]
        return re.sub(r"@\d+", "", str(path)), _short_type(kind)

    def _higher_order(self, gm: Any, node: Any, env: dict, module: tuple[str, str]) -> Any:
        name = getattr(node.target, "__name__", str(node.target))
        subs = [i for i, a in enumerate(node.args) if hasattr(a, "op") and a.op == "get_attr"]
        if name in _INLINED and subs:
            sub = getattr(gm, node.args[subs[0]].target)
            inner_env: dict = {}
            operands = node.args[subs[0] + 1:]
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            for ph, arg in zip(placeholders, operands, strict=False):
                inner_env[ph] = env.get(arg) if hasattr(arg, "op") else None
            self.prefixes.append(node.name)
            try:
                return self._walk(sub, inner_env, module)
            finally:
                self.prefixes.pop()
        val = node.meta.get("val")
        reads = self._reads([(i, a) for i, a in enumerate(node.args) if i not in subs], env)
        if isinstance(val, (list, tuple)):
            return _Deferred(node)
        return self._make(node.name, node, name, "unknown", val, reads, {"target": name}, module)

    def _getitem(self, node: Any, env: dict, module: tuple[str, str]) -> Any:
        source, index = env.get(node.args[0]), node.args[1]
        if isinstance(source, tuple):
            return source[index] if isinstance(index, int) and -len(source) <= index < len(source) else None
        if not isinstance(source, _Deferred):
            return None
        if index in source.names:
            return source.names[index]
        op = source.fx
        used = [u for u in op.users if u.target is operator.getitem and len(u.users) > 0]
        name = op.name if len(used) == 1 and used[0] is node and index == 0 else node.name
        target = str(op.target)
        val = op.meta["val"][index]
        if not _is_tensor(val):
            return None
        packet = _packet(op.target)
        if packet in _PIECES:
            made = self._piece(name, node, op, index, env, module)
        elif packet == "broadcast_tensors":  # output i is input i broadcast to the common shape
            reads = self._reads([(0, op.args[0][index])], env)
            made = self._make(name, op, target, "elementwise", val, reads, {"op": "expand"}, module)
        elif index == 0 and isinstance(op.target, _op_overload_type()):
            made = self._op(op, env, module, name=name, val=val)
        else:
            reads = self._reads(list(enumerate(op.args)), env)
            made = self._make(name, op, target, "unknown", val, reads, {"target": target, "output": index}, module)
        source.names[index] = made
        return made

    def _piece(self, name: str, node: Any, op: Any, index: int, env: dict, module: tuple[str, str]) -> str:
        """Piece `index` of a split / chunk / unbind: a slice of the source along the split dim (and, for unbind,
        a view dropping that dim)."""
        bound = _bind(op)
        src = op.args[0]
        ndim = len(src.meta["val"].shape)
        dim = _dim(int(dict(bound).get("dim", 0) or 0), ndim)
        vals = op.meta["val"]
        squeeze = _packet(op.target) == "unbind"
        sizes = [1 if squeeze else int(v.shape[dim]) for v in vals]
        start = sum(sizes[:index])
        target = str(op.target)
        reads = self._reads([(0, src)], env)
        attrs = {"dim": dim, "start": start, "stop": start + sizes[index]}
        if not squeeze:
            return self._make(name, node, target, "slice", vals[index], reads, attrs, module)
        shape = list(src.meta["val"].shape)
        shape[dim] = 1
        piece = self._make(f"{name}.slice", node, target, "slice", Tensor(tuple(int(d) for d in shape),
                           _tensor(vals[index]).dtype), reads, attrs, module)
        return self._make(name, node, target, "view", vals[index], [(0, piece)], {"op": "squeeze"}, module)

    def _reads(self, args: list[tuple[int, Any]], env: dict) -> list[tuple[int, Any]]:
        """(argument position, value) of every tensor an op reads: graph node names, _Param or _Buffer."""
        out = []
        for pos, arg in args:
            for item in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                if hasattr(item, "op"):
                    value = env.get(item)
                    if isinstance(value, (str, _Param, _Buffer)):
                        out.append((pos, value))
        return out

    def _op(self, node: Any, env: dict, module: tuple[str, str], name: str | None = None, val: Any = None) -> Any:
        val = node.meta.get("val") if val is None else val
        if isinstance(val, (list, tuple)):
            return _Deferred(node) if any(_is_tensor(v) for v in val) else None
        if not _is_tensor(val):
            return None  # assertions, symbolic sizes, ops returning nothing
        bound = _bind(node)
        reads = self._reads([(i, v) for i, (_, v) in enumerate(bound)], env)
        kind, attrs, reads = _classify(node, bound, val, reads, self)
        name = name or node.name
        if kind == "slice" and attrs.pop("squeeze", False):  # select: a size-1 slice, then a view dropping it
            shape = list(_shape(node.args[0]))
            shape[attrs["dim"]] = 1
            piece = self._make(f"{name}.slice", node, str(node.target), "slice",
                               Tensor(tuple(shape), _tensor(val).dtype), reads, attrs, module)
            return self._make(name, node, str(node.target), "view", val, [(0, piece)], {"op": "squeeze"}, module)
        return self._make(name, node, str(node.target), kind, val, reads, attrs, module)

    def _make(self, name: str, node: Any, target: str, kind: str, val: Any, reads: list[tuple[int, Any]],
              attrs: dict, module: tuple[str, str]) -> str:
        """Add one node; its inputs, parameters and buffers come from `reads`."""
        if self.prefixes and (name in self.used or name in self.G):
            name = f"{self.prefixes[-1]}.{name}"  # a subgraph's node named like one outside it
        self.used.add(name)
        output = val if isinstance(val, Tensor) else _tensor(val)
        acts = [(pos, v) for pos, v in reads if isinstance(v, str)]
        params = [(pos, v) for pos, v in reads if isinstance(v, _Param)]
        bufs = {pos: v.fqn for pos, v in reads if isinstance(v, _Buffer)}
        if not acts and not params and kind != "input" and attrs.get("op") != "constant":
            kind, attrs = "elementwise", {"op": "constant", "from": attrs.get("op", attrs.get("target", target))}
        if bufs:
            attrs["buffers"] = bufs
        schema_names = _arg_names(node.target) if node is not None else []
        uses = tuple(attrs.pop("_params", None) or (
            ParamUse(p.fqn, self.params[p.fqn], _role(p.fqn, schema_names, pos), pos) for pos, p in params))
        op = OpNode(name=name, kind=kind, target=target, inputs=tuple(v for _, v in acts),
                    input_tensors=tuple(self.G.nodes[v]["op"].output for _, v in acts), output=output,
                    params=uses, module=module[0], module_type=module[1], attrs=attrs)
        flop = _flop(op)
        op = OpNode(**{**op.__dict__, "flop": float(flop)})
        self._add(op, acts)
        return name

    def module_of(self, node: Any) -> str:
        stack = node.meta.get("nn_module_stack")
        return re.sub(r"@\d+", "", str(list(stack.values())[-1][0])) if stack else ""

    def check_positions(self, reads: list[tuple[int, Any]], rows: int, module: str) -> None:
        """An embedding looked up by `arange` (positions) must have a row for each: fake tensors hold no values,
        so a sequence longer than a learned position table would trace silently and fail on a real run."""
        name = next((v for pos, v in reads if pos == 1 and isinstance(v, str)), None)
        while name is not None:
            op = self.G.nodes[name]["op"]
            if "range" in op.attrs:
                start, stop = op.attrs["range"]
                if start < 0 or stop > rows:
                    raise SpecError(f"input_shape: {self.shapes} does not fit the module: positions {start}.."
                                    f"{stop - 1} index the embedding {module or '(root)'} of {rows} rows")
                return
            name = op.inputs[0] if op.kind == "view" and op.inputs else None

    def _add(self, op: OpNode, acts: list[tuple[int, str]]) -> None:
        self.G.add_node(op.name, op=op)
        self.order.append(op.name)
        for pos, producer in acts:
            if self.G.has_edge(producer, op.name):
                self.G.edges[producer, op.name]["args"].append(pos)
            else:
                self.G.add_edge(producer, op.name, args=[pos])


def _op_overload_type() -> type:
    import torch

    return torch._ops.OpOverload


def _packet(target: Any) -> str:
    schema = getattr(target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else getattr(target, "__name__", str(target))


def _arg_names(target: Any) -> list[str]:
    schema = getattr(target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def _bind(node: Any) -> list[tuple[str, Any]]:
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


def _role(fqn: str, names: list[str], pos: int) -> str:
    arg = names[pos] if pos < len(names) else ""
    return "bias" if arg == "bias" or (arg != "weight" and fqn.rsplit(".", 1)[-1].startswith("bias")) else "weight"


def _shape(arg: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in arg.meta["val"].shape)


def _classify(node: Any, bound: list[tuple[str, Any]], val: Any, reads: list[tuple[int, Any]],
              b: _Builder) -> tuple[str, dict, list[tuple[int, Any]]]:
    """The kind and attributes of one aten op (see `planner.autoshard.ops`), and the reads it keeps."""
    name = _packet(node.target)
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
        if kinds.get(1) is not _Param or kinds.get(2, _Param) is not _Param or kinds.get(0) is not str:
            return unknown
        return "linear", {}, reads
    if name in _MATMUL:
        return "matmul", {"op": name}, reads
    if name == "addmm":
        if kinds.get(0, _Param) is not _Param or 0 not in kinds:
            return unknown
        uses = [ParamUse(v.fqn, b.params[v.fqn], "weight", pos - 1) for pos, v in reads
                if isinstance(v, _Param) and pos in (1, 2)]
        bias = next(v for pos, v in reads if pos == 0)
        uses.append(ParamUse(bias.fqn, b.params[bias.fqn], "bias", 2))
        return "matmul", {"op": "addmm", "_params": uses}, reads
    if name == "embedding":
        if kinds.get(0) is not _Param:
            return unknown
        b.check_positions(reads, _shape(args["weight"])[0], b.module_of(node))
        return "embedding", {"padding_idx": int(args.get("padding_idx", -1))}, reads
    if name == "layer_norm":
        return "layer_norm", {"normalized_ndim": len(args["normalized_shape"]), "eps": args.get("eps")}, reads
    if name == "rms_norm":
        return "rms_norm", {"normalized_ndim": len(args["normalized_shape"]), "eps": args.get("eps")}, reads
    if name in _SOFTMAX:
        return "softmax", {"op": _SOFTMAX[name], "dim": _dim(int(args["dim"]), ndim)}, reads
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
        return "cat", {"dim": _dim(int(args.get("dim", 0)), ndim)}, reads
    if name in ("conv2d", "convolution"):
        weight = args.get("weight")
        if (kinds.get(1) is not _Param or ndim != 4 or len(_shape(weight)) != 4 or args.get("transposed")
                or kinds.get(2, _Param) is not _Param):
            return unknown
        kh, kw = _shape(weight)[2:]
        dilation = _pair(args.get("dilation", 1))
        padding = args.get("padding", 0)
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            padding = (dilation[0] * (kh - 1) // 2, dilation[1] * (kw - 1) // 2)
        return "conv2d", {"stride": _pair(args.get("stride", 1)), "padding": _pair(padding), "dilation": dilation,
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
        return "reduce", {"op": _REDUCE[name], "dims": tuple(sorted(_dim(int(d), in_ndim()) for d in dims)),
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
        return tuple(_dim(int(d), ndim) for d in args["dims"])
    if name in ("transpose", "swapaxes", "swapdims"):
        keys = [k for k in args if k not in ("self",)]
        a, c = (_dim(int(args[k]), ndim) for k in keys[:2])
        dims[a], dims[c] = dims[c], dims[a]
        return tuple(dims)
    if name in ("t", "numpy_T"):
        return tuple(reversed(dims))
    if name == "movedim":
        src, dst = args["source"], args["destination"]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [_dim(int(s), ndim) for s in src], [_dim(int(d), ndim) for d in dst]
        rest = iter(d for d in dims if d not in src)
        placed = dict(zip(dst, src, strict=True))
        return tuple(placed[i] if i in placed else next(rest) for i in range(ndim))
    return None


def _slice(name: str, args: dict, val: Any, reads: list, target: str) -> tuple[str, dict, list]:
    """The piece slice / narrow / select keep. select drops the dim: it is marked ``squeeze`` here and becomes
    a size-1 slice node ``<name>.slice`` followed by the view ``<name>`` (see `_Builder._op`), so that every
    slice node keeps its input's rank."""
    src = args["self"]
    shape = _shape(src)
    dim = _dim(int(args.get("dim", 0)), len(shape))
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
        start = _dim(int(args["start"]), size)
        stop = start + int(args["length"])
    else:
        start = _dim(int(args["index"]), size)
        stop = start + 1
        return "slice", {"dim": dim, "start": start, "stop": stop, "squeeze": True}, reads
    return "slice", {"dim": dim, "start": start, "stop": stop}, reads


def _pool(name: str, args: dict, reads: list) -> tuple[str, dict, list]:
    op = _POOL[name]
    if op.startswith("adaptive"):
        out = _pair(args["output_size"])
        h, w = _shape(args["self"])[-2:]
        attrs = {"op": op, "output_size": out, "kernel": (-(-h // out[0]), -(-w // out[1]))}
    else:
        kernel = _pair(args["kernel_size"])
        stride = args.get("stride") or kernel
        attrs = {"op": op, "kernel": kernel, "stride": _pair(stride), "padding": _pair(args.get("padding", 0)),
                 "ceil_mode": bool(args.get("ceil_mode", False))}
        if op == "max":
            attrs["dilation"] = _pair(args.get("dilation", 1))
    return "pool", attrs, reads


def _flop(op: OpNode) -> float:
    """Forward FLOPs of the whole op. Matrix products count 2 per multiply-add; a bias counts as one more
    input column of ones (2·M·N·(K+1)), so that a layer's FLOPs are 2 per parameter per row, the convention
    behind 6·N·tokens."""
    out = op.output.numel
    bias = any(p.role == "bias" for p in op.params)
    if op.kind == "linear":
        k = next(p.tensor.shape[1] for p in op.params if p.role == "weight")
        return 2 * out * (k + bias)
    if op.kind == "matmul":
        first = next((p.tensor for p in op.params if p.arg == 0 and p.role == "weight"), None)
        a = first if first is not None else op.input_tensors[0]
        return 2 * out * (a.shape[-1] + bias)
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


__all__ = ["FLOP_PER_ELEMENT", "FLOP_PER_INPUT_ELEMENT", "InputSpec", "in_module", "module_prefixes",
           "repeated_blocks", "trace"]
