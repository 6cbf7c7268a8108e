"""The share of the MoE exchange Megatron's EP overlap hides (ClusterSpec.ep_comm_overlap)."""

import numpy as np
import pytest

from benchmarks.ep_overlap import FIT_ROWS, fit
from benchmarks.generations import calibration_rows
from cost_models.collectives import comm_model_for
from cost_models.step import per_layer_times
from planner.specs import Strategy, TrainSpec
from cost_models.arrays import StrategyArrays
from profiles import load_cluster, load_model


def test_every_gpu_cluster_says_how_much_of_the_exchange_the_overlap_hides():
    for name in ("dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72", "gb300-nvl72"):
        cluster = load_cluster(name)
        assert cluster.ep_comm_overlap is not None, name
        assert cluster.ep_overlap_efficiency == cluster.ep_comm_overlap < cluster.overlap_efficiency
    cpu = load_cluster("local-cpu")  # not measured there: the generic overlap efficiency
    assert cpu.ep_comm_overlap is None and cpu.ep_overlap_efficiency == cpu.overlap_efficiency


def test_the_shipped_share_is_the_fit_of_the_published_ab():
    """benchmarks/ep_overlap.py reproduces profiles/clusters/dgx-h100.yaml's value from Megatron-Bridge's A/B, and
    the accuracy report counts the A/B's rows as calibration rows."""
    share, ratio, _ = fit()
    assert ratio == pytest.approx(20.9920 / 24.7138, rel=1e-5)  # the file keeps tokens/s to 0.1
    assert load_cluster("dgx-h100").ep_comm_overlap == pytest.approx(share, abs=0.01)
    assert set(FIT_ROWS) <= calibration_rows()


def _exposed(share):
    model = load_model("qwen3-30b-a3b")
    cluster = load_cluster("dgx-h100")
    st = StrategyArrays.from_strategies([Strategy(dp=16, ep=16, micro_batch_size=1, overlap_moe_comm=True)])
    train = TrainSpec(global_batch_size=16, seq_len=4096, moe_dispatcher="hybridep")
    pl = per_layer_times(model, train, cluster.gpu, comm_model_for(cluster), st, cluster.overlap_efficiency, None,
                         cluster.tp_comm_overlap, share)
    return float(np.sum(pl.ep_fwd_s) + np.sum(pl.ep_bwd_s))


def test_a_smaller_share_leaves_more_of_the_exchange_exposed():
    none, half, full = _exposed(0.0), _exposed(0.5), _exposed(1.0)
    assert none > half > full >= 0
    assert half == pytest.approx((none + full) / 2)  # linear in the share (the fit relies on it)


@pytest.mark.parametrize("value,rule", [(1.5, "less than or equal to 1"), ("fast", "valid number")])
def test_a_bad_share_is_refused_naming_the_field(value, rule):
    import yaml

    from planner.errors import SpecError
    from profiles import PROFILES_DIR

    doc = yaml.safe_load((PROFILES_DIR / "clusters" / "dgx-h100.yaml").read_text())
    with pytest.raises(SpecError, match=rf"ep_comm_overlap.*{rule}"):
        load_cluster(doc | {"ep_comm_overlap": value})
