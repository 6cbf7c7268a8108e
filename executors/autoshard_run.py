"""Run a graph auto-parallel plan (`planner.autoshard`'s AutoshardResult) with DTensor and check its loss against
one process (no torch here; the ranks run `executors.autoshard_worker`).

Why: a solved plan is a cost model's opinion until it runs. This module turns the plan's placements into real
DTensors on `num_gpus` gloo ranks of this machine, trains a few steps and compares every step's loss with the same
model, seed, batch and optimizer in one process without DTensor. A plan that runs and matches is a plan whose
placements compose (every operator has a sharding rule for them, every resharding is legal) and whose gradients are
reduced right; the measured step time is put next to the plan's prediction.

How it launches: the ranks are started the way every executor starts them (`executors.launcher.local_command`:
`executors.local_run` with its store on 127.0.0.1, gloo on the loopback interface, `executors.lifeline` so that no
rank outlives meshplan, the wall-clock limit of `executors.launcher.run_process`), each rank writes
`rank<r>.json` (an `AutoshardRankResult`) before it tears down, and `fold` reads those.

The mesh convention: `AutoshardResult.mesh_shape` lists the axes innermost first (axis 0 is the fastest-varying
one, the axis whose devices are closest, as in meshplan's strategies where tp is innermost). Rank r sits at
coordinate ``(r // prod(mesh_shape[:i])) % mesh_shape[i]`` on axis i (`mesh_coords`). torch's DeviceMesh lays its
ranks out row-major, last dimension fastest, so the worker builds it with the shape reversed
(`torch_mesh_shape`) and reverses every placement list too: the plan's axis i is torch's dimension n-1-i.

What the run refuses instead of changing the plan: placements that are not ``Replicate()``, ``Shard(d)`` or
``Partial()``; ``Partial()`` on a parameter; a plan with pipeline stages (pp > 1: this executor runs one stage);
and, in the worker, the placements DTensor cannot run on CPU in this torch (`executors.autoshard_worker`: a
convolution whose weight or input channels are sharded). Those end the run as "unsupported" with the operator and
the placement named; they are never replaced by a placement that works.
"""

from __future__ import annotations

import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from executors.launcher import (
    SECONDARY_ERRORS,
    local_command,
    run_process,
    worker_env,
    work_folder,
)
from executors.parity import parity_errors
from planner.autoshard.inputs import load_factory as inputs_load_factory
from planner.autoshard.result import AutoshardResult
from planner.errors import SpecError, short_repr
from planner.specs.files import read_text

WORKER = "executors.autoshard_worker"
FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""A factory named as ``package.module:function`` (no attribute chains, no call syntax: it is imported, never
evaluated)."""
PLACEMENT_RE = re.compile(r"^(?:Replicate\(\)|Partial\(\)|Shard\((?:dim=)?(-?\d+)\))$")
"""A DTensor placement as `AutoshardResult` writes it: ``Replicate()``, ``Partial()``, ``Shard(d)``."""
FLOAT_DTYPES = ("float32", "float64")
INT_DTYPES = ("int64", "int32")
"""Input dtypes a run draws: floats from a standard normal, integers uniformly in [0, high)."""
MAX_RANKS = 16
"""Most ranks of one run: every rank is a process of this machine, and the run checks placements, not scale."""
LOSS_RTOL = 1e-4
"""Relative tolerance on each step's loss against one process (fp32). The distributed run reduces in another
order (sharded matmuls sum partial products across ranks, data-parallel gradients are summed by an all-reduce), so
the losses differ by rounding. Measured with the tests' plans (tests/executors/test_autoshard_run.py: small_gpt
tensor parallel, data parallel and 2 x 2; small_cnn data parallel), 5 steps, SGD lr 0.05 and Adam lr 1e-3, torch
2.13 on gloo: largest error 1.0e-7. The tolerance is ~1000x that; a plan that computes something else (a shard
taken for the whole tensor, a partial sum never reduced) is off by percents."""
UPDATE_RTOL = 1e-2
"""Relative tolerance on the loss change since step 1, which isolates the gradients and the update from the
forward pass (as `executors.parity.parity_errors`): to first order an SGD step moves the loss by -lr·|g|², so a
gradient c times too large changes it by c - 1 (a doubled one by ~100%), while it moves the loss itself by less
than LOSS_RTOL in one step. Measured on LOSS_RTOL's runs: largest error 1.5e-5 (~660x below the tolerance)."""
DEFAULT_STEPS = 5
DEFAULT_LR = 0.05
"""SGD's default step size: large enough that five steps on the tests' models move the loss by percents (so the
update check sees the gradients), small enough that they stay stable."""
DEFAULT_TIMEOUT_S = 300.0


def _model_config() -> ConfigDict:
    return ConfigDict(frozen=True, extra="forbid")


class AutoshardInput(BaseModel):
    """One model input: drawn once from the run's seed (the same global tensor on every rank and in the
    reference), then distributed with the plan's placements."""

    model_config = _model_config()

    shape: list[int] = Field(description="Global shape.")
    dtype: str = Field("float32", description=f"One of {FLOAT_DTYPES + INT_DTYPES}.")
    high: int | None = Field(None, description="Integer inputs: values are drawn in [0, high).")

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: list[int]) -> list[int]:
        if not v or any(d < 1 for d in v):
            raise ValueError(f"shape must be a non-empty list of positive sizes (got {v})")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in FLOAT_DTYPES + INT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(FLOAT_DTYPES + INT_DTYPES)} (got {v!r})")
        return v

    @model_validator(mode="after")
    def _high(self) -> "AutoshardInput":
        if self.dtype in INT_DTYPES and (self.high is None or self.high < 1):
            raise ValueError(f"dtype {self.dtype} needs high >= 1 (values are drawn in [0, high); got {self.high})")
        if self.dtype in FLOAT_DTYPES and self.high is not None:
            raise ValueError(f"high is for integer inputs (a {self.dtype} input is drawn from a standard normal)")
        return self


class AutoshardRunConfig(BaseModel):
    """One run, as every rank and the reference read it (`run.json`)."""

    model_config = _model_config()

    factory: str = Field(description="The module's factory, 'package.module:function'.")
    factory_kwargs: dict[str, int | float | str | bool] = Field(default_factory=dict,
                                                                description="Keyword arguments of the factory.")
    inputs: list[AutoshardInput] = Field(description="The forward's inputs, in order (the loss's labels included).")
    plan: AutoshardResult = Field(description="The plan to run.")
    seed: int = Field(1234, description="Seed of the weights (torch.manual_seed before the factory) and the inputs.")
    steps: int = Field(DEFAULT_STEPS, ge=2, le=1000, description="Training steps on the one batch; at least 2 (the "
                       "first is not timed).")
    learning_rate: float = Field(DEFAULT_LR, gt=0, description="The optimizer's learning rate.")
    optimizer: Literal["sgd", "adam"] = Field("sgd", description="torch.optim.SGD (plain) or torch.optim.Adam, on the "
                                              "DTensor parameters and in the reference alike.")
    sdpa_math: bool = Field(True, description="Run scaled_dot_product_attention with the math backend (both runs): "
                            "DTensor has no sharding rule for its CPU flash kernel in torch 2.13; the math backend "
                            "decomposes it into matmul and softmax, which DTensor shards.")
    num_threads: int | None = Field(None, ge=1, description="torch threads per rank; None = cores / ranks.")
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, description="Wall-clock limit of each launch, seconds.")

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: str) -> str:
        if not FACTORY_RE.match(v):
            raise ValueError(f"factory must be 'package.module:function' (got {short_repr(v)})")
        return v


class AutoshardRankResult(BaseModel):
    """What one rank measured (`rank<r>.json`), written before teardown."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    status: Literal["ok", "unsupported", "error"] = Field(description="unsupported: DTensor cannot run a "
                                                          "placement of the plan (the error names it).")
    coords: list[int] = Field(default_factory=list, description="This rank's coordinate per plan mesh axis "
                              "(innermost first), as the DeviceMesh placed it.")
    losses: list[float] = Field(default_factory=list, description="The full loss of each step.")
    step_times_s: list[float] = Field(default_factory=list, description="Wall time of each step, seconds.")
    local_param_numel: int = Field(0, description="Parameter elements this rank holds (its shards).")
    error: str = ""


class ReferenceResult(BaseModel):
    """The one-process run (`reference.json`)."""

    model_config = ConfigDict(extra="forbid")

    losses: list[float]
    step_times_s: list[float]
    param_numel: int


class AutoshardRunResult(BaseModel):
    """A plan's run against one process."""

    model_config = ConfigDict(extra="forbid")

    factory: str
    factory_kwargs: dict[str, int | float | str | bool]
    num_ranks: int = Field(description="Processes (gloo, CPU).")
    mesh_shape: list[int] = Field(description="The plan's mesh, innermost first.")
    outcome: Literal["ok", "wrong", "unsupported", "crashed", "timeout"] = Field(
        description="ok: ran and matched one process; wrong: ran, but the losses differ (or the ranks disagree); "
        "unsupported: DTensor cannot run a placement of the plan (reason names the op and placement); crashed, "
        "timeout: as the other executors.")
    reason: str = ""
    losses: list[float] = Field(default_factory=list, description="The distributed run's loss per step.")
    reference_losses: list[float] = Field(default_factory=list, description="One process's loss per step.")
    max_rel_error: float | None = Field(None, description="Largest relative loss difference over the steps.")
    update_rel_error: float | None = Field(None, description="Largest relative error of the loss change since "
                                           "step 1.")
    rtol: float = LOSS_RTOL
    update_rtol: float = UPDATE_RTOL
    parity_passed: bool = False
    step_time_s: float | None = Field(None, description="Measured: median over the steps after the first of the "
                                      "slowest rank's step time, seconds.")
    step_times_s: list[float] = Field(default_factory=list, description="Slowest rank's time per step, seconds.")
    reference_step_time_s: float | None = Field(None, description="One process's median step time (after the "
                                                "first), seconds.")
    predicted_step_time_s: float = Field(description="The plan's step_time_s (for its cluster, not this CPU).")
    coords: list[list[int]] = Field(default_factory=list, description="Each rank's mesh coordinates, innermost "
                                    "axis first.")
    local_param_numel: list[int] = Field(default_factory=list, description="Parameter elements per rank.")
    reference_param_numel: int = 0
    notes: list[str] = Field(default_factory=list)
    stderr_tail: str = ""
    wall_s: float = 0.0


def mesh_coords(rank: int, mesh_shape: list[int]) -> list[int]:
    """Rank `rank`'s coordinate on each axis of `mesh_shape` (innermost, fastest-varying, first)."""
    out, stride = [], 1
    for size in mesh_shape:
        out.append((rank // stride) % size)
        stride *= size
    return out


def torch_mesh_shape(mesh_shape: list[int]) -> tuple[int, ...]:
    """The DeviceMesh shape of a plan mesh: reversed (torch's last dimension varies fastest)."""
    return tuple(reversed(mesh_shape))


def parse_placement(text: str, field: str) -> tuple[str, int | None]:
    """("replicate" | "partial" | "shard", dim) of one placement string; SpecError naming `field` otherwise."""
    m = PLACEMENT_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise SpecError(f"{field}: placement must be 'Replicate()', 'Shard(d)' or 'Partial()' (got {short_repr(text)})")
    if text.startswith("Shard"):
        return "shard", int(m.group(1))
    return ("replicate" if text.startswith("Replicate") else "partial"), None


def check_plan(plan: AutoshardResult, inputs: list[AutoshardInput]) -> None:
    """SpecError (one line, naming the field) when the plan cannot be run as written."""
    shape = plan.mesh_shape
    if not shape or any(s < 1 for s in shape):
        raise SpecError(f"plan.mesh_shape must hold positive sizes (got {shape})")
    if plan.pp != 1:
        raise SpecError(f"plan.pp is {plan.pp}: this executor runs one pipeline stage (the plan's DTensor placements "
                        "on one mesh); pipeline stages are not run")
    ranks = math.prod(shape)
    if ranks != plan.num_gpus:
        raise SpecError(f"plan.mesh_shape {shape} holds {ranks} devices but plan.num_gpus is {plan.num_gpus}")
    if ranks > MAX_RANKS:
        raise SpecError(f"plan.num_gpus ({ranks}) > {MAX_RANKS}: every rank is a process of this machine")
    if len(plan.inputs) != len(inputs):
        raise SpecError(f"plan.inputs holds {len(plan.inputs)} placements but {len(inputs)} inputs were given")

    def check_list(placements: list[str], field: str, ndim: int | None, partial_ok: bool) -> None:
        if len(placements) != len(shape):
            raise SpecError(f"{field}: {len(placements)} placements for a {len(shape)}-axis mesh {shape}")
        for p in placements:
            kind, dim = parse_placement(p, field)
            if kind == "partial" and not partial_ok:
                raise SpecError(f"{field}: 'Partial()' is not a placement a parameter or an input can start in")
            if kind == "shard" and ndim is not None and not -ndim <= dim < ndim:
                raise SpecError(f"{field}: {p} names a dimension the {ndim}-d tensor does not have")

    for name, pls in plan.params.items():
        check_list(pls, f"plan.params[{name!r}]", None, partial_ok=False)
    for i, (pls, spec) in enumerate(zip(plan.inputs, inputs)):
        check_list(pls, f"plan.inputs[{i}]", len(spec.shape), partial_ok=False)
    for name, pls in plan.activations.items():
        check_list(pls, f"plan.activations[{name!r}]", None, partial_ok=True)


def load_factory(factory: str, field: str = "factory"):
    """The callable `factory` names ('package.module:function'), imported (never evaluated) by
    `planner.autoshard.inputs.load_factory`; SpecError naming the field otherwise."""
    try:
        return inputs_load_factory(factory, app_dir=None)
    except SpecError as err:
        raise SpecError(f"{field}: {str(err).removeprefix('factory: ')}") from None


def coerce_inputs(inputs: Iterable[Any]) -> list[AutoshardInput]:
    """`AutoshardInput`s from AutoshardInputs, dicts, or objects with shape / dtype / high attributes
    (planner.autoshard.trace.InputSpec)."""
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, AutoshardInput):
            out.append(item)
            continue
        data = item if isinstance(item, dict) else {
            "shape": getattr(item, "shape", None), "dtype": getattr(item, "dtype", "float32"),
            "high": getattr(item, "high", None)}
        if data.get("shape") is not None:
            data = dict(data, shape=list(data["shape"]))
        if not isinstance(data.get("dtype", "float32"), str):
            data = dict(data, dtype=str(data["dtype"]).removeprefix("torch."))
        try:
            out.append(AutoshardInput.model_validate(data))
        except ValidationError as exc:
            err = exc.errors()[0]
            raise SpecError(f"inputs[{i}].{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return out


def _median_after_first(times: list[float]) -> float | None:
    return statistics.median(times[1:]) if len(times) > 1 else None


def _read(path: Path, model: type[BaseModel]):
    try:
        return model.model_validate_json(read_text(path, "run result"))
    except (SpecError, ValueError):
        return None


def read_rank_results(out_dir: Path) -> list[AutoshardRankResult]:
    ranks = [r for r in (_read(p, AutoshardRankResult) for p in sorted(out_dir.glob("rank*.json"))) if r]
    return sorted(ranks, key=lambda r: r.rank)


def fold(cfg: AutoshardRunConfig, ranks: list[AutoshardRankResult], reference: ReferenceResult,
         return_code: int | None, timed_out: bool, stderr_tail: str, wall_s: float) -> AutoshardRunResult:
    """One AutoshardRunResult from the ranks' files, the reference and the launch's outcome."""
    n = cfg.plan.num_gpus
    result = AutoshardRunResult(
        factory=cfg.factory, factory_kwargs=cfg.factory_kwargs, num_ranks=n, mesh_shape=cfg.plan.mesh_shape,
        outcome="crashed", reference_losses=reference.losses, predicted_step_time_s=cfg.plan.step_time_s,
        reference_step_time_s=_median_after_first(reference.step_times_s), coords=[r.coords for r in ranks],
        local_param_numel=[r.local_param_numel for r in ranks], reference_param_numel=reference.param_numel,
        wall_s=wall_s)
    if cfg.sdpa_math and any(node.kind == "sdpa" for node in cfg.plan.nodes):  # a plan that has attention
        result.notes.append("scaled_dot_product_attention ran with the math backend in both runs (DTensor has no "
                            "sharding rule for the CPU flash kernel)")
    failed = [r for r in ranks if r.status != "ok"]
    unsupported = next((r for r in failed if r.status == "unsupported"), None)
    primary = [r for r in failed if not any(m in r.error.lower() for m in SECONDARY_ERRORS)]
    if unsupported is not None:
        result.outcome, result.reason = "unsupported", f"rank {unsupported.rank}: {unsupported.error}"
    elif timed_out:
        result.outcome, result.reason = "timeout", f"killed at the wall-clock limit ({cfg.timeout_s:g} s)"
    elif failed:
        first = (primary or failed)[0]
        result.reason = f"rank {first.rank}: {first.error}"
    elif len(ranks) != n:
        result.reason = f"exited with status {return_code}; {len(ranks)}/{n} ranks wrote results"
    if result.reason:
        result.stderr_tail = stderr_tail
        return result
    result.losses = ranks[0].losses
    if any(r.losses != ranks[0].losses for r in ranks):
        result.outcome = "wrong"
        result.reason = ("the ranks disagree on the loss (a placement DTensor marks replicated holds different "
                         "values per rank): " + "; ".join(f"rank {r.rank}: {r.losses[:3]}" for r in ranks))
        return result
    loss_err, update_err = parity_errors(result.losses, reference.losses)
    result.max_rel_error, result.update_rel_error = loss_err, update_err
    result.parity_passed = loss_err <= LOSS_RTOL and update_err <= UPDATE_RTOL
    per_step = [max(r.step_times_s[i] for r in ranks) for i in range(len(ranks[0].step_times_s))]
    result.step_times_s = per_step
    result.step_time_s = _median_after_first(per_step)
    if result.parity_passed:
        result.outcome = "ok"
    else:
        result.outcome = "wrong"
        result.reason = (f"loss parity against one process failed: largest relative loss error {loss_err:.2e} "
                         f"(rtol {LOSS_RTOL:.0e}), loss-change error {update_err:.2e} (rtol {UPDATE_RTOL:.0e})")
    if return_code:
        result.notes.append(f"processes exited with status {return_code} after writing complete results")
    return result


def _reference(cfg: AutoshardRunConfig, config_path: Path, run_dir: Path) -> tuple[ReferenceResult | None, str]:
    ref_dir = run_dir / "reference"
    ref_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", WORKER, "--reference", "--config", str(config_path), "--out", str(ref_dir)]
    proc = run_process(cmd, cfg.timeout_s, ref_dir, worker_env("cpu"), pid_dir=ref_dir)
    ref = _read(ref_dir / "reference.json", ReferenceResult)
    if ref is not None:
        return ref, ""
    why = "timed out" if proc.timed_out else f"exited with status {proc.return_code}"
    return None, f"the one-process reference {why}: {proc.stderr_tail[-2000:]}"


def launch(cfg: AutoshardRunConfig, run_dir: Path) -> AutoshardRunResult:
    """The reference, then the plan's ranks, in `run_dir`; their results folded."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(run_dir.glob("rank*.json")) + list(run_dir.glob("rank*.pid")):
        stale.unlink()
    config_path = run_dir / "run.json"
    config_path.write_text(cfg.model_dump_json(indent=1))
    reference, why = _reference(cfg, config_path, run_dir)
    if reference is None:
        return AutoshardRunResult(factory=cfg.factory, factory_kwargs=cfg.factory_kwargs, num_ranks=cfg.plan.num_gpus,
                                  mesh_shape=cfg.plan.mesh_shape, outcome="crashed", reason=why,
                                  predicted_step_time_s=cfg.plan.step_time_s)
    n = cfg.plan.num_gpus
    cmd = local_command(n, WORKER, ["--config", str(config_path), "--out", str(run_dir)])
    proc = run_process(cmd, cfg.timeout_s, run_dir, worker_env("cpu"), pid_dir=run_dir)
    return fold(cfg, read_rank_results(run_dir), reference, proc.return_code, proc.timed_out, proc.stderr_tail,
                proc.wall_s)


def run_plan(factory: str, inputs: Iterable[Any], result: AutoshardResult | dict, steps: int = DEFAULT_STEPS,
             out_dir: Path | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
             factory_kwargs: dict[str, int | float | str | bool] | None = None, seed: int = 1234,
             learning_rate: float = DEFAULT_LR, optimizer: Literal["sgd", "adam"] = "sgd",
             sdpa_math: bool = True, num_threads: int | None = None) -> AutoshardRunResult:
    """Run `result` (an AutoshardResult, or its JSON dump as a dict) for the module `factory(**factory_kwargs)`
    builds on `inputs` (AutoshardInput, dicts or InputSpec-like objects) with `result.num_gpus` gloo ranks, and
    compare every step's loss with one process. `out_dir` keeps the run's files (locked while it runs); without it
    a temporary folder is used and removed. SpecError (one line, naming the field) on bad input; failures of the
    run itself come back in the result's outcome."""
    plan = result if isinstance(result, AutoshardResult) else _validated(AutoshardResult, result, "result")
    specs = coerce_inputs(inputs)
    load_factory(factory)  # here, so that a bad name is a SpecError and not a failed run
    check_plan(plan, specs)
    data = {"factory": factory, "factory_kwargs": dict(factory_kwargs or {}), "inputs": specs, "plan": plan,
            "seed": seed, "steps": steps, "learning_rate": learning_rate, "optimizer": optimizer,
            "sdpa_math": sdpa_math, "num_threads": num_threads, "timeout_s": timeout_s}
    cfg = _validated(AutoshardRunConfig, data, "run")
    with work_folder(out_dir, "meshplan-autoshard-", field="out_dir") as folder:
        return launch(cfg, folder)


def _validated(model: type[BaseModel], data: Any, what: str):
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(map(str, err["loc"]))
        raise SpecError(f"{what}{'.' + loc if loc else ''}: {err['msg']} (got {short_repr(err.get('input'))})") \
            from None


__all__ = ["AutoshardInput", "AutoshardRankResult", "AutoshardRunConfig", "AutoshardRunResult", "ReferenceResult",
           "check_plan", "coerce_inputs", "fold", "launch", "load_factory", "mesh_coords", "parse_placement",
           "run_plan", "torch_mesh_shape"]

