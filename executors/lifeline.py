"""Processes that die with the process that started them (standard library only).

meshplan starts torchrun (or a single worker) through this file, run as a script:

    python -I executors/lifeline.py <meshplan pid> -- torchrun args...

It asks the kernel to SIGKILL it when its parent dies (Linux `PR_SET_PDEATHSIG`),
exits at once if meshplan is already gone (the parent died before the request),
records its own pid in `MESHPLAN_LIFELINE_PID` and execs the command, which keeps
both the death signal and the pid. Each worker torchrun starts inherits that
variable and calls `bind_to_parent()` first thing: the same request against
torchrun, so `kill -9` of meshplan takes torchrun with it, and `kill -9` of
torchrun takes its workers. Where prctl is missing (not Linux) a daemon thread
polls the parent pid instead.

The kernel sends the signal when the *thread* that forked the child exits: the
launcher starts and waits for each run in one thread (executors.launcher.run_process).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

ENV = "MESHPLAN_LIFELINE_PID"
"""The pid of the process the lifeline exec'd (torchrun, or a lone worker)."""
PR_SET_PDEATHSIG = 1
PARENT_GONE_EXIT = 125
"""Exit status of a process whose parent was already gone when it asked to die with it."""
WATCHDOG_POLL_S = 0.5


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCHDOG_POLL_S)
    os._exit(PARENT_GONE_EXIT)


def die_with(parent: int) -> None:
    """From now on this process dies when `parent` does (death signal, else a watchdog thread);
    it exits at once when `parent` is no longer its parent."""
    if not set_parent_death_signal():
        threading.Thread(target=_watch, args=(parent,), daemon=True, name="meshplan-lifeline").start()
    if os.getppid() != parent:  # the parent died before the request: nobody would signal us
        os._exit(PARENT_GONE_EXIT)


def bind_to_parent() -> None:
    """In a worker: die with the torchrun that started it, when meshplan launched that torchrun
    (`ENV` is set). A lone worker the lifeline exec'd already dies with meshplan."""
    expected = os.environ.get(ENV, "")
    if not expected.isdigit() or int(expected) == os.getpid():
        return
    die_with(int(expected))


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[0].isdigit() or argv[1] != "--":
        print("usage: lifeline.py PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    die_with(int(argv[0]))
    os.environ[ENV] = str(os.getpid())
    os.execvp(argv[2], argv[2:])
    return 127  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
