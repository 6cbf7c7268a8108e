"""The tuner's Optuna study: storage, heartbeat, and the job it belongs to.

Storage is any SQLAlchemy URL Optuna's `RDBStorage` takes: `sqlite:///tune.db` (the embedded
default, one machine, several processes) or `postgresql+psycopg://user@host/db` for workers on
several machines. Every worker records a heartbeat on its running trial every
`HEARTBEAT_INTERVAL_S`; a trial whose heartbeat is older than `GRACE_PERIOD_S` (its worker was
killed) is marked FAIL by the next worker that starts a trial, and Optuna's retry callback
(`RetryHeartbeatStaleTrialCallback`) enqueues it again with the same parameters, at most `MAX_RETRY` times. A finished trial is
committed when it ends, so killing a worker loses at most the trial it was running.

A study belongs to one job: the model, cluster, GPU count, batch, sequence, precision, training
options and constraints it was created for are stored on it (`job_fingerprint`), together with
the search space. A worker for another job is refused before it writes anything.
"""

from __future__ import annotations

import json
import random
import re
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

from planner.errors import SpecError
from planner.specs import ClusterSpec, ModelSpec, TrainSpec

HEARTBEAT_INTERVAL_S = 5
"""Seconds between a running trial's heartbeats."""
GRACE_PERIOD_S = 20
"""A RUNNING trial whose last heartbeat is older than this is a killed worker's: it is marked FAIL
and retried. Four heartbeats: a worker busy launching a run still beats (the heartbeat is a thread)."""
MAX_RETRY = 2
"""Retries of a trial whose worker was killed (its heartbeat stopped). A run that crashed, ran out
of memory, timed out or failed loss parity ended by itself: it is recorded and never retried."""
SCHEMA_RACE_TRIES = 5
"""Attempts to open a storage whose tables another worker is creating at the same moment."""
SQLITE_TIMEOUT_S = 60
"""How long a SQLite writer waits for another process's lock before it fails."""
JOB_ATTR = "meshplan_job"
SPACE_ATTR = "meshplan_space"
CALIBRATION_ATTR = "meshplan_calibration"
STUDY_NAME_RULE = "1 to 128 characters: letters, digits, '.', '_', '-'"
_STUDY_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_study_name(name: str) -> str:
    if not isinstance(name, str) or not _STUDY_NAME.fullmatch(name):
        raise SpecError(f"--study-name must be {STUDY_NAME_RULE} (got {name!r})")
    return name


def default_study_name(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_gpus: int) -> str:
    """`<model>-<cluster>-n<gpus>-b<batch>-s<seq>-<precision>`, with other characters made '-'."""
    text = f"{model.name}-{cluster.name}-n{num_gpus}-b{train.global_batch_size}-s{train.seq_len}-{train.precision}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:128]


def masked(url: str) -> str:
    """The storage URL with any password replaced by ***."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


def check_storage_url(url: str) -> None:
    """Refuse what is no database URL before SQLAlchemy sees it; a SQLite file's folder must exist."""
    if not isinstance(url, str) or "://" not in url:
        raise SpecError(f"--storage must be a database URL such as sqlite:///tune.db or "
                        f"postgresql+psycopg://user@host/db (got {url!r})")
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        path = Path(url[len("sqlite:///"):])
        if path.is_dir():
            raise SpecError(f"--storage {url!r}: {str(path)!r} is a folder; name the database file in it")
        if not path.parent.is_dir():
            raise SpecError(f"--storage {url!r}: folder {str(path.parent)!r} does not exist")


def open_storage(url: str, heartbeat_interval_s: int = HEARTBEAT_INTERVAL_S,
                 grace_period_s: int = GRACE_PERIOD_S) -> RDBStorage:
    """Optuna's RDBStorage at `url` with the heartbeat and the retry of killed trials; an unreachable
    or malformed URL is one SpecError naming it (password masked)."""
    check_storage_url(url)
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        engine_kwargs["connect_args"] = {"timeout": SQLITE_TIMEOUT_S}
    else:
        engine_kwargs["pool_pre_ping"] = True
    attempt = 1
    while True:
        try:
            return _storage(url, engine_kwargs, heartbeat_interval_s, grace_period_s)
        except Exception as exc:
            if attempt >= SCHEMA_RACE_TRIES or not _schema_race(exc):
                raise _refusal(url, exc) from None
        attempt += 1
        time.sleep(random.uniform(0.2, 1.0))  # another worker is creating the tables: then they exist


def _schema_race(exc: Exception) -> bool:
    """Two workers creating Optuna's tables in one database at once: one of them fails on a duplicate
    catalogue entry (PostgreSQL) or on the schema version row the other wrote first (SQLite, PostgreSQL)."""
    text = str(exc)
    return any(words in text for words in ("already exists", "duplicate key value", "UniqueViolation",
                                           "UNIQUE constraint failed", "database is locked"))


def _storage(url: str, engine_kwargs: dict[str, Any], heartbeat_interval_s: int, grace_period_s: int) -> RDBStorage:
    with warnings.catch_warnings():  # the heartbeat and its retry callback are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval_s,
                          grace_period=grace_period_s,
                          heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY))


def _refusal(url: str, exc: Exception) -> SpecError:
    """One line naming the storage (password masked) and the first line of what went wrong."""
    if isinstance(exc, ImportError):
        return SpecError(f"--storage {masked(url)!r}: its database driver is not installed ({exc}); for PostgreSQL "
                         "install meshplan[tune] (psycopg)")
    # SQLAlchemy's OperationalError, ArgumentError, ...: say which, in one line
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return SpecError(f"--storage {masked(url)!r}: cannot open the study storage: {first[:300]}")


def job_fingerprint(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_gpus: int,
                    constraints: dict[str, Any], engine: str, num_layers: int | None) -> dict[str, Any]:
    """What a study is tuning: the names shown in a refusal, and the full specs compared."""
    return {"model": model.name, "cluster": cluster.name, "num_gpus": num_gpus,
            "global_batch_size": train.global_batch_size, "seq_len": train.seq_len, "precision": train.precision,
            "engine": engine, "num_layers": num_layers, "constraints": constraints,
            "model_spec": json.loads(model.model_dump_json()), "train_spec": json.loads(train.model_dump_json()),
            "gpu": cluster.gpu.name}


def _differences(stored: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    names = ("model", "cluster", "gpu", "num_gpus", "global_batch_size", "seq_len", "precision", "engine",
             "num_layers", "constraints")
    out = [f"{k} {stored.get(k)!r} (this run: {mine.get(k)!r})" for k in names if stored.get(k) != mine.get(k)]
    if not out and stored.get("model_spec") != mine.get("model_spec"):
        out.append(f"model {stored.get('model')!r} with other fields (same name, another spec)")
    if not out and stored.get("train_spec") != mine.get("train_spec"):
        out.append("training options (optimizer, gradient precision, kernels, framework)")
    return out


#: How long a worker that finds the study without its job waits for it: the worker that created the study writes
#: its job right after (optuna creates a study and its attributes in separate transactions), which on a busy
#: machine may take a moment. A study still without one is not `meshplan tune`'s.
CREATION_WAIT_S = 20.0


def _job_of(study: optuna.Study) -> dict[str, Any] | None:
    """The study's job fingerprint, waiting up to CREATION_WAIT_S (a study with trials: not at all) for a worker
    that is creating it to write it."""
    deadline = time.monotonic() + (CREATION_WAIT_S if not study.trials else 0.0)
    while True:
        stored = study.user_attrs.get(JOB_ATTR)
        if stored is not None or time.monotonic() >= deadline:
            return stored
        time.sleep(0.2)


def open_study(storage: RDBStorage, name: str, fingerprint: dict[str, Any], url: str,
               sampler: optuna.samplers.BaseSampler) -> optuna.Study:
    """Create the study, or load it when it exists and belongs to this job (SpecError otherwise)."""
    check_study_name(name)
    try:
        existing = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    except Exception as exc:
        raise SpecError(f"--storage {masked(url)!r}: cannot read its studies: {str(exc).splitlines()[0][:300]}") \
            from None
    if name in existing:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
        stored = _job_of(study)
        if stored is None:
            raise SpecError(f"--study-name {name!r}: the study exists in {masked(url)} but was not created by "
                            "`meshplan tune`; choose another name")
        diff = _differences(stored, fingerprint)
        if diff:
            raise SpecError(f"--study-name {name!r} belongs to another job: {'; '.join(diff)}; choose another "
                            "--study-name or the same job")
        if study.direction != optuna.study.StudyDirection.MAXIMIZE:
            raise SpecError(f"--study-name {name!r}: the study does not maximise tokens/s")
        return study
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize", sampler=sampler,
                                load_if_exists=True)  # another worker may have just created it
    stored = study.user_attrs.get(JOB_ATTR)
    if stored is None:
        study.set_user_attr(JOB_ATTR, fingerprint)
    elif _differences(stored, fingerprint):
        raise SpecError(f"--study-name {name!r} was created for another job at the same moment; choose another name")
    return study
