"""Pipeline stages: cut the topological order into `pp` contiguous stages by dynamic programming.

A cut after position i sends the tensors produced at or before i and read after it (the live tensors; the
model's own inputs are loaded by every stage and never sent). Cuts are tried only where the fewest tensors are
live (between a GPT's blocks one, the residual stream), widening to the next count when there are too few such
places. Each stage's time is the sum of its nodes' per-micro-batch time plus the time of sending its live
tensors to the next stage; its memory is its parameters' share plus the activations of the micro-batches it
holds at once under one-forward-one-backward (stage s of p keeps min(m, p - s) micro-batches, Narayanan et al.
2021, Sec. 2.2). The program minimises the slowest stage subject to every stage's memory fitting the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.errors import SpecError


@dataclass
class Cut:
    """The stages: `bounds[s]` = (first position, last position + 1) of stage s in the order."""

    bounds: list[tuple[int, int]]
    times_s: list[float]
    memory_bytes: list[float]
    send_bytes: list[float]


def live_after(order: list[str], inputs_of: dict[str, list[str]], nbytes: dict[str, float],
               skip: set[str]) -> tuple[np.ndarray, np.ndarray]:
    """(count, bytes) of the tensors live across a cut after each position."""
    pos = {name: i for i, name in enumerate(order)}
    last = {}
    for v in order:
        for u in inputs_of[v]:
            if u in pos and u not in skip:
                last[u] = max(last.get(u, -1), pos[v])
    count = np.zeros(len(order) + 1)
    size = np.zeros(len(order) + 1)
    for u, end in last.items():
        start = pos[u]
        if end > start:
            count[start] += 1
            count[end] -= 1
            size[start] += nbytes[u]
            size[end] -= nbytes[u]
    return np.cumsum(count)[:-1], np.cumsum(size)[:-1]


def partition(order: list[str], time_s: np.ndarray, param_bytes: np.ndarray, act_bytes: np.ndarray,
              live_count: np.ndarray, live_bytes: np.ndarray, send_s, pp: int, micro_batches: int,
              budget: float | None) -> Cut:
    """The cut minimising the slowest stage (module docstring). `send_s(nbytes)`: seconds to send nbytes to
    the next stage."""
    n = len(order)
    if pp == 1:
        return Cut([(0, n)], [float(time_s.sum())], [float(param_bytes.sum() + act_bytes.sum())], [0.0])
    if n < pp:
        raise SpecError(f"pp: {pp} stages need at least {pp} ops; the graph has {n}")
    interior = live_count[:-1]
    candidates: list[int] = []
    for limit in sorted(set(interior[interior > 0].tolist())):
        candidates = [i for i in range(n - 1) if 0 < interior[i] <= limit]
        if len(candidates) >= 4 * pp:
            break
    if len(candidates) < pp - 1:
        candidates = list(range(n - 1))
    cuts = [-1] + candidates + [n - 1]  # a stage runs from cuts[a] + 1 to cuts[b]
    t_pre = np.concatenate([[0.0], np.cumsum(time_s)])
    p_pre = np.concatenate([[0.0], np.cumsum(param_bytes)])
    a_pre = np.concatenate([[0.0], np.cumsum(act_bytes)])
    k = len(cuts)
    inf = float("inf")
    best = np.full((pp + 1, k), inf)
    back = np.zeros((pp + 1, k), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, pp + 1):
        held = min(micro_batches, pp - s + 1)
        for b in range(1, k):
            end = cuts[b]
            if (s == pp) != (b == k - 1):
                continue
            send = 0.0 if b == k - 1 else send_s(live_bytes[end])
            for a in range(b):
                if best[s - 1, a] == inf:
                    continue
                start = cuts[a] + 1
                mem = p_pre[end + 1] - p_pre[start] + held * (a_pre[end + 1] - a_pre[start])
                if budget is not None and mem > budget:
                    continue
                stage = t_pre[end + 1] - t_pre[start] + send
                value = max(best[s - 1, a], stage)
                if value < best[s, b]:
                    best[s, b], back[s, b] = value, a
    if best[pp, k - 1] == inf:
        raise SpecError(f"memory_budget_bytes: no split into {pp} pipeline stages fits "
                        f"{(budget or 0) / 2**30:.3g} GiB per device")
    bounds, b = [], k - 1
    for s in range(pp, 0, -1):
        a = back[s, b]
        bounds.append((cuts[a] + 1, cuts[b] + 1))
        b = a
    bounds.reverse()
    times, mems, sends = [], [], []
    for s, (lo, hi) in enumerate(bounds):
        held = min(micro_batches, pp - s)
        send = 0.0 if s == pp - 1 else float(live_bytes[hi - 1])
        times.append(float(t_pre[hi] - t_pre[lo]) + (send_s(send) if send else 0.0))
        mems.append(float(p_pre[hi] - p_pre[lo] + held * (a_pre[hi] - a_pre[lo])))
        sends.append(send)
    return Cut(bounds, times, mems, sends)
