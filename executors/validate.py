"""Validate plans: run each one briefly and put the measurement next to the prediction (no torch).

For every strategy, in order: decide whether the executor can run it
(`executors.support`), score it with `planner.evaluate` on the model that is
actually built (fewer layers, untied embeddings under pp), compute the
single-process reference losses (once per distinct model), launch it under
torchrun with a wall-clock limit, and fold the per-rank results. One plan that
hangs, crashes, runs out of memory or fails parity is reported as such and the
next plan still runs.

Multi-node: `prepare_runs` writes each run's `run.json` (reference losses
included) and the torchrun command to start it on every node
(`executors.launcher.torchrun_command(standalone=False)`); after the job,
`collect_runs` folds the rank files the nodes wrote into the same report.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from executors import host_load
from executors.compare import (
    PlanComparison,
    ValidationReport,
    compare_one,
    predicted_adapter_params,
    rank_and_summarise,
)
from executors.footprint import Footprint, host_budget_bytes, reference_footprint, refusal, run_footprint
from executors.launcher import (
    ProcessOutcome,
    fold,
    launch,
    launch_reference,
    locked_dir,
    read_ranks,
    work_folder,
)
from executors.lora import lora_notes
from executors.results import Engine, ParityReference, RunConfig, RunResult
from executors.support import executed_model, unsupported_reasons
from planner.errors import SpecError, format_validation_error
from planner.specs import ClusterSpec, Estimate, ModelSpec, Plan, Strategy, TrainSpec
from planner.specs.files import read_text

PARITY_TOLERANCES = {"fp32": (1e-5, 1e-3), "bf16": (1e-3, 0.1), "fp16": (1e-3, 0.1)}
"""precision -> (parity_rtol, update_rtol): relative tolerances on the parity steps' losses and
on their loss change since step 1 (executors.parity).

Measured by benchmarks/parity_tolerance.py on a 2-core CPU (gloo), the executor tests'
model (4 layers, hidden 64, vocab 256, 8 x 32 tokens), parity steps of plain SGD that
lower the loss by 1%, ten plans (dp2 DDP, ZeRO-1, tp2+SP, pp2 1F1B, ZeRO-3, ZeRO-2 with
selective recompute, pp2 vpp2 with full recompute, tp2 x dp2 ZeRO-3, pp2 x tp2, HSDP 2x2):

    largest error of the right runs     fp32        bf16
      loss                              4.3e-8      1.1e-5
      loss change                       8.7e-6      1.3e-3
    smallest loss-change error with every gradient doubled (grad_x2): 0.94 (both)

The loss change is 1% of the loss, so its error is ~100x the loss error. Tolerances:
~200x (fp32) and ~75x (bf16) above the largest right-run error, room for larger
models and GPU kernels, and 940x / 9x below the doubled-gradient error (any gradient
10% off fails bf16). fp16 does not run on CPU and is not measured: bf16's tolerances
(fp16 keeps more mantissa bits)."""


GRAD_NORM_TOLERANCES = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2}
"""precision -> grad_rtol: relative tolerance on each parameter group's step-1 squared gradient
norm (MoE runs; executors.parity.GRAD_GROUPS).

Measured by benchmarks/parity_tolerance.py on a 2-core CPU (gloo) with the MoE test model
(3 layers, layer 0 dense, layers 1-2 with 4 experts of width 64, top-2, one shared
expert; hidden 64, vocab 256; 8 x 32 tokens): ep2 over dp2, ep2 over dp4 (edp 2), and dp2
DDP with every expert on every rank:

                                                      fp32       bf16
    gradient-norm error, largest of the right runs    3.8e-9     3.7e-5
    expert gradients averaged over edp (÷ edp, ÷ dp right): gradient-norm error 3.0,
        loss-change error                             3.6e-3     4.3e-3
    expert gradients reduced over dp like the dense ones: gradient-norm error 1.02,
        loss-change error                             4.3e-5     7.9e-4

With update_rtol (fp32 1e-3, bf16 0.1) the loss change alone catches only the first
fault, in fp32 only, by 3.6x (the routed experts hold 0.4% of |g|²). Tolerances ~10^4x
(fp32) and ~270x (bf16) above the right runs, 100x below the smaller fault."""


MAX_STEPS = 10_000
"""Upper bound of warmup_steps and timed_steps: a validation run is a few steps (the defaults
run 1 + 3); 10,000 steps of the smallest model already take minutes on a CPU."""
MAX_PARITY_STEPS = 1_000
"""Upper bound of parity_steps: each one also runs in the single-process reference, and their
losses are stored in every run's config (the default checks 2)."""
TEMP_PREFIX = "meshplan-validate-"
"""Name prefix of the temporary work folders."""


class ValidateOptions(BaseModel):
    """How each plan is run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    warmup_steps: int = Field(1, ge=1, le=MAX_STEPS, description="Untimed steps after the parity steps, at least 1 "
                              "(the plan's optimizer creates its states in the first; see RunConfig.warmup_steps).")
    timed_steps: int = Field(3, ge=1, le=MAX_STEPS, description="Timed steps per plan.")
    parity_steps: int = Field(2, ge=1, le=MAX_PARITY_STEPS,
                              description="Leading steps checked against the single-process reference.")
    timeout_s: float = Field(300.0, gt=0, description="Wall-clock limit of each run, seconds.")
    num_layers: int | None = Field(None, ge=1, description="Build the model with this many layers (shapes kept).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    engine: Engine = Field("torch", description="torch, megatron or deepspeed (the last two need CUDA), or jax (the "
                           "plan's JAX mesh on simulated CPU devices, executors.jax_run).")
    hsdp_replicate: int = Field(1, ge=1, description="HSDP replicas for zero_stage >= 2 (1 = plain FSDP).")
    seed: int = Field(1234, description="Seed of weights and data.")
    learning_rate: float = Field(1e-3, gt=0, description="Learning rate of the plan's optimizer (the parity "
                                 "steps take plain SGD at the reference's step size).")
    work_dir: Path | None = Field(None, description="Where run directories go; default: a temporary directory, "
                                  "removed at the end and on interruption unless keep_work_dir. A given "
                                  "work_dir is never removed.")
    keep_work_dir: bool = Field(False, description="Keep the temporary directory (its path is reported through "
                                "the 'work_dir' event).")
    max_host_memory_gib: float | None = Field(None, gt=0, description="Host memory a local cpu run may use, GiB "
                                              "(default: executors.footprint.HOST_MEMORY_SHARE of MemAvailable); "
                                              "plans whose estimate exceeds it are not started.")


def resolve_device(device: str) -> str:
    """auto -> cuda when torch sees a CUDA device, else cpu; cuda without one -> SpecError (before
    anything starts)."""
    if device not in ("auto", "cuda"):
        return device
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if device == "cuda" and not has_cuda:
        raise SpecError("--device cuda: torch has no CUDA device here")
    return "cuda" if has_cuda else "cpu"


def run_label(st: Strategy) -> str:
    """`Strategy.short()`, with ep and etp added when they are > 1 and the label lacks them
    (runs that differ only in ep must not share a label or a run directory)."""
    label = st.short()
    words = label.split()
    extra = [f"{name}{v}" for name, v in (("ep", st.ep), ("etp", st.etp)) if v > 1 and f"{name}{v}" not in words]
    return " ".join(words[:3] + extra + words[3:]) if extra else label


def run_dir_name(index: int, label: str) -> str:
    return f"{index:02d}-" + re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")


def predict(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_gpus: int,
            st: Strategy) -> tuple[Estimate | None, str]:
    from planner import evaluate
    from planner.calibrate import run_settings

    settings = {"grad_precision": train.grad_precision, "optimizer": train.optimizer,
                "attention_kernel": train.attention_kernel} | finetune_settings(train)
    try:
        est = evaluate(model=model, cluster=cluster, num_gpus=num_gpus, global_batch_size=train.global_batch_size,
                       seq_len=train.seq_len, precision=train.precision, strategy=st, **run_settings(settings))
    except SpecError as exc:
        return None, f"no prediction: {exc}"
    return est, ""


FINETUNE_FIELDS = ("finetune", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_layers",
                   "adapter_precision", "framework", "torch_compile")
"""TrainSpec fields an adapter (LoRA) plan's prediction keeps from the plan: what is trained, and the framework
it runs under (planner.rules.ADAPTER_FRAMEWORKS), whose ZeRO-3 and element-wise costs it is priced with."""


def finetune_settings(train: TrainSpec) -> dict[str, Any]:
    """The plan's fine-tuning settings for `evaluate` (empty for pre-training and full fine-tuning, which are
    predicted as the executor runs them: every parameter trained)."""
    if not train.adapters:
        return {}
    return {name: getattr(train, name) for name in FINETUNE_FIELDS}


def refuse_engine(options: ValidateOptions, device: str, train: TrainSpec) -> None:
    """SpecError when no plan can run at all with this engine, device and precision
    (`engine_reasons` do not depend on the plan)."""
    reasons = engine_reasons(options, device, train)
    if reasons:
        raise SpecError("validate: " + "; ".join(reasons) + ": no plan can run")


def engine_reasons(options: ValidateOptions, device: str, train: TrainSpec) -> list[str]:
    reasons = []
    if options.engine == "jax":
        return ["engine 'jax' runs the plan's JAX mesh through executors.jax_run.validate_jax, not torchrun"]
    if options.engine != "torch" and device != "cuda":
        reasons.append(f"engine {options.engine!r} needs CUDA (device is {device})")
    if options.engine == "torch" and train.precision == "fp8":
        reasons.append("precision fp8 needs Transformer Engine; the torch executor runs fp32, bf16 or fp16 "
                       "(use the megatron engine)")
    if device == "cpu" and train.precision == "fp16":
        reasons.append("precision fp16 is not supported on cpu (use fp32 or bf16)")
    if train.adapters and options.engine != "torch":
        reasons.append(f"finetune {train.finetune!r} runs with the torch engine only (peft on its model, "
                       f"executors.lora); engine {options.engine!r} builds its own model")
    return reasons


def engine_config(engine: str, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_gpus: int,
                  st: Strategy, estimate: Estimate | None) -> tuple[dict | None, str]:
    """The emitted configuration the megatron / deepspeed executors run, or (None, why not)."""
    if engine == "torch":
        return None, ""
    if engine == "megatron" and model.is_moe:
        return None, (f"num_experts ({model.num_experts}) > 0: the megatron engine builds GPTModel with the dense "
                      "layer spec and no expert parallel state, so MoE models run only with the torch engine")
    if engine == "deepspeed" and (st.tp > 1 or st.pp > 1 or st.cp > 1):
        return None, "the deepspeed engine runs dp/ZeRO plans only (tp, pp and cp need Megatron-DeepSpeed)"
    if estimate is None:
        return None, "no prediction to build the plan the emitter needs"
    from planner.emit.base import NotExpressibleError
    from planner.specs import Plan

    plan = Plan(rank=1, strategy=st, estimate=estimate, model=model, cluster=cluster, train=train, num_gpus=num_gpus)
    try:
        if engine == "megatron":
            from planner.emit.megatron import core_config_kwargs, glu_omissions, megatron_args, parse_args

            dropped = glu_omissions(plan, "Megatron-LM's flags")  # the engine would build another activation
            if dropped:
                return None, "; ".join(dropped)
            return core_config_kwargs(parse_args(megatron_args(plan))), ""
        from planner.emit.deepspeed import ds_config

        return ds_config(plan), ""
    except NotExpressibleError as exc:
        return None, str(exc)


def make_config(label: str, model: ModelSpec, train: TrainSpec, st: Strategy, num_gpus: int,
                options: ValidateOptions, device: str, notes: list[str]) -> RunConfig:
    rtol, update_rtol = PARITY_TOLERANCES.get(train.precision, (2e-2, 0.5))
    return RunConfig(label=label, model=model, train=train, strategy=st, num_gpus=num_gpus, seed=options.seed,
                     parity_steps=options.parity_steps, warmup_steps=options.warmup_steps,
                     timed_steps=options.timed_steps, learning_rate=options.learning_rate, device=device,
                     engine=options.engine, hsdp_replicate=options.hsdp_replicate, parity_rtol=rtol,
                     update_rtol=update_rtol, grad_rtol=GRAD_NORM_TOLERANCES.get(train.precision, 0.1),
                     timeout_s=options.timeout_s, notes=notes)


EventCallback = Callable[[str, dict[str, Any]], None]
"""on_event(kind, data) of `validate_strategies`: kind 'work_dir' (path, kept), 'reference'
(label), 'launch' (index, total, label, steps), 'step' (index, step, total): the run's rank 0
finished `step` of `total` steps."""


def reference_chunk_estimate(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> Estimate | None:
    """The prediction of one process at the reference run's chunk of sequences (its activations)."""
    rows = min(4, train.global_batch_size)
    chunk = train.model_copy(update={"global_batch_size": rows})
    est, _ = predict(model, cluster, chunk, 1, Strategy(dp=1, micro_batch_size=rows))
    return est


def memory_refusals(items: list[dict[str, Any]], cluster: ClusterSpec, train: TrainSpec, num_gpus: int,
                    options: ValidateOptions, device: str) -> list[str | None]:
    """Per item (a strategy about to run): None, or why it is not started (its run or its reference
    run would exceed the host memory budget). Only local cpu runs are checked: on cuda the
    training terms live on the GPUs."""
    if device != "cpu":
        return [None] * len(items)
    budget, rule = host_budget_bytes(options.max_host_memory_gib)
    if budget is None:
        return [None] * len(items)
    references: dict[str, Footprint] = {}
    out: list[str | None] = []
    for item in items:
        model, st = item["model"], item["strategy"]
        key = model.model_dump_json()
        if key not in references:
            references[key] = reference_footprint(model, reference_chunk_estimate(model, cluster, train))
        estimate = item["estimate"]
        if st.zero_stage > 0:  # ZeRO does not shrink host memory (executors.footprint)
            estimate, _ = predict(model, cluster, train, num_gpus, st.model_copy(update={"zero_stage": 0}))
        largest = max(references[key], run_footprint(item["label"], model, estimate, num_gpus, st.tp, st.pp),
                      key=lambda f: f.total_bytes)
        out.append(refusal(largest, budget, rule) if largest.total_bytes > budget else None)
    return out


def run_cores(cfg: RunConfig, num_ranks: int, cpu_count: int) -> int:
    """Runnable threads `num_ranks` ranks of `cfg` keep busy on this host (executors.host_load): on cpu
    the worker's threads per rank (RunConfig.num_threads, or cores // local ranks); on cuda one
    thread per rank, which drives its GPU."""
    threads = cfg.num_threads if cfg.device == "cpu" else 1
    return host_load.cores_in_use(num_ranks, threads, cpu_count)


def validate_strategies(strategies: list[Strategy], model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                        num_gpus: int, options: ValidateOptions | None = None,
                        progress: Callable[[int, int, RunResult], None] | None = None,
                        labels: list[str] | None = None, on_event: EventCallback | None = None,
                        references: dict[str, tuple[ParityReference | None, str]] | None = None) -> ValidationReport:
    """Run every strategy (in order) and compare each with its prediction.

    `references`: the single-process parity references by executed model (its JSON), filled as
    they are computed; a caller that validates one strategy at a time (the tuner) passes the
    same mapping to each call so that each model's reference runs once.

    Before anything starts, each local cpu run's host memory is estimated (executors.footprint);
    a plan whose run would exceed the budget is reported as `unsupported` with the estimate, and
    when no plan can start for that reason alone, SpecError says so (nothing is launched). SIGINT
    and SIGTERM stop the running process tree and raise `executors.launcher.Interrupted`; the
    temporary work directory is removed then too (unless `keep_work_dir`). The work directory is
    locked while the runs last (`executors.launcher.work_folder`): a second validation on it gets
    a SpecError at once.

    The 1-minute load average is sampled before each launch and after its results are folded;
    a run taken while other processes competed for its cores is flagged busy
    (`executors.host_load.judge_load`; the load this process's earlier runs left is discounted,
    `executors.host_load.OWN_RUNS`)."""
    from executors.launcher import signals_raise

    options = options or ValidateOptions()
    device = resolve_device(options.device)
    refuse_engine(options, device, train)
    event = on_event or (lambda kind, data: None)
    items = []
    for i, st in enumerate(strategies):
        st = st.resolve(num_gpus)
        label = labels[i] if labels else run_label(st)
        run_model, notes = executed_model(model, st, options.num_layers)
        notes = notes + lora_notes(train, st.zero_stage)
        estimate, why = predict(run_model, cluster, train, num_gpus, st)
        if why:
            notes = notes + [why]
        reasons = engine_reasons(options, device, train) + unsupported_reasons(
            run_model, train, st, device, options.hsdp_replicate)
        cfg = make_config(label, run_model, train, st, num_gpus, options, device, notes)
        if not reasons and options.engine != "torch":
            emitted, why_not = engine_config(options.engine, run_model, cluster, train, num_gpus, st, estimate)
            reasons += [why_not] if why_not else []
            cfg = cfg.model_copy(update={"engine_config": emitted})
        items.append({"index": i, "strategy": st, "label": label, "model": run_model, "estimate": estimate,
                      "notes": notes, "reasons": reasons, "cfg": cfg})
    runnable = [it for it in items if not it["reasons"]]
    for it, why in zip(runnable, memory_refusals(runnable, cluster, train, num_gpus, options, device)):
        if why:
            it["reasons"].append(why)
    if runnable and all(it["reasons"] for it in runnable):
        first = runnable[0]
        more = len(runnable) - 1
        raise SpecError("validate: " + first["reasons"][-1]
                        + (f" (and {more} more plan{'s' if more > 1 else ''} likewise)" if more else ""))
    references = {} if references is None else references
    comparisons: list[PlanComparison] = []
    runs: list[RunResult] = []
    cpu_count = host_load.host_cpu_count()
    ours = host_load.OWN_RUNS  # one record for the process: a validation right after another discounts it too
    with work_folder(options.work_dir, TEMP_PREFIX, options.keep_work_dir) as work, signals_raise():
        event("work_dir", {"path": str(work), "kept": options.work_dir is not None or options.keep_work_dir})
        for it in items:
            i, st, label, cfg = it["index"], it["strategy"], it["label"], it["cfg"]
            if it["reasons"]:
                run = RunResult(label=label, strategy=st, outcome="unsupported", reason="; ".join(it["reasons"]),
                                notes=it["notes"])
            else:
                key = it["model"].model_dump_json()
                if key not in references:
                    event("reference", {"label": label})
                    start = time.monotonic()
                    references[key] = launch_reference(cfg, work / f"reference-{len(references)}")
                    ours.record(start, time.monotonic(), run_cores(cfg, 1, cpu_count))
                ref, ref_error = references[key]
                if ref is None:
                    run = RunResult(label=label, strategy=st, outcome="crashed", reason=ref_error,
                                    notes=it["notes"])
                else:
                    steps = cfg.parity_steps + cfg.warmup_steps + cfg.timed_steps
                    event("launch", {"index": i + 1, "total": len(items), "label": label, "steps": steps})
                    cores = run_cores(cfg, cfg.num_gpus, cpu_count)
                    load_before, start = host_load.sample_load(), time.monotonic()
                    run = launch(cfg.with_reference(ref), work / run_dir_name(i, label),
                                 on_progress=lambda p, i=i: event("step", {"index": i + 1, **p}))
                    end, load_after = time.monotonic(), host_load.sample_load()
                    run.host_load = host_load.judge_load(load_before, load_after, cores, cpu_count,
                                                         own_load_before=ours.residual(start))
                    ours.record(start, end, cores)
            runs.append(run)
            comparisons.append(compare_one(run, it["estimate"], predicted_adapter_params(it["model"], train)))
            if progress:
                progress(i + 1, len(items), run)
    summary = rank_and_summarise(comparisons)
    base_model, _ = executed_model(model, Strategy(dp=1), options.num_layers)
    return ValidationReport(model=base_model, cluster=cluster.name, train=train, num_gpus=num_gpus, device=device,
                            engine=options.engine, comparisons=comparisons, runs=runs, **summary)


def validate_plans(plans: list[Plan], options: ValidateOptions | None = None,
                   progress: Callable[[int, int, RunResult], None] | None = None) -> ValidationReport:
    """Validate ranked plans (all for the same model, cluster, training and GPU count)."""
    if not plans:
        raise SpecError("no plans to validate (the plan result is empty: nothing fits?)")
    first = plans[0]
    for p in plans[1:]:
        if (p.model, p.cluster.name, p.train, p.num_gpus) != (first.model, first.cluster.name, first.train, first.num_gpus):
            raise SpecError("all plans to validate must share model, cluster, training settings and num_gpus")
    return validate_strategies([p.strategy for p in plans], first.model, first.cluster, first.train,
                               first.num_gpus, options, progress)


# ---- multi-node: prepare, run elsewhere, collect ------------------------------------
EMIT_TARGETS = ("torchtitan", "megatron", "deepspeed", "colossalai")
"""Frameworks tried, in order, for the emitted launch scripts; the first that can express
the plan wins. The worker ignores the framework's own flags the scripts append."""


def emitted_launch_scripts(cfg: RunConfig, cluster: ClusterSpec, estimate: Estimate | None,
                           run_dir: Path) -> dict[str, str]:
    """The emitters' torchrun and Slurm scripts for this run, with the worker as entry point
    (empty when no emitter is installed or none can express the plan)."""
    try:
        from planner.emit.base import REGISTRY, EmitOptions, NotExpressibleError
        import planner.emit.launch  # noqa: F401  (registers torchrun and slurm)
    except ImportError:
        return {}
    if estimate is None:
        return {}
    from planner.specs import Plan

    plan = Plan(rank=1, strategy=cfg.strategy, estimate=estimate, model=cfg.model, cluster=cluster, train=cfg.train,
                num_gpus=cfg.num_gpus)
    entry = shlex.join(["-m", "executors.worker", "--config", str(run_dir / "run.json"), "--out", str(run_dir)])
    if cfg.engine == "deepspeed":
        targets = ("deepspeed",)
    else:
        targets = EMIT_TARGETS
    for target in targets:
        options = EmitOptions(launch_for=target, script=entry, job_name="meshplan-validate")
        try:
            return {"launch-torchrun.sh": REGISTRY.get("torchrun").render(plan, options),
                    "launch-slurm.sbatch": REGISTRY.get("slurm").render(plan, options)}
        except NotExpressibleError:
            continue
    return {}


NODE_VARIABLE_ARGS = ("--rdzv-endpoint=$MASTER_ADDR:29500", "--rdzv-id=$SLURM_JOB_ID")
"""The multi-node torchrun arguments whose variables the node's shell expands (Slurm sets them)."""


def shell_line(cmd: list[str]) -> str:
    """`cmd` as one shell command line: every argument quoted (shlex.quote), except the
    `NODE_VARIABLE_ARGS`, written as they are so that the node's shell expands them."""
    return " ".join(a if a in NODE_VARIABLE_ARGS else shlex.quote(a) for a in cmd)


def prepare_runs(strategies: list[Strategy], model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                 num_gpus: int, options: ValidateOptions, out_dir: Path) -> list[tuple[Path, list[str]]]:
    """Write out_dir/<run>/run.json for every supported strategy (reference losses computed
    here), the emitters' launch scripts next to it when they can express the plan, and
    return (run dir, torchrun command) pairs; `collect_runs` reads the results back."""
    device = resolve_device(options.device)
    refuse_engine(options, device, train)
    with locked_dir(out_dir, "--prepare folder"):
        return _prepare(strategies, model, cluster, train, num_gpus, options, out_dir, device)


def _prepare(strategies: list[Strategy], model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
             num_gpus: int, options: ValidateOptions, out_dir: Path, device: str) -> list[tuple[Path, list[str]]]:
    from executors.launcher import torchrun_command

    prepared = []
    references: dict[str, tuple[ParityReference | None, str]] = {}
    for i, st in enumerate(strategies):
        st = st.resolve(num_gpus)
        run_model, notes = executed_model(model, st, options.num_layers)
        if engine_reasons(options, device, train) + unsupported_reasons(run_model, train, st, device,
                                                                         options.hsdp_replicate):
            continue
        cfg = make_config(run_label(st), run_model, train, st, num_gpus, options, device, notes)
        estimate, _ = predict(run_model, cluster, train, num_gpus, st)
        if options.engine != "torch":
            emitted, why_not = engine_config(options.engine, run_model, cluster, train, num_gpus, st, estimate)
            if why_not:
                continue
            cfg = cfg.model_copy(update={"engine_config": emitted})
        key = run_model.model_dump_json()
        if key not in references:
            references[key] = launch_reference(cfg, out_dir / f"reference-{len(references)}")
        ref, error = references[key]
        if ref is None:
            raise SpecError(error)
        run_dir = (out_dir / run_dir_name(i, cfg.label)).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run.json").write_text(cfg.with_reference(ref).model_dump_json(indent=1))
        for name, text in emitted_launch_scripts(cfg, cluster, estimate, run_dir).items():
            (run_dir / name).write_text(text)
        per_node = min(num_gpus, cluster.gpus_per_node)
        multi = num_gpus > per_node
        extra = [f"--nnodes={num_gpus // per_node}", "--rdzv-backend=c10d", *NODE_VARIABLE_ARGS] if multi else []
        prepared.append((run_dir, torchrun_command(per_node, run_dir / "run.json", run_dir, standalone=not multi,
                                                   extra_args=extra)))
    return prepared


def _run_config(path: Path) -> RunConfig:
    """A prepared run's run.json, read by the bounded reader; a broken one is a SpecError naming it."""
    try:
        return RunConfig.model_validate_json(read_text(path, "run"))
    except ValidationError as exc:
        raise SpecError(f"run file {str(path)!r} is not a run prepared by `meshplan validate --prepare`: "
                        f"{format_validation_error(exc)}") from None


def collect_runs(out_dir: Path, cluster: ClusterSpec) -> ValidationReport:
    """Fold the rank files of runs started elsewhere (see `prepare_runs`) into a report."""
    if not out_dir.is_dir():
        raise SpecError(f"--collect {str(out_dir)!r} is not a folder (give the folder --prepare wrote)")
    configs = [(d, _run_config(d / "run.json")) for d in sorted(out_dir.iterdir())
               if d.is_dir() and (d / "run.json").exists() and not d.name.startswith("reference")]
    if not configs:
        raise SpecError(f"no prepared runs (run.json files) under {str(out_dir)!r}")
    comparisons, runs = [], []
    for d, cfg in configs:
        ranks = read_ranks(d)
        run = fold(cfg, ranks, ProcessOutcome(return_code=None, timed_out=False, wall_s=0.0,
                                              stderr_tail="(run started outside meshplan; see its job logs)"))
        estimate, _ = predict(cfg.model, cluster, cfg.train, cfg.num_gpus, cfg.strategy)
        runs.append(run)
        comparisons.append(compare_one(run, estimate, predicted_adapter_params(cfg.model, cfg.train)))
    first = configs[0][1]
    return ValidationReport(model=first.model, cluster=cluster.name, train=first.train, num_gpus=first.num_gpus,
                            device=first.device, engine=first.engine, comparisons=comparisons, runs=runs,
                            **rank_and_summarise(comparisons))
