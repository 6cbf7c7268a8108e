"""`meshplan emit`: a plan as flags, a config file or a launch script for one framework.

The plan comes from `meshplan plan --format json` (a file, or `-` for stdin;
`--rank` picks one, default the best) or is searched here from the same plan
options `meshplan plan` takes.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Annotated, Any, Optional

import typer
from pydantic import ValidationError

from planner.cli.app import app
from planner.cli.common import (
    AttentionOpt,
    ClusterOpt,
    ExitWith,
    Fp8ParamGatherOpt,
    GbsOpt,
    GpusOpt,
    GradPrecisionOpt,
    ModelOpt,
    OptimizerOpt,
    PlanFileOpt,
    Precision,
    PrecisionOpt,
    SeqOpt,
    emit_json,
    parse_constraints,
    plan_result_from_json,
    read_text_arg,
    train_options,
)
from planner.errors import SpecError
from planner.specs import Plan, PlanResult


class EmitFormat(str, Enum):
    text = "text"
    json = "json"


class LaunchFor(str, Enum):
    megatron = "megatron"
    deepspeed = "deepspeed"
    colossalai = "colossalai"
    torchtitan = "torchtitan"


def _backend_help() -> str:
    from planner.emit import backends

    return "Framework to emit for: " + ", ".join(backends()) + "."


@app.command("emit")
def emit_cmd(
    plan_json: Annotated[Optional[str], typer.Argument(
        metavar="[PLAN_JSON]", help="Output of `meshplan plan --format json` (a path, or - for stdin).")] = None,
    backend: Annotated[str, typer.Option("--backend", "-B", help=_backend_help())] = "megatron",
    rank: Annotated[int, typer.Option("--rank", "-r", help="Which plan to emit: 1 = the fastest.")] = 1,
    best_expressible: Annotated[bool, typer.Option("--best-expressible", help="Emit the best plan (from --rank down) that the backend can run, skipping the ones it cannot express.")] = False,
    model: ModelOpt = None,
    cluster: ClusterOpt = None,
    gpus: GpusOpt = None,
    global_batch_size: GbsOpt = None,
    seq_len: SeqOpt = None,
    precision: PrecisionOpt = Precision.bf16,
    constraint: Annotated[Optional[list[str]], typer.Option("--constraint", "-C", help="Fix or restrict a Strategy field when searching: tp=8, pp=2,4 (repeatable).")] = None,
    constraints: Annotated[Optional[str], typer.Option("--constraints", help='Constraints as a JSON object, e.g. \'{"tp": 8}\'.')] = None,
    grad_precision: GradPrecisionOpt = "fp32",
    attention_kernel: AttentionOpt = "flash",
    optimizer: OptimizerOpt = "adam",
    fp8_param_gather: Fp8ParamGatherOpt = False,
    launch_for: Annotated[LaunchFor, typer.Option("--launch-for", help="Framework the torchrun/slurm scripts start.")] = LaunchFor.megatron,
    script: Annotated[Optional[str], typer.Option("--script", help="Training entry point the torchrun/slurm scripts run (default depends on --launch-for).")] = None,
    master_port: Annotated[int, typer.Option("--master-port", help="Rendezvous TCP port on the first node.")] = 29500,
    job_name: Annotated[str, typer.Option("--job-name", help="Slurm job name.")] = "meshplan",
    fmt: Annotated[EmitFormat, typer.Option("--format", "-f", help="text: what you paste; json: the structured form.")] = EmitFormat.text,
    plan_file: PlanFileOpt = None,
    allow_partial: Annotated[bool, typer.Option("--allow-partial", help="Print text that cannot carry the whole plan (what it drops goes to stderr) instead of exiting 2.")] = False,
) -> None:
    """Emit a plan as Megatron-LM flags, Megatron-Bridge overrides, a DeepSpeed JSON, Colossal-AI plugin
    kwargs, a torchtitan TOML, or a torchrun / Slurm launch script."""
    from planner.emit import EmitOptions, get_emitter

    emitter = get_emitter(backend)
    if plan_file is not None:  # --plan FILE is PLAN_JSON by name, as evaluate and explain take it
        if plan_json is not None:
            raise SpecError(f"give the plan file once: PLAN_JSON ({plan_json!r}) or --plan ({plan_file!r})")
        plan_json = plan_file
    if rank < 1:
        raise SpecError(f"--rank must be >= 1 (got {rank})")
    search = {"--model": model, "--cluster": cluster, "--gpus": gpus, "--global-batch-size": global_batch_size,
              "--seq-len": seq_len}
    if plan_json is not None:
        given = [k for k, v in search.items() if v is not None] + ["--fp8-param-gather"] * fp8_param_gather
        if given:
            raise SpecError(f"give either PLAN_JSON or plan options, not both (got PLAN_JSON and {', '.join(given)})")
        result, single = plan_result_from_json(read_text_arg(plan_json), plan_json)
        source = repr(plan_json)
        if single:  # one Plan's JSON: emit it, whatever its rank
            rank = result.plans[0].rank
    else:
        missing = [k for k, v in search.items() if v is None]
        if len(missing) == len(search):
            raise SpecError("give a plan: PLAN_JSON (from `meshplan plan --format json`, - for stdin) or the plan "
                            "options --model --cluster --gpus --global-batch-size --seq-len")
        if missing:
            raise SpecError(f"missing plan option(s) {', '.join(missing)} (or give PLAN_JSON instead)")
        top_k = max(rank, SEARCH_DEPTH) if best_expressible else rank
        result, source = _search(model, cluster, gpus, global_batch_size, seq_len, precision.value, top_k,
                                 parse_constraints(constraint, constraints),
                                 train_options(grad_precision, attention_kernel, optimizer,
                                               fp8_param_gather=fp8_param_gather)), "the search"
    try:
        options = EmitOptions(launch_for=launch_for.value, script=script, master_port=master_port, job_name=job_name)
    except ValidationError as exc:
        from profiles import format_validation_error

        raise SpecError(f"invalid emit option: {format_validation_error(exc)}") from None
    chosen = pick(result, rank, source)
    if best_expressible:
        chosen = _best_expressible(result, chosen, backend, options)
    if fmt is EmitFormat.json:
        emit_json(emitter.data(chosen, options))
    else:
        _text(emitter, chosen, options, backend, allow_partial)


def _text(emitter, chosen: Plan, options, backend: str, allow_partial: bool) -> None:
    """The text form; what it cannot carry of the plan goes to stderr, and without --allow-partial
    nothing is printed and the exit code is 2."""
    from planner.cli.common import stderr
    from planner.emit import omissions

    text = emitter.render(chosen, options)
    dropped = omissions(chosen, backend, options)
    for reason in dropped:
        stderr.print(f"{backend} text drops part of plan {chosen.rank}: {reason}", markup=False, highlight=False)
    if dropped and not allow_partial:
        raise ExitWith(2, "not emitted: pass --allow-partial to print it anyway, or use --format json")
    sys.stdout.write(text)


#: plans searched for --best-expressible when the plan comes from plan options
SEARCH_DEPTH = 2000


def _search(model: str, cluster: str, gpus: int, gbs: int, seq: int, precision: str, top_k: int,
            constraints: dict[str, Any], train: dict[str, Any]) -> PlanResult:
    from planner.api import plan as api_plan

    return api_plan(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=gbs, seq_len=seq,
                    precision=precision, constraints=constraints, top_k=top_k, **train)


def _best_expressible(result: PlanResult, chosen: Plan, backend: str, options) -> Plan:
    from planner.cli.common import stderr
    from planner.emit import first_expressible, summarize

    candidates = [p for p in result.plans if p.rank >= chosen.rank]
    best, refused = first_expressible(candidates, backend, options)
    if refused:
        stderr.print(f"emitting plan {best.rank} ({best.strategy.short()}): plans {chosen.rank}-{best.rank - 1} are "
                     f"not expressible in {refused[0][1].framework} ({summarize(refused)})", markup=False,
                     highlight=False)
    return best


def pick(result: PlanResult, rank: int, source: str) -> Plan:
    for p in result.plans:
        if p.rank == rank:
            return p
    if not result.plans:
        from planner.cli.plan_cmds import no_fit_message

        raise ExitWith(1, f"{source}: " + no_fit_message(result))
    ranks = [p.rank for p in result.plans]
    listed = (f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 3 and ranks == list(range(ranks[0], ranks[-1] + 1))
              else ", ".join(map(str, ranks)))
    raise SpecError(f"--rank {rank} is not in {source}: it has plans ranked {listed}")
