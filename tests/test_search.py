"""plan()/evaluate() contract, constraints, rejections and bad input."""

from __future__ import annotations

import pytest

from cost_models.layout import ParallelLayout
from planner.calibrate import run_settings
from planner import Estimate, PlanResult, SpecError, Strategy, evaluate, plan
from planner.ranking import TIE_FRACTION

Q = dict(model="llama3-8b", cluster="dgx-h100", num_gpus=16, global_batch_size=64, seq_len=4096)


def test_plan_contract_fields():
    result = plan(**Q, top_k=3)
    assert isinstance(result, PlanResult)
    assert 1 <= len(result.plans) <= 3
    assert [p.rank for p in result.plans] == list(range(1, len(result.plans) + 1))
    # fastest first, except that near-ties go to the simpler layout (planner.ranking)
    best = plan(**Q, top_k=100).plans
    fastest = min(p.estimate.step_time_s for p in best)
    assert result.plans[0].estimate.step_time_s <= fastest * (1 + TIE_FRACTION)
    est = result.plans[0].estimate
    for field in ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu",
                  "hardware_tflops_per_gpu", "mfu", "peak_memory_bytes", "memory_bytes", "time_s", "fits", "reasons"):
        assert hasattr(est, field)
    assert {"params", "grads", "optimizer", "activations"} <= set(est.memory_bytes)
    assert {"compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "pp_bubble", "dp_comm",
            "optimizer"} <= set(est.time_s)
    assert est.fits and not est.reasons
    assert est.tokens_per_s == pytest.approx(64 * 4096 / est.step_time_s)
    assert est.tokens_per_s_per_gpu == pytest.approx(est.tokens_per_s / 16)
    assert 0 < est.mfu < 1
    s = result.plans[0].strategy
    assert s.dp * s.tp * s.pp * s.cp == 16
    assert result.stats.num_candidates > result.stats.num_valid >= result.stats.num_feasible > 0
    assert result.stats.search_time_s > 0


def test_json_round_trip():
    result = plan(**Q, top_k=2)
    again = PlanResult.model_validate_json(result.model_dump_json())
    assert again == result


def test_constraints_fix_and_restrict():
    result = plan(**Q, constraints={"tp": 2, "pp": [1, 2], "recompute": "selective", "zero_stage": 1}, top_k=50)
    assert result.plans
    for p in result.plans:
        assert p.strategy.tp == 2 and p.strategy.pp in (1, 2)
        assert p.strategy.recompute == "selective" and p.strategy.zero_stage == 1


def test_evaluate_matches_plan():
    best = plan(**Q, top_k=1).plans[0]
    est = evaluate(**Q, strategy=best.strategy)
    assert isinstance(est, Estimate)
    assert est.step_time_s == best.estimate.step_time_s
    assert est.peak_memory_bytes == best.estimate.peak_memory_bytes


def test_evaluate_resolves_auto_dp_and_accepts_a_mapping():
    est = evaluate(**Q, strategy={"tp": 4, "pp": 2, "micro_batch_size": 1, "sequence_parallel": True})
    assert est.fits


def test_invalid_strategy_gets_reasons_not_an_exception():
    est = evaluate(**Q, strategy=Strategy(tp=16))  # llama3-8b has 8 KV heads
    assert not est.fits
    assert any("tp (16) must divide num_kv_heads (8)" in r for r in est.reasons)
    est = evaluate(**Q, strategy=Strategy(tp=2, pp=4, vpp=3))
    assert any("pp·vpp (4·3) must divide num_layers (32)" in r for r in est.reasons)


def test_oversized_strategy_says_by_how_much():
    est = evaluate(model="llama3-70b", cluster="dgx-a100-40gb", num_gpus=8, global_batch_size=8, seq_len=4096,
                   strategy=Strategy(tp=8))
    assert not est.fits
    assert "GiB >" in est.reasons[0] and "by" in est.reasons[0] and "stage" in est.reasons[0]


def test_nothing_fits_returns_closest():
    result = plan(model="llama3.1-405b", cluster="dgx-a100-40gb", num_gpus=8, global_batch_size=8, seq_len=8192)
    assert result.plans == []
    assert result.closest and not result.closest[0].estimate.fits
    assert "GiB" in result.closest[0].estimate.reasons[0]


@pytest.mark.parametrize("kwargs,match", [
    ({"num_gpus": 0}, "num_gpus must be a positive integer"),
    ({"num_gpus": -8}, "num_gpus must be a positive integer"),
    ({"model": "llama3-7b"}, "close matches: .*llama3-8b"),
    ({"cluster": "dgx-a100"}, "unknown cluster preset"),
    ({"global_batch_size": 0}, "global_batch_size"),
    ({"seq_len": -1}, "seq_len"),
])
def test_bad_input_is_a_spec_error(kwargs, match):
    with pytest.raises(SpecError, match=match):
        plan(**(Q | kwargs))


def test_precision_without_peak_is_refused():
    with pytest.raises(SpecError, match="no peak rate for precision 'fp8'"):
        plan(**(Q | {"cluster": "dgx-a100-80gb"}), precision="fp8")


@pytest.mark.parametrize("constraints,match", [
    ({"tensor_parallel": 2}, "unknown constraint field 'tensor_parallel'"),
    ({"tp": 0}, "constraint tp=0 must be an integer between 1 and"),
    ({"zero_stage": 4}, "zero_stage=4 must be an integer 0..3"),
    ({"recompute": "some"}, "recompute='some' must be one of"),
    ({"tp": []}, "allows no value"),
    ({"tp": 3, "pp": 3}, "no strategy has dp·tp·cp·pp equal to the number of GPUs"),
])
def test_impossible_or_malformed_constraints(constraints, match):
    with pytest.raises(SpecError, match=match):
        plan(**Q, constraints=constraints)


def test_long_sequences_use_context_parallelism_when_needed():
    # 128k tokens of Llama-3-8B do not fit one H100 without splitting the sequence.
    result = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=16, global_batch_size=16, seq_len=131072, top_k=5)
    assert result.plans
    assert all(p.strategy.cp * p.strategy.tp > 1 for p in result.plans)


def test_uneven_pipeline_for_405b():
    # 126 layers on pp=16: 8 layers on middle stages, 7 on the first and last (Llama 3 paper, Sec. 3.3.2), whether
    # by first/last-stage counts or by counting the embedding and the loss as layers with interleaving.
    result = plan(model="llama3.1-405b", cluster="dgx-h100", num_gpus=1024, global_batch_size=512, seq_len=8192,
                  constraints={"pp": 16, "tp": 8}, top_k=1)
    s = result.plans[0].strategy
    assert ParallelLayout.of_strategy(s, 126).layers_per_stage() == [7] + [8] * 14 + [7]


def test_module_recompute_twins_are_scored_for_moe_and_latent_attention_only():
    from planner.search import module_recompute_sets
    from profiles import load_model

    from cost_models.arrays import modules_of

    assert module_recompute_sets(load_model("llama3-70b")) == []
    qwen = [modules_of(m) for m in module_recompute_sets(load_model("qwen3-235b-a22b"))]
    assert qwen == [["moe_act"], ["layernorm", "moe_act"]]
    dsv3 = [modules_of(m) for m in module_recompute_sets(load_model("deepseek-v3"))]
    assert ["mla_up_proj"] in dsv3 and ["layernorm", "mla_up_proj", "moe_act"] in dsv3


def test_a_moe_plan_over_the_limit_without_recompute_fits_by_recomputing_modules():
    # tp4 pp8 with two sequences per micro-batch: just over 80 GB without recomputation, under it with the
    # layer norms' and expert activations' recomputation (pp16 vpp2 was the example before the query/key
    # norms' saved inputs were counted; it now needs full recomputation of a layer)
    # the framework's default settings (fp32 gradients, bf16 weight copies): the planner's own choices free
    # enough memory that the plan fits without recomputation
    settings = run_settings({})
    question = dict(model="qwen3-235b-a22b", cluster="dgx-h100", num_gpus=256, global_batch_size=8192, seq_len=4096,
                    precision="fp8", constraints={"tp": 4, "pp": 8, "vpp": 1, "ep": 8, "micro_batch_size": 2,
                                                  "zero_stage": 1, "offload_optimizer": False}, top_k=20, **settings)
    r = plan(**question)
    modules = [p for p in r.plans if p.strategy.recompute_modules]
    assert modules and all(p.strategy.recompute == "selective" for p in modules)
    best = modules[0]
    none = evaluate(best.model, best.cluster, 256, 8192, 4096, precision="fp8",
                    strategy=best.strategy.model_copy(update={"recompute": "none", "recompute_modules": None}),
                    **settings)
    assert not none.fits or none.peak_memory_bytes > 0.95 * none.memory_capacity_bytes  # over the limit without
    assert best.estimate.peak_memory_bytes < none.peak_memory_bytes
    # a recompute constraint is the user's choice: no twins
    fixed = plan(**question | {"constraints": question["constraints"] | {"recompute": ["none", "full"]}})
    assert not any(p.strategy.recompute_modules for p in fixed.plans)
