"""FP8 current scaling all-reduces the amax of sequence-parallel tensors over the TP group
(Transformer Engine's `with_amax_reduction`, set by Linear._customize_quantizers_float8_current_scaling
for column-parallel inputs and row-parallel output gradients; the all-reduce runs in
Float8CurrentScalingQuantizer::quantize_impl before the cast, v2.9)."""

import numpy as np
import pytest

from cost_models.arrays import StrategyArrays
from cost_models.blocks import model_blocks
from cost_models.collectives import comm_model_for
from cost_models.step import micro_of, per_layer_times
from planner.specs import Strategy, TrainSpec
from profiles import load_cluster, load_model


def _times(recipe, tp=4, sp=True):
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    st = StrategyArrays.from_strategies([Strategy(dp=8 // tp, tp=tp, sequence_parallel=sp, micro_batch_size=1)])
    train = TrainSpec(global_batch_size=8, seq_len=4096, precision="fp8", fp8_recipe=recipe)
    comm = comm_model_for(cluster)
    pl = per_layer_times(model, train, cluster.gpu, comm, st, cluster.overlap_efficiency, None, cluster.tp_comm_overlap)
    exchanges = sum(c.tp_exchanges for c in model_blocks(model).kinds[0].comms(micro_of(train, st)))
    return pl, float(comm.all_reduce_s(4.0, tp, 1)), exchanges


def test_each_exchange_all_reduces_one_amax_per_direction_under_current_scaling():
    cs, one, exchanges = _times("tensorwise")
    ds, _, _ = _times("delayed")
    assert one > 0 and exchanges == 2  # attention and MLP: a column-parallel GEMM, then a row-parallel one
    for field in ("tp_fwd_s", "tp_bwd_s", "tp_raw_s"):
        extra = float(np.ravel(getattr(cs, field))[0] - np.ravel(getattr(ds, field))[0])
        assert extra == pytest.approx(exchanges * one, rel=1e-9), field


@pytest.mark.parametrize("kwargs", [dict(tp=1, sp=False), dict(sp=False)])
def test_no_amax_all_reduce_without_a_sequence_parallel_tp_group(kwargs):
    cs, _, _ = _times("tensorwise", **kwargs)
    ds, _, _ = _times("delayed", **kwargs)
    for field in ("tp_fwd_s", "tp_bwd_s"):
        assert float(np.ravel(getattr(cs, field))[0]) == pytest.approx(float(np.ravel(getattr(ds, field))[0]))
