"""`meshplan validate`: run plans briefly with torchrun and compare them with the prediction."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from pydantic import ValidationError

from planner.cli.app import app
from planner.calibrate import run_settings
from planner.cli.common import (
    AdapterPrecisionOpt,
    AttentionOpt,
    CalibrationOpt,
    DoubleQuantOpt,
    ExitWith,
    FinetuneOpt,
    Format,
    FormatOpt,
    FrameworkOpt,
    GradPrecisionOpt,
    LoraAlphaOpt,
    LoraDropoutOpt,
    LoraLayersOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    OptimizerOpt,
    PagedOptimizerOpt,
    Precision,
    emit_csv,
    emit_json,
    finetune_options,
    parse_constraints,
    json_option,
    read_text_arg,
    stderr,
    stdout,
    train_options,
)
from planner.cli.plot_out import PlotFileOpt, check_plot, write_plot
from planner.cli.text import MESSAGE_CHARS, cells_table, plain
from planner.show.labels import validation_table
from planner.errors import SpecError, short_repr

#: ValidateOptions' fields by the flag that sets them, for error messages.
_OPTION_FLAGS = {"warmup_steps": "--warmup", "timed_steps": "--steps", "parity_steps": "--parity-steps",
                 "timeout_s": "--timeout", "num_layers": "--num-layers", "device": "--device", "engine": "--engine",
                 "hsdp_replicate": "--hsdp-replicate", "seed": "--seed", "work_dir": "--work-dir",
                 "max_host_memory_gib": "--max-host-memory"}
FAILED = ("wrong", "crashed", "timeout")


def _plans_from_json(text: str, source: str = "-"):
    """A PlanResult, one Plan, or a list of Plans (as `meshplan plan --format json` writes them)."""
    from planner.specs import Plan, PlanResult
    from planner.specs.files import MAX_PLAN_VALUES, parse_json

    data = parse_json(text, f"--plan file {source!r}", MAX_PLAN_VALUES)
    if isinstance(data, dict) and "plans" in data:
        return PlanResult.model_validate(data).plans
    if isinstance(data, dict):
        return [Plan.model_validate(data)]
    if isinstance(data, list):
        return [Plan.model_validate(p) for p in data]
    raise SpecError("--plan must hold a PlanResult, a Plan or a list of Plans")


def _strategies(items: list[str] | None):
    from planner.api import coerce_strategy

    out = []
    for item in items or []:
        data = json_option(item, "--strategy")
        if not isinstance(data, dict):
            raise SpecError(f"--strategy must be a JSON object of Strategy fields (got {short_repr(item)})")
        out.append(coerce_strategy(data))
    return out


def print_report(report) -> None:
    stdout.print(cells_table(validation_table(report)))
    for i, c in enumerate(report.comparisons, start=1):
        if c.outcome != "ok":
            stdout.print(f"  #{i} {c.outcome}: {plain(c.reason, MESSAGE_CHARS)}", markup=False, highlight=False)
        for note in c.notes:
            stdout.print(f"  #{i} note: {plain(note, MESSAGE_CHARS)}", markup=False, highlight=False)
        if c.busy:
            stdout.print(f"  #{i} busy host: {plain(c.host_load.reason, MESSAGE_CHARS)}", markup=False,
                         highlight=False)
        if c.measured_trainable_params is not None and c.predicted_trainable_params is not None:
            stdout.print(f"  #{i} {trainable_line(c)}", markup=False, highlight=False)
        if c.step_spread_exceeds_band:
            stdout.print(f"  #{i} note: its timed steps spread {100 * c.step_spread:.0f}%, more than the "
                         "prediction's error band is wide: one run this noisy cannot judge the prediction",
                         markup=False, highlight=False)
    if report.median_abs_step_time_error is not None:
        stdout.print(f"median |step-time error|: {100 * report.median_abs_step_time_error:.1f}%   "
                     f"median |memory error|: {100 * (report.median_abs_memory_error or 0):.1f}%")
        if report.host is not None and report.host.num_busy_runs:
            quiet = report.median_abs_step_time_error_quiet
            stdout.print("median |step-time error| of the runs on a quiet host: "
                         + ("none was taken on a quiet host" if quiet is None else f"{100 * quiet:.1f}%"))
        stdout.print(f"measured best: {plain(report.measured_best, MESSAGE_CHARS)} (predicted rank {report.measured_best_predicted_rank}; "
                     f"in predicted top 2: {'yes' if report.measured_best_in_predicted_top2 else 'no'})",
                     markup=False, highlight=False)


def trainable_line(c) -> str:
    """The run's trainable (adapter) parameter count next to the planner's."""
    measured, predicted = c.measured_trainable_params, c.predicted_trainable_params
    error = (predicted - measured) / measured
    return (f"trainable parameters: measured {measured:,} (peft's adapters), predicted {predicted:,} "
            f"({100 * error:+.1f}%)")


def busy_warning(report) -> str | None:
    """One line when any run was measured on a busy host: how many, the load, what it means."""
    host = report.host
    if host is None or not host.num_busy_runs:
        return None
    quiet = report.median_abs_step_time_error_quiet
    median = ("no run was taken on a quiet host: rerun on a quiet machine" if quiet is None
              else f"median |step-time error| over the quiet runs: {100 * quiet:.1f}% (or rerun on a quiet machine)")
    return (f"{host.num_busy_runs} of {host.num_runs_sampled} runs were measured on a busy host (load average up "
            f"to {host.max_load:.1f} on {host.cpu_count} cores): other processes inflated their step times, so "
            f"their step-time errors overstate the model's; {median}")


def comparison_row(c) -> dict[str, Any]:
    return {"label": c.label, "outcome": c.outcome, "predicted_step_time_s": c.predicted_step_time_s,
            "measured_step_time_s": c.measured_step_time_s, "step_time_error": c.step_time_error,
            "predicted_memory_bytes": c.predicted_memory_bytes, "measured_memory_bytes": c.measured_memory_bytes,
            "memory_error": c.memory_error, "predicted_rank": c.predicted_rank, "measured_rank": c.measured_rank,
            "parity_passed": None if c.parity is None else c.parity.passed, "reason": c.reason,
            "step_spread": c.step_spread, "busy": c.busy if c.host_load is not None else None,
            "measured_trainable_params": c.measured_trainable_params,
            "predicted_trainable_params": c.predicted_trainable_params}


def emit_report(report, fmt: Format, plot: Path | None = None) -> None:
    if fmt is Format.json:
        emit_json(report.model_dump(mode="json"))
    elif fmt is Format.csv:
        emit_csv([comparison_row(c) for c in report.comparisons])
    else:
        print_report(report)
    warning = busy_warning(report)
    if warning:  # on stderr in every format: JSON and CSV carry the flags in their fields
        stderr.print(f"warning: {plain(warning, MESSAGE_CHARS)}", markup=False, highlight=False)
    write_plot(plot, report.plot)
    failed = [c for c in report.comparisons if c.outcome in FAILED]
    if report.comparisons and all(c.outcome == "unsupported" for c in report.comparisons):
        more = len(report.comparisons) - 1
        raise ExitWith(1, f"no plan could run here: {report.comparisons[0].label}: {report.comparisons[0].reason}"
                          + (f" (and {more} more unsupported)" if more else ""))
    if failed:
        raise ExitWith(1, f"{len(failed)} of {len(report.comparisons)} runs did not pass: "
                          + ", ".join(f"{c.label} ({c.outcome})" for c in failed))


@app.command("validate")
def validate_cmd(
    plan_file: Annotated[Optional[str], typer.Option("--plan", help="Plans to run: a `meshplan plan --format json` file (PlanResult, Plan or list of Plans); '-' reads stdin.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Plan first: model preset, YAML or HF config.json.")] = None,
    cluster: Annotated[Optional[str], typer.Option("--cluster", "-c", help="Cluster preset or YAML (e.g. the `meshplan profile` output).")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", "-n", help="Ranks per run.")] = None,
    global_batch_size: Annotated[Optional[int], typer.Option("--global-batch-size", "-b", help="Sequences per optimizer step.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", "-s", help="Tokens per sequence.")] = None,
    precision: Annotated[Precision, typer.Option("--precision", help="GEMM precision (fp32 on CPU).")] = Precision.bf16,
    top: Annotated[int, typer.Option("--top", "-k", help="Validate the K best predicted plans.")] = 3,
    constraint: Annotated[Optional[list[str]], typer.Option("--constraint", "-C", help="Restrict the plan search: tp=2, zero_stage=3 (repeatable).")] = None,
    constraints: Annotated[Optional[str], typer.Option("--constraints", help="Plan constraints as a JSON object.")] = None,
    strategy: Annotated[Optional[list[str]], typer.Option("--strategy", help='Also validate this strategy (JSON, e.g. \'{"tp": 2, "sequence_parallel": true}\'; repeatable).')] = None,
    grad_precision: GradPrecisionOpt = "fp32",
    attention_kernel: AttentionOpt = "flash",
    optimizer: OptimizerOpt = "adam",
    framework: FrameworkOpt = None,
    finetune: FinetuneOpt = "none",
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_dropout: LoraDropoutOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_layers: LoraLayersOpt = None,
    adapter_precision: AdapterPrecisionOpt = None,
    double_quant: DoubleQuantOpt = None,
    paged_optimizer: PagedOptimizerOpt = False,
    num_layers: Annotated[Optional[int], typer.Option("--num-layers", help="Run the model with this many layers (per-layer shapes kept); predictions use the same.")] = None,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed steps after the parity steps (1 to 10000; at least 1: the plan's optimizer creates its states in the first).")] = 1,
    steps: Annotated[int, typer.Option("--steps", help="Timed steps per plan, 1 to 10000 (the median is reported; a validation run is short).")] = 3,
    parity_steps: Annotated[int, typer.Option("--parity-steps", help="Leading plain-SGD steps whose loss must equal the single-process reference, 1 to 1000 (the reference runs them too).")] = 2,
    timeout: Annotated[float, typer.Option("--timeout", help="Wall-clock limit per run, seconds; the run's process group is killed after it.")] = 300.0,
    device: Annotated[str, typer.Option("--device", help="auto, cpu (gloo) or cuda (NCCL).")] = "auto",
    engine: Annotated[str, typer.Option("--engine", help="torch (PyTorch parallel APIs), megatron or deepspeed (CUDA only), or jax (the plan's JAX mesh, as the MaxText emitter writes it, on simulated CPU devices; TPU plans).")] = "torch",
    hsdp_replicate: Annotated[int, typer.Option("--hsdp-replicate", help="With ZeRO-2/3: HSDP replicas (2-D mesh); 1 = plain FSDP.")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed of weights and synthetic data.")] = 1234,
    work_dir: Annotated[Optional[Path], typer.Option("--work-dir", help="Directory for run configs, per-rank results and logs (default: a temporary directory, removed at the end and on Ctrl-C). A given directory is kept.")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the temporary run directory and print its path.")] = False,
    max_host_memory: Annotated[Optional[float], typer.Option("--max-host-memory", help="Host memory the local cpu runs may use, GiB (default: 80% of MemAvailable); plans estimated above it are not started.")] = None,
    prepare: Annotated[Optional[Path], typer.Option("--prepare", help="Multi-node: write run configs here and print the torchrun command of each run instead of launching.")] = None,
    collect: Annotated[Optional[Path], typer.Option("--collect", help="Multi-node: fold the results of runs prepared with --prepare (needs --cluster).")] = None,
    calibration: CalibrationOpt = None,
    autoshard: Annotated[Optional[str], typer.Option("--autoshard", help="Graph auto-parallel instead of plans: solve the module this factory builds (PKG.MODULE:FACTORY; its forward takes the inputs and returns the loss) with planner.autoshard for --ranks CPU devices, run the plan's DTensor placements on that many gloo ranks for --steps plain-SGD steps and check each step's loss against one process.")] = None,
    input_shape: Annotated[Optional[list[str]], typer.Option("--input-shape", "-i", help="With --autoshard: one forward input, SIZES[:DTYPE[:HIGH]] (e.g. 4,32:int64:128 for tokens in [0, 128); 8,3,32,32 for float32); repeat in order.")] = None,
    factory_arg: Annotated[Optional[list[str]], typer.Option("--factory-arg", help="With --autoshard: a keyword argument of the factory, KEY=VALUE (an int, float, true/false or string; repeatable).")] = None,
    ranks: Annotated[int, typer.Option("--ranks", help="With --autoshard: devices to plan for and gloo ranks to run.")] = 2,
    plot: PlotFileOpt = None,
    fmt: FormatOpt = Format.table,
) -> None:
    """Run the top plans for a few steps, check their loss against a single-process run, and put the
    measured step time and memory next to the prediction (--plot: predicted against measured)."""
    target = check_plot(plot)
    if target is not None and (autoshard is not None or prepare is not None):
        raise SpecError("--plot draws the runs' predicted against measured step times: not with "
                        + ("--autoshard" if autoshard is not None else "--prepare (nothing runs here)"))
    if autoshard is not None:
        given = [flag for flag, v in (("--plan", plan_file), ("--model", model), ("--strategy", strategy),
                                      ("--prepare", prepare), ("--collect", collect), ("--cluster", cluster),
                                      ("--gpus", gpus)) if v]
        if given or engine != "torch" or device not in ("auto", "cpu"):
            what = ", ".join(given) or (f"--engine {engine}" if engine != "torch" else f"--device {device}")
            raise SpecError(f"--autoshard solves and runs its own plan on this machine's CPU ranks (--ranks): "
                            f"drop {what}")
        from planner.cli.validate_autoshard import validate_autoshard

        validate_autoshard(autoshard, input_shape, factory_arg, ranks, steps, seed, timeout, work_dir, fmt)
        return
    if input_shape or factory_arg:
        raise SpecError("--input-shape and --factory-arg go with --autoshard PKG.MODULE:FACTORY")
    from executors.launcher import check_folder
    from executors.validate import (
        ValidateOptions,
        collect_runs,
        prepare_runs,
        resolve_device,
        shell_line,
        validate_strategies,
    )
    from profiles import apply_calibration, load_cluster

    for flag, folder in (("--work-dir", work_dir), ("--prepare", prepare)):
        check_folder(folder, flag)  # before the planning; the run checks it again when it locks it
    try:
        options = ValidateOptions(warmup_steps=warmup, timed_steps=steps, parity_steps=parity_steps,
                                  timeout_s=timeout, num_layers=num_layers, device=device, engine=engine,
                                  hsdp_replicate=hsdp_replicate, seed=seed, work_dir=work_dir, keep_work_dir=keep,
                                  max_host_memory_gib=max_host_memory)
    except ValidationError as exc:  # named by the flag the user typed, not the option's field
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        raise SpecError(f"{_OPTION_FLAGS.get(field, field)} {err['msg'][0].lower()}{err['msg'][1:]} "
                        f"(got {short_repr(err.get('input'))})") from None
    if options.engine == "jax" and (collect is not None or prepare is not None):
        raise SpecError("--engine jax runs here, on simulated CPU devices: --prepare and --collect are for torchrun runs")
    if collect is not None:
        if cluster is None:
            raise SpecError("--collect needs --cluster (the profile the predictions are made on)")
        spec = load_cluster(cluster)
        emit_report(collect_runs(collect, spec if calibration is None else apply_calibration(spec, calibration)), fmt,
                    target)
        return
    if options.engine != "jax":
        resolve_device(device)  # --device cuda without a CUDA device: refused before the planning
    elif device == "cuda":
        raise SpecError("--engine jax runs the plan's mesh on simulated CPU devices: --device cuda is not for it")
    extra = _strategies(strategy)
    tuning = finetune_options(finetune, lora_rank, lora_alpha, lora_dropout, lora_targets, lora_layers,
                              adapter_precision, double_quant, paged_optimizer)
    if plan_file is not None and (tuning or framework is not None):
        raise SpecError("--plan files carry their training settings: drop --framework, --finetune and the --lora-* "
                        "options (or plan here with --model ...)")
    if plan_file is not None:
        if calibration is not None:
            raise SpecError("--calibration applies to a cluster planned here; a --plan file's plans carry the "
                            "cluster (and calibration) they were planned on: drop --calibration")
        plans = _plans_from_json(read_text_arg(plan_file, "--plan"), plan_file)
        if not plans:
            raise SpecError("--plan holds no plans")
        first = plans[0]
        spec_model, spec_cluster, train, num_gpus = first.model, first.cluster, first.train, first.num_gpus
        strategies = [p.strategy for p in plans[:top]]
    else:
        missing = [flag for flag, v in (("--model", model), ("--cluster", cluster), ("--gpus", gpus),
                                        ("--global-batch-size", global_batch_size), ("--seq-len", seq_len)) if v is None]
        if missing:
            raise SpecError(f"give --plan FILE, or plan options: missing {', '.join(missing)}")
        from planner.api import plan as api_plan

        result = api_plan(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=global_batch_size,
                          seq_len=seq_len, precision=precision.value, top_k=top, calibration=calibration,
                          constraints=parse_constraints(constraint, constraints),
                          **run_settings(train_options(grad_precision, attention_kernel, optimizer,
                                                       framework=framework) | tuning))
        spec_model, spec_cluster, train, num_gpus = result.model, result.cluster, result.train, result.num_gpus
        strategies = [p.strategy for p in result.plans]
    if train.cross_entropy_fusion_impl == "te":
        raise SpecError("the plan was costed with Transformer Engine's cross-entropy (cross_entropy_fusion_impl 'te'), "
                        "which the CPU runs cannot execute (they compute PyTorch's cross_entropy over fp32 logits, "
                        "as Megatron's native loss holds them); plan with cross_entropy_fusion_impl 'native' to validate")
    seen, unique = set(), []
    for st in strategies + extra:
        key = st.resolve(num_gpus).model_dump_json()
        if key not in seen:
            seen.add(key)
            unique.append(st)
    if not unique:
        raise SpecError("nothing to validate: no plan fits and no --strategy was given")
    from executors.launcher import Interrupted

    if prepare is not None:
        try:
            prepared = prepare_runs(unique, spec_model, spec_cluster, train, num_gpus, options, prepare)
        except Interrupted as exc:
            raise ExitWith(exc.exit_code, f"{exc}: every process of the reference run stopped") from None
        for run_dir, cmd in prepared:
            stdout.print(f"# {run_dir.name}", markup=False, highlight=False)
            stdout.print(shell_line(cmd), markup=False, highlight=False)
        return

    from planner.cli.progress import run_progress

    if options.engine == "jax":
        from executors.jax_run import validate_jax

        with run_progress() as progress:
            report = validate_jax(unique, spec_model, spec_cluster, train, num_gpus, options, progress.done)
        emit_report(report, fmt, target)
        return
    with run_progress() as progress:
        try:
            report = validate_strategies(unique, spec_model, spec_cluster, train, num_gpus, options, progress.done,
                                         on_event=progress.event)
        except Interrupted as exc:
            where = (f"run files kept in {progress.work_dir}" if progress.kept and progress.work_dir
                     else "temporary run files removed")
            raise ExitWith(exc.exit_code, f"{exc}: every process of the run stopped; {where}") from None
    if keep and work_dir is None and progress.work_dir:
        stderr.print(f"run files kept in {progress.work_dir}", markup=False, highlight=False)
    emit_report(report, fmt, target)
