"""Start the ranks of a one-machine run the way `torchrun --standalone` does, with the
rendezvous store listening on 127.0.0.1 only.

    python -m executors.local_run --nproc N -m MODULE [ARGS...]

torchrun's stores (its rendezvous store and the store its workers share) listen on every
interface whatever its flags: torch's TCPStore server binds the any-address. For the ranks of
one machine that is a port anyone on the network can reach while a run lasts. This launcher
binds a socket to 127.0.0.1 itself and hands it to the TCPStore server (`master_listen_fd`),
then starts the N ranks with the environment torchrun gives them (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR / MASTER_PORT of that store, TORCHELASTIC_USE_AGENT_STORE so that
every rank is a client of it, OMP_NUM_THREADS=1 unless set). Like torchrun it ends the other
ranks when one fails, exits with the failing rank's status (1 for a rank killed by a signal),
and on SIGTERM / SIGINT passes SIGTERM to the ranks, waits `GRACE_S` and kills what is left.
Each rank binds itself to this process (`executors.lifeline.bind_to_parent`), and this process
to meshplan, so a `kill -9` of either leaves no rank behind.

Runs across machines (`validate --prepare`, the emitted launch scripts) use torchrun.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import time

from executors import lifeline

LOOPBACK_ADDR = "127.0.0.1"
GRACE_S = 5.0
"""Grace between SIGTERM and SIGKILL for the ranks left when one fails or the run is stopped."""
POLL_S = 0.05
STORE_TIMEOUT_S = 1800
"""How long a rank waits on the store (torch's default process-group timeout)."""
MAX_RANKS = 1024


class _Stop(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum, frame):
    raise _Stop(signum)


def loopback_store(timeout_s: float = STORE_TIMEOUT_S):
    """(TCPStore server listening on 127.0.0.1 only, its port)."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK_ADDR, 0))
    sock.listen(MAX_RANKS)
    port = sock.getsockname()[1]
    store = TCPStore(LOOPBACK_ADDR, port, None, True, datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False, master_listen_fd=sock.detach(), use_libuv=True)
    return store, port


def rank_env(base: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment torchrun gives rank `rank` of a one-machine run of `nproc` ranks."""
    env = dict(base)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several ranks on one machine
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": LOOPBACK_ADDR, "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": f"meshplan-{os.getpid()}",
    })
    return env


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _exit_status(rc: int) -> int:
    return rc if rc > 0 else 1


def run(nproc: int, module: str, args: list[str]) -> int:
    """Run `python -m module args` as `nproc` ranks; the first failing rank's status, or 0."""
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    procs: list[subprocess.Popen] = []
    try:
        _store, port = loopback_store()  # held until the ranks are done
        os.environ.setdefault(lifeline.ENV, str(os.getpid()))  # the ranks bind to this process
        for rank in range(nproc):
            procs.append(subprocess.Popen([sys.executable, "-u", "-m", module, *args],
                                          env=rank_env(dict(os.environ), rank, nproc, port)))
        while True:
            codes = [p.poll() for p in procs]
            failed = next((rc for rc in codes if rc is not None and rc != 0), None)
            if failed is not None:
                print(f"local_run: a rank exited with status {failed}; stopping the others", file=sys.stderr)
                _stop_all(procs)
                return _exit_status(failed)
            if all(rc == 0 for rc in codes):
                return 0
            time.sleep(POLL_S)
    except _Stop as stop:
        _stop_all(procs)
        return 128 + stop.signum


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m executors.local_run", description=__doc__.splitlines()[0],
                                     usage="%(prog)s --nproc N -m MODULE [ARGS...]")
    parser.add_argument("--nproc", type=int, required=True, help=f"ranks to start, 1 to {MAX_RANKS}")
    parser.add_argument("-m", dest="module", required=True, help="module each rank runs; what follows is its arguments")
    cut = argv.index("-m") + 2 if "-m" in argv else len(argv)  # everything after MODULE is the module's
    ns = parser.parse_args(argv[:cut])
    if not 1 <= ns.nproc <= MAX_RANKS:
        parser.error(f"--nproc must be between 1 and {MAX_RANKS} (got {ns.nproc})")
    return run(ns.nproc, ns.module, argv[cut:])


if __name__ == "__main__":
    sys.exit(main())
