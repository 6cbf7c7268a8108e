"""The smallest GPU count that fits is found with a bounded number of searches (each probe is a whole
search): a memory floor skips counts that cannot hold the gradients and weights, a short scan, then
doubling and bisection; the count found fits and the count below it does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from planner import plan
from planner.advice import MAX_PROBES, MAX_SCAN, gpus_line, memory_floor_gpus, min_gpus_to_fit
from profiles import load_cluster, load_model

NODE = 8


def _search(threshold: int | None, num_gpus: int = 8, floor: int = 0, max_gpus: int | None = None):
    """min_gpus_to_fit on a fake question that fits from `threshold` GPUs on (never when None); the calls made."""
    calls: list[int] = []

    def fits_at(n: int) -> bool:
        calls.append(n)
        return threshold is not None and n >= threshold

    cluster = SimpleNamespace(gpus_per_node=NODE, max_gpus=max_gpus)
    found, tried = min_gpus_to_fit(cluster, num_gpus, fits_at, floor)
    assert sorted(calls) == tried
    return found, calls


@pytest.mark.parametrize("threshold", [16, 40, 8 * (MAX_SCAN + 1), 1000, 4104, 20_000, 8 * 4096])
def test_the_count_found_is_the_smallest_when_fitting_only_grows_with_the_count(threshold):
    found, calls = _search(threshold)
    assert len(calls) <= MAX_PROBES
    assert found == -(-threshold // NODE) * NODE  # the smallest node multiple from the threshold on
    assert found - NODE in calls or found - NODE <= 8  # the count below it was searched and did not fit


def test_the_searches_are_bounded_when_nothing_fits():
    found, calls = _search(None)
    assert found is None and len(calls) <= MAX_PROBES
    found, calls = _search(None, max_gpus=64)
    assert found is None and max(calls) <= 64 and len(calls) == 7  # 16 .. 64, one by one


def test_counts_below_the_memory_floor_are_never_searched():
    found, calls = _search(1000, floor=957)
    assert found == 1000 and min(calls) == 960 and len(calls) <= MAX_SCAN  # found by the scan from the floor
    assert "needs at least 1,000 GPUs" in gpus_line(8, found, calls, NODE, 957)
    assert "fewer than 957 cannot hold the gradients and weights" in gpus_line(8, found, calls, NODE, 957)
    # without the floor the scan cannot reach 1000: the line says not every count below was tried
    found, calls = _search(1000)
    assert "not every multiple below it was tried" in gpus_line(8, found, calls, NODE)


@pytest.mark.parametrize("train", [
    {},
    {"grad_precision": "bf16"},
    {"optimizer": "sgd"},
    {"framework": "torchtitan"},
    {"precision": "fp8", "grad_precision": "bf16"},
], ids=str)
def test_the_memory_floor_is_a_lower_bound(train):
    """The largest node multiple below the floor fits no plan, whatever the training options."""
    q = dict(model="llama3.1-405b", cluster="dgx-h100", global_batch_size=64, seq_len=4096) | train
    probe = plan(**q, num_gpus=8, top_k=1)
    floor = memory_floor_gpus(load_model("llama3.1-405b"), probe.train, load_cluster("dgx-h100"), probe.headroom)
    assert floor > NODE  # a real test: some count is below the floor
    below = (floor - 1) // NODE * NODE
    assert not plan(**q, num_gpus=below, top_k=1).plans
