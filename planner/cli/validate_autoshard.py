"""`meshplan validate --autoshard PKG.MODULE:FACTORY`: solve a module's graph auto-parallel plan
(`planner.autoshard.autoshard`) and run it with DTensor on CPU ranks against one process
(`executors.autoshard_run`).

The options' text is parsed here without eval: an input is ``SHAPE[:DTYPE[:HIGH]]`` (``4,32:int64:128``: a
4 x 32 int64 tensor drawn in [0, 128); ``8,3,32,32`` is float32), a factory argument ``KEY=VALUE`` whose value is
an int, a float, true / false, or else a string.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from planner.cli.common import ExitWith, Format, emit_csv, emit_json, stdout
from planner.cli.text import MESSAGE_CHARS, plain
from planner.errors import SpecError, short_repr

INPUT_RE = re.compile(r"^(\d+(?:,\d+)*)(?::([a-z0-9]+))?(?::(\d+))?$")
"""--input-shape: comma-separated sizes, then optionally ':dtype' and ':high'."""
ARG_KEY_RE = re.compile(r"^[A-Za-z_]\w*$")
INT_RE = re.compile(r"^[+-]?\d+$")
FLOAT_RE = re.compile(r"^[+-]?(?:\d+\.\d*|\.\d+|\d+(?:\.\d*)?[eE][+-]?\d+)$")
CLUSTER = "local-cpu"
"""The cluster the plan is solved for: this machine's CPU profile, the ranks the run starts."""


def parse_input_shape(text: str) -> dict[str, Any]:
    """{'shape', 'dtype', 'high'} of one --input-shape; SpecError naming the option otherwise."""
    m = INPUT_RE.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise SpecError(f"--input-shape must be SIZES[:DTYPE[:HIGH]], e.g. 4,32:int64:128 (got {short_repr(text)})")
    shape = [int(d) for d in m.group(1).split(",")]
    dtype = m.group(2) or "float32"
    high = int(m.group(3)) if m.group(3) is not None else None
    from executors.autoshard_run import FLOAT_DTYPES, INT_DTYPES

    if dtype not in FLOAT_DTYPES + INT_DTYPES:
        raise SpecError(f"--input-shape {text!r}: dtype must be one of {', '.join(FLOAT_DTYPES + INT_DTYPES)}")
    if any(d < 1 for d in shape):
        raise SpecError(f"--input-shape {text!r}: sizes must be positive")
    if dtype in INT_DTYPES and (high is None or high < 1):
        raise SpecError(f"--input-shape {text!r}: an integer input needs :HIGH >= 1 (values are drawn in [0, HIGH))")
    if dtype in FLOAT_DTYPES and high is not None:
        raise SpecError(f"--input-shape {text!r}: HIGH is for integer inputs (floats are drawn from a normal)")
    return {"shape": shape, "dtype": dtype, "high": high}


def parse_factory_arg(text: str) -> tuple[str, int | float | bool | str]:
    """(key, value) of one --factory-arg KEY=VALUE: an int, a float, true / false, else the string."""
    key, sep, raw = text.partition("=") if isinstance(text, str) else ("", "", "")
    if not sep or not ARG_KEY_RE.match(key):
        raise SpecError(f"--factory-arg must be KEY=VALUE with KEY an identifier (got {short_repr(text)})")
    if INT_RE.match(raw):
        return key, int(raw)
    if FLOAT_RE.match(raw):
        return key, float(raw)
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    return key, raw


def autoshard_api():
    """planner.autoshard's `autoshard` entry, or None while this installation has none."""
    try:
        from planner.autoshard import autoshard
    except ImportError:
        try:
            from planner.autoshard.api import autoshard
        except ImportError:
            return None
    return autoshard


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
    api = autoshard_api()
    if api is None:
        raise SpecError("--autoshard needs planner.autoshard.autoshard (the graph tracer and solver), which this "
                        "installation does not have")
    plan = api(functools.partial(fn, **kwargs), _example_inputs(inputs), cluster=CLUSTER, num_gpus=ranks)
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
