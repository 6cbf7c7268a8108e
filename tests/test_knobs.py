"""The settings vendors' recipes turn, chosen by the planner when the input leaves them free (planner.knobs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cost_models import evaluate_arrays
from cost_models.arrays import StrategyArrays
from planner import SpecError, evaluate, plan
from planner.calibrate import run_settings
from planner.cli import main
from planner.knobs import FREE_KNOBS, choose
from planner.rules import Context, check
from planner.space import enumerate_space
from profiles import load_cluster, load_model

FP8 = dict(model="llama3.1-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=64, seq_len=4096, precision="fp8")
sys.path.insert(0, str(Path(__file__).parent / "emit"))  # emit_checks: the real frameworks' config checks
QWEN = dict(model="qwen3-30b-a3b", cluster="gb200-nvl72", num_gpus=8, global_batch_size=256, seq_len=4096,
            precision="fp8", fp8_recipe="mxfp8")


def test_free_settings_are_the_recipes_and_fp8_gather_follows_the_zero_stage():
    plans = [p for zero in (0, 1, 3) for p in plan(**FP8, top_k=5, constraints={"zero_stage": zero}).plans]
    assert {p.strategy.zero_stage for p in plans} == {0, 1, 3}
    for p in plans:
        t = p.train
        assert t.grad_precision == "bf16" and t.cross_entropy_fusion_impl == "te"
        # Megatron's --fp8-param-gather needs the distributed optimizer or Megatron-FSDP
        assert t.fp8_param_gather == (p.strategy.zero_stage >= 1)
        assert p.estimate.settings["grad_precision"] == "bf16"


def test_given_settings_are_kept_and_not_listed_as_chosen():
    r = plan(**FP8, top_k=5, grad_precision="fp32", fp8_param_gather=False, cross_entropy_fusion_impl="native")
    for p in r.plans:
        assert (p.train.grad_precision, p.train.fp8_param_gather, p.train.cross_entropy_fusion_impl) == \
            ("fp32", False, "native")
        assert not {"grad_precision", "fp8_param_gather", "cross_entropy_fusion_impl"} & set(p.estimate.settings)


def test_chosen_settings_are_never_slower_than_the_framework_defaults():
    free = plan(**FP8, top_k=1, headroom=0.0, ranking="fastest").plans[0].estimate.step_time_s
    pinned = plan(**FP8, top_k=1, headroom=0.0, ranking="fastest", **run_settings({})).plans[0].estimate.step_time_s
    assert free <= pinned


def test_strict_numerics_keeps_the_defaults_and_refuses_asking_for_them():
    r = plan(**FP8, top_k=3, strict_numerics=True)
    for p in r.plans:
        assert p.train.grad_precision == "fp32" and not p.train.fp8_param_gather
        assert "grad_precision" not in p.estimate.settings
    with pytest.raises(SpecError, match="grad_precision 'bf16' changes the numerics"):
        plan(**FP8, strict_numerics=True, grad_precision="bf16")
    with pytest.raises(SpecError, match="strict_numerics must be true or false"):
        plan(**FP8, strict_numerics="yes")


def test_cli_strict_numerics_conflict_is_one_line_and_exit_2(capsys):
    code = main(["plan", "--model", "llama3.1-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size",
                 "64", "--seq-len", "4096", "--precision", "fp8", "--fp8-param-gather", "--strict-numerics"])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == ["error: fp8_param_gather True changes the numerics, which strict_numerics "
                                        "forbids (drop strict_numerics, or fp8_param_gather False)"]


def test_cli_table_says_which_settings_were_chosen(capsys):
    code = main(["plan", "--model", "llama3.1-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size",
                 "64", "--seq-len", "4096", "--precision", "fp8", "--top", "3"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "settings chosen (not given" in out and "gradients reduced in bf16" in out


def test_fp8_param_gather_asked_for_refuses_zero_0_plans():
    r = plan(**FP8, fp8_param_gather=True, constraints={"zero_stage": [0, 1]}, top_k=20)
    assert r.plans and all(p.strategy.zero_stage == 1 for p in r.plans)
    assert r.stats.rejected.get("fp8_param_gather", 0) > 0
    est = evaluate(**FP8, fp8_param_gather=True, strategy={"zero_stage": 0})
    assert not est.valid and any("fp8_param_gather needs zero_stage >= 1" in m for m in est.reasons)


def test_moe_dispatcher_is_searched_where_the_gpu_has_flex_dispatchers():
    r = plan(**QWEN, top_k=10, ranking="fastest", headroom=0.0)
    dispatchers = {p.train.moe_dispatcher for p in r.plans}
    assert dispatchers - {"alltoall"}
    fixed = plan(**QWEN, top_k=1, ranking="fastest", headroom=0.0, moe_dispatcher="alltoall")
    assert r.plans[0].estimate.step_time_s <= fixed.plans[0].estimate.step_time_s
    best = r.plans[0]
    if best.train.moe_dispatcher == "hybridep":
        assert best.train.moe_flex_num_sms == 32  # the recipes' SMs
    # an A100 has no measured flex dispatcher: alltoall only
    a100 = plan(**(QWEN | {"cluster": "dgx-a100-80gb", "precision": "bf16", "fp8_recipe": "delayed"}), top_k=5)
    assert {p.train.moe_dispatcher for p in a100.plans} == {"alltoall"}


def _brute_force_best(question: dict, top: int = 1) -> float:
    """The fastest fitting step time over every candidate, every dispatcher and the all-to-all overlap on and off,
    each scored in full (no pruning)."""
    model, cluster = load_model(question["model"]), load_cluster(question["cluster"])
    from planner.api import make_inputs

    _, _, train = make_inputs(model, cluster, question["num_gpus"], question["global_batch_size"],
                              question["seq_len"], question["precision"], fp8_recipe=question["fp8_recipe"])
    knobs = choose(train, model, cluster.gpu)
    space = enumerate_space(model, knobs.base, question["num_gpus"], {"offload_optimizer": False,
                                                                      "offload_activation_layers": None})
    best = np.inf
    for overlap in (False, True):
        cand = StrategyArrays.concat([space])
        cand.overlap_moe_comm[:] = overlap
        valid, _ = check(Context(model, knobs.base, question["num_gpus"], cluster), cand)
        cand = cand.take(np.flatnonzero(valid))
        base = knobs.assign(cand)
        for shift in range(len(knobs.dispatchers)):
            for graphs in (False, True):
                variant = base + shift
                if graphs:
                    ok = np.flatnonzero(knobs.graph_ok(cand))
                    sub, variant = cand.take(ok), knobs.with_graphs(variant[ok])
                else:
                    sub = cand
                for v in np.unique(variant):
                    part = sub.take(np.flatnonzero(variant == v))
                    costs = evaluate_arrays(model, cluster, knobs.trains[int(v)], part)
                    fit = costs.step_time_s[costs.fits]
                    if len(fit):
                        best = min(best, float(fit.min()))
    return best


@pytest.mark.slow
def test_pruned_knob_search_finds_the_brute_force_best():
    """The search re-scores another dispatcher, the overlap and graphs only where they could win (planner.search);
    on this question that prunes nothing that matters: its best is every variant's best, scored in full."""
    question = QWEN | {"global_batch_size": 64}
    searched = plan(**question, top_k=1, ranking="fastest", headroom=0.0,
                    constraints={"offload_optimizer": False, "offload_activation_layers": None})
    assert searched.plans[0].estimate.step_time_s == pytest.approx(_brute_force_best(question), rel=1e-9)


def test_published_runs_keep_the_framework_defaults():
    pinned = run_settings({"grad_precision": "bf16"})
    assert pinned["grad_precision"] == "bf16" and set(FREE_KNOBS) <= set(pinned)
    assert pinned["moe_dispatcher"] == "alltoall" and pinned["fp8_param_gather"] is False
    assert pinned["cuda_graph_impl"] == "none"


def test_cuda_graphs_take_host_time_off_a_host_bound_moe_step_and_hold_buffers():
    strategy = {"ep": 8, "zero_stage": 1, "micro_batch_size": 4}
    common = QWEN | {"global_batch_size": 512, "strategy": strategy}
    off = evaluate(**common, **run_settings({"moe_dispatcher": "hybridep"}))
    on = evaluate(**common, **run_settings({"moe_dispatcher": "hybridep", "cuda_graph_impl": "transformer_engine",
                                            "cuda_graph_scope": ["attn", "moe_router", "moe_preprocess"]}))
    assert on.step_time_s < off.step_time_s
    assert on.memory_bytes["cuda_graph_buffers"] > 0 == off.memory_bytes["cuda_graph_buffers"]
    # a GPU-bound dense step gains nothing and pays the buffers
    dense = dict(model="llama3.1-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=64, seq_len=4096,
                 strategy={"zero_stage": 1})
    d_off = evaluate(**dense, **run_settings({}))
    d_on = evaluate(**dense, **run_settings({"cuda_graph_impl": "transformer_engine",
                                             "cuda_graph_scope": ["attn", "mlp"]}))
    assert d_on.step_time_s == d_off.step_time_s and d_on.peak_memory_bytes > d_off.peak_memory_bytes


def test_cuda_graph_settings_megatron_core_refuses_are_refused():
    with pytest.raises(SpecError, match="dropless experts cannot be captured"):
        evaluate(**QWEN, cuda_graph_impl="transformer_engine")
    with pytest.raises(SpecError, match="moe_preprocess with the alltoall dispatcher"):
        evaluate(**QWEN, cuda_graph_impl="transformer_engine", moe_dispatcher="alltoall",
                 moe_router_padding_for_quantization=True, cuda_graph_scope=["attn", "moe_router", "moe_preprocess"])
    with pytest.raises(SpecError, match="router scopes need an MoE model"):
        evaluate(**FP8, cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe_router"])
    with pytest.raises(SpecError, match="cuda_graph_impl 'local' is Megatron's"):
        evaluate(**FP8, cuda_graph_impl="local", framework="torchtitan")
    est = evaluate(**FP8, cuda_graph_impl="transformer_engine", strategy={"zero_stage": 1, "recompute": "full"})
    assert not est.valid and any("no full recompute" in m for m in est.reasons)


def test_cuda_graphs_are_emitted_for_megatron_and_refused_elsewhere():
    pytest.importorskip("megatron.core")
    from emit_checks import check_megatron
    from planner.emit import EmitOptions, NotExpressibleError, get_emitter
    from planner.emit.megatron import megatron_args

    r = plan(**FP8, top_k=1, cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "mlp"])
    best = r.plans[0]
    args = megatron_args(best)
    text = " ".join(args)
    assert "--cuda-graph-impl transformer_engine" in text and "--cuda-graph-scope attn mlp" in text
    check_megatron(best, args)  # megatron-core's TransformerConfig takes them
    with pytest.raises(NotExpressibleError, match="not emitted with megatron-core's CUDA graphs"):
        get_emitter("torchtitan").data(best, EmitOptions())


def test_bridge_emit_searches_with_the_settings_its_recipe_imposes(capsys):
    code = main(["emit", "--backend", "megatron-bridge", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus",
                 "64", "--global-batch-size", "128", "--seq-len", "8192", "--precision", "fp8", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    overrides = json.loads(out)["overrides"]
    assert "ddp.grad_reduce_in_fp32=true" in overrides  # the FP8 recipe reduces in fp32
    assert "mixed_precision=bf16_with_fp8_delayed_scaling_mixed" in overrides


def test_evaluate_flags_reproduce_a_plan_with_the_overlap_and_recompute_modules(capsys):
    """The plan table's `a2a-ovl` and `selective(a+b)` cells are typed back as --overlap-moe-comm and
    --recompute-modules, and evaluate reproduces the plan with its settings given."""
    question = QWEN | {"global_batch_size": 512}
    strategy = {"ep": 8, "zero_stage": 1, "micro_batch_size": 4, "overlap_moe_comm": True, "recompute": "selective",
                "recompute_modules": ["moe_act", "layernorm"]}
    settings = run_settings({"moe_dispatcher": "hybridep"})
    direct = evaluate(**question, strategy=strategy, **settings)
    code = main(["evaluate", "--model", "qwen3-30b-a3b", "--cluster", "gb200-nvl72", "--gpus", "8",
                 "--global-batch-size", "512", "--seq-len", "4096", "--precision", "fp8", "--fp8-recipe", "mxfp8",
                 "--ep", "8", "--zero", "1", "--mbs", "4", "--overlap-moe-comm", "--recompute", "selective",
                 "--recompute-modules", "moe_act+layernorm", "--moe-dispatcher", "hybridep", "--moe-flex-num-sms", "16",
                 "--grad-precision",
                 "fp32", "--no-fp8-param-gather", "--cross-entropy-fusion-impl", "native",
                 "--no-router-padding", "--cuda-graph-impl", "none", "--format", "json"])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    assert json.loads(out)["step_time_s"] == pytest.approx(direct.step_time_s, rel=1e-12)
    code = main(["evaluate", "--model", "qwen3-30b-a3b", "--cluster", "gb200-nvl72", "--gpus", "8",
                 "--global-batch-size", "512", "--seq-len", "4096", "--ep", "8", "--recompute", "selective",
                 "--recompute-modules", "moe_act,bogus"])
    _, err = capsys.readouterr()
    assert code == 2 and "recompute_modules" in err and "Traceback" not in err
