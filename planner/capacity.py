"""Capacity planning: for several GPU counts, the best plan, the time to train a token budget (with the time
lost to failures and checkpoints, planner.goodput), the GPU-hours, the cost and the energy; with a deadline, the
cheapest count that meets it.

GPU counts (`gpus`): a count, a list of counts, or text: `1024`, `256,512,1024`, `A:B` or `A:B:STEP`.
`A:B` means A, B and every count of a power-of-two number of whole nodes between them (gpus_per_node x 1, 2, 4,
...: on 8-GPU nodes 256:4096 is 256, 512, 1024, 2048, 4096, and 300:1000 is 300, 512, 1000); `A:B:STEP` means
A, A + STEP, ... up to B. With more than one count, a count is left out (and `skipped` says why) where it
exceeds the cluster's max_gpus, or where it shares no factor with the global batch (only dp = 1 layouts would
be possible: every GPU in tp·cp·pp); when no count is left, that is a SpecError naming each count's reason.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from planner.api import ClusterRef, ModelRef, plan
from planner.errors import SpecError, short_repr
from planner.goodput import HOUR_S, goodput, goodput_options
from planner.specs import ClusterSpec, PlanResult
from planner.specs.base import MAX_GPUS
from planner.specs.capacity import CapacityResult, CapacityRow
from profiles import load_cluster

#: The most GPU counts one capacity question runs (each is a full search).
MAX_SIZES = 64
#: Decimal multipliers of a token budget's suffix.
TOKEN_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
#: Seconds per unit of a deadline's suffix (hours, days, weeks).
DURATION_UNITS = {"h": 3600.0, "d": 86_400.0, "w": 604_800.0}
#: The largest token budget accepted: 10^18 tokens, far beyond any corpus; keeps every time finite.
MAX_TOKENS = 1e18
#: PUE bounds: a data centre cannot use less energy than its IT load (1.0); 10 is far beyond any real one.
PUE_RANGE = (1.0, 10.0)
#: Joules per megawatt-hour.
J_PER_MWH = 3.6e9

_COUNT = re.compile(r"[0-9]{1,10}", re.ASCII)  # MAX_GPUS (2**32) has 10 digits


def parse_tokens(value: Any, field: str = "tokens") -> float:
    """A token budget: a positive number, or text with an optional decimal suffix K, M, B or T (`15T` = 15e12)."""
    if isinstance(value, str):
        text = value.strip()
        scale = TOKEN_SUFFIXES.get(text[-1:].upper(), 1.0) if text else 1.0
        number = text[:-1] if scale != 1.0 else text
        try:
            amount = float(number) * scale
        except ValueError:
            amount = math.nan
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        amount = float(value)
    else:
        amount = math.nan
    if not 0 < amount <= MAX_TOKENS:  # NaN fails too
        raise SpecError(f"{field} must be a positive number of tokens up to {MAX_TOKENS:g}, optionally with a "
                        f"decimal suffix K, M, B or T, e.g. 15T (got {short_repr(value)})")
    return amount


def parse_duration(value: Any, field: str = "deadline") -> float:
    """A duration in seconds: a positive number of seconds, or text `36h`, `30d`, `2w`."""
    seconds = math.nan
    if isinstance(value, str):
        text = value.strip()
        unit = DURATION_UNITS.get(text[-1:].lower()) if text else None
        if unit is not None:
            try:
                seconds = float(text[:-1]) * unit
            except ValueError:
                pass
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    if not 0 < seconds < math.inf:
        raise SpecError(f"{field} must be a positive duration: a number with a unit h, d or w, e.g. 30d "
                        f"(got {short_repr(value)})")
    return seconds


def parse_price(value: Any, field: str = "price_per_gpu_hour") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise SpecError(f"{field} must be a finite price per GPU-hour >= 0 (got {short_repr(value)})")
    return float(value)


def parse_pue(value: Any, field: str = "pue") -> float:
    low, high = PUE_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise SpecError(f"{field} must be a power usage effectiveness between {low:g} and {high:g} (1.0: the GPU "
                        f"boards alone) (got {short_repr(value)})")
    return float(value)


def _count(text: str, what: str) -> int:
    if not _COUNT.fullmatch(text.strip()):
        raise SpecError(f"gpus: {what} must be a whole number of GPUs (got {short_repr(text)}); write N, "
                        "N1,N2,... or a range A:B[:STEP]")
    return int(text.strip())


def gpu_sizes(gpus: Any, gpus_per_node: int) -> tuple[list[int], str]:
    """The GPU counts `gpus` names, ascending, and the rule that chose them (module docstring)."""
    if isinstance(gpus, int) and not isinstance(gpus, bool):
        return [gpus], "one count"
    if isinstance(gpus, Sequence) and not isinstance(gpus, str):
        sizes = list(gpus)
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) for n in sizes):
            raise SpecError(f"gpus must be a non-empty list of whole GPU counts (got {short_repr(gpus)})")
        rule = "the counts given"
    elif isinstance(gpus, str):
        text = gpus.strip()
        if ":" in text:
            parts = text.split(":")
            if len(parts) > 3:
                raise SpecError(f"gpus: a range is A:B[:STEP] (got {short_repr(gpus)})")
            low, high = _count(parts[0], "A of A:B"), _count(parts[1], "B of A:B")
            if not 1 <= low <= high:
                raise SpecError(f"gpus: a range A:B needs 1 <= A <= B (got {short_repr(gpus)})")
            if len(parts) == 3:
                step = _count(parts[2], "the STEP of A:B[:STEP]")
                if step < 1:
                    raise SpecError(f"gpus: the STEP of A:B[:STEP] must be at least 1 (got {short_repr(gpus)})")
                if (high - low) // step + 1 > MAX_SIZES:
                    raise SpecError(f"gpus: {gpus.strip()} names {(high - low) // step + 1:,} counts; at most "
                                    f"{MAX_SIZES} (a larger STEP)")
                sizes, rule = list(range(low, high + 1, step)), f"{low} to {high} in steps of {step}"
            else:
                sizes, nodes = {low, high}, 1
                while nodes * gpus_per_node <= high:
                    if nodes * gpus_per_node >= low:
                        sizes.add(nodes * gpus_per_node)
                    nodes *= 2
                sizes, rule = sorted(sizes), (f"{low}, {high} and every power-of-two number of "
                                              f"{gpus_per_node}-GPU nodes between")
        else:
            sizes = [_count(t, "each count") for t in text.split(",")]
            if len(sizes) == 1:  # planner.plan checks one count as it checks num_gpus
                return sizes, "one count"
            rule = "the counts given"
    else:
        raise SpecError(f"gpus must be a GPU count, a list of counts or text N, N1,N2 or A:B[:STEP] "
                        f"(got {short_repr(gpus)})")
    if len(set(sizes)) != len(sizes):
        raise SpecError(f"gpus: each count once (got {short_repr(gpus)})")
    if len(sizes) > MAX_SIZES:
        raise SpecError(f"gpus: at most {MAX_SIZES} counts (got {len(sizes)})")
    if min(sizes) < 1:
        raise SpecError(f"gpus: every count must be at least 1 (got {short_repr(gpus)})")
    return sorted(sizes), rule


def usable_sizes(sizes: list[int], cluster: ClusterSpec, global_batch_size: int) -> tuple[list[int], list[str]]:
    """The counts worth a search and, for each one left out, why (module docstring); a SpecError naming every
    reason when none is left."""
    limit = min(MAX_GPUS, cluster.max_gpus or MAX_GPUS)
    keep, skipped = [], []
    for n in sizes:
        if n > limit:
            skipped.append(f"{n}: exceeds cluster {cluster.name}'s max_gpus ({limit})")
        elif n > 1 and math.gcd(n, global_batch_size) == 1:
            skipped.append(f"{n}: shares no factor with the global batch ({global_batch_size}), so only dp=1 "
                           "layouts are possible")
        else:
            keep.append(n)
    if not keep:
        raise SpecError("gpus: no count is valid for cluster " f"{cluster.name} and global_batch_size "
                        f"{global_batch_size}: " + "; ".join(skipped))
    return keep, skipped


def _no_plan_reason(result: PlanResult) -> str:
    if not result.stats.num_valid:
        rules = ", ".join(f"{r.rule} {r.count:,}" for r in result.rejections[:3])
        return f"0 valid strategies ({rules})" if rules else "0 valid strategies"
    near = result.closest[0].estimate.reasons[0] if result.closest and result.closest[0].estimate.reasons else ""
    return "no strategy fits" + (f": closest {near}" if near else "")


def plan_capacity(model: ModelRef, cluster: ClusterRef, gpus: Any, global_batch_size: int, seq_len: int,
                  tokens: Any = None, price_per_gpu_hour: float | None = None, deadline_s: Any = None,
                  pue: float = 1.0, failure_rate_per_gpu_hour: float | None = None,
                  node_write_bw_bytes_per_s: float | None = None,
                  aggregate_write_bw_bytes_per_s: float | None = None, restart_s: float | None = None,
                  **plan_options: Any) -> CapacityResult:
    """Plan each GPU count of `gpus` (module docstring) and say what training `tokens` takes on its best plan.

    `tokens`: a number or text with a decimal suffix (`15T`); without it there is no time, cost or energy.
    `price_per_gpu_hour` prices the GPU-hours; `deadline_s` (seconds, or text `30d`, `36h`, `2w`; needs `tokens`)
    picks `chosen`, the cheapest count whose expected time to train meets it. `pue` multiplies the GPU board
    energy (1.0: boards only). Goodput options as planner.goodput.goodput. Other keyword arguments go to
    planner.plan for every count (precision, constraints, headroom, ranking, calibration, strict_numerics,
    TrainSpec options; `top_k` is 1)."""
    budget = None if tokens is None else parse_tokens(tokens)
    price = None if price_per_gpu_hour is None else parse_price(price_per_gpu_hour)
    deadline = None if deadline_s is None else parse_duration(deadline_s, "deadline_s")
    if deadline is not None and budget is None:
        raise SpecError("deadline_s needs tokens: the time to train is the token budget over the throughput")
    pue = parse_pue(pue)
    goodput_options(failure_rate_per_gpu_hour, node_write_bw_bytes_per_s, aggregate_write_bw_bytes_per_s, restart_s)
    if "top_k" in plan_options or "num_gpus" in plan_options:
        raise SpecError("plan_capacity plans each count of `gpus` for its best plan: drop top_k and num_gpus")
    cluster_spec = load_cluster(cluster)
    sizes, rule = gpu_sizes(gpus, cluster_spec.gpus_per_node)
    skipped: list[str] = []
    if len(sizes) > 1:
        sizes, skipped = usable_sizes(sizes, cluster_spec, global_batch_size)
    rows, names = [], ("", "", "")
    for n in sizes:
        result = plan(model, cluster, n, global_batch_size, seq_len, top_k=1, **plan_options)
        names = (result.model.name, result.cluster.name, result.cluster.gpu.name)
        rows.append(capacity_row(result, budget, price, deadline, pue, failure_rate_per_gpu_hour,
                                 node_write_bw_bytes_per_s, aggregate_write_bw_bytes_per_s, restart_s))
    meeting = [r for r in rows if r.meets_deadline]
    chosen = min(meeting, key=lambda r: (r.cost if r.cost is not None else r.gpu_hours, r.num_gpus),
                 default=None)
    return CapacityResult(model=names[0], cluster=names[1], gpu=names[2], global_batch_size=global_batch_size,
                          seq_len=seq_len, tokens=budget, price_per_gpu_hour=price, deadline_s=deadline, pue=pue,
                          sizes_rule=rule, skipped=skipped, rows=rows,
                          chosen=None if chosen is None else chosen.num_gpus)


def capacity_row(result: PlanResult, tokens: float | None = None, price: float | None = None,
                 deadline: float | None = None, pue: float = 1.0, failure_rate: float | None = None,
                 node_bw: float | None = None, aggregate_bw: float | None = None,
                 restart_s: float | None = None) -> CapacityRow:
    """One search's row: its best plan, goodput and (with a token budget) time, GPU-hours, cost and energy;
    the arguments as plan_capacity's, already checked."""
    n, gpu = result.num_gpus, result.cluster.gpu
    nodes = -(-n // result.cluster.gpus_per_node)
    if not result.plans:
        return CapacityRow(num_gpus=n, num_nodes=nodes, plan=None, reason=_no_plan_reason(result))
    best = result.plans[0]
    est = best.estimate
    good = goodput(result.model, result.train, result.cluster, n, failure_rate, node_bw, aggregate_bw, restart_s)
    row: dict[str, Any] = dict(num_gpus=n, num_nodes=nodes, plan=best, step_time_s=est.step_time_s,
                               tokens_per_s=est.tokens_per_s, mfu=est.mfu, goodput=good)
    if tokens is not None:
        ideal = tokens / est.tokens_per_s
        wall = ideal / good.fraction if good.fraction > 0 else math.inf
        gpu_hours = n * wall / HOUR_S
        row.update(time_to_train_s=ideal, time_to_train_goodput_s=wall, gpu_hours=gpu_hours,
                   cost=None if price is None else gpu_hours * price,
                   meets_deadline=None if deadline is None else wall <= deadline)
        if gpu.board_power_w is None:
            row["energy_note"] = (f"no energy for GPU {gpu.name}, whose board power is unknown: "
                                  f"{gpu.board_power_source or 'its profile gives no board_power_w'}")
        else:
            row["energy_j"] = gpu.board_power_w * gpu_hours * HOUR_S * pue
    return CapacityRow(**row)
