"""`meshplan tune`: the analytic ranking's best plans run for real in an Optuna study, the cost
model calibrated on them, the best measured plan emitted (executors.tune)."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from pydantic import ValidationError

from planner.cli.app import app
from planner.cli.common import (
    AttentionOpt,
    ExitWith,
    GradPrecisionOpt,
    OptimizerOpt,
    Precision,
    emit_json,
    parse_constraints,
    stderr,
    stdout,
    train_options,
)
from planner.cli.text import MESSAGE_CHARS, cells_table, plain
from planner.show.labels import trials_table
from planner.cli.plot_out import PlotFileOpt, check_plot, write_plot
from planner.errors import SpecError, short_repr

#: TuneOptions' and ValidateOptions' fields by the flag that sets them, for error messages.
_FLAGS = {"storage": "--storage", "study_name": "--study-name", "n_trials": "--trials", "timeout_s": "--time-budget",
          "top_k": "--top-k", "near_ties": "--near-ties", "calibrate_every": "--calibrate-every", "calibration_out": "--calibration-out",
          "sampler_seed": "--sampler-seed", "max_idle_proposals": "--max-idle", "warmup_steps": "--warmup",
          "timed_steps": "--steps", "parity_steps": "--parity-steps", "num_layers": "--num-layers",
          "device": "--device", "engine": "--engine", "work_dir": "--work-dir", "seed": "--seed",
          "max_host_memory_gib": "--max-host-memory", "repeat_busy": "--repeat-busy",
          "heartbeat_interval_s": "--heartbeat", "grace_period_s": "--grace-period"}


class TuneFormat(str, Enum):
    table = "table"
    json = "json"


def _refusal(exc: ValidationError, flags: dict[str, str]) -> SpecError:
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else ""
    return SpecError(f"{flags.get(field, field)} {err['msg'][0].lower()}{err['msg'][1:]} "
                     f"(got {short_repr(err.get('input'))})")


def _options(run_timeout_s: float, **kw: Any):
    """TuneOptions from the flags; a bad value is refused naming the flag the user typed."""
    from executors.tune import TuneOptions
    from executors.validate import ValidateOptions

    run_fields = {k: kw.pop(k) for k in list(kw) if k in ValidateOptions.model_fields and k not in ("timeout_s",
                                                                                                     "engine")}
    try:
        run = ValidateOptions(timeout_s=run_timeout_s, **run_fields)
    except ValidationError as exc:
        raise _refusal(exc, _FLAGS | {"timeout_s": "--run-timeout"}) from None
    try:
        return TuneOptions(run=run, **kw)
    except ValidationError as exc:
        raise _refusal(exc, _FLAGS) from None


class _Progress:
    """Live progress on stderr: the current trial, the best so far, predicted against measured; on a
    terminal the running trial's steps as a bar (planner.cli.progress), elsewhere plain lines."""

    def __init__(self, runs) -> None:
        self.runs = runs  # planner.cli.progress.RunProgress: the bar of the running trial's steps

    def line(self, text: str) -> None:
        self.runs.line(text)

    def event(self, kind: str, data: dict[str, Any]) -> None:
        if kind in ("work_dir", "launch", "step"):
            if kind != "launch" or self.runs.live is not None:  # piped: the trial's own lines say enough
                self.runs.event(kind, data)
            return
        if kind == "study":
            what = (f"resumed, {data['measured']} of {data['budget']} trials measured" if data["resumed"]
                    else f"new, budget {data['budget']} trials")
            space = ", ".join(f"{k} ({v})" for k, v in data["space"].items()) or "nothing varies"
            self.line(f"study {data['name']} in {data['storage']}: {what}; {data['pool']} fitting strategies, "
                      f"tuned fields: {space}")
        elif kind == "trial_start":
            self.line(f"trial {data['number']} ({data['origin']}): {data['label']}: predicted "
                      f"{data['predicted_step_s']:.3f} s/step, running...")
        elif kind == "reference":
            self.line(f"  single-process parity reference for {data['label']}...")
        elif kind == "skipped":
            self.line(f"trial {data['number']}: {data['label']}: not run: {data['reason']}")
        elif kind == "trial_end":
            best = data.get("best")
            best_text = (f"; best so far {best.label}: {best.tokens_per_s:,.0f} tokens/s (trial {best.number})"
                         if best is not None and best.tokens_per_s else "")
            if data["status"] == "ok":
                self.line(f"trial {data['number']}: measured {data['measured_step_s']:.3f} s/step, predicted "
                          f"{data['predicted_step_s']:.3f} ({100 * data['error']:+.0f}%)"
                          + (" [busy host]" if data.get("busy") else "") + best_text)
            else:
                self.line(f"trial {data['number']}: {data['status']}: {data.get('reason', '')[:300]}{best_text}")
        elif kind == "note":
            self.line(f"note: {data['text']}")
        elif kind == "calibrated":
            values = ", ".join(f"{k} {v:.4g}" for k, v in data["values"].items())
            self.line(f"calibrated on {data['trials']} trials: median |error| {100 * data['before']:.1f}% -> "
                      f"{100 * data['after']:.1f}% ({values}); remaining candidates re-ranked")


def print_report(report) -> None:
    stdout.print(cells_table(trials_table(report)))
    skipped = [r for r in report.trials if r.state == "PRUNED" and r.status == "not run"]
    if skipped:
        stdout.print(f"{len(skipped)} proposals not run (do not fit, make no strategy, or already tried)",
                     markup=False, highlight=False)
    queued = [r for r in report.trials if r.state == "WAITING"]
    if queued:
        stdout.print(f"{len(queued)} candidates queued in the study for a larger --trials: "
                     + ", ".join(f"#{r.number} ({plain(r.origin)})" for r in queued[:8]), markup=False,
                     highlight=False)
    for r in report.trials:
        if r.state == "FAIL" and r.reason:
            stdout.print(f"  trial {r.number} {r.status}: {plain(r.reason, MESSAGE_CHARS)}", markup=False,
                         highlight=False)
        if r.busy:
            stdout.print(f"  trial {r.number} busy host: {plain(r.busy_reason, MESSAGE_CHARS)} (weight {r.weight:g} "
                         "in the calibration)", markup=False, highlight=False)
    cal = report.calibration
    if cal is not None:
        stdout.print(f"calibration on {len(cal.after)} trials: weighted mean |log error| (what the fit lowers) "
                     f"{cal.score_before:.3f} -> {cal.score_after:.3f}; median |step-time error| "
                     f"{100 * cal.median_abs(cal.before):.1f}% before, {100 * cal.median_abs(cal.after):.1f}% after "
                     f"({', '.join(f'{k} = {v:.4g}' for k, v in cal.values.items())})", markup=False, highlight=False)
        if cal.at_bound:
            stdout.print(f"  at the bound of its range: {', '.join(cal.at_bound)} (the trials ask for more than it can "
                         "give: an effect the model lacks)", markup=False, highlight=False)
        if cal.not_identified:
            stdout.print(f"  not identified by these trials (left as profiled): {', '.join(cal.not_identified)}",
                         markup=False, highlight=False)
    elif report.measured >= 2:
        stdout.print("calibration: no parameter lowered the profile's error on these trials by 10 % or more; the "
                     "profile is kept and no calibration profile is written", markup=False, highlight=False)
    rr = report.reranked_errors
    if rr.get("n"):
        stdout.print(f"trials run after a calibration ({rr['n']:.0f}): median |error| {100 * rr['before']:.1f}% on the "
                     f"profile, {100 * rr['after']:.1f}% calibrated (fitted before they ran)", markup=False,
                     highlight=False)
    if report.calibration_file:
        stdout.print(f"calibration profile written to {plain(report.calibration_file)}; use it with "
                     "--calibration", markup=False, highlight=False)
    if report.best is not None:
        b = report.best
        stdout.print(f"best measured: trial {b.number}: {plain(b.label)}: {b.tokens_per_s:,.0f} tokens/s "
                     f"({b.measured_step_s:.3f} s/step)", markup=False, highlight=False)
        stdout.print(f"  configs: {', '.join(report.best_configs) or 'none'} (meshplan tune --emit-dir DIR writes "
                     "them; --format json carries them)", markup=False, highlight=False)
    stdout.print(f"stopped: {report.stopped}", markup=False, highlight=False)


EXTENSIONS = {"deepspeed": "json", "colossalai": "py", "torchtitan": "toml", "megatron-bridge": "py",
              "slurm": "sbatch"}
"""File extension of each backend's text in --emit-dir (others: .sh)."""


def write_configs(folder: Path, configs: dict[str, str]) -> list[Path]:
    """Each backend's text as <folder>/best-<backend>.<ext>, written whole and only inside `folder`."""
    from planner.specs.files import write_whole

    if not folder.is_dir():
        raise SpecError(f"--emit-dir {str(folder)!r} is not an existing folder")
    out = []
    for name, text in configs.items():
        path = folder / f"best-{name}.{EXTENSIONS.get(name, 'sh')}"
        if path.is_symlink():
            raise SpecError(f"--emit-dir: {str(path)!r} is a symbolic link; configs are written only as regular files")
        write_whole(path, text)
        out.append(path)
    return out


@app.command("tune")
def tune_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="Model preset, model YAML or HF config.json.")],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="Cluster preset or YAML (e.g. `meshplan profile`'s).")],
    gpus: Annotated[int, typer.Option("--gpus", "-n", help="Ranks of each trial.")],
    global_batch_size: Annotated[int, typer.Option("--global-batch-size", "-b", help="Sequences per step.")],
    seq_len: Annotated[int, typer.Option("--seq-len", "-s", help="Tokens per sequence.")],
    precision: Annotated[Precision, typer.Option("--precision", help="GEMM precision (fp32 or bf16 on CPU).")] = Precision.bf16,
    constraint: Annotated[Optional[list[str]], typer.Option("--constraint", "-C", help="Restrict the space as `plan` does: tp=2, zero_stage=3 (repeatable).")] = None,
    constraints: Annotated[Optional[str], typer.Option("--constraints", help="Constraints as a JSON object.")] = None,
    calibration: Annotated[Optional[str], typer.Option("--calibration", help="Start from this calibration profile (YAML, e.g. an earlier tune's).")] = None,
    storage: Annotated[str, typer.Option("--storage", help="Study storage: a SQLAlchemy URL; sqlite:///tune.db (default) or postgresql+psycopg://user@host/db for workers on several machines.")] = "sqlite:///tune.db",
    study_name: Annotated[Optional[str], typer.Option("--study-name", help="Default: <model>-<cluster>-n<gpus>-b<batch>-s<seq>-<precision>. Rerunning the same command resumes it.")] = None,
    trials: Annotated[int, typer.Option("--trials", help="Measured trials the study should hold, all workers together (1 to 10000).")] = 8,
    time_budget: Annotated[Optional[float], typer.Option("--time-budget", help="Wall-clock budget of this worker, seconds (the running trial finishes).")] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="Analytic top plans run first, 1 to 64.")] = 4,
    near_ties: Annotated[int, typer.Option("--near-ties", help="Then at most this many near-ties of the top plan (inside its error band) of other layouts, 0 to 64.")] = 4,
    calibrate_every: Annotated[int, typer.Option("--calibrate-every", help="Refit the calibration after this many new ok trials and re-rank.")] = 3,
    calibration_out: Annotated[Optional[Path], typer.Option("--calibration-out", help="Write the final calibration profile (YAML) here.")] = None,
    emit_dir: Annotated[Optional[Path], typer.Option("--emit-dir", help="Write the best measured plan's configs (every framework that can express it) into this folder.")] = None,
    steps: Annotated[int, typer.Option("--steps", help="Timed steps per trial (their median and spread are kept).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed steps after the parity steps, dropped (at least 1).")] = 1,
    parity_steps: Annotated[int, typer.Option("--parity-steps", help="Leading steps checked against the single-process reference.")] = 2,
    run_timeout: Annotated[float, typer.Option("--run-timeout", help="Wall-clock limit of each trial's run, seconds.")] = 300.0,
    num_layers: Annotated[Optional[int], typer.Option("--num-layers", help="Run the model with this many layers (shapes kept).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu (gloo) or cuda (NCCL).")] = "auto",
    engine: Annotated[str, typer.Option("--engine", help="auto (the plan's framework's executor where it runs: Megatron-core or DeepSpeed on CUDA; else torch-native), torch, megatron or deepspeed (the last two need CUDA).")] = "auto",
    work_dir: Annotated[Optional[Path], typer.Option("--work-dir", help="Folder for the runs' files (default: temporary, removed).")] = None,
    sampler_seed: Annotated[Optional[int], typer.Option("--sampler-seed", help="Seed of the TPE sampler.")] = None,
    repeat_busy: Annotated[bool, typer.Option("--repeat-busy/--no-repeat-busy", help="Run a trial taken on a busy host once more and keep the faster (otherwise it is only weighted down in the calibration).")] = True,
    heartbeat: Annotated[int, typer.Option("--heartbeat", help="Seconds between a running trial's heartbeats.")] = 5,
    grace_period: Annotated[int, typer.Option("--grace-period", help="A running trial without a heartbeat for this many seconds is a stopped worker's: marked failed and retried.")] = 20,
    grad_precision: GradPrecisionOpt = "fp32",
    attention_kernel: AttentionOpt = "flash",
    optimizer: OptimizerOpt = "adam",
    slurm_workers: Annotated[Optional[int], typer.Option("--slurm-workers", help="Print a Slurm batch script that runs one tuner worker per node on N nodes, sharing this study (needs a database-server --storage), instead of tuning here.")] = None,
    plot: PlotFileOpt = None,
    fmt: Annotated[TuneFormat, typer.Option("--format", "-f", help="table or json.")] = TuneFormat.table,
) -> None:
    """Run the best predicted plans briefly in a persistent Optuna study, calibrate the cost model on
    the measurements, re-rank, and report the fastest measured plan with its configs."""
    from executors.launcher import Interrupted, check_folder
    from executors.tune import tune

    check_folder(work_dir, "--work-dir")
    target = check_plot(plot)
    if target is not None and slurm_workers is not None:
        raise SpecError("--plot draws this worker's measured trials: not with --slurm-workers (nothing runs here)")
    if emit_dir is not None and not emit_dir.is_dir():
        raise SpecError(f"--emit-dir {str(emit_dir)!r} is not an existing folder")
    if calibration_out is not None and calibration_out.suffix != ".yaml":
        raise SpecError(f"--calibration-out must name a .yaml file (got {str(calibration_out)!r})")
    options = _options(storage=storage, study_name=study_name, n_trials=trials, timeout_s=time_budget, top_k=top_k,
                       near_ties=near_ties,
                       calibrate_every=calibrate_every, calibration_out=calibration_out, sampler_seed=sampler_seed,
                       max_idle_proposals=64, repeat_busy=repeat_busy, heartbeat_interval_s=heartbeat,
                       grace_period_s=grace_period, run_timeout_s=run_timeout, timed_steps=steps, warmup_steps=warmup,
                       parity_steps=parity_steps, num_layers=num_layers, device=device, engine=engine,
                       work_dir=work_dir)
    if slurm_workers is not None:
        from executors.tune.slurm import slurm_workers_script
        from profiles import load_cluster

        flags = [("--model", model), ("--cluster", cluster), ("--gpus", gpus), ("--global-batch-size", global_batch_size),
                 ("--seq-len", seq_len), ("--precision", precision.value), ("--trials", trials), ("--top-k", top_k), ("--near-ties", near_ties),
                 ("--calibrate-every", calibrate_every), ("--steps", steps), ("--warmup", warmup),
                 ("--parity-steps", parity_steps), ("--run-timeout", run_timeout), ("--device", "cuda"),
                 ("--engine", engine), ("--grad-precision", grad_precision), ("--attention-kernel", attention_kernel),
                 ("--optimizer", optimizer), ("--heartbeat", heartbeat), ("--grace-period", grace_period),
                 ("--study-name", study_name), ("--time-budget", time_budget), ("--num-layers", num_layers),
                 ("--constraints", json.dumps(parse_constraints(constraint, constraints)) if constraint or constraints
                  else None), ("--calibration", calibration)]
        args = [str(w) for flag, value in flags if value is not None for w in (flag, value)]
        sys.stdout.write(slurm_workers_script(args, slurm_workers, load_cluster(cluster).gpus_per_node, storage))
        return
    from planner.cli.progress import run_progress

    with run_progress() as runs:
        progress = _Progress(runs)
        try:
            report = tune(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=global_batch_size,
                          seq_len=seq_len, precision=precision.value,
                          constraints=parse_constraints(constraint, constraints), calibration=calibration,
                          options=options, on_event=progress.event,
                          **train_options(grad_precision, attention_kernel, optimizer))
        except Interrupted as exc:
            raise ExitWith(exc.exit_code, f"{exc}: the running trial's processes stopped; finished trials are kept "
                                          "in the study (rerun the same command to resume)") from None
    if emit_dir is not None and report.best_configs:
        written = write_configs(emit_dir, report.best_configs)
        stderr.print(f"best plan's configs written: {', '.join(p.name for p in written)}", markup=False,
                     highlight=False)
    if fmt is TuneFormat.json:
        emit_json(report.model_dump(mode="json"))
    else:
        print_report(report)
    write_plot(target, report.plot)
    if report.best is None:
        raise ExitWith(1, f"no trial measured ok ({report.stopped})")
