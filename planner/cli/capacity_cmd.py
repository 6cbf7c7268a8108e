"""`meshplan plan` with several GPU counts, a token budget, a price or a deadline: the capacity table
(planner.capacity), and the goodput, time, cost and energy lines under a single plan's table."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional

import typer
from rich.table import Table

from planner.capacity import (J_PER_MWH, capacity_row, gpu_sizes, parse_duration, parse_price, parse_pue,
                              parse_tokens, plan_capacity)
from planner.cli.common import ExitWith, Format, emit_csv, emit_json, stdout
from planner.cli.text import MESSAGE_CHARS, plain, shown
from planner.errors import SpecError
from planner.goodput import (DEFAULT_NODE_WRITE_BW_BYTES_PER_S, DEFAULT_RESTART_S, HOUR_S, goodput_options)
from planner.show.labels import layout_label
from planner.specs import PlanResult
from planner.specs.capacity import CapacityResult, CapacityRow, Goodput

#: From this many GPUs, `plan` prints the goodput line under its table: failures then cost more than a few
#: percent of the run (at the default rate, one every two days at 1,024 GPUs).
GOODPUT_LINE_MIN_GPUS = 1024
DAY_S = 86_400.0

GpusArgOpt = Annotated[str, typer.Option(
    "--gpus", "-n", help="GPUs in the job: a count (1024), or several for the capacity table: a list "
    "(256,512,1024), a range A:B (A, B and every power-of-two number of whole nodes between) or A:B:STEP.")]
TokensOpt = Annotated[Optional[str], typer.Option(
    "--tokens", help="Token budget to train, with a decimal suffix K, M, B or T (15T): adds the time to train "
    "(ideal and with goodput), GPU-hours and GPU board energy.")]
PriceOpt = Annotated[Optional[float], typer.Option(
    "--price", help="Price of one GPU-hour (with --tokens): adds the cost.")]
DeadlineOpt = Annotated[Optional[str], typer.Option(
    "--deadline", help="Wall time the training must fit in, with a unit h, d or w (30d; with --tokens): picks "
    "the cheapest GPU count that meets it (exit 1 if none does).")]
PueOpt = Annotated[Optional[float], typer.Option(
    "--pue", help="Power usage effectiveness the energy is multiplied by (default 1.0: the GPU boards' rated "
    "power alone, no host, network or cooling).")]
FailureRateOpt = Annotated[Optional[float], typer.Option(
    "--failure-rate", help="Job-interrupting failures per GPU-hour (default 1.97e-5: Llama 3 405B's 419 "
    "unexpected interruptions in 54 days on 16,384 GPUs).")]
CkptBandwidthOpt = Annotated[Optional[float], typer.Option(
    "--ckpt-bandwidth", help="Aggregate storage write bandwidth for checkpoints, GB/s (default: 5 GB/s per node, "
    "assumed, uncapped).")]


@dataclass(frozen=True)
class CapacityArgs:
    """The capacity options of `plan`, checked once before any search."""

    gpus: str
    num_gpus: int | None  # the count when --gpus names one
    tokens: float | None
    price: float | None
    deadline_s: float | None
    pue: float
    failure_rate: float | None
    aggregate_bw: float | None

    @classmethod
    def parse(cls, gpus: str, tokens: str | None, price: float | None, deadline: str | None, pue: float | None,
              failure_rate: float | None, ckpt_bandwidth: float | None) -> "CapacityArgs":
        sizes, _ = gpu_sizes(gpus, 1)  # the form only: the cluster's node size matters for A:B alone
        budget = None if tokens is None else parse_tokens(tokens, "--tokens")
        for flag, value in (("--price", price), ("--deadline", deadline), ("--pue", pue)):
            if value is not None and budget is None:
                raise SpecError(f"{flag} needs --tokens (the token budget whose time, cost or energy it prices)")
        aggregate = None if ckpt_bandwidth is None else ckpt_bandwidth * 1e9
        try:
            goodput_options(failure_rate, None, aggregate, None)
        except SpecError as exc:
            raise SpecError(str(exc).replace("failure_rate_per_gpu_hour", "--failure-rate")
                            .replace("aggregate_write_bw_bytes_per_s", "--ckpt-bandwidth (GB/s)")) from None
        return cls(gpus=gpus, num_gpus=sizes[0] if len(sizes) == 1 and ":" not in gpus else None, tokens=budget,
                   price=None if price is None else parse_price(price, "--price"),
                   deadline_s=None if deadline is None else parse_duration(deadline, "--deadline"),
                   pue=1.0 if pue is None else parse_pue(pue, "--pue"), failure_rate=failure_rate,
                   aggregate_bw=aggregate)

    def table_wanted(self, fmt: Format) -> bool:
        """The capacity table rather than the plan table: several counts, a deadline, or a token budget in
        JSON / CSV (the plan table's JSON stays the PlanResult)."""
        return self.num_gpus is None or self.deadline_s is not None or (self.tokens is not None
                                                                        and fmt is not Format.table)


def run_capacity(args: CapacityArgs, plan_kwargs: dict[str, Any], fmt: Format, plot: Any, searching: Callable) -> None:
    """Plan every count and print the capacity table (or its JSON / CSV); exit 1 when no count has a plan or
    none meets the deadline."""
    if plot is not None:
        raise SpecError("--plot draws one plan's pictures: give --gpus a single count without --deadline")
    kwargs = {k: v for k, v in plan_kwargs.items() if k not in ("num_gpus", "top_k")}
    with searching(f"searching strategies for each GPU count of {args.gpus}"):
        result = plan_capacity(gpus=args.gpus, tokens=args.tokens, price_per_gpu_hour=args.price,
                               deadline_s=args.deadline_s, pue=args.pue, failure_rate_per_gpu_hour=args.failure_rate,
                               aggregate_write_bw_bytes_per_s=args.aggregate_bw, **kwargs)
    if fmt is Format.json:
        emit_json(result.model_dump(mode="json"))
    elif fmt is Format.csv:
        emit_csv([csv_row(r, result) for r in result.rows])
    else:
        print_capacity(result, args.aggregate_bw)
    if not any(r.plan for r in result.rows):
        raise ExitWith(1, "no GPU count has a plan: " + "; ".join(f"{r.num_gpus}: {r.reason}" for r in result.rows))
    if result.deadline_s is not None and result.chosen is None:
        fastest = min((r for r in result.rows if r.time_to_train_goodput_s is not None),
                      key=lambda r: r.time_to_train_goodput_s)
        raise ExitWith(1, f"no GPU count meets the deadline of {days(result.deadline_s)}: the fastest, "
                          f"{fastest.num_gpus:,} GPUs, takes {days(fastest.time_to_train_goodput_s)}")


def days(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if math.isinf(seconds):
        return "never"
    return f"{seconds / 3600:.1f} h" if seconds < DAY_S else f"{seconds / DAY_S:,.1f} d"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def tokens_words(tokens: float) -> str:
    """`15T tokens`, `1B tokens`, `250M tokens`: the budget with the largest suffix that keeps it at least 1."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if tokens >= scale:
            return f"{tokens / scale:g}{suffix} tokens"
    return f"{tokens:g} tokens"


def amount(value: float) -> str:
    """`3.746M` from a million up, `12,345` below: GPU-hours and costs."""
    return f"{value / 1e6:,.3f}M" if value >= 1e6 else f"{value:,.0f}"


def table_units(result: CapacityResult) -> dict[str, tuple[float, str]]:
    """Each scaled column's divisor and header, from its largest value: days from two days up (else hours),
    GPU-hours and cost in millions from a million up, energy in MWh from one MWh up (else kWh)."""
    rows = [r for r in result.rows if r.time_to_train_goodput_s is not None]
    longest = max((r.time_to_train_goodput_s for r in rows), default=0.0)
    hours = max((r.gpu_hours or 0.0 for r in rows), default=0.0)
    cost = max((r.cost or 0.0 for r in rows), default=0.0)
    energy = max((r.energy_j or 0.0 for r in rows), default=0.0)
    return {"time": (DAY_S, "days") if longest >= 2 * DAY_S else (3600.0, "hours"),
            "gpu_hours": (1e6, "GPU-hours (M)") if hours >= 1e6 else (1.0, "GPU-hours"),
            "cost": (1e6, "cost (M)") if cost >= 1e6 else (1.0, "cost"),
            "energy": (J_PER_MWH, "MWh") if energy >= J_PER_MWH else (J_PER_MWH / 1e3, "kWh")}


def capacity_cells(r: CapacityRow, result: CapacityResult) -> list[str]:
    mark = "*" if result.chosen == r.num_gpus else ("x" if r.meets_deadline is False else "")
    cells = [f"{r.num_gpus:,}{mark}", layout_label(r.plan.strategy, r.plan.train) if r.plan else "none (below)",
             _num(r.step_time_s, ".3f"), _num(None if r.tokens_per_s is None else r.tokens_per_s / 1e6, ".3f"),
             _num(None if r.mfu is None else 100 * r.mfu, ".1f"),
             _num(None if r.goodput is None else 100 * r.goodput.fraction, ".1f")]
    if result.tokens is not None:
        u = table_units(result)
        (t, _), (g, _), (c, _), (e, _) = u["time"], u["gpu_hours"], u["cost"], u["energy"]
        cells += [_num(None if r.time_to_train_s is None else r.time_to_train_s / t, ",.1f"),
                  _num(None if r.time_to_train_goodput_s is None else r.time_to_train_goodput_s / t, ",.1f"),
                  _num(None if r.gpu_hours is None else r.gpu_hours / g, ",.3f" if g > 1 else ",.0f")]
        if result.price_per_gpu_hour is not None:
            cells.append(_num(None if r.cost is None else r.cost / c, ",.2f" if c > 1 else ",.0f"))
        cells.append(_num(None if r.energy_j is None else r.energy_j / e, ",.0f"))
    return cells


def capacity_columns(result: CapacityResult) -> list[str]:
    cols = ["GPUs", "layout", "step (s)", "Mtok/s", "MFU %", "goodput %"]
    if result.tokens is not None:
        u = table_units(result)
        unit = u["time"][1]
        cols += [f"ideal {unit}", f"{unit} w/ goodput", u["gpu_hours"][1]]
        if result.price_per_gpu_hour is not None:
            cols.append(u["cost"][1])
        cols.append(u["energy"][1])
    return cols


def print_capacity(result: CapacityResult, aggregate_bw: float | None = None) -> None:
    """The capacity table and its lines: how the counts were chosen, what was left out, the goodput and energy
    basis, and the deadline's answer."""
    question = (f"{shown(result.model)} on {shown(result.cluster)} ({shown(result.gpu)}), global batch "
                f"{result.global_batch_size} x {result.seq_len} tokens")
    budget = [tokens_words(result.tokens)] if result.tokens is not None else []
    if result.price_per_gpu_hour is not None:
        budget.append(f"{result.price_per_gpu_hour:g} per GPU-hour")
    if result.deadline_s is not None:
        budget.append(f"deadline {days(result.deadline_s)}")
    lines = [question] + ([f"to train: {', '.join(budget)}"] if budget else [])
    table = Table(title="capacity: the best plan per GPU count", title_justify="left", box=None, pad_edge=False,
                  padding=(0, 1), header_style="bold underline")
    for col in capacity_columns(result):
        # headers wrap at their spaces, never inside a word; numbers (no spaces) stay whole
        table.add_column(col, justify="left" if col == "layout" else "right", no_wrap=col == "layout",
                         overflow="fold", min_width=max(len(word) for word in col.split()))
    for r in result.rows:
        table.add_row(*(shown(c, MESSAGE_CHARS) for c in capacity_cells(r, result)))
    for line in lines:
        stdout.print(plain(line, MESSAGE_CHARS), markup=False, highlight=False, soft_wrap=False)
    stdout.print(table)
    for line in capacity_lines(result, aggregate_bw):
        stdout.print(plain(line, MESSAGE_CHARS), markup=False, highlight=False, soft_wrap=False)


def capacity_lines(result: CapacityResult, aggregate_bw: float | None = None) -> list[str]:
    out = [f"GPU counts: {result.sizes_rule}"]
    out += [f"left out: {s}" for s in result.skipped]
    out += [f"{r.num_gpus:,} GPUs: {r.reason}" for r in result.rows if r.reason]
    first = next((r for r in result.rows if r.goodput is not None), None)
    if first is not None:
        out += goodput_basis(first.goodput, aggregate_bw)
    if result.tokens is not None:
        unit = table_units(result)["time"][1]
        out.append(f"ideal {unit} = tokens / (tokens/s); {unit} w/ goodput = ideal / goodput; GPU-hours = GPUs x "
                   f"{unit} w/ goodput")
        note = next((r.energy_note for r in result.rows if r.energy_note), None)
        out.append(note or f"energy: board power x GPU-hours x PUE {result.pue:g} (rated power, an upper bound"
                           + ("; hosts, network and cooling excluded)" if result.pue == 1 else ")"))
    if result.deadline_s is not None and result.chosen is not None:
        r = result.row(result.chosen)
        price = f", cost {amount(r.cost)}" if r.cost is not None else ""
        out.append(f"deadline {days(result.deadline_s)}: the cheapest count that meets it is {r.num_gpus:,} GPUs "
                   f"(*): {days(r.time_to_train_goodput_s)}, {amount(r.gpu_hours)} GPU-hours{price}")
    if any(r.meets_deadline is False for r in result.rows):
        out.append("x: misses the deadline")
    return out


def goodput_basis(g: Goodput, aggregate_bw: float | None) -> list[str]:
    """The goodput model's inputs, two lines."""
    bw = f"{DEFAULT_NODE_WRITE_BW_BYTES_PER_S / 1e9:g} GB/s per node (assumed)" + (
        "" if aggregate_bw is None else f", at most {aggregate_bw / 1e9:,.0f} GB/s in all")
    return [f"goodput: failures {g.failure_rate_per_gpu_hour:.3g} per GPU-hour (default: Llama 3 405B's), restart "
            f"{DEFAULT_RESTART_S / 60:g} min (assumed) + reload",
            f"checkpoints: {g.checkpoint_bytes / 1e12:.3g} TB at {bw}, at Daly's (2006) optimum interval"]


def goodput_line(g: Goodput) -> str:
    """`goodput: 93.8% (failures every 3.09 h, checkpoint 0.555 s every 1.85 min)`."""
    return (f"goodput: {100 * g.fraction:.1f}% (failures every {g.mtbf_s / HOUR_S:.3g} h, checkpoint "
            f"{g.checkpoint_s:.3g} s every {g.interval_s / 60:.3g} min, restart {g.restart_s / 60:.3g} min)")


def print_plan_lines(result: PlanResult, args: CapacityArgs) -> None:
    """Under a single plan's table: the goodput line (from GOODPUT_LINE_MIN_GPUS GPUs, or when asked for with
    --tokens / --failure-rate / --ckpt-bandwidth) and, with --tokens, the time, GPU-hours, cost and energy."""
    if not result.plans:
        return
    asked = args.tokens is not None or args.failure_rate is not None or args.aggregate_bw is not None
    if result.num_gpus < GOODPUT_LINE_MIN_GPUS and not asked:
        return
    r = capacity_row(result, args.tokens, args.price, None, args.pue, args.failure_rate, None, args.aggregate_bw)
    lines = [goodput_line(r.goodput)]
    if args.tokens is not None:
        lines.append(f"time to train {tokens_words(args.tokens)}: {days(r.time_to_train_s)} ideal, "
                     f"{days(r.time_to_train_goodput_s)} with goodput; {amount(r.gpu_hours)} GPU-hours")
        if r.cost is not None:
            lines.append(f"cost: {amount(r.cost)} at {args.price:g} per GPU-hour")
        gpu = result.cluster.gpu
        energy = (f"{r.energy_j / J_PER_MWH:,.0f} MWh" if r.energy_j is not None and r.energy_j >= J_PER_MWH
                  else f"{(r.energy_j or 0.0) / (J_PER_MWH / 1e3):,.0f} kWh")
        lines.append(r.energy_note or f"energy: {energy} ({gpu.board_power_w:g} W board "
                     f"power x GPU-hours x PUE {args.pue:g})")
    for line in lines:
        stdout.print(plain(line, MESSAGE_CHARS), markup=False, highlight=False, soft_wrap=False)


def csv_row(r: CapacityRow, result: CapacityResult) -> dict[str, Any]:
    g = r.goodput
    return {"num_gpus": r.num_gpus, "num_nodes": r.num_nodes,
            "layout": layout_label(r.plan.strategy, r.plan.train) if r.plan else "",
            "step_time_s": r.step_time_s, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
            "goodput": g.fraction if g else None, "mtbf_s": g.mtbf_s if g else None,
            "checkpoint_s": g.checkpoint_s if g else None, "checkpoint_interval_s": g.interval_s if g else None,
            "time_to_train_s": r.time_to_train_s, "time_to_train_goodput_s": r.time_to_train_goodput_s,
            "gpu_hours": r.gpu_hours, "cost": r.cost, "energy_j": r.energy_j, "meets_deadline": r.meets_deadline,
            "chosen": result.chosen == r.num_gpus, "reason": r.reason or ""}
