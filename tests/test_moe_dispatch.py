"""The MoE token dispatchers (cost_models.dispatch): copies per token by tier, group-limited routing,
the TrainSpec / ModelSpec fields, the CLI option and what each emitter writes or refuses."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cost_models.dispatch import distinct_units, expected_distinct, tier_scales
from tests.framework_defaults import evaluate
from planner.errors import SpecError
from planner.specs import ModelSpec, TrainSpec
from profiles import load_model
from profiles.bundle import load_tables

sys.path.insert(0, str(Path(__file__).parent / "emit"))

DSV3 = dict(model="deepseek-v3", cluster="dgx-b200", num_gpus=256, global_batch_size=4096, seq_len=4096,
            precision="fp8", fp8_recipe="mxfp8")
DSV3_EP32 = dict(pp=8, ep=32, zero_stage=1, num_layers_in_first_stage=6, num_layers_in_last_stage=7)


def test_expected_distinct_matches_a_sampled_routing():
    rng = np.random.default_rng(0)
    picks = np.array([rng.choice(256, 8, replace=False) for _ in range(20000)])
    for units in (4, 8, 32):
        sampled = np.mean([len(set(row // (256 // units))) for row in picks])
        assert expected_distinct(units, 256 // units, 8) == pytest.approx(sampled, rel=0.01)


def test_group_limit_never_adds_destinations_and_caps_them():
    for units in (2, 4, 8, 16, 32, 64):
        limited, free = distinct_units(256, 8, units, 8, 4), distinct_units(256, 8, units)
        assert limited <= free + 1e-12
    assert distinct_units(256, 8, 8, 8, 4) <= 4  # one group per node: at most topk_group nodes


def test_alltoall_is_the_unit_and_flex_never_sends_more_over_the_network():
    ep, local = np.array([8, 16, 32, 64, 128]), np.array([8, 8, 8, 8, 8])
    intra, inter = tier_scales("alltoall", 256, 8, ep, local, 8, 4)
    assert np.all(intra == 1) and np.all(inter == 1)
    for disp in ("deepep", "hybridep"):
        intra, inter = tier_scales(disp, 256, 8, ep, local)
        assert np.all(inter <= 1) and intra[0] <= 1  # inside one node: one copy per destination GPU
        assert np.all(np.diff(inter) >= 0)  # more nodes, more of them reached


def test_deepep_cuts_the_cross_node_dispatch_of_deepseek_v3():
    a2a = evaluate(**DSV3, strategy=DSV3_EP32)
    flex = evaluate(**DSV3, strategy=DSV3_EP32, moe_dispatcher="deepep")
    assert flex.time_s["ep_comm"] < 0.5 * a2a.time_s["ep_comm"]
    # the alltoall dispatcher also sorts the received tokens by local expert and back; DeepEP's kernel does not
    assert 0.9 * a2a.time_s["compute"] < flex.time_s["compute"] < a2a.time_s["compute"]


def test_router_groups_are_validated_and_read_from_hugging_face():
    base = load_model("deepseek-v3").model_dump()
    assert (base["moe_router_num_groups"], base["moe_router_group_topk"]) == (8, 4)
    for bad, match in (({"moe_router_num_groups": 8, "moe_router_group_topk": 0}, "go together"),
                       ({"moe_router_num_groups": 7}, "divide num_experts"),
                       ({"moe_router_group_topk": 9}, "between 1 and"),
                       ({"moe_router_group_topk": 3}, "multiple of")):
        with pytest.raises(SpecError, match=match):
            ModelSpec(**(base | bad))
    with pytest.raises(SpecError, match="needs num_experts"):
        ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100,
                  moe_router_num_groups=2, moe_router_group_topk=1)
    fixtures = Path(__file__).parent / "fixtures" / "hf"
    assert load_model(str(fixtures / "deepseek-v3.json")).moe_router_num_groups == 8
    assert load_model(str(fixtures / "deepseek-v2-lite.json")).moe_router_num_groups == 0  # topk_method greedy
    greedy = json.loads((fixtures / "deepseek-v3.json").read_text()) | {"topk_method": "greedy"}
    assert ModelSpec.model_validate(load_model(str(fixtures / "deepseek-v3.json")).model_dump())  # round trip
    assert greedy["n_group"] == 8


def test_train_spec_refuses_an_unknown_dispatcher():
    with pytest.raises(SpecError, match="moe_dispatcher"):
        TrainSpec(global_batch_size=8, seq_len=128, moe_dispatcher="nccl")


def test_cli_option_reaches_the_estimate(capsys):
    from planner.cli import main

    args = ["evaluate", "-m", "deepseek-v3", "-c", "dgx-b200", "-n", "256", "-b", "4096", "-s", "4096",
            "--precision", "fp8", "--fp8-recipe", "mxfp8", "--pp", "8", "--ep", "32", "--zero", "1",
            "--first-stage-layers", "6", "--last-stage-layers", "7", "-f", "json"]
    ep_comm = []
    for extra in (["--moe-dispatcher", "alltoall"], ["--moe-dispatcher", "hybridep"]):
        main(args + extra)
        ep_comm.append(json.loads(capsys.readouterr().out)["time_s"]["ep_comm"])
    assert ep_comm[1] < ep_comm[0]
    assert main(args + ["--moe-dispatcher", "nccl"]) == 2
    assert "moe_dispatcher" in capsys.readouterr().err


def test_megatron_writes_the_flex_dispatcher_and_router_groups():
    pytest.importorskip("megatron.core")
    from emit_checks import check_megatron, megatron_configs
    from emit_plans import make_plan

    from planner.emit.megatron import megatron_args

    # bf16: megatron-core checks MoE with FP8 against the installed Transformer Engine (none on CPU)
    plan = make_plan("deepseek-v3", "dgx-b200", 256, 4096, 4096, strategy=DSV3_EP32, moe_dispatcher="hybridep")
    argv = megatron_args(plan)
    pairs = dict(zip(argv, argv[1:]))
    assert (pairs["--moe-token-dispatcher-type"], pairs["--moe-flex-dispatcher-backend"]) == ("flex", "hybridep")
    assert (pairs["--moe-router-num-groups"], pairs["--moe-router-group-topk"]) == ("8", "4")
    check_megatron(plan, argv)
    tc = megatron_configs(argv)["transformer"]
    assert (tc.moe_token_dispatcher_type, tc.moe_flex_dispatcher_backend) == ("flex", "hybridep")
    assert (tc.moe_router_num_groups, tc.moe_router_group_topk) == (8, 4)
    assert not tc.moe_shared_expert_overlap  # megatron-core overlaps shared experts with alltoall only


@pytest.mark.parametrize("backend", ["torchtitan", "deepspeed", "colossalai"])
def test_other_frameworks_refuse_the_flex_dispatcher(backend):
    from emit_plans import MIXTRAL_LIKE, make_plan

    from planner.emit import NotExpressibleError, emit

    plan = make_plan(MIXTRAL_LIKE, "dgx-h100", 64, 256, 4096, strategy=dict(ep=8, zero_stage=1),
                     moe_dispatcher="deepep")
    with pytest.raises(NotExpressibleError, match="moe_dispatcher"):
        emit(plan, backend)
    framework_run = evaluate(MIXTRAL_LIKE, "dgx-h100", 64, 256, 4096, strategy=dict(ep=8, zero_stage=1),
                             moe_dispatcher="deepep", framework=backend)
    assert not framework_run.valid and any("moe_dispatcher" in r for r in framework_run.reasons)


# ---- measured dispatchers (profiles/kernels/dispatch) ----------------------------------------------
QWEN_GB200 = dict(model="qwen3-30b-a3b", cluster="gb200-nvl72", num_gpus=8, global_batch_size=512, seq_len=4096,
                  precision="fp8", fp8_recipe="mxfp8", moe_load_imbalance=1.0,
                  strategy=dict(ep=8, micro_batch_size=4, zero_stage=1, recompute="none"))


def test_a_dispatch_table_returns_its_measured_points():
    """At the benchmark's own call (4096 tokens of hidden 7168, top-8, 8 local experts per rank) a call takes
    the measured Python-API time; a call of no bytes keeps the API's own cost, the API time less the kernel's."""
    from cost_models.dispatch import _bench_bytes, dispatch_table
    from profiles.dispatch import DispatchBench

    table = dispatch_table(load_tables("b200").dispatch)
    bench = DispatchBench(tokens=4096, hidden=7168, top_k=8, local_experts=8, bytes_per_element=2)
    nbytes = _bench_bytes(bench, "nvlink", 8, "t")
    assert nbytes == pytest.approx(4096 * expected_distinct(8, 8, 8) * 7168 * 2)
    curve = table.curve("hybridep", "nvlink")
    assert float(curve.call_s("dispatch", 8, nbytes)) == pytest.approx(nbytes / 535.94e9)
    assert float(curve.call_s("combine", 8, nbytes)) == pytest.approx(nbytes / 530.86e9)
    assert float(curve.call_s("dispatch", 8, 0)) == pytest.approx(nbytes / 535.94e9 - nbytes / 734.95e9)
    h100 = dispatch_table(load_tables("h100-sxm").dispatch).curve("hybridep", "network")
    ib = _bench_bytes(dataclasses.replace(bench, ranks_per_node=8), "network", 32, "t")  # 4 nodes: 3 remote, once each
    assert ib == pytest.approx(4096 * expected_distinct(4, 64, 8) * 3 / 4 * 7168 * 2)
    assert float(h100.call_s("combine", 32, ib)) == pytest.approx(ib / 52.53e9)
    # group sizes between measured ones: linear in log2(ep); outside: the nearest measured size
    gb200 = dispatch_table(load_tables("gb200").dispatch).curve("hybridep", "nvlink")
    mid = float(gb200.call_s("dispatch", 12, 1e8))
    assert min(float(gb200.call_s("dispatch", 8, 1e8)), float(gb200.call_s("dispatch", 16, 1e8))) <= mid
    assert mid <= max(float(gb200.call_s("dispatch", 8, 1e8)), float(gb200.call_s("dispatch", 16, 1e8)))
    assert float(gb200.call_s("dispatch", 72, 1e8)) == float(gb200.call_s("dispatch", 36, 1e8))
    # GB300 and H200 name their twin's table and say so
    assert dispatch_table(load_tables("gb300").dispatch) is dispatch_table(load_tables("gb200").dispatch)
    assert dispatch_table(load_tables("h200").dispatch).curve("hybridep", "network") is not None
    assert dispatch_table(load_tables("a100-80gb").dispatch) is None


def test_a_measured_dispatcher_sets_the_exchange_and_a_tier_without_measurements_keeps_the_curves(monkeypatch):
    """Qwen3-30B on 8 GB200s with HybridEP: the expert-parallel time is the table's dispatch and combine per
    layer and micro-batch (both directions); the all-to-all dispatcher, which the table does not measure,
    and HybridEP across DGX-B200 nodes (no network measurement) keep the collective curves."""
    import cost_models.step as step
    from cost_models.dispatch import dispatch_table

    with_table = evaluate(**QWEN_GB200, moe_dispatcher="hybridep")
    monkeypatch.setattr(step, "dispatch_table", lambda *args: None)
    curves = evaluate(**QWEN_GB200, moe_dispatcher="hybridep")
    alltoall = evaluate(**QWEN_GB200, moe_dispatcher="alltoall")
    b200_two_nodes = dict(QWEN_GB200, cluster="dgx-b200", num_gpus=16, strategy=dict(QWEN_GB200["strategy"], ep=16))
    b200_curves = evaluate(**b200_two_nodes, moe_dispatcher="hybridep")
    monkeypatch.undo()
    assert evaluate(**QWEN_GB200, moe_dispatcher="alltoall").time_s["ep_comm"] == alltoall.time_s["ep_comm"]
    assert evaluate(**b200_two_nodes, moe_dispatcher="hybridep").time_s["ep_comm"] == b200_curves.time_s["ep_comm"]
    intra, inter = tier_scales("hybridep", 128, 8, 8, 8)
    per_call = float(dispatch_table(load_tables("gb200").dispatch).exchange_s("hybridep", 16384 * 8 * 2048 * 2, 8, 8, intra, inter))
    calls = 48 * with_table.num_microbatches * 2  # every MoE layer, every micro-batch, forward and backward
    assert with_table.time_s["ep_comm"] == pytest.approx(calls * per_call, rel=1e-6)
    assert with_table.time_s["ep_comm"] != pytest.approx(curves.time_s["ep_comm"], rel=0.01)


def test_a_malformed_dispatch_table_names_the_field():
    from cost_models.dispatch import dispatch_table
    from profiles.dispatch import dispatch_measurements_from

    def dispatch_table_from(data, name):  # parsed (profiles), then priced at Megatron's default SMs (cost_models)
        return dispatch_table(dispatch_measurements_from(data, name))

    good = {"bench": {"tokens": 4096, "hidden": 7168, "top_k": 8, "local_experts": 8, "bytes_per_element": 2},
            "hybridep": {"nvlink": [{"ep": 8, "sms": 16, "dispatch_torch": 500, "combine_torch": 500}]}}
    assert dispatch_table_from(good, "t").curve("hybridep", "nvlink") is not None
    row = good["hybridep"]["nvlink"][0]
    for bad, match in (({"bench": {"tokens": 4096}}, "bench needs positive"),
                       ({"hybridep": {"pcie": [row]}}, "unknown tier 'pcie'"),
                       ({"hybridep": {"nvlink": [row | {"dispatch_kernel": 400}]}}, "dispatch_kernel is below"),
                       ({"hybridep": {"nvlink": [{k: v for k, v in row.items() if k != "combine_torch"}]}},
                        "combine_torch must be a positive rate in GB/s \\(required\\)"),
                       ({"hybridep": {"nvlink": [row | {"ep": 1}]}}, "integer ep >= 2"),
                       ({"hybridep": {"network": [row | {"ep": 16}]}}, "ranks_per_node")):
        with pytest.raises(SpecError, match=match):
            dispatch_table_from(good | bad, "t")


def test_the_flex_dispatchers_sm_count_reads_the_rates_there():
    """HybridEP on 32 SMs (Megatron-Bridge's performance recipes) runs at the GB200 table's 32-SM rates, faster
    than megatron-core's default 16; an SM count outside the measured ones takes the nearest (H100: 16); the
    alltoall dispatcher has no SM count to set, and the emitted job asks for the count the plan was costed at."""
    from cost_models.dispatch import dispatch_table
    from planner.emit.megatron import megatron_args
    from planner.specs import TrainSpec

    gb200 = dispatch_table(load_tables("gb200").dispatch)
    wide = dispatch_table(load_tables("gb200").dispatch, "hybridep", 32)
    def both(table):  # one dispatch and one combine of 1 GB on 8 ranks
        curve = table.curve("hybridep", "nvlink")
        return float(curve.call_s("dispatch", 8, 1e9) + curve.call_s("combine", 8, 1e9))

    assert both(wide) < both(gb200)
    h100 = dispatch_table(load_tables("h100-sxm").dispatch).curve("hybridep", "network")
    assert float(dispatch_table(load_tables("h100-sxm").dispatch, "hybridep", 32).curve("hybridep", "network").call_s("dispatch", 16, 1e8)) \
        == float(h100.call_s("dispatch", 16, 1e8))
    default = evaluate(**QWEN_GB200, moe_dispatcher="hybridep")
    at_32 = evaluate(**QWEN_GB200, moe_dispatcher="hybridep", moe_flex_num_sms=32)
    assert at_32.time_s["ep_comm"] < default.time_s["ep_comm"]
    with pytest.raises(SpecError, match="moe_flex_num_sms.*flex dispatcher"):
        TrainSpec(global_batch_size=8, seq_len=4096, moe_flex_num_sms=32)
    from emit_plans import make_plan

    plan = make_plan("qwen3-30b-a3b", "gb200-nvl72", 8, 512, 4096, strategy=dict(ep=8, micro_batch_size=4, zero_stage=1),
                     precision="fp8", fp8_recipe="mxfp8", moe_dispatcher="hybridep", moe_flex_num_sms=32)
    argv = megatron_args(plan)
    assert argv[argv.index("--moe-hybridep-num-sms") + 1] == "32"
    assert "--moe-hybridep-num-sms" not in megatron_args(make_plan(
        "qwen3-30b-a3b", "gb200-nvl72", 8, 512, 4096, strategy=dict(ep=8, micro_batch_size=4, zero_stage=1),
        precision="fp8", fp8_recipe="mxfp8", moe_dispatcher="hybridep"))
