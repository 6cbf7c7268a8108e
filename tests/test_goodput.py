"""Goodput (planner.goodput): the optimum checkpoint interval against brute force, and goodput's direction in
the job size and the failure rate."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models.finetune import adapter_params
from cost_models.params import num_params
from planner.api import make_inputs
from planner.errors import SpecError
from planner.goodput import (DEFAULT_FAILURE_RATE_PER_GPU_HOUR, checkpoint_bytes, daly_interval, goodput,
                             wall_factor, young_interval)


@pytest.fixture(scope="module")
def inputs():
    return make_inputs("llama3-70b", "dgx-h100", 1024, 1024, 4096)


def _grid(center: float) -> np.ndarray:
    """Intervals from center/20 to 20·center, 0.01 % apart."""
    return center * np.exp(np.arange(np.log(1 / 20), np.log(20), 1e-4))


@pytest.mark.parametrize("delta,mtbf", [(1.0, 3600.0), (60.0, 3 * 3600.0), (300.0, 50 * 3600.0), (5.0, 600.0)])
def test_young_interval_minimises_the_first_order_waste(delta, mtbf):
    """Young 1974: tau = sqrt(2 delta M) minimises delta / tau + tau / (2M) (checkpoint share + half an
    interval lost per failure)."""
    taus = _grid(young_interval(delta, mtbf))
    waste = delta / taus + taus / (2 * mtbf)
    assert taus[np.argmin(waste)] == pytest.approx(young_interval(delta, mtbf), rel=2e-4)


@pytest.mark.parametrize("delta,mtbf,restart", [(1.0, 3600.0, 600.0), (60.0, 3 * 3600.0, 600.0),
                                                (300.0, 50 * 3600.0, 0.0), (30.0, 3600.0, 120.0),
                                                (200.0, 3600.0, 60.0)])
def test_daly_interval_minimises_the_expected_wall_time(delta, mtbf, restart):
    """Daly 2006's higher-order estimate against the brute-force minimum of his expected wall time: the
    interval within 1 %, the wall time within 1e-5 of the minimum (the curve is flat at the optimum)."""
    tau = daly_interval(delta, mtbf)
    taus = _grid(tau)
    factors = np.array([wall_factor(t, delta, mtbf, restart) for t in taus])
    best = taus[np.argmin(factors)]
    assert tau == pytest.approx(best, rel=1e-2)
    assert wall_factor(tau, delta, mtbf, restart) == pytest.approx(factors.min(), rel=1e-5)
    # Young's first-order interval is the leading term of Daly's
    assert young_interval(delta, mtbf) == pytest.approx(tau + delta, rel=2 * (delta / (2 * mtbf)) ** 0.5)


def test_daly_interval_is_the_mtbf_when_a_checkpoint_takes_longer_than_two_of_them():
    assert daly_interval(10.0, 4.0) == 4.0


def test_default_failure_rate_is_llama3s_unexpected_interruptions():
    """419 unexpected interruptions in 54 days on 16,384 GPUs (arXiv 2407.21783, Sec. 3.3.4): about one every
    3.1 hours for the whole job."""
    assert DEFAULT_FAILURE_RATE_PER_GPU_HOUR == pytest.approx(419 / (54 * 24 * 16384))
    assert 1 / (DEFAULT_FAILURE_RATE_PER_GPU_HOUR * 16384) == pytest.approx(3.09, abs=0.01)


def test_checkpoint_is_the_models_parameters_times_weight_and_optimizer_bytes(inputs):
    model, _, train = inputs
    assert checkpoint_bytes(model, train) == num_params(model) * (2 + 4 + 4 + 4)
    fp32 = train.model_copy(update={"precision": "fp32"})
    assert checkpoint_bytes(model, fp32) == num_params(model) * (4 + 4 + 4)


def test_a_lora_checkpoint_saves_the_adapters_alone():
    model, _, train = make_inputs("llama3-8b", "dgx-h100", 8, 64, 4096, finetune="lora", lora_rank=16)
    adapters = adapter_params(model, train)
    assert 0 < adapters < num_params(model) / 100
    assert checkpoint_bytes(model, train) == adapters * (4 + 8)  # fp32 adapter weight and Adam's two moments


def test_goodput_falls_with_the_job_size_and_the_failure_rate(inputs):
    model, cluster, train = inputs
    by_size = [goodput(model, train, cluster, n).fraction for n in (64, 512, 2048, 8192, 32768)]
    assert all(0 < g < 1 for g in by_size)
    assert by_size == sorted(by_size, reverse=True) and len(set(by_size)) == len(by_size)
    rates = [1e-7, 1e-6, 1e-5, 1e-4, 1e-3]
    by_rate = [goodput(model, train, cluster, 1024, failure_rate_per_gpu_hour=r).fraction for r in rates]
    assert by_rate == sorted(by_rate, reverse=True) and len(set(by_rate)) == len(by_rate)
    assert by_rate[0] > 0.999


def test_goodput_figures_hang_together(inputs):
    model, cluster, train = inputs
    g = goodput(model, train, cluster, 4096, node_write_bw_bytes_per_s=2e9, aggregate_write_bw_bytes_per_s=100e9,
                restart_s=300.0)
    assert g.checkpoint_bw_bytes_per_s == 100e9  # 512 nodes x 2 GB/s capped at 100 GB/s
    assert g.checkpoint_s == pytest.approx(g.checkpoint_bytes / 100e9)
    assert g.mtbf_s == pytest.approx(3600 / (DEFAULT_FAILURE_RATE_PER_GPU_HOUR * 4096))
    assert g.restart_s == pytest.approx(300.0 + g.checkpoint_s)  # the checkpoint is read back
    assert g.fraction == pytest.approx(1 / wall_factor(g.interval_s, g.checkpoint_s, g.mtbf_s, g.restart_s))


@pytest.mark.parametrize("option,value", [("failure_rate_per_gpu_hour", 0.0), ("failure_rate_per_gpu_hour", -1e-5),
                                          ("node_write_bw_bytes_per_s", float("nan")),
                                          ("aggregate_write_bw_bytes_per_s", 0), ("restart_s", -1.0),
                                          ("restart_s", True)])
def test_bad_goodput_options_are_refused(inputs, option, value):
    model, cluster, train = inputs
    with pytest.raises(SpecError, match=option):
        goodput(model, train, cluster, 1024, **{option: value})
