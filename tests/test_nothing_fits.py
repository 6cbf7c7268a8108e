"""Nothing fits and nothing valid: closest plans by how far they miss, distinct, advice from the
memory breakdown, the smallest GPU count that fits, and 0 valid strategies counted by rule
(issue #10, part 3)."""

from __future__ import annotations

import json

import pytest

from planner import plan
from planner.advice import memory_floor_gpus
from planner.cli import main

NO_FIT = dict(model="llama3.1-405b", cluster="dgx-a100-40gb", num_gpus=8, global_batch_size=8, seq_len=8192)


@pytest.fixture(scope="module")
def no_fit():
    return plan(**NO_FIT)


def test_closest_are_ranked_by_how_far_they_miss_and_distinct(no_fit):
    assert no_fit.plans == [] and len(no_fit.closest) >= 2
    limit = 0.95 * no_fit.closest[0].estimate.memory_capacity_bytes
    misses = [(p.estimate.peak_memory_bytes - limit) / limit for p in no_fit.closest]
    assert misses == sorted(misses)
    keys = [(p.strategy.model_dump(exclude={"zero_stage"}), round(p.estimate.peak_memory_bytes)) for p in no_fit.closest]
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == len(keys)  # no rows differing only in ZeRO stage
    assert all(p.folded is None or len(p.folded.zero_stages) >= 2 for p in no_fit.closest)


def test_smallest_gpu_count_is_searched_and_really_fits(no_fit):
    n = no_fit.min_gpus_to_fit
    assert n is not None and n % 8 == 0 and n > 8
    assert plan(**NO_FIT | {"num_gpus": n}, top_k=1).plans
    below = [m for m in range(16, n, 8)]
    # every node multiple below it was tried, or holds too little memory for the gradients and weights
    floor = memory_floor_gpus(no_fit.model, no_fit.train, no_fit.cluster, no_fit.headroom)
    assert set(m for m in below if m >= floor) <= set(no_fit.min_gpus_searched)
    assert not plan(**NO_FIT | {"num_gpus": below[-1]}, top_k=1).plans
    skipped = [m for m in below if m < floor]
    assert skipped and not any(m in no_fit.min_gpus_searched for m in skipped)
    assert not plan(**NO_FIT | {"num_gpus": skipped[-1]}, top_k=1).plans  # the floor skips only what cannot fit
    assert any(f"needs at least {n:,} GPUs" in a for a in no_fit.advice)


def test_advice_names_the_binding_term_and_never_a_knob_at_its_limit():
    from planner.advice import advice_for

    # activations bind and recompute is kept off by a constraint: the advice names that constraint
    r = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=1, global_batch_size=8, seq_len=131072,
             constraints={"recompute": "none"})
    assert not r.plans
    assert r.advice[0].startswith("binding term: activations")
    assert any("recompute=none keeps the search from it" in a for a in r.advice)
    assert any("needs at least" in a for a in r.advice)
    # the same breakdown with recompute already full (every layer): recomputation is never advised
    near = r.closest[0]
    full = near.model_copy(update={"strategy": near.strategy.model_copy(update={"recompute": "full"})})
    advice = advice_for(full, {"recompute": "full"}, 0.05, None, [])
    assert advice[0].startswith("binding term: activations")
    assert not any("recompute" in a for a in advice)
    # a knob outside the search that is at its limit is not advised either (bf16 gradients already)
    assert not any("bf16 gradients" in a for a in advice)


def test_advice_names_activation_offloading_only_where_megatron_can_run_it():
    from planner.advice import advice_for

    # offloading kept off by a constraint, activations binding, pp 1 and no recompute: offloading is advised
    r = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=1, global_batch_size=8, seq_len=131072,
             constraints={"recompute": "none", "offload_activation_layers": None})
    assert not r.plans and r.advice[0].startswith("binding term: activations")
    named = "the constraint offload_activation_layers=None keeps the search from it"
    assert any("activation offloading" in a and named in a for a in r.advice)
    near = r.closest[0]
    cons = {"offload_activation_layers": None}

    def advised(p) -> bool:
        return any("activation offloading" in a for a in advice_for(p, cons, 0.05, None, []))

    assert advised(near)
    strategy, train = near.strategy, near.train
    # not where Megatron cannot offload: recomputation, pipeline stages, another framework, every layer but one
    for update in ({"strategy": strategy.model_copy(update={"recompute": "selective"})},
                   {"strategy": strategy.model_copy(update={"pp": 2})},
                   {"strategy": strategy.model_copy(update={"offload_activation_layers": near.model.num_layers - 1})},
                   {"train": train.model_copy(update={"framework": "torchtitan"})}):
        assert not advised(near.model_copy(update=update)), update


@pytest.mark.parametrize("args,rule", [
    (["--model", "llama3-8b", "--gpus", "1000000000", "--global-batch-size", "64"], "batch"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "64", "-C", "ep=8"], "ep_dense"),
])
def test_zero_valid_strategies_names_the_rule_and_exits_2(capsys, args, rule):
    code = main(["plan", "--cluster", "dgx-h100", "--seq-len", "4096", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert "0 valid strategies" in err and f"{rule}:" in err
    assert "memory" not in err and "Traceback" not in err


def test_zero_valid_in_python_counts_rejections_by_rule():
    r = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=64, seq_len=4096,
             constraints={"ep": 8})
    assert r.plans == [] and r.closest == [] and r.stats.num_valid == 0
    assert r.rejections and r.rejections[0].rule == "ep_dense"
    assert sum(x.count for x in r.rejections) == r.stats.num_candidates
    assert "dense" in r.rejections[0].example


def test_no_fit_cli_prints_advice_and_exits_1(capsys):
    code = main(["plan", "--model", "llama3.1-405b", "--cluster", "dgx-a100-40gb", "--gpus", "8",
                 "--global-batch-size", "8", "--seq-len", "8192"])
    err = capsys.readouterr().err
    assert code == 1
    assert "binding term: optimizer" in err and "needs at least" in err and "5% safety margin" in err
