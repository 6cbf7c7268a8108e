"""The solver: the integer program against brute force on random small problems, the heuristic, and the
refusals. No torch."""

from __future__ import annotations

import numpy as np
import pytest

from planner.autoshard.solver import Problem, brute_force, milp_size, solve_heuristic, solve_milp
from planner.errors import SpecError


def random_problem(rng: np.random.Generator) -> Problem:
    n = int(rng.integers(2, 7))
    k = [int(rng.integers(1, 5)) for _ in range(n)]
    costs = [rng.random(x) for x in k]
    memory = [rng.random(x) for x in k]
    edges = []
    for v in range(1, n):
        for u in range(v):
            if rng.random() < 0.45:
                edges.append((u, v, rng.random((k[u], k[v]))))
    if rng.random() < 0.2:  # an edge whose cost splits into its ends' parts (folded into the nodes)
        a, b = rng.random(k[0]), rng.random(k[-1])
        edges.append((0, n - 1, a[:, None] + b[None, :]))
    ties = []
    if n >= 3 and rng.random() < 0.3:
        ties.append((0, rng.integers(0, 2, k[0]), 2, rng.integers(0, 2, k[2])))
    budget = float(sum(m.min() for m in memory) + rng.random() * 1.5) if rng.random() < 0.7 else None
    return Problem(costs, memory, edges, ties, budget)


def test_integer_program_matches_brute_force():
    rng = np.random.default_rng(7)
    checked = infeasible = 0
    for _ in range(150):
        problem = random_problem(rng)
        try:
            expected = brute_force(problem)
        except SpecError:
            with pytest.raises(SpecError):
                solve_milp(problem)
            infeasible += 1
            continue
        got = solve_milp(problem)
        assert got.optimal
        assert got.objective == pytest.approx(expected.objective, rel=1e-9, abs=1e-12)
        assert problem.ties_hold(got.choice) and problem.fits(got.choice)
        assert problem.objective(got.choice) == pytest.approx(got.objective)
        checked += 1
    assert checked > 100 and infeasible > 0  # both paths were exercised


def solvable(seed: int, count: int):
    """(problem, brute-force optimum) for the random problems of `seed` that have a feasible assignment."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        problem = random_problem(rng)
        try:
            yield problem, brute_force(problem)
        except SpecError:
            continue


def test_heuristic_is_feasible_and_never_beats_the_optimum():
    for problem, best in solvable(11, 80):
        try:
            found = solve_heuristic(problem)
        except SpecError:  # the heuristic may miss a tight feasible region; it then says so, never lies
            continue
        assert not found.optimal and found.method == "heuristic"
        assert problem.fits(found.choice) and problem.ties_hold(found.choice)
        assert found.objective >= best.objective - 1e-12


def test_linear_relaxation_is_a_lower_bound():
    for problem, best in solvable(3, 40):
        assert solve_milp(problem, relax=True).bound <= best.objective + 1e-9


def test_nothing_fits_names_the_smallest_memory():
    problem = Problem([np.array([1.0, 2.0]), np.array([1.0])], [np.array([5.0, 3.0]) * 2**30,
                                                                np.array([1.0]) * 2**30], budget=2 * 2**30)
    with pytest.raises(SpecError, match=r"memory_budget_bytes: no sharding fits 2 GiB .* smallest memory found is "
                                         r"4 GiB"):
        solve_milp(problem)
    with pytest.raises(SpecError, match="smallest memory found is 4 GiB"):
        solve_heuristic(problem)


def test_memory_budget_changes_the_choice():
    costs = [np.array([1.0, 3.0])]
    memory = [np.array([10.0, 1.0])]
    assert solve_milp(Problem(costs, memory)).choice == [0]
    assert solve_milp(Problem(costs, memory, budget=5.0)).choice == [1]


def test_folding_keeps_the_optimum_and_shrinks_the_program():
    a, b = np.array([0.0, 1.0, 5.0]), np.array([2.0, 0.5])
    separable = Problem([np.zeros(3), np.zeros(2)], [np.zeros(3), np.zeros(2)], [(0, 1, a[:, None] + b[None, :])])
    assert milp_size(separable) == 5  # no edge variables left
    assert solve_milp(separable).objective == pytest.approx(0.5)
