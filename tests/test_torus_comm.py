"""Collectives on a TPU torus (cost_models.torus): the decomposition into torus axes, hand-computed times,
the ring-of-two limit, the DCN rule across slices, and the refusal of groups that do not tile the torus."""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace as S

import numpy as np
import pytest

from cost_models.comm import TierCommModel
from cost_models.layout import ParallelLayout
from cost_models.torus import TorusCommModel, decompose, tiles, torus_groups_message, torus_groups_ok
from planner import Strategy, evaluate
from planner.errors import SpecError
from profiles import load_cluster

L, EFF = 100e9, 0.8  # one v5p ICI link per direction, the preset's efficiency
GB = 1e9


def model(shape=(4, 4, 8), wrap=(True, True, True), **kw) -> TorusCommModel:
    return TorusCommModel.of(list(shape), list(wrap), ici_bw_bytes_per_s=L, ici_efficiency=EFF, **kw)


# ---- decomposition -----------------------------------------------------------------------------------------
def test_groups_decompose_into_segments_along_consecutive_axes():
    seg = decompose([4, 4, 8], [4, 16, 8, 2, 4, 256], [1, 4, 1, 2, 64, 1])
    assert seg.ok.all()
    assert seg.members.tolist() == [[4, 1, 1, 1],   # the x ring
                                    [1, 4, 4, 1],   # y whole, half of z
                                    [4, 2, 1, 1],   # x whole, half of y
                                    [2, 1, 1, 1],   # x, every other chip
                                    [1, 1, 2, 2],   # z every 4th chip, then two slices
                                    [4, 4, 8, 2]]   # everything, over two slices
    assert seg.step[3].tolist()[0] == 2 and seg.step[4].tolist()[2] == 4


def test_groups_that_do_not_tile_are_found():
    #        stride 3 on x | 6 of z's 8 | diagonal (stride 6) | x then 3 of y's 4 | a whole slice + a half
    ok = tiles([4, 4, 8], [2, 6, 2, 12, 2], [1, 16, 6, 1, 96])
    assert ok.tolist() == [True, False, False, False, False]
    assert not tiles([4, 4, 8], 3, 1) and not tiles([4, 4, 8], 2, 3) and tiles([4, 4, 8], [[4], [8]], 1).shape == (2, 1)


# ---- hand-computed times -------------------------------------------------------------------------------
def test_all_reduce_on_a_wrapped_ring_uses_both_directions():
    assert model().all_reduce_s(GB, 4, 1) == pytest.approx(2 * 3 / 4 * GB / (2 * L * EFF))


def test_all_reduce_over_two_axes_shrinks_the_message():
    # y (4 of 4, wrapped ring: 2 links), then z (4 of 8: a line, 1 link) on a quarter of the message
    want = 2 * 3 / 4 * GB / (2 * L * EFF) + 2 * 3 / 4 * (GB / 4) / (L * EFF)
    assert model().all_reduce_s(GB, 16, 4) == pytest.approx(want) == pytest.approx(14.0625e-3)


def test_strided_segments_share_their_links_with_the_sibling_groups():
    # members 0 and 2 of a wrapped x of 4: both ways round the ring, each link shared with the group {1, 3}
    assert model().all_reduce_s(GB, 2, 2) == pytest.approx(2 * 1 / 2 * GB / (2 * L * EFF / 2))
    # members 4 apart on z (8, wrapped): the 2 rings' links shared by 4 interleaved groups
    assert model().gather_scatter_s(GB, 2, 64) == pytest.approx(1 / 2 * GB / (2 * L * EFF / 4))


def test_an_open_axis_is_one_link():
    m = model((4, 4), (False, True))
    assert m.all_reduce_s(GB, 4, 1) == pytest.approx(2 * 3 / 4 * GB / (L * EFF))
    assert m.all_reduce_s(GB, 4, 4) == pytest.approx(2 * 3 / 4 * GB / (2 * L * EFF))


def test_gather_scatter_over_two_whole_axes():
    want = 3 / 4 * GB / (2 * L * EFF) + 3 / 4 * (GB / 4) / (2 * L * EFF)
    assert model().gather_scatter_s(GB, 16, 1) == pytest.approx(want)


def test_latency_is_one_ici_latency_per_ring_step():
    m = model(ici_latency_s=1e-6)
    assert m.all_reduce_s(0.0, 16, 1) == pytest.approx(2 * (3 + 3) * 1e-6)
    assert m.gather_scatter_s(0.0, 16, 1) == pytest.approx((3 + 3) * 1e-6)


def test_all_to_all_is_bounded_by_the_bisection():
    # 4x4 of x and y, both wrapped: the cut across x crosses 4 rings twice: 8 links per direction carry n·M/4
    nbytes = 1e6
    assert model().all_to_all_s(nbytes, 16, 1) == pytest.approx(16 * nbytes / 4 / (8 * L * EFF))
    # a ring of 4: the bisection (2 links each way) binds before the injection (2 links out of each chip)
    assert model().all_to_all_s(nbytes, 4, 1) == pytest.approx(4 * nbytes / 4 / (2 * L * EFF))


def test_send_recv_is_one_link_plus_the_hops_of_the_stride():
    m = model(ici_latency_s=1e-6, dcn_bw_bytes_per_s=6.25e9, dcn_latency_s=1e-5)
    assert m.p2p_s(1e6, 16, 128) == pytest.approx(1e6 / (L * EFF) + 1e-6)  # next along z
    assert m.p2p_s(1e6, 2, 4) == pytest.approx(1e6 / (L * EFF) + 2e-6)  # two hops along x
    assert m.p2p_s(1e6, 3, 4) == pytest.approx(1e6 / (L * EFF) + 1e-6)  # one hop back over the wraparound
    assert m.p2p_s(1e6, 128, 256) == pytest.approx(1e6 / 6.25e9 + 1e-5)  # between slices: the DCN


# ---- the ring of two, and the DCN rule ----------------------------------------------------------------------
def test_one_axis_of_two_chips_is_a_ring_of_two():
    lat = 2e-6
    torus = TorusCommModel.of([2, 1], [True, False], ici_bw_bytes_per_s=L, ici_efficiency=EFF, ici_latency_s=lat)
    tier = S(bus_bw_bytes_per_s=L * EFF, latency_s=lat, gather_scatter_bw_bytes_per_s=L * EFF, efficiency=EFF,
             gather_scatter_efficiency=None)
    level = S(name="nvlink-domain", unit_gpus=2, egress_bytes_per_s=L, latency_s=lat, sharp=False)
    ring = TierCommModel(S(domain_size=2, intra_node=tier, inter_node=tier, levels=[level]))
    for nbytes in (0.0, 1e3, 1e6, 1e9):
        assert torus.all_reduce_s(nbytes, 2, 1) == pytest.approx(ring.all_reduce_s(nbytes, 2, 1))
        assert torus.gather_scatter_s(nbytes, 2, 1) == pytest.approx(ring.gather_scatter_s(nbytes, 2, 1))
        assert torus.all_to_all_s(nbytes, 2, 1) == pytest.approx(ring.all_to_all_s(nbytes, 2, 1))
        assert torus.p2p_s(nbytes, 1, 2) == pytest.approx(ring.p2p_s(nbytes, 1, 2))


def test_across_slices_the_k_members_of_a_slice_share_their_dcn_links():
    dcn = 6.25e9 * 0.9
    m = model(dcn_bw_bytes_per_s=6.25e9, dcn_efficiency=0.9, num_slices=2)
    # one member per slice: the DCN alone
    assert m.all_reduce_s(GB, 2, 128) == pytest.approx(2 * 1 / 2 * GB / dcn)
    # the whole of two slices: the slice's torus (busbw 2·L·eff on wrapped rings) binds before 128 · DCN
    assert m.all_reduce_s(GB, 256, 1) == pytest.approx(2 * 255 / 256 * GB / (2 * L * EFF))
    # 2 members per slice (z, 4 apart), two slices: min(the pair's busbw, 2 · DCN) = 2 · DCN
    assert m.all_reduce_s(GB, 4, 64) == pytest.approx(2 * 3 / 4 * GB / (2 * dcn))
    assert m.domain_members(4, 64) == 2


def test_every_time_is_finite_non_negative_and_zero_for_groups_of_one():
    m = model(ici_latency_s=1e-6, dcn_bw_bytes_per_s=6.25e9, num_slices=2)
    rng = np.random.default_rng(0)
    size = rng.choice([1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256], 500)
    stride = rng.choice([1, 2, 3, 4, 8, 16, 64, 128], 500)
    nbytes = rng.uniform(0, 1e9, 500)
    for t in (m.all_reduce_s(nbytes, size, stride), m.gather_scatter_s(nbytes, size, stride),
              m.all_to_all_s(nbytes, size, stride), m.p2p_s(nbytes, stride, size * stride)):
        assert t.shape == (500,) and np.isfinite(t).all() and (t >= 0).all()
    assert (m.all_reduce_s(nbytes, 1, stride) == 0).all() and (m.all_to_all_s(nbytes, 1, stride) == 0).all()
    assert np.ndim(m.all_reduce_s(1e6, 4, 1)) == 0
    rows = m.all_reduce_s(np.stack([nbytes, 2 * nbytes, 3 * nbytes]), size, stride.astype(float))  # stage rows
    assert rows.shape == (3, 500) and np.allclose(rows[0], m.all_reduce_s(nbytes, size, stride))


def test_more_bytes_never_take_less_time():
    m = model()
    sizes = np.array([2, 4, 8, 16, 32, 128])
    small, large = m.all_reduce_s(1e6, sizes, 1), m.all_reduce_s(1e8, sizes, 1)
    assert (large >= small).all()


# ---- the cluster model, the rule and the refusal ---------------------------------------------------------
def test_the_model_reads_a_tpu_cluster():
    c = load_cluster("tpu-v5p-2x128")
    m = TorusCommModel(c)
    assert m.shape == [4, 4, 8] and m.chips_per_slice == 128
    assert m.all_reduce_s(GB, 4, 1) == pytest.approx(2 * 3 / 4 * GB / (2 * L * EFF) + 6 * 1e-6)
    with pytest.raises(SpecError, match="needs topology kind 'torus'"):
        TorusCommModel(load_cluster("dgx-h100"))


def _layout(st: Strategy, num_gpus: int) -> ParallelLayout:
    return ParallelLayout.of_strategy(st.resolve(num_gpus), 8)


def test_the_rule_passes_tiling_candidates_and_drops_the_others():
    c = load_cluster("tpu-v5p-128")
    lay = _layout(Strategy(tp=4, cp=2, pp=2), 128)
    assert torus_groups_ok(c, lay).all()
    bad = _layout(Strategy(tp=3), 96)
    assert not torus_groups_ok(c, bad).any()
    assert torus_groups_ok(load_cluster("dgx-h100"), bad).all()  # not a torus: no rule
    assert torus_groups_message(c, bad).startswith("the tp group of 3 ranks at stride 1 does not tile the 4x4x8 torus")
    assert torus_groups_message(c, lay) is None and torus_groups_message(load_cluster("dgx-h100"), bad) is None


def test_evaluate_refuses_a_group_that_does_not_tile_the_torus():
    """A rule like every other (planner.rules): the strategy is invalid with the reason named, and the
    search drops such candidates."""
    bad = evaluate("gpt3-175b", "tpu-v5p-128", 96, 96, 2048, strategy=Strategy(tp=3))
    assert not bad.valid
    assert any(re.match(r"the tp group of 3 ranks at stride 1 does not tile the 4x4x8 torus", r) for r in bad.reasons)
    est = evaluate("llama3-8b", "tpu-v5p-128", 128, 256, 8192, strategy=Strategy(tp=4, zero_stage=3))
    assert est.valid and est.step_time_s > 0


def test_the_cli_refuses_it_with_exit_2_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "planner", "evaluate", "--model", "gpt3-175b", "--cluster",
                           "tpu-v5p-128", "--gpus", "96", "--global-batch-size", "96", "--seq-len", "2048",
                           "--tp", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "tp group of 3 ranks at stride 1 does not tile the 4x4x8 torus" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


# ---- planning on a TPU preset ----------------------------------------------------------------------------
def test_plan_on_a_tpu_preset_gives_a_ranked_table():
    proc = subprocess.run([sys.executable, "-m", "planner", "plan", "--model", "llama3-8b", "--cluster", "tpu-v5p-128",
                           "--gpus", "128", "--global-batch-size", "256", "--seq-len", "8192", "--top", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if re.match(r"^\s*1~?\s+dp\d+", line)]
    assert "ranked plans" in proc.stdout and rows, proc.stdout


def test_a_search_priced_on_the_torus():
    from cost_models.collectives import comm_model_for
    from planner import plan

    tpu = load_cluster("tpu-v5p-128")
    torus = comm_model_for(tpu)
    assert isinstance(torus, TorusCommModel)
    flat = comm_model_for(tpu.model_copy(update={"topology": None, "fabric": None}))
    # the tp group is the x ring: both directions of its wrapped links, where the two-tier model has one link
    assert 0 < float(torus.all_reduce_s(GB, 4, 1)) < float(flat.all_reduce_s(GB, 4, 1))
    est = evaluate("llama3-8b", "tpu-v5p-128", 128, 256, 8192, strategy=Strategy(tp=4, sequence_parallel=True,
                                                                                zero_stage=3))
    tp = {g.dim: g for g in est.groups}["tp"]
    assert tp.tier == tpu.intra_node.name and tp.bus_bw_bytes_per_s == pytest.approx(2 * L * EFF)
    result = plan("llama3-70b", "tpu-v5p-2x128", 256, 512, 4096, top_k=3)
    assert result.plans and all(np.isfinite(p.estimate.step_time_s) and p.estimate.fits for p in result.plans)
