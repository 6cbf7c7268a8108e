"""`meshplan compare`: two plans side by side, what the slower one loses to, and why the other candidates lost.

Three ways to name the two plans:
- `--plan plans.json --ranks 1,3`: two ranks of a plan file (`meshplan plan --format json`);
- the question (`-m -c -n -b -s`) alone: the search runs and ranks 1 and 2 (or `--ranks`) are compared, followed by
  every reason candidates were set aside, with the nearest miss of each (planner.misses);
- the question with `-B FIELD=VALUE ...` (and `-A ...`): your layout against the planner's best (or against A).
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from planner.api import coerce_strategy, make_inputs
from planner.api import evaluate as api_evaluate
from planner.api import plan as api_plan
from planner.cli.app import app
from planner.cli.common import (
    AttentionOpt,
    CalibrationOpt,
    ClusterOpt,
    ExitWith,
    Format,
    FormatOpt,
    FrameworkOpt,
    GbsOpt,
    GpusOpt,
    GradPrecisionOpt,
    HeadroomOpt,
    ModelOpt,
    OptimizerOpt,
    Precision,
    PrecisionOpt,
    SeqOpt,
    StrictNumericsOpt,
    emit_csv,
    emit_json,
    parse_constraints,
    parse_headroom,
    plan_inputs,
    plan_result_from_json,
    read_text_arg,
    stdout,
    train_options,
)
from planner.cli.plot_out import PlotFileOpt, check_plot, write_plot
from planner.cli.plan_cmds import no_fit_message, no_valid_message, searching
from planner.cli.text import MESSAGE_CHARS, plain, shown
from planner.errors import SpecError
from planner.misses import Miss, rejected_by_reason
from planner.show import plots
from planner.show.compare import Comparison
from planner.show.labels import plan_label
from planner.specs import Plan

RanksOpt = Annotated[Optional[str], typer.Option(
    "--ranks", metavar="A,B", help="The two ranks to compare, e.g. 1,3 (default 1,2): of --plan's file, or of the "
    "search the question runs.")]
ComparePlanFileOpt = Annotated[Optional[str], typer.Option(
    "--plan", metavar="FILE", help="A plan file written by `meshplan plan --format json` (or - for stdin); --ranks "
    "picks the two plans.")]
SideOpt = Annotated[Optional[list[str]], typer.Option(
    "-A", "--a", metavar="FIELD=VALUE", help="Plan A's layout, one Strategy field per option (-A tp=8 -A pp=2); "
    "without -A, A is the search's best plan.")]
SideBOpt = Annotated[Optional[list[str]], typer.Option(
    "-B", "--b", metavar="FIELD=VALUE", help="Plan B's layout, one Strategy field per option (-B tp=4 -B pp=4).")]


@app.command("compare")
def compare_cmd(
    model: ModelOpt = None, cluster: ClusterOpt = None, gpus: GpusOpt = None, global_batch_size: GbsOpt = None,
    seq_len: SeqOpt = None, precision: PrecisionOpt = Precision.bf16,
    plan_file: ComparePlanFileOpt = None, ranks: RanksOpt = None, a: SideOpt = None, b: SideBOpt = None,
    constraint: Annotated[Optional[list[str]], typer.Option("--constraint", "-C", help="With the question: restrict "
                                                            "the search (tp=8, pp=2,4; repeatable).")] = None,
    constraints: Annotated[Optional[str], typer.Option("--constraints", help="With the question: constraints as a "
                                                       "JSON object.")] = None,
    rejected: Annotated[bool, typer.Option("--rejected/--no-rejected", help="After a search: the candidates set "
                                           "aside, by reason, with the nearest miss of each (default on).")] = True,
    grad_precision: GradPrecisionOpt = None, attention_kernel: AttentionOpt = "flash",
    optimizer: OptimizerOpt = "adam", framework: FrameworkOpt = "megatron", strict_numerics: StrictNumericsOpt = False,
    headroom: HeadroomOpt = None, calibration: CalibrationOpt = None, plot: PlotFileOpt = None,
    fmt: FormatOpt = Format.table,
) -> None:
    """Compare two plans: both breakdowns side by side and, in words, what the slower one loses to ("B is 15%
    slower than A: it loses 11% to the pipeline bubble ..."); after a search, every reason candidates were set
    aside with the nearest miss of each."""
    target = check_plot(plot)
    pair = _ranks(ranks)
    question = {"--model": model, "--cluster": cluster, "--gpus": gpus, "--global-batch-size": global_batch_size,
                "--seq-len": seq_len}
    misses: list[Miss] | None = None
    if plan_file is not None:
        given = [k for k, v in question.items() if v is not None] + (["-A"] if a else []) + (["-B"] if b else []) + (
            ["-C/--constraints"] if constraint or constraints else [])
        if given:
            raise SpecError(f"--plan gives the question and the plans; drop {', '.join(given)}")
        result, _ = plan_result_from_json(read_text_arg(plan_file), plan_file)
        one, two = (_ranked(result.plans, r, f"{plan_file!r}") for r in pair)
        one, two = _evaluated(one), _evaluated(two)
    else:
        missing = [k for k, v in question.items() if v is None]
        if missing:
            raise SpecError(f"missing option(s) {', '.join(missing)} (or give --plan FILE --ranks A,B)")
        if (a or b) and ranks is not None:
            raise SpecError("--ranks picks plans of the search; -A/-B give layouts: use one or the other")
        common = dict(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=global_batch_size,
                      seq_len=seq_len, precision=precision.value, calibration=calibration,
                      strict_numerics=strict_numerics, **train_options(grad_precision, attention_kernel, optimizer,
                                                                        framework=framework))
        if a and b:
            one, two = (_given(common, items, name) for items, name in ((a, "A"), (b, "B")))
        else:
            if a:
                raise SpecError("-A needs -B (A defaults to the search's best plan; B is the layout to compare)")
            with searching(f"searching strategies for {gpus:,} GPUs"):
                result = api_plan(top_k=max(pair) if not b else 1, headroom=parse_headroom(headroom),
                                  constraints=parse_constraints(constraint, constraints), **common)
            if not result.stats.num_valid:
                raise ExitWith(2, no_valid_message(result))
            if not result.plans:
                raise ExitWith(1, no_fit_message(result))
            if b:
                one, two = _evaluated(result.plans[0]), _given(common, b, "B")
            else:
                one, two = (_evaluated(_ranked(result.plans, r, "the search")) for r in pair)
            misses = rejected_by_reason(result) if rejected else None
    comparison = _render(one, two, misses, fmt)
    write_plot(target, lambda: plots.comparison(comparison, one.estimate, two.estimate))


def _ranks(text: str | None) -> tuple[int, int]:
    if text is None:
        return 1, 2
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or parts[0] == parts[1]:
        raise SpecError(f"--ranks must be two different ranks, e.g. 1,3 (got {text!r})")
    return int(parts[0]), int(parts[1])


def _ranked(plans: list[Plan], rank: int, where: str) -> Plan:
    for p in plans:
        if p.rank == rank:
            return p
    if not plans:
        raise SpecError(f"{where} holds no plan that fits")
    raise SpecError(f"rank {rank} is not in {where}: it has plans ranked {plans[0].rank}-{plans[-1].rank}")


def _evaluated(p: Plan) -> Plan:
    """The plan scored again by `evaluate`, which adds where each parallel group sits on the fabric (the
    sentence names a dimension that crosses nodes) and the per-stage figures a file written before may lack."""
    est = api_evaluate(strategy=p.strategy, **plan_inputs(p))
    return p.model_copy(update={"estimate": est})


def _given(common: dict[str, Any], items: list[str], name: str) -> Plan:
    """A layout given by -A/-B FIELD=VALUE, scored as `evaluate` scores it, as a Plan of rank 0 (its label is
    its name)."""
    fields = parse_constraints(items, None)
    lists = [k for k, v in fields.items() if isinstance(v, list)]
    if lists:
        raise SpecError(f"-{name} gives one layout: {', '.join(lists)} must be one value each")
    strategy = coerce_strategy(fields)
    est = api_evaluate(strategy=strategy, **common)
    if not est.valid:
        raise ExitWith(2, f"invalid strategy {name}: " + "; ".join(est.reasons))
    train_keys = {k: v for k, v in common.items() if k not in ("model", "cluster", "num_gpus", "global_batch_size",
                                                               "seq_len", "precision", "calibration",
                                                               "strict_numerics")}
    with warnings.catch_warnings():  # the evaluate above has shown the question's warnings once
        warnings.simplefilter("ignore")
        model, cluster, train = make_inputs(common["model"], common["cluster"], common["num_gpus"],
                                            common["global_batch_size"], common["seq_len"], common["precision"],
                                            common["calibration"], **train_keys)
    train = train.model_copy(update=est.settings)
    return Plan(rank=0, strategy=strategy.resolve(common["num_gpus"]), estimate=est, model=model, cluster=cluster,
                train=train, num_gpus=common["num_gpus"])


def _label(p: Plan, name: str) -> str:
    """`#2 dp8 tp8 ...` for a ranked plan, `B: dp8 tp8 ...` for a given layout."""
    return plan_label(p) if p.rank else f"{name}: {plan_label(p).split(' ', 1)[1]}"


def _render(one: Plan, two: Plan, misses: list[Miss] | None, fmt: Format) -> Comparison:
    """Print the comparison in `fmt`; returns it (labelled as printed)."""
    a_name = "A" if not one.rank else f"#{one.rank}"
    b_name = "B" if not two.rank else f"#{two.rank}"
    if one.rank and two.rank and one.rank == two.rank:
        a_name, b_name = "A", "B"
    c = one.compare(two, a_name, b_name)
    if fmt is Format.json:
        emit_json({"a": one.model_dump(mode="json", include={"rank", "strategy", "estimate", "train"}),
                   "b": two.model_dump(mode="json", include={"rank", "strategy", "estimate", "train"}),
                   "comparison": c.model_dump(mode="json"),
                   "rejected": None if misses is None else [m.model_dump(mode="json") for m in misses]})
        return c
    if fmt is Format.csv:
        emit_csv([{"kind": "time_s", "term": d.term, "a": d.a, "b": d.b, "difference": d.difference,
                   "share": d.share} for d in c.time]
                 + [{"kind": "memory_bytes", "term": d.term, "a": d.a, "b": d.b, "difference": d.difference,
                     "share": d.share} for d in c.memory])
        return c
    for name, p in ((a_name, one), (b_name, two)):
        stdout.print(plain(_label(p, name), MESSAGE_CHARS), markup=False, highlight=False)
    for cells in (c.time_table(), c.memory_table()):
        table = Table(title=cells.title, title_justify="left")
        for col in cells.columns:
            table.add_column(col, justify="left" if col in cells.left else "right")
        for row in cells.rows:
            table.add_row(*(shown(v, MESSAGE_CHARS) for v in row), style="bold" if row is cells.rows[-1] else None)
        stdout.print(table)
    for line in c.lines():
        stdout.print(plain(line, MESSAGE_CHARS), markup=False, highlight=False)
    for name, p in ((a_name, one), (b_name, two)):
        if p.estimate.reasons:
            stdout.print(f"{name} does not fit: " + plain("; ".join(p.estimate.reasons), MESSAGE_CHARS),
                         markup=False, highlight=False)
    if misses:
        stdout.print(rejected_table(misses))
    return c


def rejected_table(misses: list[Miss]) -> Table:
    """The candidates set aside, by reason, with the nearest miss of each."""
    table = Table(title="candidates set aside, by reason (each under the first it meets), with the nearest miss",
                  title_justify="left")
    for col in ("reason", "candidates", "nearest miss", "why"):
        table.add_column(col, justify="right" if col == "candidates" else "left")
    for m in misses:
        table.add_row(shown(m.reason, MESSAGE_CHARS), f"{m.count:,}",
                      shown(m.nearest.short(), MESSAGE_CHARS) if m.nearest is not None else "-",
                      shown(m.detail, MESSAGE_CHARS))
    return table
