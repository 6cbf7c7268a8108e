"""`tune`: analytic ranking, then real trials in an Optuna study, then calibration fed back.

1. The analytic search (`planner.plan`, the user's constraints) gives the pool of fitting
   strategies (`space.POOL_SIZE` fastest), the search space (`space.build_space`) and the seeds:
   the top-K and the near-ties inside the top plan's error band, enqueued as the study's first
   trials (a strategy already measured, waiting or running in the study is not enqueued again).
2. Each trial (Optuna's `study.optimize`, heartbeat on) turns its parameters into a strategy,
   scores it on the present calibration, and runs it briefly (`measure.measure`) unless the cost
   model says it does not fit, or the study already measured it or another worker is measuring
   it: those end PRUNED with the reason and cost no run. The objective is the measured tokens/s
   (maximised). OOM, timeout, crash and failed loss parity end FAIL with the reason and are
   never run again; an OOM raises the memory reserve the next scores use (`feedback`).
3. Every `calibrate_every` ok trials the calibration is refitted on all of them, stored on the
   study (so other workers and a resumed run use it), and the remaining candidates are re-ranked
   on it: the new top-K not yet measured are enqueued.
4. The budget is the number of measured trials the study should hold (shared by all workers;
   a rerun of a finished study runs nothing) and this worker's wall-clock time. The tuner also
   stops when `max_idle_proposals` proposals in a row could not run, or every pool strategy ran.

Every trial carries, as user attributes, its strategy, the prediction and its band, what was
measured and how (`measure.Measurement`), its status and reason (`TrialRecord` reads them back).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Literal

import optuna
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ConfigDict, Field

from executors.results import ParityReference
from executors.support import executed_model, unsupported_reasons
from executors.tune.feedback import (
    MIN_FIT_TRIALS,
    FitReport,
    TrialRun,
    calibrated_cluster,
    fit_trials,
    reserve_after_oom,
)
from executors.tune.measure import Measurement, measure
from executors.tune.space import (
    NEAR_TIE_DEPTH,
    POOL_SIZE,
    Space,
    build_space,
    params_of,
    seeds_of,
    strategy_for,
    strategy_key,
)
from executors.tune.study import (
    CALIBRATION_ATTR,
    SPACE_ATTR,
    GRACE_PERIOD_S,
    HEARTBEAT_INTERVAL_S,
    default_study_name,
    job_fingerprint,
    masked,
    open_storage,
    open_study,
)
from executors.validate import ValidateOptions, engine_reasons, resolve_device
from planner.calibrate import run_settings
from planner.api import plan
from planner.errors import SpecError
from planner.search import evaluate_one
from planner.show import plots
from planner.show.html import html_table, lines_html
from planner.show.labels import trials_table
from planner.specs import ClusterSpec, ModelSpec, Strategy, TrainSpec

WORKER = f"{socket.gethostname()}:{os.getpid()}"
"""This process, as recorded on the trials it runs."""
MAX_TRIALS = 10_000
"""Upper bound of the trial budget (each trial is a real run)."""
EventCallback = Callable[[str, dict[str, Any]], None]
"""on_event(kind, data): 'study' (name, storage, resumed, measured), 'trial_start' (number, label,
origin, predicted_step_s), 'step' (from the run), 'trial_end' (number, label, status, measured_step_s,
predicted_step_s, error, best_label, best_tokens_per_s), 'skipped' (number, label, reason),
'calibrated' (trials, before, after, values)."""


class TrialFailed(Exception):
    """A measured trial that did not end ok (OOM, timeout, crash, failed parity): Optuna records
    it FAIL with its reason; the tuner goes on."""


class TuneOptions(BaseModel):
    """How the study is run (the runs themselves: `run`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    storage: str = Field("sqlite:///tune.db", description="SQLAlchemy URL of the study storage.")
    study_name: str | None = Field(None, description="Default: <model>-<cluster>-n<gpus>-b<batch>-s<seq>-<precision>.")
    n_trials: int = Field(8, ge=1, le=MAX_TRIALS, description="Measured trials the study should hold (all workers).")
    timeout_s: float | None = Field(None, gt=0, description="Wall-clock budget of this worker, seconds.")
    top_k: int = Field(4, ge=1, le=64, description="Analytic top plans enqueued first.")
    near_ties: int = Field(4, ge=0, le=64, description="Then at most this many near-ties of the top plan (inside its "
                           "error band) of layouts the seeds do not have yet.")
    calibrate_every: int = Field(3, ge=1, le=MAX_TRIALS, description="Refit after this many new ok trials.")
    calibration_out: Path | None = Field(None, description="Write the final calibration profile here (.yaml).")
    sampler_seed: int | None = Field(None, description="Seed of Optuna's TPE sampler.")
    max_idle_proposals: int = Field(64, ge=1, le=100_000, description="Stop after this many proposals in a row "
                                    "that could not run (do not fit, already measured).")
    engine: Literal["auto", "torch", "megatron", "deepspeed"] = Field(
        "auto", description="Executor of the trials; auto: the plan's framework's where it runs here (Megatron-core "
        "or DeepSpeed on CUDA), else the torch-native one. Replaces run.engine.")
    repeat_busy: bool = Field(True, description="Run a trial taken on a busy host (or with steps spread wider than "
                              "its error band) once more and keep the faster.")
    heartbeat_interval_s: int = Field(HEARTBEAT_INTERVAL_S, ge=1, le=3600, description="Seconds between a running "
                                      "trial's heartbeats.")
    grace_period_s: int = Field(GRACE_PERIOD_S, ge=2, le=86_400, description="A running trial without a heartbeat "
                                "for this long belongs to a stopped worker: it is marked failed and retried.")
    run: ValidateOptions = Field(default_factory=lambda: ValidateOptions(timed_steps=5, warmup_steps=1),
                                 description="How each trial runs (steps, timeout, device, engine, layers).")


class TrialRecord(BaseModel):
    """One trial as the report shows it (from its user attributes)."""

    number: int
    state: str
    origin: str = ""
    label: str = ""
    strategy: dict[str, Any] | None = None
    status: str = ""
    reason: str = ""
    predicted_step_s: float | None = None
    predicted_step_s_low: float | None = None
    predicted_step_s_high: float | None = None
    predicted_step_s_calibrated: float | None = None
    predicted_peak_memory_bytes: float | None = None
    measured_step_s: float | None = None
    measured_peak_memory_bytes: float | None = None
    spread: float | None = None
    error: float | None = Field(None, description="predicted / measured - 1 on the profile (before calibration).")
    error_calibrated: float | None = Field(None, description="The same with the calibration the trial was scored on.")
    tokens_per_s: float | None = None
    busy: bool = False
    busy_reason: str = ""
    repeated: bool = False
    weight: float = 1.0

    @classmethod
    def of(cls, t: FrozenTrial) -> TrialRecord:
        a = t.user_attrs
        known = {k: a[k] for k in cls.model_fields if k in a and k not in ("number", "state")}
        return cls(number=t.number, state=t.state.name, **known)


class TuneReport(BaseModel):
    """The study after this worker stopped."""

    study_name: str
    storage: str = Field(description="The storage URL, password masked.")
    job: dict[str, Any]
    trials: list[TrialRecord]
    best: TrialRecord | None
    measured: int
    stopped: str = Field(description="Why this worker stopped.")
    calibration: FitReport | None = None
    calibration_values: dict[str, float] = Field(default_factory=dict)
    calibration_file: str | None = None
    best_configs: dict[str, str] = Field(
        default_factory=dict, description="The best measured strategy emitted for each framework that can express "
        "it (backend -> text; planner.emit), planned on the final calibration.")
    best_not_expressible: dict[str, str] = Field(default_factory=dict, description="backend -> why not.")
    reranked_errors: dict[str, float | None] = Field(
        default_factory=dict, description="Over the trials scored on a calibration fitted before they ran: median "
        "|error| of their profile prediction ('before') and of their calibrated one ('after').")

    def _repr_html_(self) -> str:
        """The trials' table as a notebook shows it: the cells `meshplan tune` prints (planner.show.labels)."""
        return html_table(trials_table(self)) + lines_html([f"stopped: {self.stopped}"])

    def plot(self, path: str | None = None):
        """Predicted (on the profile, with its band) against measured step time of every trial measured ok
        (planner.show.plots); a matplotlib Figure, also written to `path` (.png or .svg)."""
        pairs = [(r.label or f"trial {r.number}", r.predicted_step_s, r.measured_step_s, r.predicted_step_s_low,
                  r.predicted_step_s_high) for r in self.trials
                 if r.state == "COMPLETE" and r.measured_step_s and r.predicted_step_s]
        return plots.predicted_vs_measured(pairs, title=f"study {self.study_name}: {len(pairs)} trials measured",
                                           path=path)


def measured_trials(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("measured")]


def _origin(study: optuna.Study, trial: optuna.Trial) -> str:
    """Where a trial comes from: its 'origin' attribute (seeds, re-ranked candidates), a retry of a
    trial whose worker stopped (Optuna's retry callback copies that trial's attributes and marks
    the copy in its system attributes), or the sampler."""
    mine = next((t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                 if t.number == trial.number), None)
    failed = None if mine is None else mine.system_attrs.get("failed_trial")
    if failed is not None:
        return f"retry of trial {failed} (its worker stopped)"
    return trial.user_attrs.get("origin") or "sampler"


class _Tuner:
    def __init__(self, study: optuna.Study, space: Space, pool: list[Strategy], model: ModelSpec, cluster: ClusterSpec,
                 train: TrainSpec, num_gpus: int, options: TuneOptions, on_event: EventCallback):
        self.study, self.space, self.pool, self.model = study, space, pool, model
        self.base, self.train, self.num_gpus, self.options, self.event = cluster, train, num_gpus, options, on_event
        self.references: dict[str, tuple[ParityReference | None, str]] = {}
        self.device = resolve_device(options.run.device)
        self.idle = 0
        self.stopped = "the trial budget is reached"
        self.fits_seen = len([t for t in measured_trials(study) if t.user_attrs.get("status") == "ok"])
        self.given_values: dict[str, float] = {}  # the --calibration the study started from
        self.given_source = ""

    # ---- calibration state (shared through the study) ----
    @property
    def values(self) -> dict[str, float]:
        return dict(self.study.user_attrs.get(CALIBRATION_ATTR, {}).get("values", {}))

    def cluster_now(self) -> ClusterSpec:
        return calibrated_cluster(self.base, self.values)

    def run_model(self, st: Strategy) -> ModelSpec:
        return executed_model(self.model, st, self.options.run.num_layers)[0]

    # ---- the objective ----
    def skip(self, trial: optuna.Trial, label: str, status: str, reason: str) -> None:
        trial.set_user_attr("status", status)
        trial.set_user_attr("reason", reason)
        self.event("skipped", {"number": trial.number, "label": label, "reason": reason})
        self.idle += 1
        if self.idle >= self.options.max_idle_proposals:
            self.stopped = (f"{self.idle} proposals in a row could not run (do not fit, or already measured): the "
                            "space under the constraints looks exhausted")
            self.study.stop()
        raise optuna.TrialPruned(reason)

    def taken_by(self, key: str, number: int) -> FrozenTrial | None:
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE,
                                                                 TrialState.FAIL)):
            if t.number == number or t.user_attrs.get("key") != key:
                continue
            if t.state == TrialState.RUNNING or t.user_attrs.get("measured"):
                return t
        return None

    def objective(self, trial: optuna.Trial) -> float:
        if len(measured_trials(self.study)) >= self.options.n_trials:
            self.study.stop()
            raise optuna.TrialPruned("the trial budget is reached")
        params = {n: trial.suggest_categorical(n, values) for n, values in self.space.choices.items()}
        st, why = strategy_for(params, self.space, self.pool, self.num_gpus)
        origin = _origin(self.study, trial)
        trial.set_user_attr("origin", origin)
        if st is None:
            self.skip(trial, "-", "not run", f"the sampled values make no strategy: {why}")
        label = st.short()
        trial.set_user_attr("label", label)
        trial.set_user_attr("strategy", json.loads(st.model_dump_json()))
        key = strategy_key(st)
        trial.set_user_attr("key", key)  # written before the check below: two workers never both run it
        run_model = self.run_model(st)
        base_est = evaluate_one(run_model, self.base, self.train, st)
        values = self.values
        now_est = (evaluate_one(run_model, calibrated_cluster(self.base, values), self.train, st) if values
                   else base_est)
        if not now_est.fits:
            why = "; ".join(now_est.reasons) or "does not fit"
            self.skip(trial, label, "not run", f"the cost model says it cannot run: {why}")
        cannot = unsupported_reasons(run_model, self.train, st, self.device, self.options.run.hsdp_replicate)
        if cannot:
            self.skip(trial, label, "not run", "the executor cannot run it: " + "; ".join(cannot))
        other = self.taken_by(key, trial.number)
        if other is not None:
            what = "is being measured" if other.state == TrialState.RUNNING else "was measured"
            self.skip(trial, label, "not run", f"already tried: {what} in trial {other.number}")
        self.idle = 0
        for name, value in (("predicted_step_s", base_est.step_time_s), ("predicted_step_s_low", base_est.step_time_s_low),
                            ("predicted_step_s_high", base_est.step_time_s_high),
                            ("predicted_peak_memory_bytes", base_est.peak_memory_bytes)):
            trial.set_user_attr(name, value)
        if values:
            trial.set_user_attr("predicted_step_s_calibrated", now_est.step_time_s)
            trial.set_user_attr("calibrated_on", self.study.user_attrs[CALIBRATION_ATTR].get("trials", []))
        trial.set_user_attr("worker", WORKER)
        trial.set_user_attr("status", "running")
        self.event("trial_start", {"number": trial.number, "label": label, "origin": origin,
                                   "predicted_step_s": now_est.step_time_s})
        m = measure(st, self.model, self.base, self.train, self.num_gpus, self.options.run, f"trial-{trial.number}",
                    self.references, on_event=self.event, repeat_busy=self.options.repeat_busy)
        return self.record(trial, label, m, base_est.step_time_s, now_est)

    def record(self, trial: optuna.Trial, label: str, m: Measurement, base_pred: float, now_est) -> float:
        for name in ("spread", "busy", "busy_reason", "repeated", "weight", "load_before", "load_after",
                     "parity_max_rel_error"):
            trial.set_user_attr(name, getattr(m, name))
        trial.set_user_attr("measured_step_times_s", m.step_times_s)
        trial.set_user_attr("measured_peak_memory_bytes", m.peak_memory_bytes)
        trial.set_user_attr("reason", m.reason)
        if m.outcome == "unsupported":
            trial.set_user_attr("measured", False)
            self.skip(trial, label, "not run", f"the executor cannot run it: {m.reason}")
        trial.set_user_attr("status", m.outcome)
        trial.set_user_attr("measured", True)
        best = self.best()
        if m.outcome != "ok":
            if m.outcome == "oom":
                reserve = reserve_after_oom(self.cluster_now(), now_est)
                self.store_values(self.values | {"framework_reserve_bytes": reserve}, note=f"oom in trial {trial.number}")
                trial.set_user_attr("reason", m.reason + f"; the memory reserve is raised to {reserve / 2**30:.2f} GiB "
                                    "so that strategies this large are no longer proposed")
            self.event("trial_end", {"number": trial.number, "label": label, "status": m.outcome, "reason": m.reason,
                                     "best": best})
            raise TrialFailed(f"{m.outcome}: {m.reason}")
        tokens = self.train.global_batch_size * self.train.seq_len / m.step_s
        trial.set_user_attr("measured_step_s", m.step_s)
        trial.set_user_attr("tokens_per_s", tokens)
        trial.set_user_attr("error", base_pred / m.step_s - 1)
        if self.values:
            trial.set_user_attr("error_calibrated", now_est.step_time_s / m.step_s - 1)
        self.event("trial_end", {"number": trial.number, "label": label, "status": "ok", "measured_step_s": m.step_s,
                                 "predicted_step_s": now_est.step_time_s, "error": now_est.step_time_s / m.step_s - 1,
                                 "busy": m.busy, "best": best if best and best.tokens_per_s and best.tokens_per_s > tokens
                                 else TrialRecord(number=trial.number, state="COMPLETE", label=label,
                                                  tokens_per_s=tokens, measured_step_s=m.step_s)})
        return tokens

    def best(self) -> TrialRecord | None:
        ok = [TrialRecord.of(t) for t in measured_trials(self.study) if t.state == TrialState.COMPLETE]
        return max(ok, key=lambda r: r.tokens_per_s or 0.0) if ok else None

    # ---- after each trial ----
    def after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if len(measured_trials(study)) >= self.options.n_trials:
            study.stop()
            return
        if trial.state != TrialState.COMPLETE:
            return
        ok = len([t for t in measured_trials(study) if t.state == TrialState.COMPLETE])
        if ok - self.fits_seen >= self.options.calibrate_every and ok >= MIN_FIT_TRIALS:
            self.fits_seen = ok
            if self.calibrate() is not None:
                self.enqueue(self.reranked(), "re-ranked after calibration")
        if all(self.measured_or_busy(strategy_key(st)) for st in self.pool):
            self.stopped = "every strategy of the pool was tried"
            study.stop()

    def trial_runs(self) -> list[TrialRun]:
        out = []
        for t in measured_trials(self.study):
            if t.state != TrialState.COMPLETE:
                continue
            st = Strategy.model_validate(t.user_attrs["strategy"])
            out.append(TrialRun(number=t.number, label=t.user_attrs.get("label", ""), strategy=st,
                                model=self.run_model(st), measured_step_s=t.user_attrs["measured_step_s"],
                                weight=t.user_attrs.get("weight", 1.0)))
        return out

    def calibrate(self) -> FitReport | None:
        runs = self.trial_runs()
        fit = fit_trials(runs, self.base, self.train)
        reserve = {k: v for k, v in self.values.items() if k == "framework_reserve_bytes"}
        if fit is None:
            if len(runs) >= MIN_FIT_TRIALS and self.values != reserve:  # an earlier fit no longer helps: drop it
                self.store_values(reserve, trials=[r.number for r in runs], note="profile kept")
                self.event("note", {"text": f"calibration on {len(runs)} trials: no parameter lowers the profile's "
                                            "error by 10 % or more; the profile's own values are used"})
            return None
        self.store_values(fit.values | reserve, trials=[r.number for r in runs])
        self.event("calibrated", {"trials": len(runs), "before": FitReport.median_abs(fit.before),
                                  "after": FitReport.median_abs(fit.after), "values": fit.values,
                                  "not_identified": fit.not_identified})
        return fit

    def store_values(self, values: dict[str, float], trials: list[int] | None = None, note: str = "") -> None:
        present = self.study.user_attrs.get(CALIBRATION_ATTR, {})
        self.study.set_user_attr(CALIBRATION_ATTR, {"values": values,
                                                    "trials": present.get("trials", []) if trials is None else trials,
                                                    "note": note or present.get("note", "")})

    def reranked(self) -> list[Strategy]:
        result = plan(model=self.model, cluster=self.cluster_now(), num_gpus=self.num_gpus,
                      global_batch_size=self.train.global_batch_size, seq_len=self.train.seq_len,
                      precision=self.train.precision, constraints=self.constraints, top_k=self.options.top_k,
                      **self.train_options)
        return [p.strategy for p in result.plans]

    def measured_or_busy(self, key: str) -> bool:
        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get("key") == key and (t.user_attrs.get("measured") or t.state == TrialState.RUNNING):
                return True
        return False

    def enqueue(self, strategies: list[Strategy], origin: str) -> int:
        # an enqueued trial's parameters are its fixed_params until it runs (Optuna keeps them there)
        waiting = {json.dumps(t.system_attrs.get("fixed_params") or t.params, sort_keys=True)
                   for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))}
        n = 0
        for i, st in enumerate(strategies, start=1):
            params = params_of(st, self.space.names)
            if not self.space.holds(st) or self.measured_or_busy(strategy_key(st)) \
                    or json.dumps(params, sort_keys=True) in waiting:
                continue
            self.study.enqueue_trial(params, user_attrs={"origin": f"{origin} #{i}"})
            n += 1
        return n


def resolve_engine(engine: str, device: str, framework: str, model: ModelSpec) -> tuple[str, str]:
    """The executor the trials run on, and a note when auto chose other than the plan's framework:
    auto takes Megatron-core for framework megatron and DeepSpeed for deepspeed, on CUDA (they need it);
    on a CPU, for torchtitan and Colossal-AI plans, and for an MoE model under megatron (the Megatron
    executor builds dense layers only), the torch-native executor."""
    if engine != "auto":
        return engine, ""
    if framework not in ("megatron", "deepspeed"):
        return "torch", ""
    if device != "cuda":
        return "torch", f"the plans are costed for {framework}; its executor needs CUDA, so the trials run torch-native"
    if framework == "megatron" and model.is_moe:
        return "torch", ("the Megatron executor builds dense layers only: the MoE trials run torch-native "
                         "(their plans are costed for megatron)")
    return framework, ""


def check_one_node(device: str, num_gpus: int) -> None:
    """A trial runs on this machine (torchrun --standalone): on CUDA it needs `num_gpus` GPUs here."""
    if device != "cuda":
        return
    import torch

    here = torch.cuda.device_count()
    if num_gpus > here:
        raise SpecError(f"--gpus {num_gpus}: this node has {here} GPUs and a tuner trial runs on one node "
                        "(torchrun --standalone); across nodes run one worker per node (meshplan tune "
                        "--slurm-workers N) with trials of at most one node's GPUs, or check multi-node plans with "
                        "`meshplan validate --prepare`")


def tune(model: str | ModelSpec, cluster: str | ClusterSpec, num_gpus: int, global_batch_size: int, seq_len: int,
         precision: str = "bf16", constraints: dict[str, Any] | None = None, calibration: Any = None,
         options: TuneOptions | None = None, on_event: EventCallback | None = None,
         **train_options: Any) -> TuneReport:
    """Tune the job in an Optuna study (module docstring) and report the study after this worker.

    Bad input (a budget of 0, an unreachable storage, a study of another job, a calibration file
    with a negative bandwidth) is a SpecError before any trial runs or the study is written.

    Training settings not given run at the framework's defaults (planner.calibrate.run_settings), as
    the trials' executors run them: the planner does not choose them here."""
    options = options or TuneOptions()
    train_options = run_settings(train_options)
    event = on_event or (lambda kind, data: None)
    constraints = dict(constraints or {})
    common = dict(model=model, cluster=cluster, num_gpus=num_gpus, global_batch_size=global_batch_size,
                  seq_len=seq_len, precision=precision, constraints=constraints, **train_options)
    if calibration is not None:
        common["calibration"] = calibration
    seeds_result = plan(top_k=max(options.top_k, NEAR_TIE_DEPTH), **common)
    if not seeds_result.plans:
        raise SpecError("tune: no strategy fits under the constraints: nothing to tune (see `meshplan plan` for why)")
    pool_result = plan(top_k=POOL_SIZE, ranking="fastest", **common)
    spec_model, spec_cluster, train = seeds_result.model, seeds_result.cluster, seeds_result.train
    device = resolve_device(options.run.device)
    check_one_node(device, num_gpus)  # before the study is touched
    engine, engine_note = resolve_engine(options.engine, device, train.framework, spec_model)
    options = options.model_copy(update={"run": options.run.model_copy(update={"engine": engine})})
    reasons = engine_reasons(options.run, device, train)
    if reasons:  # e.g. --engine megatron without CUDA, fp16 on a CPU: no trial could run
        raise SpecError("tune: " + "; ".join(reasons) + ": no trial can run")
    pool = [p.strategy for p in pool_result.plans]
    fingerprint = job_fingerprint(spec_model, spec_cluster, train, num_gpus, constraints, options.run.engine,
                                  options.run.num_layers)
    name = options.study_name or default_study_name(spec_model, spec_cluster, train, num_gpus)
    if options.grace_period_s <= options.heartbeat_interval_s:
        raise SpecError(f"--grace-period ({options.grace_period_s} s) must be longer than the heartbeat interval "
                        f"({options.heartbeat_interval_s} s): a live worker's trial would be retried")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the tuner reports through on_event
    storage = open_storage(options.storage, options.heartbeat_interval_s, options.grace_period_s)
    sampler = optuna.samplers.TPESampler(seed=options.sampler_seed)
    study = open_study(storage, name, fingerprint, options.storage, sampler)
    stored = study.user_attrs.get(SPACE_ATTR)
    space = Space.from_attr(stored) if stored else build_space(pool)
    if not stored:
        study.set_user_attr(SPACE_ATTR, space.to_attr())
    tuner = _Tuner(study, space, pool, spec_model, spec_cluster, train, num_gpus, options, event)
    tuner.constraints, tuner.train_options = constraints, train_options
    if calibration is not None:  # what the written profile carries over unfitted
        from profiles import load_calibration

        given = load_calibration(calibration)
        tuner.given_values, tuner.given_source = given.values, given.source or "the given calibration"
    already = len(measured_trials(study))
    if engine_note:
        event("note", {"text": engine_note})
    event("study", {"name": name, "storage": masked(options.storage), "resumed": bool(study.trials),
                    "measured": already, "budget": options.n_trials, "pool": len(pool),
                    "space": {k: len(v) for k, v in space.choices.items()}})
    seeds = seeds_of(seeds_result.plans, seeds_result.worth_a_real_run, options.top_k, options.near_ties)
    if already < options.n_trials:
        with warnings.catch_warnings():  # a killed worker's trial is retried before this run's seeds queue up
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        tuner.enqueue(seeds[:options.top_k], "analytic top plan")
        tuner.enqueue(seeds[options.top_k:], "near-tie of the top plan, another layout")
        start = time.monotonic()
        study.optimize(tuner.objective, timeout=options.timeout_s, catch=(TrialFailed,),
                       callbacks=[tuner.after_trial])
        if options.timeout_s is not None and time.monotonic() - start >= options.timeout_s \
                and len(measured_trials(study)) < options.n_trials:
            tuner.stopped = f"the wall-clock budget of {options.timeout_s:g} s is spent"
    else:
        tuner.stopped = f"the study already holds {already} measured trials (budget {options.n_trials})"
    fit = tuner.calibrate() if len(tuner.trial_runs()) >= MIN_FIT_TRIALS else None
    written = None
    if fit is not None and options.calibration_out is not None:
        written = str(write_tuned_calibration(options.calibration_out, fit, tuner, name, masked(options.storage)))
    return report_of(study, name, options, fingerprint, tuner, fit, written)



def write_tuned_calibration(path: Path, fit: FitReport, tuner: _Tuner, study_name: str, storage: str) -> Path:
    """The fit (and any OOM reserve) as a user calibration profile (`profiles.load_calibration`'s format),
    with the trials it came from and the study, written whole."""
    from planner.calibrate.profile import user_calibration_document, write_calibration_profile

    trials = [{"trial": r.number, "strategy": r.label, "measured_step_s": round(r.measured_step_s, 6),
               "weight": r.weight} for r in tuner.trial_runs()]
    carried = {k: v for k, v in tuner.given_values.items() if k not in tuner.values}
    method = ("least squares (soft-L1 on log step-time errors, busy-host trials weighted down) over the study's ok "
              "trials; framework_reserve_gib raised after an OOM")
    if carried:
        method += f"; {', '.join(carried)} carried over unfitted from {tuner.given_source}"
    doc = user_calibration_document(
        carried | tuner.values, fit="meshplan tune", method=method,
        fitted_on=f"study {study_name}: trials " + ", ".join(str(t["trial"]) for t in trials),
        standard_errors={k: v for k, v in fit.standard_errors.items() if k in tuner.values},
        residuals=[{"row": f"trial {n}", "error": round(e, 4)} for n, e in fit.after.items()],
        gpu=tuner.base.gpu.name, cluster=tuner.base.name,
        extra={"trials": trials, "study": {
            "name": study_name, "storage": storage, "not_identified": fit.not_identified,
            "residuals_before": [{"row": f"trial {n}", "error": round(e, 4)} for n, e in fit.before.items()]}})
    return write_calibration_profile(path, doc, kind="user")


def report_of(study: optuna.Study, name: str, options: TuneOptions, fingerprint: dict[str, Any], tuner: _Tuner,
              fit: FitReport | None, written: str | None) -> TuneReport:
    records = [TrialRecord.of(t) for t in study.get_trials(deepcopy=False)]
    ok = [r for r in records if r.state == "COMPLETE" and r.tokens_per_s]
    best = max(ok, key=lambda r: r.tokens_per_s) if ok else None
    reranked = [r for r in ok if r.error_calibrated is not None and r.error is not None]
    errors: dict[str, float | None] = {"n": float(len(reranked))}
    if reranked:
        errors["before"] = statistics.median(abs(r.error) for r in reranked)
        errors["after"] = statistics.median(abs(r.error_calibrated) for r in reranked)
    job = {k: v for k, v in fingerprint.items() if k not in ("model_spec", "train_spec")}
    configs, refused = best_configs(best, tuner) if best is not None else ({}, {})
    return TuneReport(best_configs=configs, best_not_expressible=refused, study_name=name, storage=masked(options.storage), job=job, trials=records, best=best,
                      measured=len(measured_trials(study)),
                      stopped=tuner.stopped, calibration=fit, calibration_values=tuner.values,
                      calibration_file=written, reranked_errors=errors)


def best_configs(best: TrialRecord, tuner: _Tuner) -> tuple[dict[str, str], dict[str, str]]:
    """The best measured strategy as each framework's config (emitted on the full model and the
    calibrated cluster), and why the others cannot express it."""
    from planner.emit import REGISTRY, EmitOptions, NotExpressibleError
    from planner.specs import Plan

    st = Strategy.model_validate(best.strategy)
    estimate = evaluate_one(tuner.model, tuner.cluster_now(), tuner.train, st)
    chosen = Plan(rank=1, strategy=st, estimate=estimate, model=tuner.model, cluster=tuner.cluster_now(),
                  train=tuner.train, num_gpus=tuner.num_gpus)
    out, refused = {}, {}
    for name in REGISTRY.names():
        try:
            out[name] = REGISTRY.get(name).render(chosen, EmitOptions())
        except NotExpressibleError as exc:
            refused[name] = str(exc)
    return out, refused
