"""Choose one strategy per node: a mixed-integer linear program (HiGHS through `scipy.optimize.milp`), a brute
force for checking it, and a heuristic for graphs too large for the program.

The problem: node v has strategies s with cost c[v, s] (seconds) and memory m[v, s] (bytes per device); edge
(u, v) costs C[u, v][s, t] when u runs s and v runs t; tied nodes (ops reading one parameter) must choose the
same parameter layout. Minimise the total cost with the memory under the budget.

The program (Alpa's formulation, Zheng et al. 2022, Sec. 4.2): a binary x[v, s] per node strategy with
sum_s x[v, s] = 1, and per edge a continuous y[u, v, s, t] >= 0 with sum_t y[.., s, t] = x[u, s] and
sum_s y[.., s, t] = x[v, t]. With x binary, the only y with those margins is the product x[u, s]·x[v, t], so the
quadratic edge cost is linear in y and exact; y needs no integrality. Edges whose cost splits into a part of
each end (a[s] + b[t]), and edges to a node with one strategy, are folded into the node costs first.

The heuristic (`solve_heuristic`): a Lagrangian on the memory (cost + λ·memory, λ bisected until the memory
fits), each λ solved by a greedy pass in topological order and then iterated conditional modes (each node in
turn takes its best strategy given its neighbours', until no node changes); then large-neighbourhood search:
windows of consecutive nodes, each small enough for the program, are solved exactly with every node outside
the window held at its current strategy (edges to them folded into the window's costs, the budget less their
memory), sliding with half a window's overlap until a sweep improves nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import product

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from planner.errors import SpecError

#: Past this many variables the program is not tried and the heuristic is used (said in the result).
MILP_MAX_VARIABLES = 400_000
#: Relative optimality gap HiGHS stops at (its default, 1e-4, would leave plans 0.01 % off).
MILP_REL_GAP = 1e-6
#: Penalty (seconds) the heuristic puts on tied nodes that choose different parameter layouts.
TIE_PENALTY_S = 1e6
#: Variables of one window of the heuristic's neighbourhood search, and its sweeps.
WINDOW_VARIABLES = 40_000
WINDOW_SWEEPS = 3


@dataclass
class Problem:
    """The assignment problem (see the module docstring). Node i has len(costs[i]) strategies."""

    costs: list[np.ndarray]
    memory: list[np.ndarray]
    edges: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    ties: list[tuple[int, np.ndarray, int, np.ndarray]] = field(default_factory=list)  # (a, labels, b, labels)
    budget: float | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.costs)

    def objective(self, choice: list[int]) -> float:
        total = sum(float(c[s]) for c, s in zip(self.costs, choice))
        return total + sum(float(m[choice[u], choice[v]]) for u, v, m in self.edges)

    def memory_of(self, choice: list[int]) -> float:
        return sum(float(m[s]) for m, s in zip(self.memory, choice))

    def ties_hold(self, choice: list[int]) -> bool:
        return all(la[choice[a]] == lb[choice[b]] for a, la, b, lb in self.ties)

    def fits(self, choice: list[int]) -> bool:
        return self.budget is None or self.memory_of(choice) <= self.budget * (1 + 1e-12)

    def min_memory(self) -> float:
        """A lower bound on any assignment's memory (each node's smallest)."""
        return sum(float(m.min()) for m in self.memory)


@dataclass
class Solution:
    choice: list[int]
    objective: float
    memory: float
    optimal: bool
    method: str
    note: str = ""
    bound: float | None = None  # a proven lower bound on the optimum, where the method gives one


def _fold(problem: Problem) -> tuple[list[np.ndarray], list[tuple[int, int, np.ndarray]]]:
    """Node costs with the separable edges and the edges to single-strategy nodes folded in (exact)."""
    costs = [c.astype(float).copy() for c in problem.costs]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for u, v, m in problem.edges:
        if u == v:
            costs[u] += np.diag(m)
            continue
        key = (u, v)
        merged[key] = merged[key] + m if key in merged else m.astype(float).copy()
    kept = []
    for (u, v), m in merged.items():
        if m.shape[0] == 1 or m.shape[1] == 1:
            if m.shape[0] == 1:
                costs[v] += m[0]
            else:
                costs[u] += m[:, 0]
            continue
        a = m[:, 0] - m[0, 0]
        b = m[0, :]
        if np.allclose(m, a[:, None] + b[None, :], rtol=1e-12, atol=1e-15):
            costs[u] += a
            costs[v] += b
            continue
        kept.append((u, v, m))
    return costs, kept


def solve_milp(problem: Problem, time_limit_s: float = 30.0, relax: bool = False) -> Solution:
    """The exact program (module docstring). Raises SpecError when no assignment fits the budget. With `relax`,
    its linear relaxation (x continuous): a lower bound only, `bound` set and `choice` meaningless."""
    costs, edges = _fold(problem)
    offsets = np.cumsum([0] + [len(c) for c in costs])
    nx_vars = int(offsets[-1])
    edge_offsets = [nx_vars]
    for _, _, m in edges:
        edge_offsets.append(edge_offsets[-1] + m.size)
    n_vars = edge_offsets[-1]
    c = np.concatenate(costs + [m.ravel() for _, _, m in edges]) if edges else np.concatenate(costs)
    rows, cols, vals, lo, hi = [], [], [], [], []
    sizes = np.array([len(cst) for cst in costs])
    # one strategy per node: row i sums node i's variables
    rows.append(np.repeat(np.arange(problem.num_nodes), sizes))
    cols.append(np.arange(nx_vars))
    vals.append(np.ones(nx_vars))
    lo.append(np.ones(problem.num_nodes))
    hi.append(np.ones(problem.num_nodes))
    r = problem.num_nodes
    for e, (u, v, m) in enumerate(edges):
        su, sv = m.shape
        base = edge_offsets[e]
        y = base + np.arange(su * sv).reshape(su, sv)
        # sum_t y[s, t] - x[u, s] = 0, one row per s
        rows += [np.repeat(r + np.arange(su), sv), r + np.arange(su)]
        cols += [y.ravel(), offsets[u] + np.arange(su)]
        vals += [np.ones(su * sv), -np.ones(su)]
        r += su
        # sum_s y[s, t] - x[v, t] = 0, one row per t
        rows += [r + np.tile(np.arange(sv), su), r + np.arange(sv)]
        cols += [y.ravel(), offsets[v] + np.arange(sv)]
        vals += [np.ones(su * sv), -np.ones(sv)]
        r += sv
        lo.append(np.zeros(su + sv))
        hi.append(np.zeros(su + sv))
    rows, cols, vals = [np.concatenate(rows)], [np.concatenate(cols)], [np.concatenate(vals)]
    lo, hi = [np.concatenate(lo)], [np.concatenate(hi)]
    for a, la, b, lb in problem.ties:  # tied parameter layouts: each label chosen by both or neither
        for label in set(la.tolist()) | set(lb.tolist()):
            ia = offsets[a] + np.flatnonzero(la == label)
            ib = offsets[b] + np.flatnonzero(lb == label)
            rows.append(np.full(len(ia) + len(ib), r))
            cols.append(np.concatenate([ia, ib]))
            vals.append(np.concatenate([np.ones(len(ia)), -np.ones(len(ib))]))
            lo.append(np.zeros(1))
            hi.append(np.zeros(1))
            r += 1
    if problem.budget is not None:
        rows.append(np.full(nx_vars, r))
        cols.append(np.arange(nx_vars))
        vals.append(np.concatenate(problem.memory).astype(float))
        lo.append(np.array([-np.inf]))
        hi.append(np.array([problem.budget]))
        r += 1
    rows, cols, vals = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    lo, hi = np.concatenate(lo), np.concatenate(hi)
    a_mat = coo_matrix((vals, (rows, cols)), shape=(r, n_vars)).tocsr()
    integrality = np.zeros(n_vars)
    integrality[:nx_vars] = 0 if relax else 1
    ub = np.ones(n_vars)
    start = time.perf_counter()
    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(n_vars), ub),
               constraints=LinearConstraint(a_mat, lo, hi),
               options={"time_limit": float(time_limit_s), "mip_rel_gap": MILP_REL_GAP, "presolve": True})
    elapsed = time.perf_counter() - start
    if res.x is None:
        if res.status == 2:  # infeasible
            raise SpecError(_nothing_fits(problem))
        raise SpecError(f"time_limit_s: the integer program found no assignment in {time_limit_s:g} s "
                        f"({nx_vars} node and {n_vars - nx_vars} edge variables); raise the limit")
    if relax:
        return Solution([], float(res.fun), 0.0, False, "lp", "linear relaxation", float(res.fun))
    x = res.x[:nx_vars]
    choice = [int(np.argmax(x[offsets[i]:offsets[i + 1]])) for i in range(problem.num_nodes)]
    optimal = res.status == 0
    bound = getattr(res, "mip_dual_bound", None)
    note = (f"integer program: {nx_vars} node and {n_vars - nx_vars} edge variables, {r} constraints, "
            f"{elapsed:.2f} s" + ("" if optimal else f", stopped at the {time_limit_s:g} s limit"))
    return Solution(choice, problem.objective(choice), problem.memory_of(choice), optimal, "milp", note,
                    float(bound) if bound is not None and np.isfinite(bound) else None)


def milp_size(problem: Problem) -> int:
    """Variables the program would have (after folding)."""
    costs, edges = _fold(problem)
    return sum(len(c) for c in costs) + sum(m.size for _, _, m in edges)


def _nothing_fits(problem: Problem) -> str:
    if problem.budget is None:
        return "params: the ops that share a parameter have no layout of it in common"
    smallest = _min_memory_assignment(problem)
    return (f"memory_budget_bytes: no sharding fits {problem.budget / 2**30:.3g} GiB per device; the smallest "
            f"memory found is {smallest / 2**30:.3g} GiB per device")


def _min_memory_assignment(problem: Problem) -> float:
    """The memory of the assignment with the least memory (ties respected by the heuristic's penalty)."""
    if not problem.ties:
        return problem.min_memory()
    unbounded = Problem(problem.memory, problem.memory, [], problem.ties, None)
    return problem.memory_of(_icm(unbounded, [m.astype(float) for m in problem.memory], None))


def brute_force(problem: Problem) -> Solution:
    """Every assignment, for checking the program on small graphs."""
    best, best_choice = np.inf, None
    for choice in product(*[range(len(c)) for c in problem.costs]):
        choice = list(choice)
        if not problem.ties_hold(choice) or not problem.fits(choice):
            continue
        value = problem.objective(choice)
        if value < best:
            best, best_choice = value, choice
    if best_choice is None:
        raise SpecError(_nothing_fits(problem))
    return Solution(best_choice, best, problem.memory_of(best_choice), True, "brute force")


def _neighbours(problem: Problem) -> list[list[tuple[int, np.ndarray, bool]]]:
    """Per node: (other node, cost matrix, whether this node is the matrix's row)."""
    near: list[list[tuple[int, np.ndarray, bool]]] = [[] for _ in range(problem.num_nodes)]
    for u, v, m in problem.edges:
        if u == v:
            continue
        near[u].append((v, m, True))
        near[v].append((u, m, False))
    for a, la, b, lb in problem.ties:
        m = np.where(la[:, None] == lb[None, :], 0.0, TIE_PENALTY_S)
        near[a].append((b, m, True))
        near[b].append((a, m, False))
    return near


def _icm(problem: Problem, unary: list[np.ndarray], start: list[int] | None, sweeps: int = 50) -> list[int]:
    """Greedy in node order (each node's best given the nodes before it), then iterated conditional modes."""
    near = _neighbours(problem)
    self_loops = {}
    for u, v, m in problem.edges:
        if u == v:
            self_loops[u] = self_loops.get(u, 0) + np.diag(m)
    unary = [u + self_loops.get(i, 0) for i, u in enumerate(unary)]
    choice = list(start) if start is not None else [-1] * problem.num_nodes

    def local(i: int, assigned_only: bool) -> np.ndarray:
        total = unary[i].copy()
        for j, m, row in near[i]:
            if choice[j] < 0 and assigned_only:
                continue
            total += m[:, choice[j]] if row else m[choice[j], :]
        return total

    if start is None:
        for i in range(problem.num_nodes):
            choice[i] = int(np.argmin(local(i, True)))
    for _ in range(sweeps):
        changed = False
        for i in range(problem.num_nodes):
            best = int(np.argmin(local(i, False)))
            if best != choice[i] and local(i, False)[best] < local(i, False)[choice[i]] - 1e-15:
                choice[i] = best
                changed = True
        if not changed:
            break
    return choice


def solve_heuristic(problem: Problem, start: list[int] | None = None) -> Solution:
    """The Lagrangian heuristic (module docstring); `start` seeds it (e.g. a repeated-block solution)."""
    def run(lam: float, seed):
        unary = [c + lam * m for c, m in zip(problem.costs, problem.memory)]
        return _icm(problem, unary, seed)

    candidates = []
    for seed in ([start] if start is not None else []) + [None]:
        choice = run(0.0, seed)
        if problem.fits(choice) and problem.ties_hold(choice):
            candidates.append(choice)
            continue
        scale = max(problem.objective(choice), 1e-9) / max(problem.memory_of(choice), 1.0)
        hi = scale
        for _ in range(40):
            choice = run(hi, seed)
            if problem.fits(choice) and problem.ties_hold(choice):
                break
            hi *= 4
        else:
            continue
        lo, good = 0.0, choice
        for _ in range(20):
            mid = (lo + hi) / 2
            choice = run(mid, seed)
            if problem.fits(choice) and problem.ties_hold(choice):
                hi, good = mid, choice
            else:
                lo = mid
        candidates.append(good)
    if not candidates:
        raise SpecError(_nothing_fits(problem))
    best = min(candidates, key=problem.objective)
    start_value = problem.objective(best)
    best, windows = _neighbourhoods(problem, best)
    return Solution(best, problem.objective(best), problem.memory_of(best), False, "heuristic",
                    f"heuristic: Lagrangian memory price with iterated conditional modes ({start_value:.6g} s), "
                    f"then {windows} windows solved exactly ({problem.objective(best):.6g} s); not proven optimal")


def _windows(problem: Problem) -> list[list[int]]:
    """Runs of consecutive nodes of about WINDOW_VARIABLES variables, overlapping by half."""
    sizes = [len(c) for c in problem.costs]
    pair = {}
    for u, v, m in problem.edges:
        pair[u] = pair.get(u, 0) + m.size
    weight = [sizes[i] + pair.get(i, 0) for i in range(problem.num_nodes)]
    starts, out, i = [0], [], 0
    while i < problem.num_nodes:
        total, j = 0, i
        while j < problem.num_nodes and (total + weight[j] <= WINDOW_VARIABLES or j == i):
            total += weight[j]
            j += 1
        out.append(list(range(i, j)))
        if j >= problem.num_nodes:
            break
        i = max(i + 1, (i + j) // 2)
        starts.append(i)
    return out


def _neighbourhoods(problem: Problem, choice: list[int]) -> tuple[list[int], int]:
    """Large-neighbourhood search over `_windows` (module docstring)."""
    choice = list(choice)
    windows = _windows(problem)
    if len(windows) <= 1 and problem.num_nodes and len(windows[0]) == problem.num_nodes:
        sub = solve_milp(problem, 60.0)
        return (sub.choice if sub.objective < problem.objective(choice) else choice), 1
    solved = 0
    near: list[set[int]] = [set() for _ in range(problem.num_nodes)]
    for u, v, _m in problem.edges:
        near[u].add(v)
        near[v].add(u)
    changed = set(range(problem.num_nodes))  # a window is solved again only where something near it changed
    for _ in range(WINDOW_SWEEPS):
        improved = False
        for window in windows:
            touched = set(window) | {j for n in window for j in near[n]}
            if not touched & changed:
                continue
            inside = {n: k for k, n in enumerate(window)}
            costs = [problem.costs[n].astype(float).copy() for n in window]
            edges = []
            for u, v, m in problem.edges:
                if u in inside and v in inside:
                    edges.append((inside[u], inside[v], m))
                elif u in inside:
                    costs[inside[u]] += m[:, choice[v]]
                elif v in inside:
                    costs[inside[v]] += m[choice[u], :]
            ties = []
            for a, la, b, lb in problem.ties:
                if a in inside and b in inside:
                    ties.append((inside[a], la, inside[b], lb))
                elif a in inside:
                    costs[inside[a]] += np.where(la == lb[choice[b]], 0.0, TIE_PENALTY_S)
                elif b in inside:
                    costs[inside[b]] += np.where(lb == la[choice[a]], 0.0, TIE_PENALTY_S)
            budget = None
            if problem.budget is not None:
                fixed = sum(float(problem.memory[n][choice[n]]) for n in range(problem.num_nodes) if n not in inside)
                budget = problem.budget - fixed
            sub = Problem(costs, [problem.memory[n] for n in window], edges, ties, budget)
            current = [choice[n] for n in window]
            try:
                found = solve_milp(sub, 30.0)
            except SpecError:
                continue
            solved += 1
            changed -= set(window)
            if found.objective < sub.objective(current) - 1e-12 * max(1.0, abs(found.objective)):
                for n, s in zip(window, found.choice):
                    if choice[n] != s:
                        changed.add(n)
                    choice[n] = s
                improved = True
        if not improved:
            break
    return choice, solved
