"""Trace a PyTorch module into the operator graph the auto-parallel planner reads (`planner.autoshard.ops`).

The module's forward runs on fake tensors, so no weight is loaded and no memory is used (a GPT-3-sized model
traces on a laptop): once by itself, so that a failure can be told apart as the inputs' (shapes that do not fit)
or the module's (a branch on tensor values), then through ``torch.export.export(..., strict=False)``. The
export's training IR is the level the sharding strategies want: it keeps ``aten.linear``,
``aten.scaled_dot_product_attention``, ``aten.layer_norm``, ``aten.conv2d`` and ``aten.batch_norm`` as single
ops, where the core ATen IR would split each into a dozen.

A Hugging Face model takes its inputs by keyword: pass them as ``example_kwargs`` (``input_ids=``, ``labels=``),
or wrap the model in a module whose forward returns ``model(input_ids=..., labels=...).loss``. Build it from its
config (``AutoModelForCausalLM.from_config``), never with remote code.

This module holds the entry points, the inputs and the errors; `planner.autoshard.export_graph` walks the
exported program and `planner.autoshard.aten_ops` maps each op to its kind and FLOPs. torch is imported inside
functions only: the planner core, these modules included, imports without torch.

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
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx

from planner.autoshard.aten_ops import FLOP_PER_ELEMENT, FLOP_PER_INPUT_ELEMENT
from planner.autoshard.export_graph import build_graph
from planner.autoshard.ops import DTYPE_BYTES, OpNode
from planner.errors import SpecError, escape_hidden, short_repr, unknown_name_message


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
                raise _data_dependent_error(exc) from None
            raise SpecError(f"input_shape: {shapes} does not fit the module: {_first_line(exc)}") from None
        try:
            exported = torch.export.export(module, fargs, kwargs=fkwargs or None, strict=False)
        except Exception as exc:  # the forward runs but export refuses it
            if _data_dependent(exc):
                raise _data_dependent_error(exc) from None
            raise SpecError(f"module: torch.export cannot trace it: {_first_line(exc)}") from None
    return build_graph(exported, list(kwargs), shapes, _aliases(module))


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

    The module traced has fake tensors in place of its parameters and buffers: they behave as real tensors of
    their device but hold no data, so nothing is allocated, and running the forward twice (the shape check, then
    export) changes nothing the caller sees (a real module's batch-norm counters would otherwise move). A module
    on the meta device gets fake CPU tensors, because code such as ``torch.autocast(device_type=x.device.type)``
    refuses the meta device. A module the caller passed is copied (its structure only: the copy's tensors are the
    fakes), one built here is changed in place. Tied parameters stay tied.
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
    device = (torch.device("cpu") if not tensors or any(t.is_meta for t in tensors) else tensors[0].device)
    fakes: dict[int, Any] = {}
    with fake_mode:
        for param in module.parameters():
            fakes[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                  requires_grad=param.requires_grad)
        for buf in module.buffers():
            fakes[id(buf)] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
    if not owned:
        return copy.deepcopy(module, memo=dict(fakes)), fake_mode, device
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for key, value in table.items():
                if value is not None:
                    table[key] = fakes[id(value)]
    return module, fake_mode, device


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


def _data_dependent_error(exc: BaseException) -> SpecError:
    return SpecError(f"module: cannot be traced: its forward depends on tensor values (a data-dependent branch or "
                     f"output shape) at {_where(exc)}; make it depend on shapes only")


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


__all__ = ["FLOP_PER_ELEMENT", "FLOP_PER_INPUT_ELEMENT", "InputSpec", "in_module", "module_prefixes",
           "repeated_blocks", "trace"]
