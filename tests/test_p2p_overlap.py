"""Overlapped pipeline transfers of the interleaved schedule (Strategy.overlap_p2p_comm; Megatron's
--overlap-p2p-communication): only the warm-up and cool-down transfers block, the steady-state ones
hide behind the chunk computed beside them; plain 1F1B keeps every transfer."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models import StrategyArrays, evaluate_arrays
from cost_models.layout import ParallelLayout
from cost_models.step import pipeline_comm, setup
from planner import Strategy
from planner.api import make_inputs


def _costs(framework="megatron", **kw):
    model, cluster, train = make_inputs("llama3-70b", "dgx-h100", 64, 256, 8192, framework=framework)
    plans = [Strategy(tp=4, pp=8, sequence_parallel=True, zero_stage=1, overlap_p2p_comm=o, **kw).resolve(64)
             for o in (True, False)]
    return evaluate_arrays(model, cluster, train, StrategyArrays.from_strategies(plans))


def test_interleaved_transfers_hide_but_warm_up_and_cool_down_block():
    costs = _costs(vpp=5)
    on, off = costs.time_s["pp_comm"]
    assert 0 < on < off / 3  # most transfers are steady-state ones
    model, cluster, train = make_inputs("llama3-70b", "dgx-h100", 64, 256, 8192)
    st = StrategyArrays.from_strategies([Strategy(tp=4, pp=8, vpp=5, sequence_parallel=True).resolve(64)])
    s = setup(model, cluster, train, st)
    lay, m = s.lay, s.num_microbatches
    every, blocking = lay.pipeline_transfers(m), lay.blocking_transfers(m)
    assert off == pytest.approx(float(pipeline_comm(s)[0]))  # no chunk time: every transfer blocks
    per = off / float(every[0])  # the model's time of one transfer (no tied embeddings here)
    # a chunk's compute is longer than a transfer: each steady one hides, as far as the cluster overlaps
    steady = float(every[0] - blocking[0])
    assert on == pytest.approx(float(blocking[0]) * per + steady * per * (1 - cluster.overlap_efficiency), rel=1e-9)
    assert float(pipeline_comm(s, np.zeros(1))[0]) == pytest.approx(off)  # nothing to hide behind


def test_plain_one_f_one_b_blocks_and_torchtitans_interleaved_runtime_overlaps():
    on, off = _costs(vpp=1).time_s["pp_comm"]
    assert on == pytest.approx(off) and on > 0
    # torch.distributed.pipelining posts receives ahead of their compute: Interleaved1F1B overlaps as Megatron does
    titan, megatron = _costs(framework="torchtitan", vpp=5), _costs(vpp=5)
    assert titan.time_s["pp_comm"][0] < titan.time_s["pp_comm"][1] / 3
    assert titan.time_s["pp_comm"][0] == pytest.approx(megatron.time_s["pp_comm"][0])


def test_blocking_transfers_are_the_first_ranks_warm_up_each_way():
    one = lambda *v: np.array(v)  # noqa: E731
    lay = ParallelLayout(16, one(1, 1), one(1, 1), one(1, 1), one(4, 4), one(2, 4), one(1, 1), one(1, 1),
                         one(0, 0), one(0, 0), np.zeros(2, bool), np.zeros(2, bool))
    m = np.array([16, 2])
    # 2·(pp-1) + (vpp-1)·pp warm-up forwards, capped at m·vpp, and the pp - 1 fill hops, each way
    assert lay.blocking_transfers(m).tolist() == [2 * (6 + 4 + 3), 2 * (8 + 3)]
    assert (lay.blocking_transfers(m) <= lay.pipeline_transfers(m)).all()
