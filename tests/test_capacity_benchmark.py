"""Capacity acceptance (benchmarks/capacity.py): the predicted GPU-hours of published pre-training runs
within benchmarks.capacity.TOLERANCE of the published figures.

Rows that miss are listed in KNOWN_MISSES with their error when recorded, as strict expected failures: the
cost model's calibration is fixed and is not tuned to them, and a row that starts to pass fails the test so
that the list is kept true.
"""

from __future__ import annotations

import pytest

from benchmarks.capacity import TOLERANCE, load_runs, predict

#: Rows outside the tolerance, with why (errors as benchmarks.capacity printed them when recorded).
KNOWN_MISSES = {
    "Llama 3.1 70B pre-training": "-44.7%: the model card's 7.0M GPU-hours for ~15T tokens mean 25% MFU (6·N·D); "
    "the planner predicts 54% at the assumed 8,192 GPUs (no publication gives the GPU count or the batch)",
    "Llama 3.1 8B pre-training": "-66.4%: the model card's 1.46M GPU-hours for ~15T tokens mean 14% MFU (6·N·D); "
    "the planner predicts 51% at the assumed 8,192 GPUs (no publication gives the GPU count or the batch)",
}

RUNS = load_runs()


def test_every_run_names_its_source_and_the_misses_are_runs():
    assert all(str(r["source"]).strip() for r in RUNS)
    assert set(KNOWN_MISSES) <= {r["name"] for r in RUNS}


@pytest.mark.parametrize("run", [
    pytest.param(r, id=r["name"], marks=[pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[r["name"]])]
                 if r["name"] in KNOWN_MISSES else []) for r in RUNS])
def test_predicted_gpu_hours_within_tolerance(run):
    p = predict(run)
    assert p["error"] is not None, p
    assert abs(p["error"]) < TOLERANCE, p
