"""`meshplan validate --autoshard PKG.MODULE:FACTORY`: solve a module's graph auto-parallel plan
(`planner.autoshard.autoshard`) and run it with DTensor on CPU ranks against one process
(`executors.autoshard_run`).

The options' text is parsed as `meshplan autoshard` parses it (`planner.autoshard.inputs`, no eval): an input is
``SHAPE[:DTYPE[:HIGH]]`` (``4,32:int64:128``: a 4 x 32 int64 tensor drawn in [0, 128); ``8,3,32,32`` is
float32), a factory argument ``KEY=VALUE`` whose value is an int, a float, true / false, or else a string.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from planner.autoshard import autoshard
from planner.autoshard.inputs import parse_factory_arg, parse_input
from planner.cli.common import ExitWith, Format, emit_csv, emit_json, stdout
from planner.cli.text import MESSAGE_CHARS, plain
from planner.errors import SpecError

CLUSTER = "local-cpu"
"""The cluster the plan is solved for: this machine's CPU profile, the ranks the run starts."""


def parse_input_shape(text: str) -> dict[str, Any]:
    """{'shape', 'dtype', 'high'} of one --input-shape (`planner.autoshard.inputs.parse_input`), in a dtype the
    runs make data in."""
    from executors.autoshard_run import FLOAT_DTYPES, INT_DTYPES

    spec = parse_input(text)
    if spec.dtype not in FLOAT_DTYPES + INT_DTYPES:
        raise SpecError(f"--input-shape {text!r}: the runs make inputs of {', '.join(FLOAT_DTYPES + INT_DTYPES)} "
                        f"only")
    return {"shape": list(spec.shape), "dtype": spec.dtype, "high": spec.high}


def _example_inputs(inputs: list[dict[str, Any]]) -> tuple:
    from planner.autoshard.trace import InputSpec

    return tuple(InputSpec(tuple(i["shape"]), dtype=i["dtype"], high=i["high"]) for i in inputs)


def validate_autoshard(factory: str, input_shapes: list[str] | None, factory_args: list[str] | None, ranks: int,
                       steps: int, seed: int, timeout_s: float, work_dir: Path | None, fmt: Format) -> None:
    """Solve, run, print; ExitWith(1) when the run is not ok (parity failed, unsupported, crashed)."""
    from executors.autoshard_run import MAX_RANKS, load_factory, run_plan
    from executors.launcher import check_folder

    check_folder(work_dir, "--work-dir")
    fn = load_factory(factory, "--autoshard")
    inputs = [parse_input_shape(s) for s in input_shapes or []]
    if not inputs:
        raise SpecError("--autoshard needs the forward's inputs: --input-shape SIZES[:DTYPE[:HIGH]] per input "
                        "(repeatable, in order, labels included)")
    kwargs = dict(parse_factory_arg(a) for a in factory_args or [])
    if not 1 <= ranks <= MAX_RANKS:
        raise SpecError(f"--ranks must be between 1 and {MAX_RANKS} (got {ranks})")
    if steps < 2:
        raise SpecError(f"--steps must be at least 2 with --autoshard (the first step is not timed; got {steps})")
    # the runs train in fp32 with plain SGD, with DTensor: the plan is solved for the same
    plan = autoshard(functools.partial(fn, **kwargs), _example_inputs(inputs), cluster=CLUSTER, num_gpus=ranks,
                     precision="fp32", optimizer="sgd", executor="dtensor")
    run = run_plan(factory, inputs, plan, steps=steps, out_dir=work_dir, timeout_s=timeout_s,
                   factory_kwargs=kwargs, seed=seed)
    if fmt is Format.json:
        emit_json(run.model_dump(mode="json") | {"plan": plan.model_dump(mode="json")})
    elif fmt is Format.csv:
        emit_csv([_row(run)])
    else:
        _print(run, plan)
    if run.outcome != "ok":
        raise ExitWith(1, f"autoshard plan {run.outcome}: {run.reason}")


def _row(run) -> dict[str, Any]:
    return {"factory": run.factory, "ranks": run.num_ranks, "mesh_shape": "x".join(map(str, run.mesh_shape)),
            "outcome": run.outcome, "predicted_step_time_s": run.predicted_step_time_s,
            "measured_step_time_s": run.step_time_s, "reference_step_time_s": run.reference_step_time_s,
            "max_rel_error": run.max_rel_error, "update_rel_error": run.update_rel_error,
            "parity_passed": run.parity_passed, "reason": run.reason}


def _fmt(x: float | None, spec: str = "{:.4f}") -> str:
    return "-" if x is None else spec.format(x)


def _print(run, plan) -> None:
    from rich.table import Table

    table = Table(title=f"{plain(run.factory, MESSAGE_CHARS)}: autoshard plan on {run.num_ranks} CPU ranks (gloo, "
                        f"DTensor), mesh {'x'.join(map(str, run.mesh_shape))} innermost first, solver {plan.solver}")
    for col in ("outcome", "step pred (s)", "step meas (s)", "one process (s)", "loss err", "update err", "parity"):
        table.add_column(col, justify="left" if col == "outcome" else "right")
    table.add_row(run.outcome, _fmt(run.predicted_step_time_s), _fmt(run.step_time_s),
                  _fmt(run.reference_step_time_s), _fmt(run.max_rel_error, "{:.1e}"),
                  _fmt(run.update_rel_error, "{:.1e}"),
                  "pass" if run.parity_passed else ("-" if run.max_rel_error is None else "FAIL"))
    stdout.print(table)
    stdout.print(f"losses: {', '.join(f'{x:.6f}' for x in run.losses) or '-'}", markup=False, highlight=False)
    stdout.print(f"one process: {', '.join(f'{x:.6f}' for x in run.reference_losses) or '-'}", markup=False,
                 highlight=False)
    for note in run.notes:
        stdout.print(f"note: {plain(note, MESSAGE_CHARS)}", markup=False, highlight=False)
    stdout.print(f"the prediction is for cluster {CLUSTER}'s profile; the measurement is this machine's gloo ranks",
                 markup=False, highlight=False)
