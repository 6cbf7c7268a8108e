"""Capacity acceptance (benchmarks/capacity.py): the predicted GPU-hours of a published pre-training run within
benchmarks.capacity.TOLERANCE of the published figure, for the runs whose GPU count, batch and token budget are all
published (`acceptance: true` in benchmarks/data/capacity_runs.yaml). The other rows guess their GPU count and batch;
the benchmark prints them with their error and the test does not judge them.
"""

from __future__ import annotations

import pytest

from benchmarks.capacity import TOLERANCE, load_runs, predict

RUNS = load_runs()


def test_every_run_names_its_source_and_says_whether_it_is_tested():
    assert all(str(r["source"]).strip() for r in RUNS)
    assert all(isinstance(r.get("acceptance"), bool) for r in RUNS)
    assert all(str(r.get("assumed", "")).strip() for r in RUNS if not r["acceptance"])
    assert any(r["acceptance"] for r in RUNS)


@pytest.mark.parametrize("run", [r for r in RUNS if r["acceptance"]], ids=lambda r: r["name"])
def test_predicted_gpu_hours_within_tolerance(run):
    p = predict(run)
    assert p["error"] is not None, p
    assert abs(p["error"]) < TOLERANCE, p
