"""Uneven interleaved pipeline layouts: `stage_layers` with one count per virtual stage (Megatron's
`--pipeline-model-parallel-layout`), as Megatron-Bridge's DeepSeek-V3 recipes run them
(src/megatron/bridge/recipes/deepseek/h100/deepseek_v3.py, `_get_deepseek_v3_pipeline_layout`: embedding + 4
layers, 14 x 4 layers, 1 layer + MTP + loss over 16 virtual stages for (pp, vp) = (4, 4), (8, 2), (16, 1);
NVIDIA-NeMo/Megatron-Bridge@067f987df)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cost_models.arrays import StrategyArrays
from cost_models.layout import ParallelLayout
from tests.framework_defaults import evaluate, plan
from planner.cli import main
from planner.errors import SpecError
from planner.space import _pipeline_key, _pipeline_splits, normalise_constraints
from planner.specs import Strategy

BRIDGE = [4] * 15 + [1]  # DeepSeek-V3's 61 decoder layers over 16 virtual stages
DSV3 = ("deepseek-v3", "gb200-nvl72", 256, 4096, 4096)


def layout(st: Strategy, num_layers: int) -> ParallelLayout:
    return ParallelLayout.of_strategy(st.resolve(st.model_parallel_size), num_layers)


# ---- per-rank sums ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,vpp,per_rank", [(4, 4, [16, 16, 16, 13]), (8, 2, [8] * 7 + [5]),
                                             (16, 1, [4] * 15 + [1]), (2, 8, [32, 29])])
def test_a_rank_holds_the_sum_of_its_virtual_stages(pp, vpp, per_rank):
    lay = layout(Strategy(pp=pp, vpp=vpp, stage_layers=BRIDGE), 61)
    assert bool(lay.split_ok()[0])
    assert lay.layers_per_chunk() == BRIDGE  # virtual-stage order, as given
    assert lay.layers_per_stage() == per_rank
    rows = lay.rows
    assert [rows.layers[k, 0] for k in range(rows.num_rows) if rows.rank[k, 0] == pp - 1][0] == per_rank[-1]
    assert rows.layers[:, 0].max() == max(per_rank)
    assert np.allclose(rows.chunk_layers[:, 0], rows.layers[:, 0] / vpp)  # the rank's average chunk
    assert float(lay.largest_chunk()[0]) == 4


def test_rank_three_of_pp4_vp4_runs_chunks_of_4_4_4_1():
    lay = layout(Strategy(pp=4, vpp=4, stage_layers=BRIDGE), 61)
    assert [lay.layers_per_chunk()[j] for j in lay.virtual_stages(3)] == [4, 4, 4, 1]


def test_per_rank_and_per_virtual_stage_forms_of_one_split_agree():
    per_rank = layout(Strategy(pp=4, vpp=2, stage_layers=[6, 10, 12, 4]), 32)
    per_stage = layout(Strategy(pp=4, vpp=2, stage_layers=[3, 5, 6, 2, 3, 5, 6, 2]), 32)
    assert per_rank.layers_per_chunk() == per_stage.layers_per_chunk() == [3, 5, 6, 2, 3, 5, 6, 2]
    assert per_rank.layers_per_stage() == per_stage.layers_per_stage() == [6, 10, 12, 4]
    assert np.array_equal(per_rank.rows.layers, per_stage.rows.layers)


def test_an_even_split_spelled_per_virtual_stage_costs_as_the_even_split():
    q = ("llama3-8b", "dgx-h100", 32, 128, 4096)
    base = dict(tp=2, pp=4, vpp=2, micro_batch_size=1, zero_stage=1)
    even = evaluate(*q, strategy=Strategy(**base))
    spelled = evaluate(*q, strategy=Strategy(**base, stage_layers=[4] * 8))
    assert spelled.valid and spelled.step_time_s == pytest.approx(even.step_time_s, rel=1e-12)
    assert spelled.memory_bytes == pytest.approx(even.memory_bytes, rel=1e-12)


def test_moving_a_layer_between_chunks_of_one_rank_keeps_the_rank_rows():
    """The rows are per pipeline rank: two splits with the same per-rank sums have the same rows and
    the same step time (in-flight activations and the bubble use the rank's average chunk)."""
    q = ("llama3-8b", "dgx-h100", 32, 128, 4096)
    base = dict(tp=2, pp=4, vpp=2, micro_batch_size=1, zero_stage=1)
    a = evaluate(*q, strategy=Strategy(**base, stage_layers=[4] * 8))
    b = evaluate(*q, strategy=Strategy(**base, stage_layers=[5, 4, 4, 4, 3, 4, 4, 4]))
    c = evaluate(*q, strategy=Strategy(**base, stage_layers=[3, 4, 4, 5, 4, 4, 4, 4]))  # rank 0 7, rank 3 9 layers
    assert b.valid and b.step_time_s == pytest.approx(a.step_time_s, rel=1e-12)
    assert c.valid and c.step_time_s > a.step_time_s  # rank 3 (9 layers and the output layer) binds


# ---- validation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,message", [
    (dict(pp=4, vpp=2, stage_layers=[4] * 7), r"stage_layers \[4, 4, 4, 4, 4, 4, 4\] must list a positive layer "
                                               r"count for each of the pp \(4\) stages, or a count >= 0 for each of "
                                               r"the pp·vpp \(8\) virtual stages"),
    (dict(pp=4, stage_layers=[4, 4, 0, 4]), r"stage_layers \[4, 4, 0, 4\] must list a positive layer count for each "
                                            r"of the pp \(4\) stages$"),
    (dict(pp=2, vpp=2, stage_layers=[4, 0, 4, 0]), r"one count per virtual stage \(pp·vpp = 2·2\) must list layer "
                                                   r"counts >= 0 that give each of the pp \(2\) stages at least one"),
    (dict(pp=2, vpp=2, stage_layers=[4, -1, 4, 1]), r"stage_layers \[4, -1, 4, 1\] with one count per virtual stage"),
])
def test_bad_splits_are_refused_naming_the_field_and_the_rule(fields, message):
    with pytest.raises(SpecError, match=message):
        Strategy(**fields)


def test_an_empty_virtual_stage_is_allowed_as_megatron_allows_it():
    st = Strategy(pp=2, vpp=2, stage_layers=[4, 0, 4, 8])
    lay = layout(st, 16)
    assert bool(lay.split_ok()[0]) and lay.layers_per_stage() == [8, 8]


@pytest.mark.parametrize("fields,num_layers", [(dict(pp=4, vpp=4, stage_layers=BRIDGE), 62),  # sums to 61
                                               (dict(pp=4, vpp=2, stage_layers=[5, 10, 12, 5]), 32)])  # 5 % 2
def test_the_rules_reject_a_split_that_does_not_add_up(fields, num_layers):
    lay = layout(Strategy(**fields), num_layers)
    assert not bool(lay.split_ok()[0])
    assert lay.split_message().startswith(f"stage_layers {fields['stage_layers']} must give each of the pp")
    assert "pp·vpp" in lay.split_message()


def test_strategy_arrays_keep_zero_counts_and_the_form():
    """-1 pads the table, so a trailing empty virtual stage survives a round trip and a pp-length
    split next to a pp·vpp one keeps its meaning."""
    sts = [Strategy(dp=1, pp=2, vpp=2, stage_layers=[8, 8, 16, 0]), Strategy(dp=1, pp=2, vpp=2, stage_layers=[16, 16]),
           Strategy(dp=1, pp=2)]
    arrays = StrategyArrays.from_strategies(sts)
    assert [arrays.row(i)["stage_layers"] for i in range(3)] == [[8, 8, 16, 0], [16, 16], None]
    lay = ParallelLayout.of(arrays, 32)
    assert [lay.layers_per_chunk(i) for i in range(3)] == [[8, 8, 16, 0], [8, 8, 8, 8], [16, 16]]
    assert [lay.layers_per_stage(i) for i in range(3)] == [[24, 8], [16, 16], [16, 16]]
    both = StrategyArrays.concat([arrays.take([0]), StrategyArrays.from_strategies([Strategy(dp=1, pp=4)])])
    assert both.row(1)["stage_layers"] is None and both.row(0)["stage_layers"] == [8, 8, 16, 0]


# ---- the search space -----------------------------------------------------------------------------------
def test_one_per_virtual_stage_constraint_is_a_split_for_every_pp_dividing_it():
    key = _pipeline_key(normalise_constraints({"stage_layers": BRIDGE}))
    found = {pp: [(s[0], s[3]) for s in _pipeline_splits(61, pp, key)] for pp in (2, 4, 8, 16)}
    assert found == {2: [(8, tuple(BRIDGE))], 4: [(4, tuple(BRIDGE))], 8: [(2, tuple(BRIDGE))],
                     16: [(1, tuple(BRIDGE))]}
    only = _pipeline_key(normalise_constraints({"stage_layers": BRIDGE, "vpp": 2}))
    assert [s[0] for s in _pipeline_splits(61, 4, only)] == [1]  # kept for the rules to reject


def test_constraint_values_are_checked():
    with pytest.raises(SpecError, match=r"constraint stage_layers=\[0, 0\] must be a list of layer counts >= 0 "
                                        r"\(at least one positive\)"):
        normalise_constraints({"stage_layers": [0, 0]})


# ---- DeepSeek-V3 on Megatron-Bridge's layout -------------------------------------------------------------
@pytest.fixture(scope="module")
def dsv3_pp4_vp4():
    st = Strategy(pp=4, vpp=4, ep=64, stage_layers=BRIDGE, zero_stage=1, micro_batch_size=1, recompute="full")
    return evaluate(*DSV3, strategy=st, precision="fp8", moe_load_imbalance=1.0)


def test_deepseek_v3_bridge_layout_costs_and_fits(dsv3_pp4_vp4):
    est = dsv3_pp4_vp4
    assert est.valid and est.fits, est.reasons
    assert np.isfinite(est.step_time_s) and est.step_time_s > 0
    assert est.bubble_fraction == pytest.approx(3 / (4 * est.num_microbatches))
    assert est.binding_pipeline_rank == 0  # 16 layers and the most (micro-batch, chunk) pairs in flight


def test_deepseek_v3_bridge_layout_balances_the_mtp_rank():
    """Megatron-Bridge's layout gives the rank with the MTP layer and the loss 13 layers; the even-ish
    first=14/last=15 split of the same pp 4 without interleaving loads that rank with 15 + MTP and is slower."""
    common = dict(pp=4, ep=64, zero_stage=1, micro_batch_size=1, recompute="full")
    bridge = evaluate(*DSV3, strategy=Strategy(vpp=1, stage_layers=[16, 16, 16, 13], **common), precision="fp8")
    heavy = evaluate(*DSV3, strategy=Strategy(num_layers_in_first_stage=14, num_layers_in_last_stage=15, **common),
                     precision="fp8")
    assert bridge.step_time_s < heavy.step_time_s


def test_a_search_constrained_to_the_layout_returns_it():
    result = plan(*DSV3, precision="fp8", top_k=1, headroom=0.0,
                  constraints={"pp": 4, "vpp": 4, "ep": 64, "stage_layers": BRIDGE, "micro_batch_size": 1,
                               "zero_stage": 1})
    best = (result.plans or result.closest)[0].strategy
    assert best.stage_layers == BRIDGE and best.vpp == 4
    assert best.split_label() == "split=" + ",".join(map(str, BRIDGE))


# ---- CLI ------------------------------------------------------------------------------------------------
def test_cli_evaluate_takes_one_count_per_virtual_stage(capsys):
    args = ["evaluate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "32", "--global-batch-size", "128",
            "--seq-len", "4096", "--tp", "2", "--pp", "4", "--vpp", "2", "--stage-layers", "3,5,6,2,3,5,6,2",
            "--format", "json"]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err
    import planner  # the CLI's evaluate chooses the settings left free, as the API's does

    direct = planner.evaluate("llama3-8b", "dgx-h100", 32, 128, 4096,
                              strategy=Strategy(tp=2, pp=4, vpp=2, stage_layers=[3, 5, 6, 2, 3, 5, 6, 2]))
    assert json.loads(out) == direct.model_dump(mode="json")
    code = main(args[:-2] + ["--stage-layers", "3,5,6,2,3,5,6"])
    _, err = capsys.readouterr()
    assert code == 2 and "or a count >= 0 for each of the pp·vpp (8) virtual stages" in err and "Traceback" not in err
