"""`autoshard`: trace a module, choose every operator's sharding, cut pipeline stages, and return DTensor
placements with the predicted cost.

The search: for each mesh shape of one stage's devices (1-D, and 2-D as inner x outer for every factorisation,
the inner axis on the fastest links), build the problem (`problem.build`), solve it (`solver`), and keep the
fastest mesh; a mesh whose lower bound (a linear relaxation) is above the best step already found is dropped
before its integer program runs. Runs of identical blocks are solved once, as the quotient problem, and that answer is used when a
lower bound proves it optimal (`problem` explains both); otherwise the whole graph goes to the integer program
when it has at most `solver.MILP_MAX_VARIABLES` variables, else to the heuristic. The result says which.

With pp > 1 the devices split into pp groups of num_gpus / pp; the graph is solved on one group's mesh, cut into
stages by `stages.partition` on those per-node costs, and each stage is solved again on its own nodes with its
own in-flight activations (its memory then counts only its share).

Step time (pp = 1): m micro-batches of forward and backward kernels, the ops' own exchanges and the resharding,
then the gradient reduction and the optimizer step, all exposed (no overlap is credited; the planner's
transformer model credits the overlap of data-parallel reduction with the backward). With pp > 1:
(m - 1) x the slowest stage + the sum of the stages (fill and drain), plus the slowest stage's once-a-step work.
"""

from __future__ import annotations

import time
from typing import Any

import networkx as nx
import numpy as np

from planner.autoshard.problem import (Builder, between_instances, build, chains, is_op, relaxed_mapping,
                                      rep_name, uniform_mapping)
from planner.autoshard.result import AutoshardResult, NodeChoice, Stage
from planner.autoshard.solver import MILP_MAX_VARIABLES, Solution, milp_size, solve_heuristic, solve_milp
from planner.autoshard.stages import live_after, partition
from planner.autoshard.strategies import CostContext, Mesh, to_dtensor
from planner.autoshard.trace import repeated_blocks, trace
from planner.errors import SpecError
from cost_models.units import FP32, WEIGHT_BYTES, optimizer_state_bytes
from profiles import load_cluster

#: Relative tolerance of the proof that the repeated-block answer is optimal (floating-point sums).
PROOF_TOLERANCE = 1e-9
#: Precisions the graph planner prices (its GEMMs are never quantised).
PRECISIONS = ("bf16", "fp16", "fp32")


def mesh_shapes(devices: int, given: tuple[int, ...] | None) -> list[tuple[int, ...]]:
    """The meshes tried for one stage: `given`, or 1-D and every 2-D factorisation (inner axis first)."""
    if given is not None:
        shape = tuple(int(a) for a in given)
        if not shape or len(shape) > 2 or any(a < 1 for a in shape) or int(np.prod(shape)) != devices:
            raise SpecError(f"mesh_shape: {list(shape)} must be one or two positive sizes whose product is the "
                            f"devices of one stage ({devices})")
        return [shape]
    shapes = [(devices,)]
    shapes += [(a, devices // a) for a in range(2, devices) if devices % a == 0]
    return shapes


def _axis_names(mesh: Mesh, cluster) -> list[str]:
    names = []
    for size, stride in zip(mesh.shape, mesh.strides):
        inside = size * stride <= cluster.domain_size
        names.append(f"{size} devices over {'intra-node' if inside else 'inter-node'} links (stride {stride})")
    return names


class Dominated(Exception):
    """A mesh whose lower bound is already above the best plan found on another mesh: it cannot win."""


class _Solve:
    """One mesh's solve of a set of nodes: the choice per node and how it was found. `cutoff`: the best step
    found on another mesh, where the objective is the step (no pipeline); a lower bound above it ends the solve
    (`Dominated`)."""

    def __init__(self, builder: Builder, nodes: list[str], groups, micro_batches: int, in_flight: float,
                 budget: float | None, time_limit_s: float, cutoff: float | None = None, proof: bool = True):
        self.builder, self.nodes = builder, nodes
        inside = set(nodes)
        # the instances of each run that lie wholly in these nodes (a pipeline stage holds part of a run)
        runs = chains(builder, [[inst for inst in g if all(n in inside for n in inst)] for g in groups])
        seed = None
        self.note = []
        self.choice: dict[str, int] | None = None
        if runs:
            mapping = uniform_mapping(runs)
            quotient = build(builder, nodes, micro_batches, in_flight, budget, mapping)
            try:
                uniform = solve_milp(quotient.problem, time_limit_s)
            except SpecError:
                uniform = None
            if uniform is not None:
                where = {name: i for i, name in enumerate(quotient.names)}
                units, _ = builder.unit_edges(nodes)
                expanded = {n: uniform.choice[where[rep_name(n, mapping)]] for n in units}
                if not proof:  # costs to cut pipeline stages by: the best uniform plan is enough
                    self.choice, self.method, self.optimal = expanded, "milp (repeated blocks)", False
                    self.note.append(f"repeated blocks solved once for the stage cut: {uniform.note}")
                    return
                relaxed = build(builder, nodes, micro_batches, in_flight, None, relaxed_mapping(runs),
                                between_instances(builder.graph, runs))
                # the linear relaxation first (a weaker bound, found faster), then the program itself
                bound = solve_milp(relaxed.problem, time_limit_s, relax=True).bound
                if cutoff is not None and bound >= cutoff:
                    raise Dominated
                if not uniform.objective <= bound * (1 + PROOF_TOLERANCE) + 1e-15:
                    bound_sol = solve_milp(relaxed.problem, time_limit_s)
                    bound = bound_sol.objective if bound_sol.optimal else (bound_sol.bound or 0.0)
                    if cutoff is not None and bound >= cutoff:
                        raise Dominated
                blocks = ", ".join(f"{len(g)} x {len(g[0])} ops" for g in runs)
                if uniform.optimal and uniform.objective <= bound * (1 + PROOF_TOLERANCE) + 1e-15:
                    self.choice, self.method, self.optimal = expanded, "milp (repeated blocks)", True
                    self.note.append(f"repeated blocks ({blocks}) solved once: {uniform.note}; proven optimal "
                                     f"against the lower bound without the edges between blocks")
                    return
                seed = expanded
                self.note.append(f"repeated blocks ({blocks}): the uniform plan ({uniform.objective:.6g} s) is "
                                 f"above the lower bound ({bound:.6g} s); the whole graph is solved")
        full = build(builder, nodes, micro_batches, in_flight, budget)
        if cutoff is not None and solve_milp(full.problem, time_limit_s, relax=True).bound >= cutoff:
            raise Dominated
        size = milp_size(full.problem)
        start = [seed[n] for n in full.names] if seed is not None else None
        if size <= MILP_MAX_VARIABLES:
            sol = solve_milp(full.problem, time_limit_s)
            if start is not None and not sol.optimal and full.problem.objective(start) < sol.objective:
                sol = Solution(start, full.problem.objective(start), full.problem.memory_of(start), False,
                               "milp", sol.note + "; the repeated-block plan was better and is kept")
            self.method, self.optimal = "milp", sol.optimal
        else:
            sol = solve_heuristic(full.problem, start)
            self.method, self.optimal = "heuristic", False
            sol.note = f"{size} variables exceed the integer program's limit ({MILP_MAX_VARIABLES}); " + sol.note
        self.note.append(sol.note)
        self.choice = dict(zip(full.names, sol.choice))


def _breakdown(builder: Builder, nodes: list[str], choice: dict[str, int], micro_batches: int, in_flight: float
               ) -> dict[str, Any]:
    """Per-node and total costs of a choice."""
    reshard = {n: 0.0 for n in nodes}
    _, edges = builder.unit_edges(nodes)
    for u, v, arg in edges:  # each edge's seconds go to the op that reads (or, for its gradient, gives) the tensor
        reshard[v if is_op(v) else u] += float(builder.matrix(u, v, arg)[choice[u], choice[v]])
    totals = {"compute": 0.0, "comm": 0.0, "reshard": 0.0, "grad_sync": 0.0, "optimizer": 0.0}
    memory = {"params": 0.0, "activations": 0.0}
    per_node = {}
    for n in nodes:
        s = builder.strategies(n)[choice[n]]
        totals["compute"] += s.compute_s
        totals["comm"] += s.comm_s
        totals["reshard"] += reshard[n]
        totals["grad_sync"] += s.grad_sync_s
        totals["optimizer"] += s.optimizer_s
        memory["params"] += s.param_bytes
        memory["activations"] += in_flight * s.activation_bytes
        per_node[n] = (s, reshard[n])
    per_micro = totals["compute"] + totals["comm"] + totals["reshard"]
    once = totals["grad_sync"] + totals["optimizer"]
    return {"totals": totals, "memory": memory, "per_node": per_node, "per_micro_s": per_micro, "once_s": once,
            "step_s": micro_batches * per_micro + once}


def _module_outputs(graph: nx.DiGraph, order: list[str]) -> dict[str, str]:
    """Module qualified name -> the node whose output is that module's output, for modules with one output
    read outside them."""
    members: dict[str, list[str]] = {}
    for name in order:
        module = graph.nodes[name]["op"].module
        parts = module.split(".") if module else []
        for k in range(1, len(parts) + 1):
            members.setdefault(".".join(parts[:k]), []).append(name)
    outputs = {}
    final = set(graph.graph.get("outputs", []))
    for module, names in members.items():
        inside = set(names)
        leaving = [n for n in names if n in final or any(w not in inside for w in graph.successors(n))]
        if len(leaving) == 1:
            outputs[module] = leaving[0]
    return outputs


def _check(num_gpus: Any, pp: Any, micro_batches: Any, precision: Any, budget: Any, time_limit_s: Any) -> None:
    for field, value in (("num_gpus", num_gpus), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"{field}: must be a positive integer, got {value!r}")
    if num_gpus % pp:
        raise SpecError(f"pp: {pp} must divide num_gpus ({num_gpus})")
    if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                                      or micro_batches < 1):
        raise SpecError(f"micro_batches: must be a positive integer, got {micro_batches!r}")
    if precision not in PRECISIONS:
        raise SpecError(f"precision: must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
        raise SpecError(f"memory_budget_bytes: must be a positive number of bytes, got {budget!r}")
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0):
        raise SpecError(f"time_limit_s: must be a positive number of seconds, got {time_limit_s!r}")


def autoshard(module, example_inputs, cluster, num_gpus: int, memory_budget_bytes: float | None = None, pp: int = 1,
              mesh_shape: tuple[int, ...] | None = None, precision: str = "bf16", optimizer: str = "adam",
              micro_batches: int | None = None, time_limit_s: float = 30.0, graph: nx.DiGraph | None = None,
              reuse_blocks: bool = True, executor: str | None = None,
              example_kwargs: dict[str, Any] | None = None) -> AutoshardResult:
    """Choose the sharding of every operator of `module` on `num_gpus` devices of `cluster`.

    module: an nn.Module, or a zero-argument callable building one (built on the meta device: no memory, no
    weights). example_inputs: one micro-batch's inputs, tensors or `planner.autoshard.trace.InputSpec`s.
    memory_budget_bytes: per device; default the GPU's memory less its framework reserve. pp: pipeline stages
    (num_gpus / pp devices each). mesh_shape: one stage's mesh (inner axis first); default: the fastest of 1-D
    and every 2-D factorisation. micro_batches: per step (default 1, or 2·pp with a pipeline). `graph`: a traced
    graph to use instead of tracing (`trace`). reuse_blocks: solve runs of identical blocks once (False: always
    the whole graph, for checking the reduction). executor: "dtensor" keeps to the strategies DTensor runs as one
    process would (`strategies.DTENSOR_UNSUPPORTED`), for plans that `meshplan validate --autoshard` runs.
    example_kwargs: inputs given by keyword (a Hugging Face model's ``input_ids=``, ``labels=``).
    """
    micro = micro_batches if micro_batches is not None else (1 if pp == 1 else 2 * pp)
    _check(num_gpus, pp, micro, precision, memory_budget_bytes, time_limit_s)
    if optimizer not in ("adam", "sgd"):
        raise SpecError(f"optimizer: must be adam or sgd, got {optimizer!r}")
    if executor not in (None, "dtensor"):
        raise SpecError(f"executor: must be None or 'dtensor', got {executor!r}")
    spec = load_cluster(cluster)
    budget = float(memory_budget_bytes) if memory_budget_bytes is not None else \
        float(spec.gpu.memory_bytes - spec.gpu.framework_reserve_bytes)
    started = time.perf_counter()
    if graph is None:
        graph = trace(module, example_inputs, example_kwargs)
    traced = time.perf_counter()
    order = [n for n in graph.graph["order"] if n in graph]
    groups = repeated_blocks(graph) if reuse_blocks else []
    devices = num_gpus // pp
    best = None
    failures = []
    for shape in mesh_shapes(devices, mesh_shape):
        ctx = CostContext(spec, Mesh(shape), precision, optimizer, dtensor=executor == "dtensor")
        builder = Builder(graph, ctx)
        try:
            found = _plan_mesh(builder, order, groups, pp, micro, budget, time_limit_s,
                               best["step_s"] if best is not None and pp == 1 else None)
        except SpecError as err:
            failures.append(str(err))
            continue
        except Dominated:
            continue
        if best is None or found["step_s"] < best["step_s"]:
            best = found
    if best is None:
        smallest = [f for f in failures if "smallest memory found" in f]
        raise SpecError(min(smallest, key=len) if smallest else failures[0])
    solved = time.perf_counter()
    return _result(graph, order, spec, num_gpus, pp, micro, budget, best, precision, optimizer,
                   traced - started, solved - traced)


def _plan_mesh(builder: Builder, order: list[str], groups, pp: int, micro: int, budget: float,
               time_limit_s: float, cutoff: float | None) -> dict[str, Any]:
    ctx = builder.ctx
    in_flight = 1.0 if pp == 1 else float(min(micro, pp))
    first = _Solve(builder, order, groups, micro, in_flight, None if pp > 1 else budget, time_limit_s, cutoff,
                   proof=pp == 1)
    if pp == 1:
        info = _breakdown(builder, order, first.choice, micro, 1.0)
        return {"builder": builder, "stages": [(order, first, info)], "step_s": info["step_s"],
                "cut": None}
    info = _breakdown(builder, order, first.choice, micro, 1.0)
    per = info["per_node"]
    time_s = np.array([per[n][0].compute_s + per[n][0].comm_s + per[n][1] for n in order])
    params = np.array([per[n][0].param_bytes for n in order])
    acts = np.array([per[n][0].activation_bytes for n in order])
    inputs_of = {n: list(builder.op(n).inputs) for n in order}
    skip = {n for n in order if builder.op(n).kind == "input"}
    nbytes = {n: ctx.bytes_of(builder.op(n).output) / _pieces(per[n][0].out, ctx.mesh) for n in order}
    count, live = live_after(order, inputs_of, nbytes, skip)
    devices = ctx.mesh.size

    def send_s(b: float) -> float:
        return ctx.p2p_s(b, devices, devices * pp)

    cut = partition(order, time_s, params, acts, count, live, send_s, pp, micro, budget)
    stages = []
    for s, (lo, hi) in enumerate(cut.bounds):
        nodes = order[lo:hi]
        held = float(min(micro, pp - s))
        solve = _Solve(builder, nodes, groups, micro, held, budget, time_limit_s)
        stages.append((nodes, solve, _breakdown(builder, nodes, solve.choice, micro, held)))
    sends = [0.0] * pp
    for s, (lo, hi) in enumerate(cut.bounds[:-1]):
        sends[s] = float(live[hi - 1])
    stage_times = [st[2]["per_micro_s"] + send_s(sends[s]) for s, st in enumerate(stages)]
    once = max(st[2]["once_s"] for st in stages)
    step = (micro - 1) * max(stage_times) + sum(stage_times) + once
    return {"builder": builder, "stages": stages, "step_s": step, "cut": cut, "sends": sends,
            "stage_times": stage_times}


def _pieces(layout: tuple, mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a, p in enumerate(layout) if isinstance(p, int)] or [1]))


def _result(graph: nx.DiGraph, order: list[str], spec, num_gpus: int, pp: int, micro: int, budget: float,
            best: dict[str, Any], precision: str, optimizer: str, trace_s: float, solve_s: float) -> AutoshardResult:
    builder: Builder = best["builder"]
    mesh = builder.ctx.mesh
    choice: dict[str, int] = {}
    stage_of: dict[str, int] = {}
    for s, (nodes, solve, _info) in enumerate(best["stages"]):
        choice.update(solve.choice)
        stage_of.update({n: s for n in nodes})
    params: dict[str, list[str]] = {}
    nodes_out: list[NodeChoice] = []
    for name in order:
        op = builder.op(name)
        strat = builder.strategies(name)[choice[name]]
        info = best["stages"][stage_of[name]][2]["per_node"][name]
        for p, lay in zip(op.params, strat.params):
            params.setdefault(p.fqn, to_dtensor(lay))
        nodes_out.append(NodeChoice(
            name=name, kind=op.kind, target=op.target, module=op.module, strategy=strat.name,
            inputs=[to_dtensor(lay) for lay in strat.ins], output=to_dtensor(strat.out),
            params={p.fqn: to_dtensor(lay) for p, lay in zip(op.params, strat.params)},
            compute_s=micro * strat.compute_s, comm_s=micro * strat.comm_s + strat.grad_sync_s,
            reshard_s=micro * info[1], memory_bytes=strat.param_bytes + strat.activation_bytes,
            stage=stage_of[name]))
    inputs = [to_dtensor(builder.strategies(n)[choice[n]].out) for n in graph.graph["inputs"]]
    activations = {module: to_dtensor(builder.strategies(n)[choice[n]].out)
                   for module, n in _module_outputs(graph, order).items()}
    # the most loaded stage's memory, and the breakdown of the slowest stage's time
    stage_infos = [st[2] for st in best["stages"]]
    heavy = max(range(len(stage_infos)), key=lambda s: sum(stage_infos[s]["memory"].values()))
    mem = stage_infos[heavy]["memory"]
    state = WEIGHT_BYTES[precision] + FP32 + optimizer_state_bytes(optimizer, precision)
    memory_bytes = {"params": mem["params"] * WEIGHT_BYTES[precision] / state,
                    "grads": mem["params"] * FP32 / state,
                    "optimizer": mem["params"] * optimizer_state_bytes(optimizer, precision) / state,
                    "activations": mem["activations"]}
    if pp == 1:
        t = stage_infos[0]["totals"]
        time_s = {"compute": micro * t["compute"], "comm": micro * t["comm"], "reshard": micro * t["reshard"],
                  "grad_sync": t["grad_sync"], "optimizer": t["optimizer"], "pp_bubble": 0.0, "pp_comm": 0.0}
    else:
        times = best["stage_times"]
        slow = int(np.argmax(times))
        t = stage_infos[slow]["totals"]
        time_s = {"compute": micro * t["compute"], "comm": micro * t["comm"], "reshard": micro * t["reshard"],
                  "grad_sync": t["grad_sync"], "optimizer": t["optimizer"],
                  "pp_bubble": sum(times) - times[slow],
                  "pp_comm": micro * (times[slow] - stage_infos[slow]["per_micro_s"])}
    stages = []
    for s, (nodes, _solve, info) in enumerate(best["stages"]):
        tops = []
        for n in nodes:
            top = builder.op(n).module.split(".")[0] if builder.op(n).module else ""
            if top and (not tops or tops[-1] != top):
                tops.append(top)
        stages.append(Stage(index=s, first=nodes[0], last=nodes[-1], num_nodes=len(nodes), modules=tops,
                            time_s=info["per_micro_s"] if pp == 1 else best["stage_times"][s],
                            memory_bytes=sum(info["memory"].values()),
                            send_bytes=int(best.get("sends", [0] * pp)[s])))
    solves = [st[1] for st in best["stages"]]
    methods = sorted({sv.method for sv in solves})
    unknown = sorted(graph.graph.get("unknown_ops", []))
    return AutoshardResult(
        cluster=spec.name, gpu=spec.gpu.name, num_gpus=num_gpus, mesh_shape=list(mesh.shape),
        mesh_axes=_axis_names(mesh, spec), pp=pp, micro_batches=micro, memory_budget_bytes=budget,
        params=params, inputs=inputs, activations=activations, nodes=nodes_out, stages=stages,
        step_time_s=best["step_s"], time_s=time_s, memory_bytes=memory_bytes,
        peak_memory_bytes=max(sum(i["memory"].values()) for i in stage_infos), unknown_ops=unknown,
        solver=" + ".join(methods), solver_note="; ".join(n for sv in solves for n in sv.note),
        optimal=all(sv.optimal for sv in solves), num_graph_nodes=len(order), trace_time_s=trace_s,
        solve_time_s=solve_s)
