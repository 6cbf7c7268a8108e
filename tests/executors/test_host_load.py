"""Runs measured on a busy host: the load rule, the step spread, and the flags `meshplan validate`
reports (no torch: the runs are folded from made-up rank results, the load average is made up)."""

from __future__ import annotations

import json
import math
import statistics

import pytest

import executors.validate as validate_mod
from executors import host_load
from executors.host_load import (
    LOAD_MARGIN,
    RecentRuns,
    cores_in_use,
    judge_load,
    spread_too_wide,
    step_spread,
)
from executors.launcher import ProcessOutcome, fold
from executors.results import ParityReference, RankResult
from planner.errors import SpecError
from planner.specs import Strategy

from executor_fixtures import TINY, TRAIN


# ---- the rule --------------------------------------------------------------------------------

def test_cores_in_use_follows_the_workers_threads():
    assert cores_in_use(2, cpu_count=2) == 2  # one thread per rank
    assert cores_in_use(1, cpu_count=8) == 8  # the reference takes every core
    assert cores_in_use(2, cpu_count=8) == 8
    assert cores_in_use(3, cpu_count=8) == 6  # 8 // 3 = 2 threads each
    assert cores_in_use(4, cpu_count=2) == 4  # more ranks than cores: one thread each
    assert cores_in_use(2, threads_per_rank=3, cpu_count=2) == 6


@pytest.mark.parametrize("args,field", [((0,), "num_ranks (0)"), ((2, 0, 2), "threads_per_rank (0)"),
                                        ((2, None, 0), "cpu_count (0)")])
def test_cores_in_use_refuses_counts_below_one(args, field):
    with pytest.raises(SpecError, match=field.replace("(", r"\(").replace(")", r"\)")):
        cores_in_use(*args)


def test_a_quiet_host_is_not_busy():
    h = judge_load(0.3, 1.9, 2, 2)
    assert not h.busy and h.reason == ""
    assert (h.load_before, h.load_after, h.cpu_count, h.cores_in_use) == (0.3, 1.9, 2, 2)


def test_load_before_the_run_on_the_runs_cores_makes_it_busy():
    h = judge_load(7.9, 2.3, 2, 2)
    assert h.busy
    assert h.reason == ("load average 7.9 before the run on 2 cores, the run uses 2: other processes compete "
                        "for its cores")


def test_the_margin_is_the_edge():
    assert not judge_load(LOAD_MARGIN, 0.0, 2, 2).busy  # exceeding by exactly the margin is not busy
    assert judge_load(LOAD_MARGIN + 0.01, 0.0, 2, 2).busy
    assert not judge_load(0.0, 2 + LOAD_MARGIN, 2, 2).busy
    assert judge_load(0.0, 2 + LOAD_MARGIN + 0.01, 2, 2).busy


def test_load_on_the_cores_the_run_leaves_free_is_not_competition():
    assert not judge_load(5.0, 7.5, 2, 8).busy  # 6 cores free: 5 other tasks fit beside the run
    assert judge_load(6.6, 7.5, 2, 8).busy


def test_load_after_the_run_beyond_the_cores_makes_it_busy():
    h = judge_load(0.2, 3.1, 2, 2)
    assert h.busy and h.reason.startswith("load average 3.1 after the run on 2 cores, the run uses 2")


def test_a_run_that_oversubscribes_the_cores_by_itself_is_not_flagged_for_its_own_tasks():
    assert not judge_load(0.1, 4.2, 4, 2).busy  # 4 single-thread ranks on 2 cores
    assert judge_load(0.1, 5.0, 4, 2).busy


def test_own_earlier_runs_are_not_taken_for_other_work():
    assert judge_load(1.9, 2.0, 2, 2).busy  # without the discount, the run before looks like competition
    h = judge_load(1.9, 2.0, 2, 2, own_load_before=1.7)
    assert not h.busy and h.own_load_before == 1.7
    busy = judge_load(2.9, 2.0, 2, 2, own_load_before=1.7)
    assert busy.busy and "2.9 before the run (1.7 of it this process's earlier runs)" in busy.reason


@pytest.mark.parametrize("kw,field", [
    (dict(load_before=-1.0), "load_before"), (dict(load_after=math.nan), "load_after"),
    (dict(cores_in_use=0), "cores_in_use"), (dict(cpu_count=0), "cpu_count"),
    (dict(own_load_before=math.inf), "own_load_before"),
])
def test_judge_load_refuses_bad_numbers_naming_the_field(kw, field):
    args = dict(load_before=0.5, load_after=0.5, cores_in_use=2, cpu_count=2) | kw
    with pytest.raises(SpecError, match=f"^{field} "):
        judge_load(**args)


def test_host_load_is_frozen():
    h = judge_load(0.3, 1.9, 2, 2)
    with pytest.raises(ValueError):
        h.busy = True


# ---- our own share of the load average ----------------------------------------------------------

TICK_S = 5.0


def _kernel_load(runnable: list[float], start: float = 0.0) -> list[float]:
    """Linux's 1-minute load average after each 5-s tick with `runnable` tasks in it, from `start`."""
    decay, load, out = math.exp(-TICK_S / 60.0), start, []
    for n in runnable:
        load = load * decay + n * (1 - decay)
        out.append(load)
    return out


def test_recent_runs_reproduce_the_kernels_average_of_our_own_runs():
    """Runs of 30 s on both cores of a 2-core host, 5 s apart (the kernel's average, ticks aligned)."""
    runs, runnable = RecentRuns(), []
    for k in range(6):
        start = len(runnable) * TICK_S
        runnable += [2.0] * 6 + [0.0]
        runs.record(start, start + 30.0, 2)
    kernel = _kernel_load(runnable)
    for tick in (6, 13, 20, 41):
        assert runs.residual((tick + 1) * TICK_S) == pytest.approx(kernel[tick], rel=1e-9)


def test_back_to_back_runs_on_a_quiet_host_are_quiet_and_with_other_work_busy():
    """Six back-to-back 30-s runs on both cores of a 2-core host, the load average as the kernel keeps
    it: with no other work none is busy (and without the discount of our own runs most would be);
    with one other task busy all along, every run is."""
    for other, expect in ((0.0, False), (1.0, True)):
        runs, runnable, verdicts, raw = RecentRuns(), [], [], []
        for k in range(6):
            start = len(runnable) * TICK_S
            before = _kernel_load(runnable, other)[-1] if runnable else other
            runnable += [2.0 + other] * 6
            after = _kernel_load(runnable, other)[-1]
            verdicts.append(judge_load(before, after, 2, 2, own_load_before=runs.residual(start)).busy)
            raw.append(judge_load(before, after, 2, 2).busy)
            runs.record(start, start + 30.0, 2)
        assert verdicts == [expect] * 6, (other, verdicts)
        if other == 0.0:
            assert raw == [False] + [True] * 5, raw


def test_recent_runs_refuse_an_end_before_the_start():
    with pytest.raises(SpecError, match=r"^end_s \(1.0\)"):
        RecentRuns().record(2.0, 1.0, 2)


# ---- spread ------------------------------------------------------------------------------------

def test_step_spread():
    assert step_spread([1.0, 1.2, 1.1]) == pytest.approx(0.2 / 1.1)
    assert step_spread([2.0, 2.0]) == 0.0
    assert step_spread([0.5, 1.5]) == pytest.approx(1.0)
    assert step_spread([]) is None and step_spread([1.0]) is None
    assert step_spread([0.0, 0.0, 0.0]) is None


def test_spread_too_wide_against_the_band():
    assert spread_too_wide(0.30, -0.15, 0.10)
    assert not spread_too_wide(0.20, -0.15, 0.10)
    assert not spread_too_wide(0.25, -0.15, 0.10)  # as wide as the band is not wider
    assert not spread_too_wide(None, 0.0, 0.0)
    with pytest.raises(SpecError, match=r"^band_low \(0.1\) must not exceed band_high \(-0.1\)"):
        spread_too_wide(0.1, 0.1, -0.1)


# ---- validate: flags, summary, quiet median, warning ------------------------------------------

QUIET_STEPS = [0.010, 0.011, 0.012]
BUSY_STEPS = [0.030, 0.045, 0.060]


def _fake_launch(cfg, run_dir, on_progress=None):
    """The run as the launcher folds it, from made-up rank results (the second plan's steps are slower)."""
    times = QUIET_STEPS if cfg.strategy.zero_stage == 0 else BUSY_STEPS
    ranks = [RankResult(rank=r, status="ok", losses=[5.0, 4.9], step_times_s=times, peak_memory_bytes=1e6)
             for r in range(cfg.num_gpus)]
    return fold(cfg, ranks, ProcessOutcome(return_code=0, timed_out=False, wall_s=0.1, stderr_tail=""))


class _Clock:
    """validate's `time` module, advanced by the made-up launches instead of the wall clock."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def monotonic(self) -> float:
        return self.now_s


def _validate(monkeypatch, tmp_path, loads, run_s=0.0, reference_s=0.0, clock=None, own_runs=None):
    """validate_strategies over two plans with made-up launches of run_s (reference: reference_s)
    seconds each, and `loads` as the load averages sampled (before, after) around each run; a new
    clock and no earlier runs of this process unless given."""
    clock = clock or _Clock()
    monkeypatch.setattr(validate_mod, "time", clock)

    def launch(cfg, run_dir, on_progress=None):
        clock.now_s += run_s
        return _fake_launch(cfg, run_dir, on_progress)

    def launch_reference(cfg, run_dir):
        clock.now_s += reference_s
        return ParityReference(losses=[5.0, 4.9], learning_rate=0.1), ""

    samples = iter(loads)
    monkeypatch.setattr(host_load, "OWN_RUNS", own_runs or RecentRuns())
    monkeypatch.setattr(host_load, "sample_load", lambda: next(samples))
    monkeypatch.setattr(host_load, "host_cpu_count", lambda: 2)
    monkeypatch.setattr(validate_mod, "launch", launch)
    monkeypatch.setattr(validate_mod, "launch_reference", launch_reference)
    from profiles import load_cluster

    options = validate_mod.ValidateOptions(device="cpu", work_dir=tmp_path)
    return validate_mod.validate_strategies([Strategy(dp=2, zero_stage=0), Strategy(dp=2, zero_stage=1)], TINY,
                                            load_cluster("local-cpu"), TRAIN, 2, options)


def test_validate_flags_the_run_taken_on_a_busy_host(monkeypatch, tmp_path):
    report = _validate(monkeypatch, tmp_path, [0.2, 1.1, 7.9, 8.1])  # before/after run 1, then run 2
    quiet, busy = report.comparisons
    assert [c.outcome for c in report.comparisons] == ["ok", "ok"]
    assert not quiet.busy and quiet.host_load.load_before == 0.2 and quiet.host_load.cores_in_use == 2
    assert busy.busy and busy.host_load.reason.startswith("load average 7.9 before and 8.1 after the run on 2 cores")
    assert report.runs[1].host_load == busy.host_load
    assert quiet.step_spread == pytest.approx(0.002 / 0.011) and busy.step_spread == pytest.approx(0.030 / 0.045)
    assert report.host.model_dump() == {"cpu_count": 2, "max_load": 8.1, "num_runs_sampled": 2, "num_busy_runs": 1}
    errors = [abs(c.step_time_error) for c in report.comparisons]
    assert report.median_abs_step_time_error == pytest.approx(statistics.median(errors))  # still over all ok runs
    assert report.median_abs_step_time_error_quiet == pytest.approx(errors[0])
    assert report.median_abs_step_time_error_quiet != report.median_abs_step_time_error


def test_the_cli_warns_of_the_busy_run_in_every_format(monkeypatch, tmp_path, capsys):
    from planner.cli.common import Format
    from planner.cli.validate_cmd import emit_report

    report = _validate(monkeypatch, tmp_path, [0.2, 1.1, 7.9, 8.1])
    emit_report(report, Format.json)
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert [c["busy"] for c in data["comparisons"]] == [False, True]
    assert data["host"]["num_busy_runs"] == 1 and data["median_abs_step_time_error_quiet"] is not None
    assert data["median_abs_step_time_error"] == report.median_abs_step_time_error  # the old field stays
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1, err
    assert "1 of 2 runs were measured on a busy host (load average up to 8.1 on 2 cores)" in warning[0]
    assert "inflated their step times" in warning[0] and "overstate the model's" in warning[0]
    assert f"over the quiet runs: {100 * report.median_abs_step_time_error_quiet:.1f}%" in warning[0]

    emit_report(report, Format.table)
    out, err = capsys.readouterr()
    assert "#2 busy host: load average 7.9 before and 8.1 after the run" in out
    assert "median |step-time error| of the runs on a quiet host:" in out
    assert "warning: 1 of 2 runs were measured on a busy host" in err

    emit_report(report, Format.csv)
    out, err = capsys.readouterr()
    header, first, second = out.strip().splitlines()[:3]
    assert "busy" in header.split(",") and first.split(",")[header.split(",").index("busy")] == "False"
    assert second.split(",")[header.split(",").index("busy")] == "True"
    assert "warning: 1 of 2 runs" in err


def test_no_warning_on_a_quiet_host(monkeypatch, tmp_path, capsys):
    from planner.cli.common import Format
    from planner.cli.validate_cmd import emit_report

    report = _validate(monkeypatch, tmp_path, [0.2, 1.1, 0.4, 1.8])  # made-up runs take no time: nothing to discount
    assert report.host.num_busy_runs == 0 and not any(c.busy for c in report.comparisons)
    assert report.median_abs_step_time_error_quiet == report.median_abs_step_time_error
    emit_report(report, Format.table)
    out, err = capsys.readouterr()
    assert "busy" not in err and "busy host" not in out and "quiet host" not in out


def test_validate_discounts_its_own_earlier_runs_from_the_load_before_a_run(monkeypatch, tmp_path):
    """A 10-s reference and a 30-s run on both cores leave ~0.97 of the load average before the
    second run: a load of 1.0 there is this validation's own, 1.6 is other work besides."""
    own = (2 * (1 - math.exp(-10 / 60)) * math.exp(-30 / 60)) + 2 * (1 - math.exp(-30 / 60))
    report = _validate(monkeypatch, tmp_path, [0.2, 1.1, 1.0, 1.8], run_s=30.0, reference_s=10.0)
    first, second = report.comparisons
    assert first.host_load.own_load_before == pytest.approx(2 * (1 - math.exp(-10 / 60)))
    assert second.host_load.own_load_before == pytest.approx(own)
    assert not second.busy and report.host.num_busy_runs == 0
    report = _validate(monkeypatch, tmp_path, [0.2, 1.1, 1.6, 1.8], run_s=30.0, reference_s=10.0)
    busy = report.comparisons[1]
    assert busy.busy and "(1.0 of it this process's earlier runs)" in busy.host_load.reason


def test_a_validation_right_after_another_discounts_the_earlier_ones_runs(monkeypatch, tmp_path):
    """One record per process (host_load.OWN_RUNS): the second validation's first run starts 10 s
    (its reference) after the first validation's two 30-s runs and is not taken for a busy host."""
    clock, own_runs = _Clock(), RecentRuns()
    _validate(monkeypatch, tmp_path / "a", [0.2, 1.1, 1.0, 1.8], 30.0, 10.0, clock, own_runs)
    report = _validate(monkeypatch, tmp_path / "b", [1.4, 1.9, 1.9, 2.0], 30.0, 10.0, clock, own_runs)
    assert report.comparisons[0].host_load.own_load_before > 1.2
    assert report.host.num_busy_runs == 0


def test_recent_runs_forget_runs_ten_time_constants_past():
    runs = RecentRuns()
    runs.record(0.0, 60.0, 2)
    runs.record(660.0, 661.0, 2)  # starts 600 s = 10 time constants after the first ended
    assert runs.residual(661.0) == pytest.approx(2 * (1 - math.exp(-1 / 60)), rel=1e-9)  # the first is gone
    kept = RecentRuns()
    kept.record(0.0, 60.0, 2)
    kept.record(600.0, 601.0, 2)
    assert kept.residual(601.0) > 2 * (1 - math.exp(-1 / 60)) * (1 + 1e-3)  # 541 s after it ended it still counts
