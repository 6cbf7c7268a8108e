"""Real services for the tests: a throwaway PostgreSQL server and optuna-dashboard, both on 127.0.0.1.

Each is a context manager that starts the service from its own temporary folder, yields where to reach it
and always stops it and removes the folder, whether the test passed or not. Nothing here uses a shell; every
subprocess has a timeout. Tests that need them are marked `services` (tests/conftest.py puts those in the
"processes" xdist group, so they run one after another on one worker) and PostgreSQL tests carry
`requires_postgres`, which skips them with the reason when no PostgreSQL binaries are installed
(scripts/test.sh installs them with apt-get when it runs as root).

    with postgres_server(tmp_path) as url:        # postgresql+psycopg://meshplan@127.0.0.1:PORT/meshplan
        optuna.create_study(storage=url, study_name="s")
    with dashboard_server("sqlite:///study.db") as base_url:
        trials = dashboard_trials(base_url, "s")
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Where Debian's postgresql packages put the server binaries, one folder per major version.
PG_VERSIONED_BINS = "/usr/lib/postgresql/*/bin"
#: The binaries postgres_server runs: a folder is usable only if it holds all of them.
PG_PROGRAMS = ("initdb", "pg_ctl", "createdb", "postgres")
#: The OS user that runs the server when the tests run as root (PostgreSQL refuses to run as root).
PG_OS_USER = "postgres"
#: The database superuser initdb creates and the database the URL names.
PG_ROLE = "meshplan"
PG_DATABASE = "meshplan"
#: Seconds allowed for initdb (it writes a few dozen MB), for one pg_ctl start/stop wait, and for createdb.
INITDB_TIMEOUT_S = 120
PG_CTL_WAIT_S = 60
CREATEDB_TIMEOUT_S = 30
#: Tries at starting a server or a dashboard: a free port found by binding port 0 can be taken by another
#: process before the service binds it, which then fails with "address already in use" and tries another port.
START_TRIES = 3
#: Linux's limit on a unix socket's path (sun_path holds 108 bytes with the terminating NUL), and the socket's
#: own file name PostgreSQL appends to unix_socket_directories.
SOCKET_PATH_MAX = 107
PG_SOCKET_NAME = ".s.PGSQL.65535"
#: Seconds to wait for optuna-dashboard to answer HTTP, for one HTTP request, for one request of that wait (short:
#: whatever else holds the port may accept and never answer), and for the dashboard to exit on SIGTERM.
DASHBOARD_START_S = 60
HTTP_TIMEOUT_S = 10
READY_PROBE_TIMEOUT_S = 1
DASHBOARD_STOP_S = 10
#: Characters of a service's log quoted in an error.
LOG_TAIL_CHARS = 3000


def find_pg_bin() -> Path | None:
    """The folder holding PostgreSQL's initdb, pg_ctl, createdb and postgres, or None.

    `initdb` found in PATH counts through its real location (Debian links only initdb and pg_ctl into PATH,
    or none: postgresql-common's wrappers stand for createdb in /usr/bin); then the newest of
    /usr/lib/postgresql/*/bin."""
    candidates = []
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(found).resolve().parent)
    versioned = [p for p in Path("/").glob(PG_VERSIONED_BINS.lstrip("/")) if p.is_dir()]
    candidates += sorted(versioned, key=_version_key, reverse=True)
    for folder in candidates:
        if all(os.access(folder / name, os.X_OK) for name in PG_PROGRAMS):
            return folder
    return None


def _version_key(folder: Path) -> tuple[int, ...]:
    """(15,) for /usr/lib/postgresql/15/bin: newest first without "9.6" sorting above "15"."""
    return tuple(int(part) for part in folder.parent.name.split(".") if part.isdigit())


def postgres_missing_reason() -> str | None:
    """Why postgres_server cannot run here, or None when it can."""
    if find_pg_bin() is None:
        return (f"PostgreSQL is not installed: no folder with {', '.join(PG_PROGRAMS)} in PATH or "
                f"{PG_VERSIONED_BINS} (scripts/test.sh installs the postgresql package when it runs as root)")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_OS_USER)
        except KeyError:
            return f"PostgreSQL refuses to run as root and there is no {PG_OS_USER!r} user to run it as"
    return None


#: Skips a test, saying why, where PostgreSQL cannot be started.
requires_postgres = pytest.mark.skipif(postgres_missing_reason() is not None,
                                       reason=postgres_missing_reason() or "")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_open(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class _ServerUser:
    """Who runs PostgreSQL's programs: the current user, or `postgres` when the tests run as root."""

    def __init__(self) -> None:
        self.as_root = os.geteuid() == 0
        entry = pwd.getpwnam(PG_OS_USER) if self.as_root else pwd.getpwuid(os.geteuid())
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        self.groups = set(os.getgrouplist(entry.pw_name, entry.pw_gid))

    def run(self, cmd: list[str], *, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
        """Run cmd as this user (as root: setuid in the child, no supplementary groups), output captured."""
        switch = {"user": self.uid, "group": self.gid, "extra_groups": []} if self.as_root else {}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False,
                              stdin=subprocess.DEVNULL, **switch)

    def give(self, path: Path) -> None:
        """Make path this user's (it was created by root)."""
        if self.as_root:
            os.chown(path, self.uid, self.gid)

    def can_enter(self, folder: Path) -> bool:
        """Whether this user may traverse every folder down to `folder` (pytest's tmp_path under
        /tmp/pytest-of-root is root's alone)."""
        for part in [folder, *folder.parents]:
            try:
                st = part.stat()
            except OSError:
                return False
            if st.st_uid == self.uid:
                ok = st.st_mode & stat.S_IXUSR
            elif st.st_gid in self.groups:
                ok = st.st_mode & stat.S_IXGRP
            else:
                ok = st.st_mode & stat.S_IXOTH
            if not ok:
                return False
        return True


def _cluster_parent(tmp_path: Path, user: _ServerUser) -> Path:
    """Where the cluster's folder goes: tmp_path when the server's user can reach it and the socket's path fits,
    else the system temporary folder or /tmp."""
    for parent in (Path(tmp_path), Path(tempfile.gettempdir()), Path("/tmp")):
        socket_path = parent / "meshplan-pg-XXXXXXXX" / "sock" / PG_SOCKET_NAME
        if parent.is_dir() and user.can_enter(parent) and len(str(socket_path)) <= SOCKET_PATH_MAX:
            return parent
    raise RuntimeError(f"no folder for a PostgreSQL cluster: user uid {user.uid} cannot reach {tmp_path}, "
                       f"{tempfile.gettempdir()} or /tmp (or their socket paths exceed {SOCKET_PATH_MAX} bytes)")


def _conf_string(value: str) -> str:
    """A postgresql.conf string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _tail(text: str) -> str:
    return text[-LOG_TAIL_CHARS:].strip()


def _read_tail(path: Path) -> str:
    try:
        return _tail(path.read_text(errors="replace"))
    except OSError:
        return ""


def _check(proc: subprocess.CompletedProcess, what: str, log: Path | None = None) -> None:
    if proc.returncode != 0:
        log_text = f"\nserver log:\n{_read_tail(log)}" if log else ""
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {_tail(proc.stdout + proc.stderr)}{log_text}")


def _write_server_conf(path: Path, port: int, socket_dir: Path, user: _ServerUser) -> None:
    """The settings postgresql.conf includes: TCP on 127.0.0.1 only at `port`, the socket in the cluster's
    folder (never the system's /var/run/postgresql), and no fsync (a throwaway cluster: speed over
    durability)."""
    path.write_text(f"listen_addresses = '127.0.0.1'\n"
                    f"port = {port}\n"
                    f"unix_socket_directories = {_conf_string(str(socket_dir))}\n"
                    "fsync = off\n"
                    "synchronous_commit = off\n"
                    "full_page_writes = off\n")
    user.give(path)


@contextlib.contextmanager
def postgres_server(tmp_path: Path) -> Iterator[str]:
    """Start a fresh PostgreSQL cluster on 127.0.0.1 and yield its SQLAlchemy URL,
    "postgresql+psycopg://meshplan@127.0.0.1:PORT/meshplan".

    initdb writes the cluster into a new folder (under tmp_path where the server's user can reach it);
    authentication is `trust` for TCP connections from 127.0.0.1 and nothing else (the unix socket refuses
    every connection). As root the folder is given to the `postgres` user, who runs initdb, pg_ctl and
    createdb. On leaving, the server is stopped (fast, then immediate, then SIGKILL) and the folder removed,
    also when the body raised."""
    pg_bin = find_pg_bin()
    reason = postgres_missing_reason()
    if pg_bin is None or reason is not None:
        raise RuntimeError(reason)
    user = _ServerUser()
    base = Path(tempfile.mkdtemp(prefix="meshplan-pg-", dir=_cluster_parent(tmp_path, user)))
    data, socket_dir, log = base / "data", base / "sock", base / "server.log"
    try:
        socket_dir.mkdir()
        for path in (base, socket_dir):
            user.give(path)
        proc = user.run([str(pg_bin / "initdb"), "-D", str(data), "-U", PG_ROLE, "-A", "trust", "-E", "UTF8",
                         "--locale=C", "--no-sync", "--no-instructions"], timeout=INITDB_TIMEOUT_S, cwd=base)
        _check(proc, "initdb")
        hba = data / "pg_hba.conf"
        hba.write_text("# TYPE  DATABASE  USER  ADDRESS        METHOD\n"
                       "host    all       all   127.0.0.1/32   trust\n")
        with (data / "postgresql.conf").open("a") as conf:
            conf.write("\ninclude_if_exists = 'meshplan_test.conf'\n")
        try:
            port = _start(pg_bin, data, socket_dir, log, user)
            proc = user.run([str(pg_bin / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", PG_ROLE,
                             PG_DATABASE], timeout=CREATEDB_TIMEOUT_S, cwd=base)
            _check(proc, "createdb", log)
            yield f"postgresql+psycopg://{PG_ROLE}@127.0.0.1:{port}/{PG_DATABASE}"
        finally:
            _stop(pg_bin, data, user, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _start(pg_bin: Path, data: Path, socket_dir: Path, log: Path, user: _ServerUser) -> int:
    """Start the server on a free port (another on "address already in use"); return the port."""
    for attempt in range(START_TRIES):
        port = free_port()
        _write_server_conf(data / "meshplan_test.conf", port, socket_dir, user)
        log_start = log.stat().st_size if log.exists() else 0
        proc = user.run([str(pg_bin / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", str(PG_CTL_WAIT_S),
                         "start"], timeout=PG_CTL_WAIT_S + 15, cwd=data.parent)
        if proc.returncode == 0:
            return port
        new_log = _read_tail(log) if log.exists() and log.stat().st_size > log_start else ""
        if "could not bind" not in new_log or attempt == START_TRIES - 1:
            _check(proc, f"pg_ctl start on port {port}", log)
    raise AssertionError("unreachable: the last try raises")


def _stop(pg_bin: Path, data: Path, user: _ServerUser, cwd: Path) -> None:
    """Stop the server: pg_ctl fast, then immediate; a postmaster still running after both is killed."""
    pid_file = data / "postmaster.pid"
    for mode in ("fast", "immediate"):
        if not pid_file.exists():
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            user.run([str(pg_bin / "pg_ctl"), "-D", str(data), "-m", mode, "-w", "-t", str(PG_CTL_WAIT_S), "stop"],
                     timeout=PG_CTL_WAIT_S + 15, cwd=cwd)
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return
    with contextlib.suppress(OSError):
        # Only a postgres process: the pid file may be stale and its pid reused.
        if b"postgres" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)


def _dashboard_command() -> list[str]:
    """How to run optuna-dashboard with this interpreter's packages: `python -m optuna_dashboard` where the
    package has a __main__, else its console script installed beside this interpreter."""
    if importlib.util.find_spec("optuna_dashboard") is None:
        raise RuntimeError("optuna-dashboard is not installed (pip install -e '.[test]')")
    if importlib.util.find_spec("optuna_dashboard.__main__") is not None:
        return [sys.executable, "-m", "optuna_dashboard"]
    for scripts in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        script = scripts / "optuna-dashboard"
        if os.access(script, os.X_OK):
            return [str(script)]
    raise RuntimeError(f"optuna-dashboard's console script is not next to {sys.executable}")


#: urllib without proxies: the services are on 127.0.0.1, and an http_proxy setting must not reroute them.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(url: str, timeout: float = HTTP_TIMEOUT_S) -> object:
    """GET url and parse the JSON it answers."""
    with _HTTP.open(url, timeout=timeout) as response:
        return json.loads(response.read().decode())


@contextlib.contextmanager
def dashboard_server(storage_url: str) -> Iterator[str]:
    """Serve an Optuna storage with optuna-dashboard on 127.0.0.1 and yield its base URL
    ("http://127.0.0.1:PORT"); on leaving, SIGTERM it and wait, SIGKILL after DASHBOARD_STOP_S."""
    command = _dashboard_command()
    with tempfile.TemporaryDirectory(prefix="meshplan-dashboard-") as folder:
        log = Path(folder) / "dashboard.log"
        for attempt in range(START_TRIES):
            port = free_port()
            with log.open("w") as out:
                proc = subprocess.Popen([*command, storage_url, "--host", "127.0.0.1", "--port", str(port),
                                         "--server", "wsgiref"], stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT)
            try:
                base_url = f"http://127.0.0.1:{port}"
                if _wait_for_http(proc, f"{base_url}/api/meta"):
                    yield base_url
                    return
                text = _read_tail(log)
                if "Address already in use" not in text or attempt == START_TRIES - 1:
                    raise RuntimeError(f"optuna-dashboard did not start (exit {proc.returncode}):\n{text}")
            finally:
                _terminate(proc)
    raise AssertionError("unreachable: the last try raises")


def _wait_for_http(proc: subprocess.Popen, url: str) -> bool:
    """Poll the dashboard's /api/meta until it answers as the dashboard does; False once the process has exited.
    Raises if it does neither in time."""
    deadline = time.monotonic() + DASHBOARD_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            meta = http_json(url, timeout=READY_PROBE_TIMEOUT_S)
            if isinstance(meta, dict) and "artifact_is_available" in meta:
                return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"optuna-dashboard did not answer {url} within {DASHBOARD_START_S} s")


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=DASHBOARD_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=DASHBOARD_STOP_S)


#: The fields dashboard_trials keeps of each trial the dashboard serves.
TRIAL_FIELDS = ("number", "state", "values", "params", "user_attrs")


def dashboard_trials(base_url: str, study_name: str) -> list[dict]:
    """The trials of `study_name` as optuna-dashboard serves them (GET /api/studies for the study's id, then
    /api/studies/<id>), each with TRIAL_FIELDS as the API gives them: state capitalised ("Complete"), values
    absent (None) until the trial finishes, params as [{"name", "param_external_value" (a string), ...}],
    user_attrs as [{"key", "value" (a string)}]."""
    studies = http_json(f"{base_url}/api/studies")["study_summaries"]
    ids = [s["study_id"] for s in studies if s["study_name"] == study_name]
    if len(ids) != 1:
        names = sorted(s["study_name"] for s in studies)
        raise LookupError(f"the dashboard at {base_url} serves no study named {study_name!r} (it has {names})")
    detail = http_json(f"{base_url}/api/studies/{urllib.parse.quote(str(ids[0]))}")
    return [{field: trial.get(field) for field in TRIAL_FIELDS} for trial in detail["trials"]]


@pytest.fixture
def postgres_url(tmp_path):
    """A fresh PostgreSQL server's SQLAlchemy URL for one test (skipped where PostgreSQL is missing)."""
    reason = postgres_missing_reason()
    if reason:
        pytest.skip(reason)
    with postgres_server(tmp_path) as url:
        yield url
