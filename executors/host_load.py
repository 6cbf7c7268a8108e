"""Whether the host was busy with other work while a run was measured (no torch).

A run's step times on a shared machine include the time other processes took from
its cores; a step-time error measured there overstates the model's. The 1-minute load
average is sampled before a run is launched (none of its processes exist yet) and
after its results are folded, and `judge_load` says whether other work competed for
the cores the run used.

Linux's 1-minute load average is an exponential average of the runnable (and
uninterruptible) tasks, updated every 5 s with the factor exp(-5/60): a task that ran
a minute ago still counts 1/e. Runs launched back to back therefore see the load of
their own predecessors; `RecentRuns` estimates that share so it is not taken for
other work.
"""

from __future__ import annotations

import math
import os
import statistics

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import SpecError

LOAD_MARGIN = 0.5
"""Runnable tasks beyond what the cores allow before the host counts as busy.

Rule: the host is busy for a run when other work competes for the cores the run uses:
  - before the run (none of its processes running), the 1-minute load average less the
    share of this process's own earlier runs (`RecentRuns`) exceeds the cores the run
    leaves free (cpu_count - cores_in_use, at least 0) by more than LOAD_MARGIN; or
  - after the run, the 1-minute load average (the run's own tasks and the others')
    exceeds the cores there are (cpu_count, or cores_in_use when the run alone
    oversubscribes them) by more than LOAD_MARGIN.
Estimate: half a core. Another process busy half the time on one core of a run whose
ranks step in lockstep delays the slowest rank, and with it every step, by up to about
a quarter to a half (the CPU validation's median step-time error is 9 %); below half a
core lies the load average's own jitter (a short task caught at one 5-s sample adds
0.08, shells, editors and pytest add a few tenths) and the error of `RecentRuns`."""

LOAD_TIME_CONSTANT_S = 60.0
"""Time constant of Linux's 1-minute load average, seconds: every 5 s the average is
multiplied by exp(-5/60) and the runnable task count times 1 - exp(-5/60) is added
(kernel/sched/loadavg.c, EXP_1 = 1884/2048)."""


def sample_load() -> float:
    """The 1-minute load average now (`os.getloadavg()[0]`)."""
    return os.getloadavg()[0]


def host_cpu_count() -> int:
    """Logical cores, as the worker counts them to choose its threads (`os.cpu_count()`)."""
    return os.cpu_count() or 1


def cores_in_use(num_ranks: int, threads_per_rank: int | None = None, cpu_count: int | None = None) -> int:
    """Runnable threads a run of `num_ranks` local ranks keeps busy: num_ranks x threads_per_rank.

    threads_per_rank None: as the worker chooses them on a CPU run (executors.worker, RunConfig.num_threads
    None): max(1, cpu_count // num_ranks). The result may exceed cpu_count (more ranks than cores).

    >>> cores_in_use(2, cpu_count=2), cores_in_use(1, cpu_count=8), cores_in_use(4, cpu_count=2), cores_in_use(2, 3)
    (2, 8, 4, 6)
    """
    if num_ranks < 1:
        raise SpecError(f"num_ranks ({num_ranks}) must be at least 1")
    if threads_per_rank is not None and threads_per_rank < 1:
        raise SpecError(f"threads_per_rank ({threads_per_rank}) must be at least 1")
    cpus = host_cpu_count() if cpu_count is None else _check_cpu_count(cpu_count)
    return num_ranks * (threads_per_rank or max(1, cpus // num_ranks))


def step_spread(step_times: list[float]) -> float | None:
    """(max - min) / median of a run's timed steps: how far its steps disagree among
    themselves, relative; None with fewer than 2 steps (or a median that is not positive).

    >>> step_spread([1.0, 1.2, 1.1])
    0.18181818181818177
    >>> step_spread([0.5]) is None
    True
    """
    if len(step_times) < 2:
        return None
    median = statistics.median(step_times)
    if not median > 0:
        return None
    return (max(step_times) - min(step_times)) / median


def spread_too_wide(spread: float | None, band_low: float, band_high: float) -> bool:
    """Whether a run's step-time spread is wider than the prediction's error band, given as
    signed relative errors (band_low <= band_high, e.g. -0.15 and +0.10: width 0.25): the run's
    own steps then disagree by more than the prediction claims to be right, and one such run
    cannot judge the prediction. No spread (fewer than 2 steps): False.

    >>> spread_too_wide(0.3, -0.15, 0.10), spread_too_wide(0.2, -0.15, 0.10), spread_too_wide(None, 0.0, 0.0)
    (True, False, False)
    """
    if band_low > band_high:
        raise SpecError(f"band_low ({band_low}) must not exceed band_high ({band_high})")
    return spread is not None and spread > band_high - band_low


class HostLoad(BaseModel):
    """The host's load around one run, and the verdict of `judge_load`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    load_before: float = Field(description="1-minute load average just before the run was launched.")
    load_after: float = Field(description="1-minute load average just after the run's results were folded.")
    cpu_count: int = Field(description="Logical cores of the host.")
    cores_in_use: int = Field(description="Runnable threads the run keeps busy (ranks x threads per rank).")
    busy: bool = Field(description="Other work competed for the run's cores (LOAD_MARGIN states the rule).")
    reason: str = Field(description="The numbers that made the host busy, in words; empty when not busy.")
    own_load_before: float = Field(0.0, description="Estimated share of load_before left by this process's own "
                                   "earlier runs (RecentRuns), not counted as other work.")


def judge_load(load_before: float, load_after: float, cores_in_use: int, cpu_count: int | None = None,
               own_load_before: float = 0.0) -> HostLoad:
    """Whether other work competed for the cores a run used (the rule at LOAD_MARGIN).

    `own_load_before`: the share of load_before that this process's own earlier runs left
    (`RecentRuns.residual`); 0 for a first run.

    >>> judge_load(7.9, 2.3, 2, 2).reason
    'load average 7.9 before the run on 2 cores, the run uses 2: other processes compete for its cores'
    >>> judge_load(7.9, 8.1, 2, 2, own_load_before=1.2).reason.split(" on ")[0]
    "load average 7.9 before (1.2 of it this process's earlier runs) and 8.1 after the run"
    >>> judge_load(1.6, 2.1, 2, 2, own_load_before=1.4).busy
    False
    """
    for name, value in (("load_before", load_before), ("load_after", load_after), ("own_load_before", own_load_before)):
        if not (math.isfinite(value) and value >= 0):
            raise SpecError(f"{name} ({value}) must be a finite load average >= 0")
    if cores_in_use < 1:
        raise SpecError(f"cores_in_use ({cores_in_use}) must be at least 1")
    cpus = host_cpu_count() if cpu_count is None else _check_cpu_count(cpu_count)
    free = max(0, cpus - cores_in_use)
    others_before = max(0.0, load_before - own_load_before)
    capacity = max(cpus, cores_in_use)
    before = others_before > free + LOAD_MARGIN
    after = load_after > capacity + LOAD_MARGIN
    reason = ""
    if before or after:
        shown_own = before and own_load_before >= 0.05  # a share that rounds to 0.0 is not named
        own = f" ({own_load_before:.1f} of it this process's earlier runs)" if shown_own else ""
        when = (f"{load_before:.1f} before{own} and {load_after:.1f} after the run" if before and after
                else f"{load_before:.1f} before the run{own}" if before else f"{load_after:.1f} after the run")
        reason = (f"load average {when} on {cpus} cores, the run uses {cores_in_use}: "
                  "other processes compete for its cores")
    return HostLoad(load_before=load_before, load_after=load_after, cpu_count=cpus, cores_in_use=cores_in_use,
                    busy=bool(reason), reason=reason, own_load_before=own_load_before)


class RecentRuns:
    """This process's own runs (start, end, cores in use), to tell their share of a later load
    average (which decays over LOAD_TIME_CONSTANT_S) from other work.

    A run is taken to keep `cores` tasks runnable from start to end (an upper bound: ranks that
    wait in a collective sleep), so its share is overestimated rather than taken for other work.
    The share of a run at time t after its end, with d = end - start:
    cores x (1 - exp(-d / tau)) x exp(-(t - end) / tau).

    >>> runs = RecentRuns()
    >>> runs.record(0.0, 60.0, 2)
    >>> round(runs.residual(60.0), 3), round(runs.residual(120.0), 3)
    (1.264, 0.465)
    """

    def __init__(self) -> None:
        self._spans: list[tuple[float, float, int]] = []

    def record(self, start_s: float, end_s: float, cores: int) -> None:
        """A run of ours from start_s to end_s (one monotonic clock, seconds) with `cores` runnable tasks.
        Runs that ended FORGET_AFTER time constants before end_s are dropped (their share is below
        1e-4 a core)."""
        if end_s < start_s:
            raise SpecError(f"end_s ({end_s}) must not be before start_s ({start_s})")
        horizon = end_s - FORGET_AFTER * LOAD_TIME_CONSTANT_S
        self._spans = [span for span in self._spans if span[1] >= horizon] + [(start_s, end_s, cores)]

    def residual(self, at_s: float) -> float:
        """Our runs' estimated share of the 1-minute load average at `at_s` (same clock as `record`)."""
        tau = LOAD_TIME_CONSTANT_S
        total = 0.0
        for start, end, cores in self._spans:
            end = min(end, at_s)
            if end > start:
                total += cores * (1 - math.exp(-(end - start) / tau)) * math.exp(-(at_s - end) / tau)
        return total


FORGET_AFTER = 10
"""Time constants after which a run of ours no longer counts in `RecentRuns` (exp(-10) = 4.5e-5 of its cores)."""

OWN_RUNS = RecentRuns()
"""This process's runs (executors.validate records every reference and plan run it launches): one
record for the whole process, so that a validation, a benchmark round or a tuning trial that starts
right after another discounts the load the earlier one left."""


def _check_cpu_count(cpu_count: int) -> int:
    if cpu_count < 1:
        raise SpecError(f"cpu_count ({cpu_count}) must be at least 1")
    return cpu_count
