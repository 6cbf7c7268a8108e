"""The services the tuner's tests start (tests/services.py): a PostgreSQL server that several Optuna workers share,
and optuna-dashboard serving a study's trials over HTTP. Each starts, serves and is gone afterwards."""

from __future__ import annotations

import collections
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

import pytest

import services
from services import dashboard_server, dashboard_trials, port_is_open, postgres_server, requires_postgres
from services import free_port as services_free_port

optuna = pytest.importorskip("optuna")

pytestmark = [pytest.mark.slow, pytest.mark.services]

#: One Optuna worker: joins the study by URL and adds its trials, each tagged with the worker's number.
WORKER = """
import sys
import optuna

url, name, worker, num_trials = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.load_study(study_name=name, storage=url)

def objective(trial):
    trial.set_user_attr("worker", worker)
    x = trial.suggest_float("x", -10.0, 10.0)
    return (x - 2.0) ** 2

study.optimize(objective, n_trials=num_trials)
"""
NUM_WORKERS = 2
TRIALS_PER_WORKER = 6
#: Seconds one worker may take (a few trials, each a handful of SQL round trips).
WORKER_TIMEOUT_S = 120


@pytest.fixture
def cluster_folders(monkeypatch) -> list[Path]:
    """The folders postgres_server creates during the test (recorded as tempfile.mkdtemp makes them)."""
    made, mkdtemp = [], tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        made.append(Path(mkdtemp(*args, **kwargs)))
        return str(made[-1])

    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    return made


@requires_postgres
def test_workers_in_two_processes_share_one_study_through_postgresql(tmp_path, cluster_folders):
    psycopg = pytest.importorskip("psycopg")
    with postgres_server(tmp_path) as url:
        port = urllib.parse.urlsplit(url).port
        assert url == f"postgresql+psycopg://meshplan@127.0.0.1:{port}/meshplan"
        optuna.create_study(storage=url, study_name="shared", direction="minimize")
        workers = [subprocess.Popen([sys.executable, "-c", WORKER, url, "shared", str(i), str(TRIALS_PER_WORKER)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for i in range(NUM_WORKERS)]
        try:
            errors = [worker.communicate(timeout=WORKER_TIMEOUT_S)[1] for worker in workers]
        finally:
            for worker in workers:
                worker.kill()
                worker.wait()
        assert [worker.returncode for worker in workers] == [0] * NUM_WORKERS, errors

        trials = optuna.load_study(study_name="shared", storage=url).trials
        assert sorted(t.number for t in trials) == list(range(NUM_WORKERS * TRIALS_PER_WORKER))
        assert {t.state for t in trials} == {optuna.trial.TrialState.COMPLETE}
        by_worker = collections.Counter(t.user_attrs["worker"] for t in trials)
        assert by_worker == {i: TRIALS_PER_WORKER for i in range(NUM_WORKERS)}
        # The trials are rows of that server's database, not of some other storage.
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
            assert conn.execute("SELECT version()").fetchone()[0].startswith("PostgreSQL")
            assert conn.execute("SELECT count(*) FROM trials").fetchone()[0] == NUM_WORKERS * TRIALS_PER_WORKER
    assert not port_is_open(port)
    assert [p.name.startswith("meshplan-pg-") for p in cluster_folders] == [True]
    assert not cluster_folders[0].exists()


@requires_postgres
def test_postgres_server_stops_when_the_test_fails(tmp_path, cluster_folders):
    with pytest.raises(RuntimeError, match="the body failed"):
        with postgres_server(tmp_path) as url:
            port = urllib.parse.urlsplit(url).port
            assert port_is_open(port)
            raise RuntimeError("the body failed")
    assert not port_is_open(port)
    assert [p.name.startswith("meshplan-pg-") for p in cluster_folders] == [True]
    assert not cluster_folders[0].exists()


@requires_postgres
def test_postgres_url_fixture_listens_on_127_0_0_1_only(postgres_url):
    """TCP from 127.0.0.1 gets in without a password; the server listens nowhere else, and its unix socket
    (in the cluster's own folder) lets nobody in."""
    psycopg = pytest.importorskip("psycopg")
    conninfo = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo) as conn:
        assert conn.execute("SELECT current_user, current_database()").fetchone() == ("meshplan", "meshplan")
        assert conn.execute("SHOW listen_addresses").fetchone()[0] == "127.0.0.1"
        socket_dir = conn.execute("SHOW unix_socket_directories").fetchone()[0]
    assert Path(socket_dir).name == "sock" and Path(socket_dir).parent.name.startswith("meshplan-pg-")
    port = urllib.parse.urlsplit(postgres_url).port
    with pytest.raises(psycopg.OperationalError, match="no pg_hba.conf entry"):
        psycopg.connect(host=socket_dir, port=port, user="meshplan", dbname="meshplan", connect_timeout=10)


@requires_postgres
def test_a_port_taken_before_the_server_binds_it_is_replaced(tmp_path, monkeypatch):
    """free_port's answer can be taken by another process before the service binds it: the service starts
    on another port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        monkeypatch.setattr(services, "free_port", lambda: next(ports, None) or services_free_port())
        with postgres_server(tmp_path) as url:
            assert urllib.parse.urlsplit(url).port != taken.getsockname()[1]
        ports = iter([taken.getsockname()[1]])
        storage = f"sqlite:///{tmp_path / 'study.db'}"
        optuna.create_study(storage=storage, study_name="empty")
        with dashboard_server(storage) as base_url:
            assert urllib.parse.urlsplit(base_url).port != taken.getsockname()[1]
            assert dashboard_trials(base_url, "empty") == []


def test_dashboard_serves_the_trials_and_their_user_attrs(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name="served", direction="minimize")
    distributions = {"tp": optuna.distributions.IntDistribution(1, 8),
                     "lr": optuna.distributions.FloatDistribution(1e-4, 1.0, log=True)}
    study.add_trial(optuna.trial.create_trial(params={"tp": 2, "lr": 0.01}, distributions=distributions, value=1.5,
                                              user_attrs={"plan": "dp4 tp2", "step_time_s": 0.25}))
    study.add_trial(optuna.trial.create_trial(params={"tp": 8, "lr": 0.1}, distributions=distributions,
                                              state=optuna.trial.TrialState.FAIL,
                                              user_attrs={"plan": "dp1 tp8", "error": "out of memory"}))
    optuna.create_study(storage=storage, study_name="other").add_trial(
        optuna.trial.create_trial(params={}, distributions={}, value=0.0))

    with dashboard_server(storage) as base_url:
        port = urllib.parse.urlsplit(base_url).port
        trials = dashboard_trials(base_url, "served")
        with pytest.raises(LookupError, match="no study named 'missing'"):
            dashboard_trials(base_url, "missing")

    assert not port_is_open(port)
    assert [(t["number"], t["state"], t["values"]) for t in trials] == [(0, "Complete", [1.5]), (1, "Fail", None)]
    assert [{p["name"]: p["param_external_value"] for p in t["params"]} for t in trials] == [
        {"tp": "2", "lr": "0.01"}, {"tp": "8", "lr": "0.1"}]
    assert [{a["key"]: a["value"] for a in t["user_attrs"]} for t in trials] == [
        {"plan": "dp4 tp2", "step_time_s": "0.25"}, {"plan": "dp1 tp8", "error": "out of memory"}]
