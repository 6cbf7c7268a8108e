"""From a traced graph to the solver's problem, and the repeated-block reduction.

`build` gives every node its strategies (`strategies.op_strategies`) and every edge its resharding matrix, and
weights them for a step: per-micro-batch work times the micro-batches, gradient reduction and the optimizer
once, activations times the micro-batches a stage holds at once. Identical ops (the same kind, shapes and
attributes, as in repeated blocks) share one strategy list and one matrix, so a 24-layer model costs little
more to build than one layer.

Repeated blocks (`quotient`): when the graph has runs of identical module instances (a GPT's blocks), the
problem restricted to assignments where every instance of a run chooses the same strategies is the quotient
problem: one representative node per aligned position, its cost and memory times the number of instances, and
every original edge added onto the representatives it maps to (a block's internal edges n times, the edges from
one block to the next n - 1 times, edges from a node outside feeding every block n times). Its optimum is the
best uniform plan, exactly. It is the optimum of the whole problem when it meets a lower bound of the whole
problem: the same problem without the edges between instances and without the memory budget, in which, for any
choice outside the runs, the middle instances of a run are independent identical problems (`relaxed_mapping`).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from planner.autoshard.ops import OpNode
from planner.autoshard.solver import Problem
from planner.autoshard.strategies import (CostContext, OpStrategy, edge_cost_matrix, grad_layout, layout_matrix,
                                          layout_strategies, op_strategies, requires_grad, saves_inputs)


@dataclass
class Built:
    """A problem built from (part of) a graph: node i of the problem is `names[i]`."""

    names: list[str]
    strategies: list[list[OpStrategy]]
    problem: Problem


#: Attributes that name things (buffers' qualified names) rather than change what the op computes: two ops that
#: differ only in these have the same strategies.
NAMING_ATTRS = {"buffers"}


def _signature(op: OpNode, owns: tuple, shares: tuple) -> tuple:
    attrs = sorted((k, v) for k, v in op.attrs.items() if k not in NAMING_ATTRS)
    return (op.kind, op.target, op.input_tensors, op.output,
            tuple((p.tensor, p.role, p.arg) for p in op.params), repr(attrs), owns, shares)


#: Suffixes of a shared tensor's two layout nodes: the layout it is converted to once for all its readers in the
#: forward, and the layout its readers' gradients are summed in for the backward.
FWD, BWD = "@fwd", "@bwd"


def _base(name: str) -> tuple[str, str]:
    for suffix in (FWD, BWD):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return name, ""


class Builder:
    """Strategies and matrices for the nodes of one graph on one mesh, cached by op signature.

    A tensor read by several ops (a residual stream, a normalised input feeding Q, K and V) gets two layout
    nodes: its readers take it from one forward conversion (FWD), and their gradients are summed in one layout
    and converted once (BWD), as autograd sums them before the producer's backward. Without them each reader
    would pay for its own conversion of the same tensor."""

    def __init__(self, graph: nx.DiGraph, ctx: CostContext):
        self.graph, self.ctx = graph, ctx
        self.need_grad = requires_grad(graph)
        self.owner: dict[str, str] = {}  # parameter fqn -> the first node (in order) that reads it
        keepers: dict[str, int] = {}
        for name in graph.graph["order"]:
            op: OpNode = graph.nodes[name]["op"]
            for p in op.params:
                self.owner.setdefault(p.fqn, name)
            if saves_inputs(op):
                for u in set(op.inputs):
                    keepers[u] = keepers.get(u, 0) + 1
        self.keepers = keepers
        self._strategies: dict[tuple, list[OpStrategy]] = {}
        self._matrices: dict[tuple, np.ndarray] = {}
        self._by_node: dict[str, list[OpStrategy]] = {}
        self._sig: dict[str, tuple] = {}

    def op(self, name: str) -> OpNode:
        return self.graph.nodes[name]["op"]

    def strategies(self, name: str) -> list[OpStrategy]:
        if name not in self._by_node:
            base, suffix = _base(name)
            op = self.op(base)
            if suffix:
                sig = (suffix, op.output, self.ctx.mesh)
                if sig not in self._strategies:
                    self._strategies[sig] = layout_strategies(op.output, self.ctx.mesh, True)
            else:
                owns = tuple(self.owner[p.fqn] == name for p in op.params)
                shares = tuple(1.0 / self.keepers.get(u, 1) for u in op.inputs) if saves_inputs(op) else ()
                sig = _signature(op, owns, shares)
                if sig not in self._strategies:
                    self._strategies[sig] = op_strategies(op, self.ctx, owns, shares)
            self._by_node[name], self._sig[name] = self._strategies[sig], sig
        return self._by_node[name]

    def signature(self, name: str) -> tuple:
        self.strategies(name)
        return self._sig[name]

    def matrix(self, u: str, v: str, arg: int) -> np.ndarray:
        """Seconds (one micro-batch) of edge u -> v (input `arg` of v): both directions for an op-to-op edge,
        the forward only from a FWD node or into one, the backward only into a BWD node or from one."""
        su, sv = self.strategies(u), self.strategies(v)
        key = (self._sig[u], self._sig[v], arg)
        if key in self._matrices:
            return self._matrices[key]
        bu, fu = _base(u)
        bv, fv = _base(v)
        if not fu and not fv:  # op -> op
            m = edge_cost_matrix(su, sv, arg, self.op(v).input_tensors[arg], self.need_grad[u], self.ctx)
        else:
            tensor = self.op(bu if fu or fv == "" else bv).output
            nbytes = self.ctx.bytes_of(tensor)
            if fu == FWD:  # shared layout -> a reader's input
                m = layout_matrix([s.out for s in su], [s.ins[arg] for s in sv], nbytes, self.ctx)
            elif fv == FWD:  # producer -> shared layout
                m = layout_matrix([s.out for s in su], [s.out for s in sv], nbytes, self.ctx)
            elif fv == BWD:  # a reader's input gradient -> the summed gradient's layout
                m = layout_matrix([s.grads[arg] for s in su], [s.out for s in sv], nbytes, self.ctx)
            else:  # summed gradient -> the layout the producer expects
                m = layout_matrix([s.out for s in su], [grad_layout(s.out) for s in sv], nbytes, self.ctx)
        self._matrices[key] = m
        return m

    def node_arrays(self, name: str, micro_batches: int, in_flight: float) -> tuple[np.ndarray, np.ndarray]:
        """(cost s, memory bytes) per strategy for one step."""
        ss = self.strategies(name)
        cost = np.array([micro_batches * (s.compute_s + s.comm_s) + s.grad_sync_s + s.optimizer_s for s in ss])
        memory = np.array([s.param_bytes + in_flight * s.activation_bytes for s in ss])
        return cost, memory

    def unit_edges(self, nodes: list[str], cut_edges: set[tuple[str, str]] | None = None
                   ) -> tuple[list[str], list[tuple[str, str, int]]]:
        """The problem's units over `nodes` (the ops and the shared tensors' layout nodes) and its edges
        (u, v, arg) between them."""
        inside = set(nodes)
        readers: dict[str, list[tuple[str, int]]] = {}
        for v in nodes:
            for arg, u in enumerate(self.op(v).inputs):
                if u in inside:
                    readers.setdefault(u, []).append((v, arg))
        units = []  # each shared tensor's layout nodes right after its producer: neighbours stay close
        edges = []
        for u in nodes:
            units.append(u)
            rs = readers.get(u, [])
            if len(rs) < 2:
                edges += [(u, v, arg) for v, arg in rs if not (cut_edges and (u, v) in cut_edges)]
                continue
            units.append(u + FWD)
            edges.append((u, u + FWD, 0))
            grad = self.need_grad[u]
            if grad:
                units.append(u + BWD)
                edges.append((u + BWD, u, 0))
            for v, arg in rs:
                if cut_edges and (u, v) in cut_edges:
                    continue
                edges.append((u + FWD, v, arg))
                if grad:
                    edges.append((v, u + BWD, arg))
        return units, edges


def rep_name(name: str, mapping: dict[str, str]) -> str:
    """The representative of a unit (an op or a shared tensor's layout node) under `mapping`."""
    base, suffix = _base(name)
    return mapping.get(base, base) + suffix


def is_op(name: str) -> bool:
    return not _base(name)[1]


def build(builder: Builder, nodes: list[str], micro_batches: int = 1, in_flight: float = 1.0,
          budget: float | None = None, mapping: dict[str, str] | None = None,
          cut_edges: set[tuple[str, str]] | None = None) -> Built:
    """The problem over `nodes` (in topological order). With `mapping` (node -> representative), the nodes that
    map to one representative are one problem node (`quotient`); edges listed in `cut_edges` are left out. A
    node outside `nodes` that feeds one of them is left out too: the stage receives that tensor in any layout."""
    mapping = mapping or {}

    def rep_of(name: str) -> str:
        return rep_name(name, mapping)

    units, unit_edges = builder.unit_edges(nodes, cut_edges)
    reps: list[str] = []
    index: dict[str, int] = {}
    weights: list[int] = []
    for name in units:
        rep = rep_of(name)
        if rep not in index:
            index[rep] = len(reps)
            reps.append(rep)
            weights.append(0)
        weights[index[rep]] += 1
    strategies = [builder.strategies(r) for r in reps]
    costs, memory = [], []
    for r, w in zip(reps, weights):
        c, m = builder.node_arrays(r, micro_batches, in_flight)
        costs.append(w * c)
        memory.append(w * m)
    summed: dict[tuple[int, int], np.ndarray] = {}
    for u, v, arg in unit_edges:
        ru, rv = rep_of(u), rep_of(v)
        m = micro_batches * builder.matrix(ru, rv, arg)
        key = (index[ru], index[rv])
        summed[key] = summed[key] + m if key in summed else m
    edges = [(a, b, m) for (a, b), m in summed.items()]
    ties = []
    seen: dict[str, tuple[int, int]] = {}
    for i, r in enumerate(reps):
        if _base(r)[1]:
            continue
        op = builder.op(r)
        for k, p in enumerate(op.params):
            if p.fqn in seen and seen[p.fqn][0] != i:
                j, kj = seen[p.fqn]
                ids: dict[tuple, int] = {}  # one numbering of the parameter's layouts for both readers
                labels_a = np.array([ids.setdefault(s.params[kj], len(ids)) for s in strategies[j]])
                labels_b = np.array([ids.setdefault(s.params[k], len(ids)) for s in strategies[i]])
                ties.append((j, labels_a, i, labels_b))
            else:
                seen.setdefault(p.fqn, (i, k))
    return Built(reps, strategies, Problem(costs, memory, edges, ties, budget))


def chains(builder: Builder, groups: list[list[list[str]]]) -> list[list[list[str]]]:
    """The runs the reduction may use: instances whose aligned nodes have the same strategies and costs (the
    same op signature), joined only to the next and the previous instance, and whose middle instances are wired
    alike to the nodes outside the run (so that the lower-bound problem's middle instances are identical).
    Other groups are solved without reduction."""
    kept = []
    graph = builder.graph
    for group in groups:
        if len(group) < 2:
            continue
        sigs = [[builder.signature(name) for name in inst] for inst in group]
        if any(s != sigs[0] for s in sigs[1:]):
            continue
        position = {name: (k, i) for k, inst in enumerate(group) for i, name in enumerate(inst)}
        wirings, alike = [], True
        for k, inst in enumerate(group):
            wiring = set()
            for i, v in enumerate(inst):
                for arg, u in enumerate(builder.op(v).inputs):
                    if u in position:
                        ku, iu = position[u]
                        if ku not in (k, k - 1):
                            alike = False
                        wiring.add(("in", i, arg, ku - k, iu))
                    else:
                        wiring.add(("in", i, arg, "outside", u))
                for w in graph.successors(v):
                    if w not in position:
                        wiring.add(("out", i, "outside", w))
            wirings.append(wiring)
        middle = wirings[1:-1]
        if alike and all(w == middle[0] for w in middle[1:]):
            kept.append(group)
    return kept


def uniform_mapping(groups: list[list[list[str]]]) -> dict[str, str]:
    """Every instance's node -> the first instance's aligned node."""
    return {name: group[0][i] for group in groups for inst in group for i, name in enumerate(inst)}


def relaxed_mapping(groups: list[list[list[str]]]) -> dict[str, str]:
    """The lower-bound problem's mapping: the first, the middle and the last instance of each run (the edges
    between instances are left out: `between_instances`)."""
    mapping: dict[str, str] = {}
    for group in groups:
        n = len(group)
        for k, inst in enumerate(group):
            rep = group[0] if k == 0 else group[-1] if k == n - 1 else group[1]
            for i, name in enumerate(inst):
                mapping[name] = rep[i]
    return mapping


def between_instances(graph: nx.DiGraph, groups: list[list[list[str]]]) -> set[tuple[str, str]]:
    """Edges from one instance of a run to another."""
    instance = {name: (g, k) for g, group in enumerate(groups) for k, inst in enumerate(group) for name in inst}
    cut = set()
    for u, v in graph.edges:
        if u in instance and v in instance and instance[u] != instance[v]:
            cut.add((u, v))
    return cut
