"""Validate a plan with JAX on simulated devices: its mesh, its shardings, its loss, its step time (no jax here).

`meshplan validate --engine jax` (and `validate_jax`) runs each plan's JAX device mesh (the mesh the
MaxText emitter writes, `planner.emit.maxtext.jax_mesh`: axis names data, fsdp, context, tensor) on
`num_gpus` XLA CPU devices of this host, simulated by `XLA_FLAGS=--xla_force_host_platform_device_count`
in the environment of a subprocess started before jax is imported (`python -m executors.jax_worker`, a
list argv, no shell). What the worker does is in its docstring; per plan, here:

1. **Support** (`unsupported_reasons`): the plan's mesh must exist (the emitter's refusals, e.g.
   zero_stage 2) and hold only the axes this run lays out: pp > 1 (MaxText's stage axis, a circular
   pipeline) and ep > 1 (its expert axis) are refused with the reason; so are sizes the mesh does not
   divide (every sharded dimension must divide by its axes) and more than `MAX_DEVICES` devices.
2. **Prediction**: `planner.evaluate` of the executed model on the cluster profile given (a TPU preset:
   its torus; `executors.validate.predict`).
3. **Run**: the worker's parity steps against a one-device reference of the same model, seed and data
   (`PARITY_RTOL`, `UPDATE_RTOL`), then timed Adam steps.

The measured step time is this host's CPU running XLA, not the planned chip: on a TPU (torus) cluster
the comparison keeps it as the run's own figure, says so in a note and computes no step-time error (as
a gloo run on a CPU measures the CPU, not the GPU a profile describes). Memory is not measured (the
XLA CPU backend reports no device memory).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from executors.compare import PlanComparison, ValidationReport, compare_one, rank_and_summarise
from executors.results import ParityCheck, RunResult
from executors.support import executed_model
from executors.validate import ValidateOptions, predict, run_label
from planner.emit.base import NotExpressibleError
from planner.emit.maxtext import jax_mesh
from planner.errors import SpecError
from planner.specs import ClusterSpec, ModelSpec, Plan, Strategy, TrainSpec

#: The mesh axes the worker lays out (MaxText's names, its order).
RUN_AXES = ("data", "fsdp", "context", "tensor")
#: The most simulated devices of one run: each is a thread pool of this host's cores, and the runs are a check of
#: the mesh and its shardings, not of scale (a TPU plan is validated at a few chips of its cluster, e.g. --gpus 8).
MAX_DEVICES = 8
#: The loss fall of the parity steps, relative (the step size is chosen from the reference's step-1 gradient).
PARITY_DROP = 0.01
PARITY_RTOL = 1e-5
"""Relative tolerance on each parity step's loss against the one-device reference. Measured with `validate_jax`
(jax 0.10.2, float32; the executor tests' model of 4 layers, hidden 64, vocab 256, 8 x 32 tokens; 8 simulated
devices as data 8, data 8 with ZeRO-1, fsdp 8, fsdp 4 x tensor 2, fsdp 2 x context 2 x tensor 2): largest error
1.7e-7; the tolerance is about 60x that."""
UPDATE_RTOL = 1e-3
"""Relative tolerance on the loss change since step 1 (which isolates the gradients and the update). Measured on
PARITY_RTOL's runs: largest error 2.8e-5; every gradient doubled on the mesh (`grad_scale` 2, fsdp 4 x tensor 2)
gives 0.76 (the loss falls about twice as far). The tolerance is 36x above the right runs, 760x below the fault."""


class JaxRunConfig(BaseModel):
    """One JAX run, as the worker reads it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str = Field(description="The run's label.")
    model: ModelSpec = Field(description="The model actually built (the executed one).")
    num_devices: int = Field(ge=1, le=MAX_DEVICES, description="Simulated XLA devices: the plan's ranks.")
    mesh: dict[str, int] = Field(description="Mesh axis -> size, outermost first (RUN_AXES names).")
    zero_stage: int = Field(ge=0, le=3, description="0: replicated; 1: optimizer states over data; 3: all over fsdp.")
    global_batch_size: int = Field(ge=1, description="Sequences per step.")
    seq_len: int = Field(ge=2, description="Tokens per sequence.")
    num_microbatches: int = Field(ge=1, description="Micro-batches per step, averaged.")
    micro_rows: int = Field(ge=1, description="Sequences of one micro-batch over all ranks: micro_batch_size·dp.")
    seed: int = Field(1234, description="Seed of the weights and the tokens.")
    parity_steps: int = Field(2, ge=1, description="Plain-SGD steps checked against the one-device reference.")
    warmup_steps: int = Field(1, ge=1, description="Untimed Adam steps after them (compilation included).")
    timed_steps: int = Field(3, ge=1, description="Timed Adam steps.")
    learning_rate: float = Field(1e-3, gt=0, description="Adam's learning rate.")
    grad_scale: float = Field(1.0, gt=0, description="Test hook: every gradient times this on the mesh only (2: a "
                              "wrong run that parity must catch); the reference always takes 1.")


def unsupported_reasons(plan: Plan) -> tuple[dict[str, int] | None, list[str]]:
    """(the run's mesh, why the worker cannot run `plan`: empty when it can)."""
    if plan.num_gpus > MAX_DEVICES:
        return None, [f"num_gpus ({plan.num_gpus}) > {MAX_DEVICES}: the JAX run simulates at most {MAX_DEVICES} "
                      "devices on this host (validate the plan at fewer chips of its cluster, e.g. --gpus 8)"]
    try:
        mesh = jax_mesh(plan)
    except NotExpressibleError as exc:
        return None, [f"no JAX mesh for this plan ({exc})"]
    reasons = []
    s, m = plan.strategy, plan.model
    if "stage" in mesh:
        reasons.append(f"pp ({s.pp}) > 1: the JAX run builds no pipeline (MaxText's stage axis, a circular pipeline, "
                       "is not laid out by this executor)")
    if "expert" in mesh:
        reasons.append(f"ep ({s.ep}) > 1: the JAX run builds no expert layers (MaxText's expert axis)")
    if m.is_moe or m.is_mla or m.sliding_window is not None:
        reasons.append("the JAX run builds dense full-attention layers only (the model has experts, latent attention "
                       "or sliding windows)")
    tensor, fsdp = mesh.get("tensor", 1), mesh.get("fsdp", 1) * (mesh.get("data", 1) if s.zero_stage == 1 else 1)
    hd = m.head_dim or m.hidden_size // m.num_attention_heads
    for what, size, by in (("hidden_size", m.hidden_size, fsdp), ("num_kv_heads·head_dim", m.kv_heads * hd, tensor),
                           ("ffn_hidden_size", m.ffn_hidden_size, tensor), ("vocab_size", m.vocab_size, tensor)):
        if size % by:
            reasons.append(f"{what} ({size}) must divide by the mesh axes that shard it ({by})")
    return mesh, reasons


def run_config(plan: Plan, mesh: dict[str, int], options: ValidateOptions, grad_scale: float = 1.0) -> JaxRunConfig:
    s, t = plan.strategy, plan.train
    micro_rows = s.micro_batch_size * int(s.dp)
    return JaxRunConfig(label=run_label(s), model=plan.model, num_devices=plan.num_gpus,
                        mesh={a: mesh[a] for a in mesh if a in RUN_AXES} or {"data": 1}, zero_stage=s.zero_stage,
                        global_batch_size=t.global_batch_size, seq_len=t.seq_len,
                        num_microbatches=t.global_batch_size // micro_rows, micro_rows=micro_rows, seed=options.seed,
                        parity_steps=options.parity_steps, warmup_steps=options.warmup_steps,
                        timed_steps=options.timed_steps, learning_rate=options.learning_rate, grad_scale=grad_scale)


def worker_env(num_devices: int) -> dict[str, str]:
    """This environment, with the XLA CPU backend simulating `num_devices` devices (set before jax is imported)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={num_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def launch(cfg: JaxRunConfig, strategy: Strategy, timeout_s: float, notes: list[str]) -> RunResult:
    """Run the worker once and fold what it wrote into a RunResult."""
    with tempfile.TemporaryDirectory(prefix="meshplan-jax-") as tmp:
        config, out = Path(tmp) / "run.json", Path(tmp) / "result.json"
        config.write_text(cfg.model_dump_json())
        argv = [sys.executable, "-m", "executors.jax_worker", "--config", str(config), "--out", str(out)]
        start = time.monotonic()
        try:
            proc = subprocess.run(argv, env=worker_env(cfg.num_devices), capture_output=True, text=True,
                                  timeout=timeout_s, cwd=Path(__file__).resolve().parents[1])
        except subprocess.TimeoutExpired:
            return RunResult(label=cfg.label, strategy=strategy, outcome="timeout", notes=notes,
                             reason=f"the JAX run did not finish in {timeout_s:g} s", wall_s=time.monotonic() - start)
        wall = time.monotonic() - start
        result = json.loads(out.read_text()) if out.exists() else {"status": "error", "error": "no result written"}
    if result["status"] != "ok":
        return RunResult(label=cfg.label, strategy=strategy, outcome="crashed", notes=notes, wall_s=wall,
                         reason=result.get("error", "the JAX run failed"), return_code=proc.returncode,
                         stderr_tail=(result.get("trace") or proc.stderr)[-2000:])
    parity = parity_check(result["reference_losses"], result["losses"][:cfg.parity_steps])
    times = result["step_times_s"]
    ok = parity.passed
    return RunResult(label=cfg.label, strategy=strategy, outcome="ok" if ok else "wrong", parity=parity, wall_s=wall,
                     reason="" if ok else "loss parity against the one-device reference failed",
                     step_time_s=statistics.median(times) if ok else None, step_times_s=times,
                     return_code=proc.returncode, notes=notes)


def parity_check(reference: list[float], measured: list[float]) -> ParityCheck:
    """The parity steps' losses against the reference, and their change since step 1 (the update)."""
    rel = max(abs(a - b) / abs(b) for a, b in zip(measured, reference))
    update = 0.0
    for a, b in zip(measured[1:], reference[1:]):
        ref_change = b - reference[0]
        if ref_change:
            update = max(update, abs((a - measured[0]) - ref_change) / abs(ref_change))
    passed = rel <= PARITY_RTOL and update <= UPDATE_RTOL
    return ParityCheck(reference=reference, measured=measured, max_rel_error=rel, rtol=PARITY_RTOL,
                       update_rel_error=update, update_rtol=UPDATE_RTOL, passed=passed)


def _is_torus(cluster: ClusterSpec) -> bool:
    return cluster.topology is not None and cluster.topology.kind == "torus"


def validate_jax(strategies: list[Strategy], model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_gpus: int,
                 options: ValidateOptions | None = None,
                 progress: Callable[[int, int, RunResult], None] | None = None,
                 grad_scale: float = 1.0) -> ValidationReport:
    """Run every strategy's JAX mesh (module docstring) and compare each with its prediction on `cluster`.
    SpecError when jax is not installed or no strategy can run."""
    options = options or ValidateOptions(engine="jax")
    if importlib.util.find_spec("jax") is None:
        raise SpecError("validate --engine jax needs jax: pip install 'meshplan[tpu]' (the CPU wheels simulate the "
                        "plan's devices)")
    if options.device == "cuda":
        raise SpecError("validate --engine jax runs on simulated CPU devices; --device cuda is not for it")
    items = []
    for st in strategies:
        st = st.resolve(num_gpus)
        run_model, notes = executed_model(model, st, options.num_layers)
        estimate, why = predict(run_model, cluster, train, num_gpus, st)
        notes = notes + ([why] if why else [])
        if train.precision != "fp32":
            notes.append(f"precision {train.precision}: the JAX run computes in float32 (the CPU backend)")
        mesh, reasons = (None, [f"{why}; the plan's mesh is built from a prediction"]) if estimate is None else \
            unsupported_reasons(Plan(rank=1, strategy=st, estimate=estimate, model=run_model, cluster=cluster,
                                     train=train, num_gpus=num_gpus))
        items.append((st, run_model, estimate, notes, mesh, reasons))
    if items and all(reasons for *_, reasons in items):
        first = items[0]
        raise SpecError(f"validate --engine jax: {run_label(first[0])}: {first[5][0]}"
                        + (f" (and {len(items) - 1} more plans likewise)" if len(items) > 1 else ""))
    comparisons: list[PlanComparison] = []
    runs: list[RunResult] = []
    torus = _is_torus(cluster)
    for i, (st, run_model, estimate, notes, mesh, reasons) in enumerate(items):
        plan = Plan(rank=1, strategy=st, estimate=estimate, model=run_model, cluster=cluster, train=train,
                    num_gpus=num_gpus) if estimate is not None else None
        if reasons:
            run = RunResult(label=run_label(st), strategy=st, outcome="unsupported", reason="; ".join(reasons),
                            notes=notes)
        else:
            cfg = run_config(plan, mesh, options, grad_scale)
            run = launch(cfg, st, options.timeout_s, notes + [
                f"JAX mesh {dict(cfg.mesh)} on {num_gpus} simulated XLA CPU devices of this host"])
        c = compare_one(run, estimate)
        if torus and run.outcome == "ok":
            c.notes.append(f"the step time {run.step_time_s:.3g} s is this run's own figure on this host's CPU, not a "
                           f"{cluster.gpu.name}'s; the prediction is for cluster {cluster.name}: no step-time error "
                           "is computed")
            c.step_time_error = None
        runs.append(run)
        comparisons.append(c)
        if progress:
            progress(i + 1, len(items), run)
    summary = rank_and_summarise(comparisons)
    base_model, _ = executed_model(model, Strategy(dp=1), options.num_layers)
    return ValidationReport(model=base_model, cluster=cluster.name, train=train, num_gpus=num_gpus,
                            device="cpu (XLA, simulated devices)", engine="jax", comparisons=comparisons, runs=runs,
                            **summary)
