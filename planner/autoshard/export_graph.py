"""Walk an exported program (`torch.export`'s training IR) into the operator graph: one node per op that a
returned value depends on, parameters and buffers attached to the ops that read them, the subgraphs of mode
wrappers (no_grad, autocast) traced in place, and multi-output ops split into one node per used output.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx

from planner.autoshard.aten_ops import (PIECES, Buffer, Param, arg_names, bind_args, classify, flop_of, fx_shape,
                                        is_tensor, norm_dim, packet_name, param_role, tensor_of)
from planner.autoshard.ops import OpNode, ParamUse, Tensor
from planner.errors import SpecError

#: Higher-order ops that only change a mode around a subgraph (export wraps `torch.no_grad()` and autocast
#: regions in them): their subgraph is traced in place, as if the wrapper were not there.
_INLINED = frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast"})


@dataclass
class _Deferred:
    """An op with several outputs: its nodes are made when `getitem` picks an output (pieces of a split become
    slices; other ops one node per used output)."""

    fx: Any  # the torch.fx node
    names: dict[int, str] = field(default_factory=dict)  # output index -> graph node name


def build_graph(exported: Any, keywords: list[str], shapes: str, aliases: dict[str, str]) -> nx.DiGraph:
    """The operator graph of `exported` (see `planner.autoshard.trace.trace` for its attributes). `keywords`
    names the inputs given by keyword (the last ones), `shapes` the input shapes for messages, `aliases` maps
    each parameter or buffer name to the one name a tied tensor is listed under."""
    return Builder(exported, keywords, shapes, aliases).build()


def _short_type(value: Any) -> str:
    return (value.__name__ if isinstance(value, type) else str(value)).rsplit(".", 1)[-1]


class Builder:
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
        positional = sum(1 for s in sig.input_specs if s.kind == InputKind.USER_INPUT) - len(self.keywords)
        placeholders = [n for n in self.ep.graph.nodes if n.op == "placeholder"]
        for node in placeholders:
            spec = specs[node.name]
            val = node.meta.get("val")
            if spec.kind == InputKind.PARAMETER:
                fqn = self.aliases.get(spec.target, spec.target)
                env[node] = Param(fqn)
                params[fqn] = tensor_of(val)
            elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                fqn = self.aliases.get(spec.target, spec.target)
                env[node] = Buffer(fqn)
                buffers[fqn] = tensor_of(val)
            elif spec.kind == InputKind.USER_INPUT and is_tensor(val):
                index = len(inputs)
                attrs = {"index": index}
                if index >= positional:
                    attrs["keyword"] = self.keywords[index - positional]
                self._add(OpNode(node.name, "input", "input", (), (), tensor_of(val), attrs=attrs), [])
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
                    if is_tensor(val) else None)
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
        if not is_tensor(val):
            return None
        packet = packet_name(op.target)
        if packet in PIECES:
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
        bound = bind_args(op)
        src = op.args[0]
        ndim = len(src.meta["val"].shape)
        dim = norm_dim(int(dict(bound).get("dim", 0) or 0), ndim)
        vals = op.meta["val"]
        squeeze = packet_name(op.target) == "unbind"
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
                           tensor_of(vals[index]).dtype), reads, attrs, module)
        return self._make(name, node, target, "view", vals[index], [(0, piece)], {"op": "squeeze"}, module)

    def _reads(self, args: list[tuple[int, Any]], env: dict) -> list[tuple[int, Any]]:
        """(argument position, value) of every tensor an op reads: graph node names, Param or Buffer."""
        out = []
        for pos, arg in args:
            for item in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                if hasattr(item, "op"):
                    value = env.get(item)
                    if isinstance(value, (str, Param, Buffer)):
                        out.append((pos, value))
        return out

    def _op(self, node: Any, env: dict, module: tuple[str, str], name: str | None = None, val: Any = None) -> Any:
        val = node.meta.get("val") if val is None else val
        if isinstance(val, (list, tuple)):
            return _Deferred(node) if any(is_tensor(v) for v in val) else None
        if not is_tensor(val):
            return None  # assertions, symbolic sizes, ops returning nothing
        bound = bind_args(node)
        reads = self._reads([(i, v) for i, (_, v) in enumerate(bound)], env)
        try:
            kind, attrs, reads = classify(node, bound, val, reads, self)
        except SpecError:  # the inputs do not fit the module
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            # an argument form the table does not handle: kept, replicated, and listed as unknown
            kind, attrs = "unknown", {"target": str(node.target)}
        name = name or node.name
        if kind == "slice" and attrs.pop("squeeze", False):  # select: a size-1 slice, then a view dropping it
            shape = list(fx_shape(node.args[0]))
            shape[attrs["dim"]] = 1
            piece = self._make(f"{name}.slice", node, str(node.target), "slice",
                               Tensor(tuple(shape), tensor_of(val).dtype), reads, attrs, module)
            return self._make(name, node, str(node.target), "view", val, [(0, piece)], {"op": "squeeze"}, module)
        return self._make(name, node, str(node.target), kind, val, reads, attrs, module)

    def _make(self, name: str, node: Any, target: str, kind: str, val: Any, reads: list[tuple[int, Any]],
              attrs: dict, module: tuple[str, str]) -> str:
        """Add one node; its inputs, parameters and buffers come from `reads`."""
        if self.prefixes and (name in self.used or name in self.G):
            name = f"{self.prefixes[-1]}.{name}"  # a subgraph's node named like one outside it
        self.used.add(name)
        output = val if isinstance(val, Tensor) else tensor_of(val)
        acts = [(pos, v) for pos, v in reads if isinstance(v, str)]
        params = [(pos, v) for pos, v in reads if isinstance(v, Param)]
        bufs = {pos: v.fqn for pos, v in reads if isinstance(v, Buffer)}
        if not acts and not params and kind != "input" and attrs.get("op") != "constant":
            origin = target.split(".")[1] if target.startswith("aten.") else target  # the op's name
            kind, attrs = "elementwise", {"op": "constant", "from": origin}
        if bufs:
            attrs["buffers"] = bufs
        schema_names = arg_names(node.target) if node is not None else []
        uses = tuple(attrs.pop("_params", None) or (
            ParamUse(p.fqn, self.params[p.fqn], param_role(p.fqn, schema_names, pos), pos) for pos, p in params))
        op = OpNode(name=name, kind=kind, target=target, inputs=tuple(v for _, v in acts),
                    input_tensors=tuple(self.G.nodes[v]["op"].output for _, v in acts), output=output,
                    params=uses, module=module[0], module_type=module[1], attrs=attrs)
        op = replace(op, flop=float(flop_of(op)))
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


