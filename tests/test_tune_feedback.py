"""What trials teach the cost model (executors.tune.feedback), on synthetic measurements made by the
model itself with known parameters: the fit finds them, weights count, an OOM's reserve stops the
strategy from fitting."""

from __future__ import annotations

import pytest

from executors.tune.feedback import (
    MIN_FIT_TRIALS,
    TrialRun,
    fit_trials,
    identified_fields,
    predictions,
    reserve_after_oom,
)
from planner import plan
from planner.calibrate import apply_parameters
from planner.search import evaluate_one

MODEL = "tests/fixtures/tune/gpt-tiny.yaml"


@pytest.fixture(scope="module")
def job():
    result = plan(model=MODEL, cluster="local-cpu", num_gpus=2,
                  global_batch_size=16, seq_len=256, precision="fp32", top_k=40, ranking="fastest")
    return result


def _runs(job, cluster, n: int, weights=None) -> list[TrialRun]:
    strategies = [p.strategy for p in job.plans[:n]]
    out = []
    for i, st in enumerate(strategies):
        step = evaluate_one(job.model, cluster, job.train, st).step_time_s
        out.append(TrialRun(number=i, label=st.short(), strategy=st, model=job.model, measured_step_s=step,
                            weight=1.0 if weights is None else weights[i]))
    return out


def test_the_fit_recovers_a_slower_machine(job):
    truth = apply_parameters(job.cluster, {"gemm_efficiency": job.cluster.gpu.gemm_efficiency * 0.6,
                                           "intra_node_bw_bytes_per_s": job.cluster.intra_node.bw_bytes_per_s * 0.5})
    runs = _runs(job, truth, 8)
    fit = fit_trials(runs, job.cluster, job.train)
    assert fit is not None and "gemm_efficiency" in fit.fitted
    assert fit.median_abs(fit.before) > 0.1
    assert fit.median_abs(fit.after) < 0.2 * fit.median_abs(fit.before)
    assert fit.values["gemm_efficiency"] == pytest.approx(job.cluster.gpu.gemm_efficiency * 0.6, rel=0.1)


def test_a_parameter_no_trial_depends_on_is_not_fitted(job):
    chosen, idle = identified_fields(_runs(job, job.cluster, 4), job.cluster, job.train)
    # the local-cpu profile has no kernel tables: the sustained fraction of their throughput moves nothing
    assert "sustained_compute_fraction" in idle and "sustained_compute_fraction" not in chosen
    assert "gemm_efficiency" in chosen


def test_too_few_trials_fit_nothing(job):
    assert fit_trials(_runs(job, job.cluster, MIN_FIT_TRIALS - 1), job.cluster, job.train) is None
    truth = apply_parameters(job.cluster, {"gemm_efficiency": job.cluster.gpu.gemm_efficiency * 0.6,
                                           "intra_node_bw_bytes_per_s": job.cluster.intra_node.bw_bytes_per_s * 0.5})
    fit = fit_trials(_runs(job, truth, 2), job.cluster, job.train)
    assert fit is not None and len(fit.fitted) == 1
    assert len(fit_trials(_runs(job, truth, 5), job.cluster, job.train).fitted) == 1  # one per three trials
    assert len(fit_trials(_runs(job, truth, 6), job.cluster, job.train).fitted) <= 2


def test_a_busy_trial_counts_less(job):
    truth = apply_parameters(job.cluster, {"gemm_efficiency": job.cluster.gpu.gemm_efficiency * 0.8})
    runs = _runs(job, truth, 6)
    slow = runs[0].model_copy(update={"measured_step_s": runs[0].measured_step_s * 2.0})
    full = fit_trials([slow, *runs[1:]], job.cluster, job.train)
    light = fit_trials([slow.model_copy(update={"weight": 0.01}), *runs[1:]], job.cluster, job.train)
    target = job.cluster.gpu.gemm_efficiency * 0.8
    assert abs(light.values["gemm_efficiency"] - target) < abs(full.values["gemm_efficiency"] - target)


def test_the_reserve_after_an_oom_makes_the_strategy_not_fit(job):
    st = job.plans[0].strategy
    est = evaluate_one(job.model, job.cluster, job.train, st)
    assert est.fits
    reserve = reserve_after_oom(job.cluster, est)
    raised = apply_parameters(job.cluster, {"framework_reserve_bytes": reserve})
    assert not evaluate_one(job.model, raised, job.train, st).fits
    assert reserve > job.cluster.gpu.framework_reserve_bytes


def test_predictions_follow_the_cluster(job):
    runs = _runs(job, job.cluster, 3)
    base = predictions(runs, job.cluster, job.train)
    slower = predictions(runs, apply_parameters(job.cluster, {"gemm_efficiency": 0.3}), job.train)
    assert (slower > base).all()


def test_nothing_is_fitted_when_the_profile_already_predicts_the_trials(job):
    runs = _runs(job, job.cluster, 6)  # measured exactly as the profile predicts
    assert fit_trials(runs, job.cluster, job.train) is None
