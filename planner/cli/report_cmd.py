"""`meshplan report`: the search's answer as one self-contained HTML page (planner.report)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from planner.api import plan as api_plan
from planner.cli.app import app
from planner.cli.common import (
    AttentionOpt,
    CalibrationOpt,
    ClusterOpt,
    ExitWith,
    FrameworkOpt,
    GbsOpt,
    GpusOpt,
    GradPrecisionOpt,
    HeadroomOpt,
    ModelOpt,
    OptimizerOpt,
    PlanFileOpt,
    Precision,
    PrecisionOpt,
    SeqOpt,
    StrictNumericsOpt,
    parse_constraints,
    parse_headroom,
    plan_result_from_json,
    read_text_arg,
    stderr,
    train_options,
)
from planner.cli.plan_cmds import no_fit_message, no_valid_message, searching
from planner.cli.text import MESSAGE_CHARS, plain
from planner.errors import SpecError
from planner.report import check_report_target, report_figures, write_report


@app.command("report")
def report_cmd(
    out: Annotated[str, typer.Option("--out", "-o", metavar="FILE.html", help="Where to write the page.")],
    model: ModelOpt = None, cluster: ClusterOpt = None, gpus: GpusOpt = None, global_batch_size: GbsOpt = None,
    seq_len: SeqOpt = None, precision: PrecisionOpt = Precision.bf16,
    plan_file: PlanFileOpt = None,
    top: Annotated[int, typer.Option("--top", "-k", help="How many plans the table shows.")] = 10,
    constraint: Annotated[Optional[list[str]], typer.Option("--constraint", "-C", help="Restrict the search (tp=8, "
                                                            "pp=2,4; repeatable).")] = None,
    constraints: Annotated[Optional[str], typer.Option("--constraints", help="Constraints as a JSON object.")] = None,
    pictures: Annotated[bool, typer.Option("--pictures/--no-pictures", help="Draw the pictures (matplotlib).")] = True,
    configs: Annotated[bool, typer.Option("--configs/--no-configs", help="Emit each framework's config for the "
                                          "best plan it can run.")] = True,
    grad_precision: GradPrecisionOpt = None, attention_kernel: AttentionOpt = "flash",
    optimizer: OptimizerOpt = "adam", framework: FrameworkOpt = "megatron", strict_numerics: StrictNumericsOpt = False,
    headroom: HeadroomOpt = None, calibration: CalibrationOpt = None,
) -> None:
    """Write the ranked plans, their pictures, why plan 1 wins, the candidates set aside and the emitted configs
    as one HTML page that opens anywhere (no script, no network: everything is inline)."""
    check_report_target(out)  # before the search
    if plan_file is not None:
        given = [flag for flag, v in (("--model", model), ("--cluster", cluster), ("--gpus", gpus),
                                      ("--global-batch-size", global_batch_size), ("--seq-len", seq_len),
                                      ("-C/--constraints", constraint or constraints)) if v]
        if given:
            raise SpecError(f"--plan gives the question and the plans; drop {', '.join(given)}")
        result, _ = plan_result_from_json(read_text_arg(plan_file), plan_file)
    else:
        missing = [flag for flag, v in (("--model", model), ("--cluster", cluster), ("--gpus", gpus),
                                        ("--global-batch-size", global_batch_size), ("--seq-len", seq_len)) if v is None]
        if missing:
            raise SpecError(f"missing option(s) {', '.join(missing)} (or give --plan FILE)")
        with searching(f"searching strategies for {gpus:,} GPUs"):
            result = api_plan(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=global_batch_size,
                              seq_len=seq_len, precision=precision.value, top_k=top, calibration=calibration,
                              strict_numerics=strict_numerics, headroom=parse_headroom(headroom),
                              constraints=parse_constraints(constraint, constraints),
                              **train_options(grad_precision, attention_kernel, optimizer, framework=framework))
    if not result.stats.num_valid:
        raise ExitWith(2, no_valid_message(result))
    if not result.plans:
        raise ExitWith(1, no_fit_message(result))
    figures, notes = report_figures(result) if pictures else ([], [])
    for note in notes:
        stderr.print(f"note: {plain(note, MESSAGE_CHARS)}", markup=False, highlight=False)
    target = write_report(result, out, figures, configs)
    stderr.print(f"report: {plain(str(target), MESSAGE_CHARS)}", markup=False, highlight=False)
