"""The pipeline schedule simulator (planner.show.schedule): Megatron's 1F1B and interleaved 1F1B orders, their
data dependencies, one block at a time per rank, and a bubble equal to the cost model's (pp-1)/(vpp·m) when the
stages are equal."""

from __future__ import annotations

import itertools

import pytest

from planner.errors import SpecError
from planner.show.schedule import rank_order, simulate

CASES = [(pp, vpp, m) for pp, vpp, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4), (1, 2, 4, 8, 12, 16, 24))
         if vpp == 1 or m % pp == 0]


@pytest.mark.parametrize("pp,vpp,m", CASES)
@pytest.mark.parametrize("fwd,bwd", [(1.0, 2.0), (1.0, 1.0), (0.3, 1.7)])
def test_equal_stages_bubble_is_the_cost_models(pp, vpp, m, fwd, bwd):
    s = simulate(pp, vpp, m, [fwd] * pp, [bwd] * pp)
    assert s.bubble_fraction == pytest.approx((pp - 1) / (vpp * m), abs=1e-9)
    assert s.makespan_s == pytest.approx((m + (pp - 1) / vpp) * (fwd + bwd))


@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 8), (4, 2, 8), (3, 3, 6), (2, 4, 4), (4, 2, 4), (1, 1, 3)])
def test_dependencies_hold_and_ranks_run_one_block_at_a_time(pp, vpp, m):
    fwd = [1.0 + 0.3 * r for r in range(pp)]  # unequal stages: the dependencies, not the symmetry, order them
    bwd = [2.0 - 0.2 * r for r in range(pp)]
    s = simulate(pp, vpp, m, fwd, bwd)
    end = {}
    for r, blocks in enumerate(s.blocks):
        assert len(blocks) == 2 * vpp * m
        assert {(b.kind, b.chunk, b.microbatch) for b in blocks} == {
            (k, c, i) for k in "FB" for c in range(vpp) for i in range(m)}
        for a, b in zip(blocks, blocks[1:]):
            assert b.start_s >= a.end_s - 1e-12  # never two blocks at once
        for b in blocks:
            assert b.end_s - b.start_s == pytest.approx((fwd[r] if b.kind == "F" else bwd[r]) / vpp)
            end[(b.kind, b.chunk * pp + r, b.microbatch)] = b
    last = pp * vpp - 1
    for (kind, v, i), b in end.items():
        if kind == "F" and v > 0:
            assert b.start_s >= end[("F", v - 1, i)].end_s - 1e-12
        if kind == "B":
            before = end[("B", v + 1, i)] if v < last else end[("F", v, i)]
            assert b.start_s >= before.end_s - 1e-12
    assert s.makespan_s == pytest.approx(max(b.end_s for blocks in s.blocks for b in blocks))
    for r in range(pp):
        assert s.idle_s[r] == pytest.approx(s.makespan_s - m * (fwd[r] + bwd[r]))


def test_1f1b_warmup_and_interleaved_groups_follow_megatron():
    # 1F1B: rank r runs pp - r - 1 warm-up forwards, then the steady state's forward, then its first backward
    for r in range(4):
        order = rank_order(4, 1, 8, r)
        assert [k for k, _, _ in order].index("B") == (4 - r - 1) + 1
    # interleaved: (pp - r - 1)·2 + (vpp - 1)·pp warm-up forwards; chunk 0 takes micro-batches 0..pp-1 first
    order = rank_order(2, 2, 4, 0)
    assert [k for k, _, _ in order].index("B") == 2 * 1 + 1 * 2 + 1
    assert [(c, i) for k, c, i in order if k == "F"][:4] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(c, i) for k, c, i in order if k == "B"][:2] == [(1, 0), (1, 1)]  # backwards from the last chunk


def test_interleaved_needs_a_multiple_of_pp():
    with pytest.raises(SpecError, match=r"needs num_microbatches \(6\) to be a multiple of pp \(4\)"):
        simulate(4, 2, 6, [1.0] * 4, [2.0] * 4)
    with pytest.raises(SpecError, match="one forward and one backward per pipeline rank"):
        simulate(4, 1, 6, [1.0] * 3, [2.0] * 4)
    with pytest.raises(SpecError, match="vpp"):
        simulate(4, 0, 8, [1.0] * 4, [2.0] * 4)


def test_a_slow_last_stage_makes_the_others_wait():
    s = simulate(4, 1, 8, [1.0, 1.0, 1.0, 2.0], [2.0, 2.0, 2.0, 4.0])
    assert s.slowest_rank == 3
    assert s.idle_s[0] > s.idle_s[3]
    assert s.bubble_fraction >= 0
