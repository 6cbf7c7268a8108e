"""Folding per-rank results into outcomes, loss parity and prediction-vs-measurement (no torch)."""

from __future__ import annotations

import pytest

from executors.compare import compare_one, rank_and_summarise
from executors.launcher import ProcessOutcome, fold
from executors.parity import parity_errors, parity_failure
from executors.results import ParityReference, RankResult, RunConfig, RunResult
from executors.validate import PARITY_TOLERANCES
from planner.specs import Estimate, Strategy

from executor_fixtures import TINY, TRAIN


def _cfg(**kw) -> RunConfig:
    base = dict(label="dp2", model=TINY, train=TRAIN, strategy=Strategy(dp=2), num_gpus=2, timed_steps=3,
                reference_losses=[5.0, 4.9], parity_learning_rate=0.1)
    return RunConfig(**(base | kw))


def _rank(r: int, status="ok", times=(1.0, 2.0, 3.0), **kw) -> RankResult:
    return RankResult(rank=r, status=status, losses=[5.0, 4.9], step_times_s=list(times), peak_memory_bytes=100.0 + r,
                      **kw)


def _proc(rc=0, timed_out=False) -> ProcessOutcome:
    return ProcessOutcome(return_code=rc, timed_out=timed_out, wall_s=1.0, stderr_tail="boom")


def test_ok_takes_the_slowest_rank_per_step_and_the_median():
    res = fold(_cfg(), [_rank(0, times=(1.0, 2.0, 3.0)), _rank(1, times=(1.5, 1.0, 2.5))], _proc())
    assert res.outcome == "ok"
    assert res.step_times_s == [1.5, 2.0, 3.0] and res.step_time_s == 2.0
    assert res.peak_memory_bytes == 101.0 and res.parity.passed


def test_complete_results_survive_an_abort_at_teardown():
    res = fold(_cfg(), [_rank(0), _rank(1)], _proc(rc=-6))
    assert res.outcome == "ok" and any("teardown" in n for n in res.notes)


@pytest.mark.parametrize("statuses,proc,outcome", [
    (("ok", "oom"), _proc(rc=1), "oom"),
    (("wrong", "wrong"), _proc(), "wrong"),
    (("ok",), _proc(rc=1), "crashed"),
    (("ok", "error"), _proc(rc=1), "crashed"),
    (("ok",), _proc(rc=None, timed_out=True), "timeout"),
])
def test_outcomes(statuses, proc, outcome):
    ranks = [_rank(i, status=s, error="" if s == "ok" else f"{s} here") for i, s in enumerate(statuses)]
    res = fold(_cfg(), ranks, proc)
    assert res.outcome == outcome
    assert res.step_time_s is None and res.stderr_tail == "boom"
    if outcome != "timeout":
        assert res.reason


def test_reference_losses_come_with_the_references_step_size():
    with pytest.raises(ValueError, match="parity_learning_rate"):
        _cfg(parity_learning_rate=None)
    with pytest.raises(ValueError, match=r"reference_losses \(1 losses\) must hold parity_steps \(2\)"):
        _cfg(reference_losses=[5.0])
    ref = _cfg(reference_losses=None, parity_learning_rate=None).with_reference(
        ParityReference(losses=[5.0, 4.95], learning_rate=0.2))
    assert ref.reference_losses == [5.0, 4.95] and ref.parity_learning_rate == 0.2


def test_parity_errors_separate_the_loss_and_its_change():
    loss_err, update_err = parity_errors([5.0, 4.9], [5.0, 4.9])
    assert loss_err == 0 and update_err == 0
    # a 0.1% error on the step-2 loss is a 10% error on the loss change
    loss_err, update_err = parity_errors([5.0, 4.9049], [5.0, 4.9])
    assert loss_err < 1e-3 and update_err == pytest.approx(0.049, rel=1e-3)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_doubled_update_fails_parity_and_an_identical_one_passes(precision):
    """Issue 7: with plain-SGD parity steps a gradient c times too large changes the loss change c
    times; c = 2 must fail at both precisions' tolerances, and an identical run pass."""
    rtol, update_rtol = PARITY_TOLERANCES[precision]
    reference = [5.0, 4.95]  # one parity step: the loss falls by 1% (executors.parity.PARITY_LOSS_DECREASE)
    cfg = _cfg(reference_losses=reference, parity_rtol=rtol, update_rtol=update_rtol)
    assert parity_failure(cfg, list(reference)) == ""
    doubled = [5.0, 5.0 - 2 * (5.0 - 4.95)]
    loss_err, update_err = parity_errors(doubled, reference)
    assert update_err == pytest.approx(1.0) and update_err > update_rtol
    assert "loss parity failed" in parity_failure(cfg, doubled)


def _estimate(step_s: float, mem: float) -> Estimate:
    return Estimate(step_time_s=step_s, tokens_per_s=1.0, tokens_per_s_per_gpu=1.0, model_tflops_per_gpu=1.0,
                    hardware_tflops_per_gpu=1.0, mfu=0.1, peak_memory_bytes=mem + 10, memory_capacity_bytes=1e9,
                    memory_bytes={"params": mem, "framework_reserve": 10.0}, time_s={"compute": step_s},
                    binding_stage="first", binding_memory_term="params", num_microbatches=1, bubble_fraction=0.0,
                    fits=True)


def test_compare_and_rank():
    runs = [RunResult(label="a", strategy=Strategy(dp=2), outcome="ok", step_time_s=2.0, peak_memory_bytes=100.0),
            RunResult(label="b", strategy=Strategy(dp=1, tp=2), outcome="ok", step_time_s=1.0, peak_memory_bytes=50.0),
            RunResult(label="c", strategy=Strategy(dp=1, cp=2), outcome="unsupported", reason="cp")]
    comps = [compare_one(runs[0], _estimate(1.0, 100.0)), compare_one(runs[1], _estimate(1.5, 40.0)),
             compare_one(runs[2], _estimate(0.5, 10.0))]
    assert comps[0].step_time_error == pytest.approx(-0.5)
    assert comps[0].predicted_memory_bytes == 100.0  # framework reserve excluded
    assert comps[1].memory_error == pytest.approx(-0.2)
    summary = rank_and_summarise(comps)
    assert [c.predicted_rank for c in comps] == [1, 2, None]
    assert [c.measured_rank for c in comps] == [2, 1, None]
    assert summary["measured_best"] == "b" and summary["measured_best_in_predicted_top2"]
    assert summary["median_abs_step_time_error"] == pytest.approx((0.5 + 0.5) / 2)
