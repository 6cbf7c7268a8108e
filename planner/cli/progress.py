"""Progress of long commands on stderr (rich), never on stdout: JSON and CSV stay clean.

On a terminal a live bar shows the current run's steps; elsewhere (a pipe, a log file) each
event is one plain line, so logs keep a record without control characters.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from planner.cli.common import stderr
from planner.cli.text import MESSAGE_CHARS, plain, shown


class RunProgress:
    """Shows validate's events (executors.validate.EventCallback) and per-run results."""

    def __init__(self, live: Progress | None):
        self.live = live
        self.task = None
        self.work_dir: str | None = None
        self.kept = False

    def line(self, text: str) -> None:
        """One plain line (labels and reasons quote user input: no control character, no markup)."""
        (self.live.console if self.live else stderr).print(plain(text, MESSAGE_CHARS), markup=False, highlight=False)

    def event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "work_dir":
            self.work_dir, self.kept = data["path"], data["kept"]
        elif kind == "reference":
            self.line(f"single-process reference run for {data['label']}...")
        elif kind == "launch":
            self.line(f"[{data['index']}/{data['total']}] {data['label']}: launched")
            if self.live is not None:
                if self.task is not None:
                    self.live.remove_task(self.task)
                self.task = self.live.add_task(f"\\[{data['index']}/{data['total']}] {shown(data['label'])}",
                                               total=data["steps"])
        elif kind == "step" and self.live is not None and self.task is not None:
            self.live.update(self.task, completed=data["step"], total=data["total"])

    def done(self, i: int, n: int, run) -> None:
        if self.live is not None and self.task is not None:
            self.live.remove_task(self.task)
            self.task = None
        step = f"{run.step_time_s:.3f} s/step" if run.step_time_s is not None else run.reason[:160]
        self.line(f"[{i}/{n}] {run.label}: {run.outcome} ({step})")
        for r in run.ranks:
            times = ", ".join(f"{t:.3f}" for t in r.step_times_s) or "-"
            self.line(f"    rank {r.rank}: {r.status}, steps (s) {times}, peak {r.peak_memory_bytes / 2**20:.0f} MiB")


@contextlib.contextmanager
def run_progress() -> Iterator[RunProgress]:
    """A RunProgress drawing a live bar on a terminal stderr, plain lines elsewhere."""
    if not stderr.is_terminal:
        yield RunProgress(None)
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("steps"), TimeElapsedColumn(), console=stderr, transient=True) as live:
        yield RunProgress(live)


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner with `message` on a terminal stderr; one plain line elsewhere."""
    if not stderr.is_terminal:
        stderr.print(plain(message, MESSAGE_CHARS), markup=False, highlight=False)
        yield
        return
    with stderr.status(shown(message, MESSAGE_CHARS)):
        yield
