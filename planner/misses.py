"""Why the other candidates lost: every reason the search set candidates aside, how many, and the nearest miss
of each (`rejected_by_reason`).

The search counts each candidate it does not rank once, under the first reason it meets (SearchStats.rejected):
a rule of planner.rules (a degree that does not divide, a schedule Megatron cannot run) before scoring, or its
memory after. The nearest miss of a reason is the candidate it set aside that came closest to being ranked:
- memory: the smallest excess over the limit (GPU memory less the headroom; the host's for an offloaded
  optimizer), with the step time it would have had (scored here where the search did not time it);
- a rule: among the candidates whose first broken rule it is, one that breaks that rule only (it would have been
  scored without it), the one whose layout is closest to plan 1's (fewest degrees apart, each by its factor of
  two), with the rule's own message.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from planner.errors import SpecError
from planner.rules import RULES, Context, check
from planner.search import evaluate_one
from planner.space import enumerate_space
from planner.specs import PlanResult, Strategy

GIB = 2**30
#: The degrees whose distance decides which rule-rejected candidate is nearest plan 1 (log2 apart each).
DEGREES = ("dp", "tp", "pp", "cp", "ep", "etp", "vpp", "micro_batch_size", "zero_stage")


class Miss(BaseModel):
    """One reason candidates were set aside: how many, and the nearest miss."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reason: str = Field(description="The reason's key, as SearchStats.rejected counts it.")
    kind: str = Field(description="'rule' (broke a rule before scoring) or 'memory' (did not fit).")
    count: int = Field(description="Candidates set aside for it (each under its first reason).")
    nearest: Strategy | None = Field(None, description="The nearest miss (None where the search's variants alone "
                                     "met the reason: the offload and settings twins are not enumerated again).")
    detail: str = Field("", description="Why the nearest miss was set aside, with how far it was from passing.")
    step_time_s: float | None = Field(None, description="Memory misses: the nearest miss's predicted step, "
                                      "seconds.")
    peak_memory_bytes: float | None = Field(None, description="Memory misses: its peak memory, bytes.")
    versus_best: float | None = Field(None, description="Memory misses: its step over plan 1's, minus 1 "
                                      "(negative: it would have been faster).")


def rejected_by_reason(result: PlanResult) -> list[Miss]:
    """Every reason of `result.stats.rejected`, most candidates first, with its nearest miss. Needs the search's
    candidate table (`PlanResult.candidates`): a result read back from JSON refuses."""
    table = result.candidates
    best = result.plans[0] if result.plans else None
    out: list[Miss] = []
    memory_labels = {label: code for code, label in enumerate(table.reason_labels) if code}
    rules = {r.key: r for r in RULES}
    rule_keys = [k for k in result.stats.rejected if k in rules]
    rule_misses = _rule_misses(result, rule_keys, best.strategy if best else None) if rule_keys else {}
    for reason, count in sorted(result.stats.rejected.items(), key=lambda kv: -kv[1]):
        if reason in memory_labels:
            out.append(_memory_miss(result, reason, memory_labels[reason], count, best))
        elif reason in rules:
            strategy, message = rule_misses.get(reason, (None, ""))
            out.append(Miss(reason=reason, kind="rule", count=count, nearest=strategy,
                            detail=message or "met only by the search's offload and settings variants"))
        else:
            raise SpecError(f"unknown rejection reason {reason!r}: neither a rule of planner.rules nor a memory "
                            "reason of the candidate table")
    return out


def _memory_miss(result: PlanResult, reason: str, code: int, count: int, best) -> Miss:
    table = result.candidates
    rows = np.flatnonzero(table.reason == code)
    if not len(rows):  # counted among the search's variants only: never the case for memory reasons
        return Miss(reason=reason, kind="memory", count=count)
    host = reason.startswith("host memory")
    if host:
        excess = table.host_memory_bytes[rows] - table.host_capacity_bytes
        limit = table.host_capacity_bytes
    else:
        # inside the headroom: over the limit, under the capacity; over the capacity: by how much over the limit
        excess = table.peak_memory_bytes[rows] - table.memory_limit_bytes
        limit = table.memory_limit_bytes
    i = int(rows[np.argmin(excess)])
    strategy = table.strategy(i)
    step = float(table.step_time_s[i])
    train = table.trains[int(table.variant[i])]
    if not math.isfinite(step):  # over the limit, so not timed by the search: scored here
        step = evaluate_one(result.model, result.cluster, train, strategy).step_time_s
    where = "host memory per GPU" if host else "GPU memory limit"
    detail = (f"{_size(float(np.min(excess)))} over the {limit / GIB:.1f} GiB {where}"
              + ("" if host else f" (peak {table.peak_memory_bytes[i] / GIB:.1f} GiB)"))
    versus = step / best.estimate.step_time_s - 1.0 if best is not None else None
    if versus is not None:
        detail += f"; it would run {abs(versus):.0%} {'faster' if versus < 0 else 'slower'} than plan 1"
    return Miss(reason=reason, kind="memory", count=count, nearest=strategy, detail=detail, step_time_s=step,
                peak_memory_bytes=float(table.peak_memory_bytes[i]), versus_best=versus)


def _size(n: float) -> str:
    """0.8 GiB, or 37 MiB below a tenth of a GiB (a miss by a hair shows as one)."""
    return f"{n / GIB:.1f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:.0f} MiB"


def _rule_misses(result: PlanResult, keys: list[str], best: Strategy | None) -> dict[str, tuple[Strategy, str]]:
    """For each rule key, its nearest miss and the rule's message for it, from the question's candidate space
    enumerated again (the search keeps only the valid ones)."""
    table = result.candidates
    ctx = Context(result.model, result.train, result.num_gpus, result.cluster)
    constraints = {k: v for k, v in table.constraints.items()}
    if "offload_optimizer" not in constraints:
        constraints["offload_optimizer"] = False  # as the search's first pass (its twins are not enumerated)
    every = enumerate_space(result.model, result.train, result.num_gpus, constraints, result.cluster)
    _, failures = check(ctx, every)
    broken = np.zeros(len(every), dtype=np.int64)
    first = np.full(len(every), -1, dtype=np.int64)
    for n, rule in enumerate(RULES):
        mask = failures[rule.key]
        first = np.where((first < 0) & mask, n, first)
        broken += mask
    distance = _distance(every, best)
    out = {}
    for key in keys:
        n = next(j for j, r in enumerate(RULES) if r.key == key)
        rows = np.flatnonzero(first == n)
        if not len(rows):
            continue
        only = rows[broken[rows] == 1]
        pool = only if len(only) else rows
        i = int(pool[np.argmin(distance[pool])])
        row = every.row(i)
        try:
            strategy = Strategy(**row)
        except ValueError:  # a combination Strategy itself refuses: shown as enumerated
            strategy = Strategy.model_construct(**row)
        out[key] = (strategy, RULES[n].message(ctx, row))
    return out


def _distance(every, best: Strategy | None) -> np.ndarray:
    """How far each candidate's degrees are from plan 1's: the sum of |log2| of their ratios (0 without a plan)."""
    if best is None:
        return np.zeros(len(every))
    total = np.zeros(len(every))
    for name in DEGREES:
        mine = np.asarray(getattr(every, name), dtype=float)
        theirs = float(getattr(best, name))
        total += np.abs(np.log2(np.maximum(mine, 0) + 1) - np.log2(theirs + 1))
    return total
