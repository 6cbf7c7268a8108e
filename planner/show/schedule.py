"""A pipeline schedule as timed blocks: Megatron's 1F1B (vpp = 1) and interleaved 1F1B (vpp > 1), simulated from
each pipeline rank's time for one micro-batch (`Estimate.stages`). The schedule picture draws it; its idle time
is the pipeline bubble the cost model charges as (pp - 1)/vpp micro-batches of the slowest rank.

Orders (what each rank runs, in turn):
- 1F1B (SC'21 Sec. 2.2, Megatron-core's `forward_backward_pipelining_without_interleaving`): rank r runs
  min(pp - r - 1, m) warm-up forwards, then one forward and one backward in turn, then the remaining backwards.
- interleaved 1F1B (Megatron-core's `forward_backward_pipelining_with_interleaving`): the rank's vpp chunks take
  micro-batches in groups of pp (chunk 0 runs micro-batches 0..pp-1, then chunk 1 the same ones, ...; the next
  group of pp after the last chunk); backwards walk the same table with the chunks reversed. Warm-up: (pp - r - 1)·2
  + (vpp - 1)·pp forwards, capped at m·vpp (all of them when m = pp, as Megatron does). Megatron needs m to be a
  multiple of pp here.

Dependencies: virtual stage v = chunk·pp + r (chunk c of rank r); a forward on v follows the same micro-batch's
forward on v - 1, a backward on v the backward on v + 1 (the last virtual stage's backward its own forward). A
rank runs one block at a time, each as soon as its rank is free and its input has arrived. Transfers take no time
here: the cost model charges them apart (`pp_comm`).

Each chunk of rank r takes forward_s[r]/vpp and backward_s[r]/vpp (a rank's chunks as equal shares of its time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.errors import SpecError

#: The largest schedule simulated (2·pp·vpp·m blocks): the simulation is plain Python, a few seconds at this size.
MAX_BLOCKS = 4_000_000


@dataclass(frozen=True)
class Block:
    """One forward ('F') or backward ('B') of one micro-batch through one chunk of one pipeline rank."""

    rank: int
    chunk: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Schedule:
    """The simulated step's pipeline part: every block, when the last one ends, each rank's idle time."""

    pp: int
    vpp: int
    num_microbatches: int
    #: Per rank, in the order the rank runs them.
    blocks: list[list[Block]]
    makespan_s: float
    #: Per rank: makespan minus the rank's busy time, seconds.
    idle_s: list[float]
    #: Per rank: one micro-batch's forward plus backward over all its chunks, seconds.
    microbatch_s: list[float] = field(default_factory=list)

    @property
    def slowest_rank(self) -> int:
        return max(range(self.pp), key=lambda r: self.microbatch_s[r])

    @property
    def bubble_fraction(self) -> float:
        """(makespan - m·t_mb) / (m·t_mb) of the slowest rank: the cost model's Estimate.bubble_fraction, from the
        simulation (equal to (pp - 1)/(vpp·m) when the stages are equal)."""
        busy = self.num_microbatches * self.microbatch_s[self.slowest_rank]
        return (self.makespan_s - busy) / busy if busy > 0 else 0.0


def rank_order(pp: int, vpp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """What rank `rank` runs, in turn: (kind, chunk, micro-batch), per the module docstring."""
    if vpp == 1:
        warm = min(pp - rank - 1, m)
        order = [("F", 0, i) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", 0, warm + i), ("B", 0, i)]
        return order + [("B", 0, i) for i in range(m - warm, m)]
    table = [(mb, c) for g in range(0, m, pp) for c in range(vpp) for mb in range(g, min(g + pp, m))]
    total = m * vpp
    warm = total if m == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    fwd = [("F", c, mb) for mb, c in table]
    bwd = [("B", vpp - 1 - c, mb) for mb, c in table]
    order = fwd[:warm]
    for k in range(total - warm):
        order += [fwd[warm + k], bwd[k]]
    return order + bwd[total - warm:]


def check_schedule(pp: int, vpp: int, m: int) -> None:
    """One SpecError line for a schedule Megatron would not run (or too large to simulate)."""
    for name, v in (("pp", pp), ("vpp", vpp), ("num_microbatches", m)):
        if not isinstance(v, int) or v < 1:
            raise SpecError(f"schedule {name} ({v!r}) must be a positive integer")
    if vpp > 1 and m % pp:
        raise SpecError(f"the interleaved schedule (vpp {vpp}) needs num_microbatches ({m}) to be a multiple of "
                        f"pp ({pp}), as Megatron's does")
    if 2 * pp * vpp * m > MAX_BLOCKS:
        raise SpecError(f"a schedule of {2 * pp * vpp * m:,} blocks (2·pp·vpp·m) is too large to simulate "
                        f"(at most {MAX_BLOCKS:,})")


def simulate(pp: int, vpp: int, m: int, forward_s: list[float], backward_s: list[float]) -> Schedule:
    """The timed schedule of one step's micro-batches. `forward_s[r]`, `backward_s[r]`: one micro-batch's forward
    and backward over all of rank r's chunks, seconds (each chunk a 1/vpp share)."""
    check_schedule(pp, vpp, m)
    if len(forward_s) != pp or len(backward_s) != pp:
        raise SpecError(f"schedule times: one forward and one backward per pipeline rank ({pp}), got "
                        f"{len(forward_s)} and {len(backward_s)}")
    for t in (*forward_s, *backward_s):
        if not (math.isfinite(t) and t >= 0):
            raise SpecError(f"schedule times must be finite and >= 0 (got {t!r})")
    orders = [rank_order(pp, vpp, m, r) for r in range(pp)]
    stages = pp * vpp
    f_end = [[math.nan] * m for _ in range(stages)]
    b_end = [[math.nan] * m for _ in range(stages)]
    done = [0] * pp
    free = [0.0] * pp
    blocks: list[list[Block]] = [[] for _ in range(pp)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = 0
        for r in range(pp):
            order = orders[r]
            while done[r] < len(order):
                kind, c, mb = order[done[r]]
                v = c * pp + r
                if kind == "F":
                    ready = f_end[v - 1][mb] if v > 0 else 0.0
                else:
                    ready = b_end[v + 1][mb] if v < stages - 1 else f_end[v][mb]
                if math.isnan(ready):
                    break
                start = max(free[r], ready)
                end = start + (forward_s[r] if kind == "F" else backward_s[r]) / vpp
                (f_end if kind == "F" else b_end)[v][mb] = end
                blocks[r].append(Block(r, c, mb, kind, start, end))
                free[r] = end
                done[r] += 1
                moved += 1
        if not moved:  # an order whose inputs never arrive: a bug in rank_order, not the user's
            raise RuntimeError(f"the pipeline schedule (pp {pp}, vpp {vpp}, m {m}) deadlocks")
        remaining -= moved
    makespan = max(free)
    busy = [m * (forward_s[r] + backward_s[r]) for r in range(pp)]
    return Schedule(pp=pp, vpp=vpp, num_microbatches=m, blocks=blocks, makespan_s=makespan,
                    idle_s=[makespan - b for b in busy], microbatch_s=[f + b for f, b in zip(forward_s, backward_s)])


def stage_times(estimate, pp: int) -> tuple[list[float], list[float], bool]:
    """Per pipeline rank one micro-batch's forward and backward seconds from an Estimate's `stages`, and whether
    they are its own. Without stages (a file written before they were kept) every rank gets the slowest rank's
    micro-batch from the step's per-micro-batch terms, split one third forward (equal stages assumed)."""
    if estimate.stages:
        return ([s.forward_s for s in estimate.stages], [s.backward_s for s in estimate.stages], True)
    m = max(int(estimate.num_microbatches), 1)
    per_mb = sum(v for k, v in estimate.time_s.items()
                 if k not in ("pp_comm", "pp_bubble", "dp_comm", "optimizer")) / m
    return [per_mb / 3] * pp, [2 * per_mb / 3] * pp, False
