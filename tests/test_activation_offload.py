"""Activation offloading (Megatron's --cpu-offloading --cpu-offloading-num-layers): the Strategy field,
the rule, its memory on the GPU and the host, the copies' stall, and the search's offloaded twins."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models import StrategyArrays, evaluate_arrays
from cost_models.step import offload_stall_s
from planner import Strategy
from tests.framework_defaults import evaluate, plan
from planner.api import make_inputs
from planner.errors import SpecError
from planner.rules import Context, check

FP8 = dict(precision="fp8", fp8_recipe="tensorwise", grad_precision="bf16", fp8_param_gather=True)


def test_the_strategy_refuses_pipelines_and_recomputation():
    assert Strategy(offload_activation_layers=20).short().endswith("act-offload20")
    for bad in (dict(pp=2), dict(recompute="full"), dict(recompute="selective")):
        with pytest.raises(SpecError, match="offload_activation_layers"):
            Strategy(offload_activation_layers=4, **bad)


def test_the_rule_names_the_field_and_the_layer_count():
    est = evaluate("llama3-8b", "dgx-h100", 8, 64, 8192, strategy=Strategy(offload_activation_layers=32))
    assert not est.valid and any("offload_activation_layers (32) must be below num_layers (32)" in r
                                 for r in est.reasons)
    model, cluster, train = make_inputs("llama3-8b", "dgx-h100", 8, 64, 8192)
    ok = Strategy(offload_activation_layers=31).resolve(8)
    valid, failures = check(Context(model, train, 8, cluster), StrategyArrays.from_strategies([ok]))
    assert valid[0] and not failures["activation_offload"][0]


def test_offloaded_layers_leave_the_gpu_and_take_host_memory():
    model, cluster, train = make_inputs("llama3-70b", "gb200-nvl72", 64, 128, 8192, **FP8)
    plans = [Strategy(zero_stage=3, micro_batch_size=2, offload_activation_layers=n).resolve(64) for n in (None, 20, 40)]
    costs = evaluate_arrays(model, cluster, train, StrategyArrays.from_strategies(plans))
    act = costs.memory_bytes["activations"]
    per_layer = act[0] / model.num_layers
    assert act[1] == pytest.approx(act[0] - 20 * per_layer) and act[2] == pytest.approx(act[0] - 40 * per_layer)
    assert costs.host_memory_bytes[0] == 0
    assert costs.host_memory_bytes[2] == pytest.approx(40 * per_layer) == pytest.approx(2 * costs.host_memory_bytes[1])


def test_copies_hide_behind_the_other_layers_until_they_cannot():
    # NVLink-C2C (GB200): 40 of 80 layers' copies hide; PCIe (B200): 5 hide (NVIDIA's recipes), 40 do not
    model, cluster, train = make_inputs("llama3-70b", "dgx-b200", 64, 128, 8192, **FP8)
    times = {}
    for n in (None, 5, 40):
        est = evaluate(model, cluster, 64, 128, 8192, strategy=Strategy(zero_stage=3, offload_activation_layers=n), **FP8)
        times[n] = est.time_s["activation_offload"]
    assert times[None] == 0 and times[5] == 0 and times[40] > 1.0
    est = evaluate("llama3-70b", "gb200-nvl72", 64, 128, 8192,
                   strategy=Strategy(zero_stage=3, micro_batch_size=2, offload_activation_layers=40), **FP8)
    assert est.time_s["activation_offload"] == 0


def test_stall_follows_the_copy_queue():
    # copies no longer than a layer: only the last offloaded layer can wait, for its copy less L - N - 1 layers
    assert float(offload_stall_s(3.0, 1.0, 1, 4)) == pytest.approx(1.0)
    # longer copies queue: N copies against L - 2 layers
    assert float(offload_stall_s(2.0, 1.0, 10, 12)) == pytest.approx(10 * 2.0 - 10 * 1.0)
    stalls = [float(offload_stall_s(c, 1.0, 8, 16)) for c in np.linspace(0.5, 4.0, 15)]
    assert all(b >= a for a, b in zip(stalls, stalls[1:]))  # never shorter for slower copies
    assert float(offload_stall_s(9.0, 1.0, 0, 16)) == 0.0


def test_the_search_offloads_just_enough_where_nothing_else_fits():
    cons = dict(tp=1, pp=1, cp=1, zero_stage=3, micro_batch_size=2, recompute="none")
    result = plan("llama3-70b", "gb200-nvl72", 64, 128, 8192, constraints=cons, top_k=3, headroom=0.0,
                  ranking="fastest", **FP8)
    assert result.plans, result.rejections
    n = [p.strategy.offload_activation_layers for p in result.plans]
    assert all(n) and min(n) >= 40  # NVIDIA's recipe offloads 40 of 80 layers on GB200
    best = result.plans[0]
    assert best.estimate.fits and best.estimate.peak_memory_bytes <= best.estimate.memory_capacity_bytes
    one_less = evaluate("llama3-70b", "gb200-nvl72", 64, 128, 8192,
                        strategy=best.strategy.model_copy(update={"offload_activation_layers": min(n) - 1}), **FP8)
    assert not one_less.fits  # no plan offloads more than it needs to, by more than the twins' two extra
    # asked not to offload, the search does not
    off = plan("llama3-70b", "gb200-nvl72", 64, 128, 8192, constraints=cons | {"offload_activation_layers": None},
               top_k=3, headroom=0.0, **FP8)
    assert not off.plans and all(not p.strategy.offload_activation_layers for p in off.closest)


def test_gpus_behind_one_pcie_switch_share_its_uplink():
    # DGX A100: two GPUs behind each PCIe switch's x16 uplink, so each copies at half its link's rate
    model, cluster, train = make_inputs("llama3-70b", "dgx-a100-80gb", 64, 128, 4096)
    assert cluster.host.gpus_per_host_link == 2
    own = cluster.model_copy(update={"host": cluster.host.model_copy(update={"gpus_per_host_link": 1})})
    strategy = Strategy(zero_stage=3, offload_activation_layers=60)
    shared, alone = (evaluate(model, c, 64, 128, 4096, strategy=strategy).time_s["activation_offload"]
                     for c in (cluster, own))
    assert shared > 1.0 and alone < shared / 2  # 60 layers' copies at 12.5 GB/s stall; at 25 GB/s they nearly hide
    opt = Strategy(zero_stage=1, tp=8, offload_optimizer=True)
    shared, alone = (evaluate(model, c, 64, 128, 4096, strategy=opt).time_s["optimizer"] for c in (cluster, own))
    assert shared > alone
