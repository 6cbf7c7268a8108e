"""MoE layers and expert parallelism in the executor (issue 8, part 7).

Single process: the MoE layer's parameters, routing and token permutation. Real
gloo runs: ep = 2 folded over dp = 2 and dp = 4 (edp = 2) match the
single-process loss and step-1 gradient norms, and a wrong expert-gradient
reduction fails parity although its loss change passes.
"""

from __future__ import annotations

import json

import pytest
import yaml

torch = pytest.importorskip("torch")

from executor_fixtures import TINY, TINY_MOE, TRAIN  # noqa: E402

from cost_models.params import expert_params, num_params
from executors.launcher import launch, launch_reference  # noqa: E402
from executors.model import build_model  # noqa: E402
from executors.moe import MoE, expert_parameters  # noqa: E402
from executors.results import RunConfig  # noqa: E402
from executors.support import executed_model, unsupported_reasons  # noqa: E402
from executors.validate import GRAD_NORM_TOLERANCES, PARITY_TOLERANCES  # noqa: E402
from planner.specs import ModelSpec, Strategy  # noqa: E402

TIMEOUT_S = 120.0
MOE_VARIANTS = {
    "tiny-moe": TINY_MOE,
    "biases-plain-mlp-every-2nd": ModelSpec(**(TINY_MOE.model_dump() | {
        "num_layers": 4, "gated_mlp": False, "moe_first_k_dense": 0, "moe_layer_freq": 2, "moe_router_bias": True,
        "moe_expert_bias": True, "num_shared_experts": 2, "shared_expert_ffn_hidden_size": 32})),
    "explicit-dense-layers": ModelSpec(**(TINY_MOE.model_dump() | {"moe_first_k_dense": 0, "moe_dense_layers": [1],
                                                                   "num_shared_experts": 0})),
}


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_moe_parameter_count_and_layer_pattern_match_the_spec(name):
    spec = MOE_VARIANTS[name]
    model = build_model(spec, seq_len=32, seed=0)
    assert sum(p.numel() for p in model.parameters()) == num_params(spec)
    assert tuple(isinstance(layer.mlp, MoE) for layer in model.layers.values()) == spec.moe_layer_mask()
    experts = sum(p.numel() for p in expert_parameters(model))
    assert experts == expert_params(spec)


def test_moe_output_is_the_weighted_sum_of_the_top_k_experts():
    """The sort / split / unsort of the routed tokens against a per-token loop."""
    torch.manual_seed(0)
    moe = MoE(TINY_MOE)
    x = torch.randn(3, 5, TINY_MOE.hidden_size)
    y = moe(x)
    tokens = x.reshape(-1, TINY_MOE.hidden_size)
    weights, chosen = moe.route(tokens)
    assert torch.allclose(weights.sum(-1), torch.ones(len(tokens)))
    probs = torch.softmax(moe.router(tokens), dim=-1)  # Mixtral: softmax, top-k, renormalise
    assert torch.equal(chosen, probs.topk(2, dim=-1).indices)
    expected = torch.stack([
        sum(w * moe.experts[str(int(e))](t) for w, e in zip(weights[i], chosen[i])) + moe.shared(t)
        for i, t in enumerate(tokens)])
    assert torch.allclose(y.reshape(-1, TINY_MOE.hidden_size), expected, atol=1e-6)


def test_expert_parallel_keeps_a_contiguous_block_of_the_seeded_experts():
    full = build_model(TINY_MOE, 32, seed=5)
    part = build_model(TINY_MOE, 32, seed=5)
    for layer in part.layers.values():
        if isinstance(layer.mlp, MoE):
            layer.mlp.enable_expert_parallel(2, 1, group=None)
    moe_full, moe_part = full.layers["1"].mlp, part.layers["1"].mlp
    assert list(moe_part.experts.keys()) == ["2", "3"]
    for name in ("2", "3"):
        assert all(torch.equal(a, b) for a, b in zip(moe_full.experts[name].parameters(),
                                                     moe_part.experts[name].parameters()))
    assert sum(p.numel() for p in expert_parameters(part)) == expert_params(TINY_MOE) // 2


@pytest.mark.parametrize("st, words", [
    (Strategy(dp=2, ep=2), []),
    (Strategy(dp=4, ep=2), []),
    (Strategy(dp=2, ep=2, zero_stage=1), ["zero_stage (1) > 0 with ep (2)"]),
    (Strategy(dp=2, tp=2, ep=2, sequence_parallel=True), ["tp (2) > 1 with MoE layers"]),
    (Strategy(dp=2, ep=2, etp=2), ["etp (2) > 1"]),
    (Strategy(dp=3, ep=3), ["ep (3) must divide num_experts (4)"]),
    (Strategy(dp=2, pp=2, ep=2, micro_batch_size=1), ["pp (2) / cp (1) > 1 with ep (2)"]),
])
def test_support_names_the_field_the_rule_and_the_value(st, words):
    reasons = unsupported_reasons(TINY_MOE, TRAIN, st.resolve(st.num_gpus))
    assert all(any(w in r for r in reasons) for w in words), reasons
    assert bool(reasons) == bool(words), reasons


def test_ep_needs_an_moe_model_and_mtp_is_not_built():
    assert any("needs an MoE model" in r for r in unsupported_reasons(TINY, TRAIN, Strategy(dp=2, ep=2).resolve(2)))
    built, notes = executed_model(TINY_MOE.model_copy(update={"num_mtp_layers": 1}), Strategy(dp=2, ep=2))
    assert built.num_mtp_layers == 0 and any("multi-token prediction" in n for n in notes)


# ---- real runs (gloo) --------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    cfg = RunConfig(label="ref", model=TINY_MOE, train=TRAIN, strategy=Strategy(dp=1), num_gpus=1,
                    timeout_s=TIMEOUT_S)
    ref, error = launch_reference(cfg, tmp_path_factory.mktemp("moe-reference"))
    assert ref is not None, error
    assert set(ref.grad_sq_norms) == {"dense", "experts"} and ref.grad_sq_norms["experts"] > 0
    return ref


def _run(st: Strategy, num_gpus: int, reference, run_dir, fault: str = "none"):
    st = st.resolve(num_gpus)
    assert unsupported_reasons(TINY_MOE, TRAIN, st) == []
    rtol, update_rtol = PARITY_TOLERANCES[TRAIN.precision]
    cfg = RunConfig(label=st.short(), model=TINY_MOE, train=TRAIN, strategy=st, num_gpus=num_gpus, warmup_steps=1,
                    timed_steps=1, timeout_s=TIMEOUT_S, parity_rtol=rtol, update_rtol=update_rtol,
                    grad_rtol=GRAD_NORM_TOLERANCES[TRAIN.precision], fault=fault)
    return launch(cfg.with_reference(reference), run_dir)


@pytest.mark.executor
def test_ep2_over_dp4_matches_the_reference(tmp_path, moe_reference):
    """Four ranks, ep groups {0, 1} and {2, 3}, expert-data-parallel groups {0, 2} and {1, 3}."""
    result = _run(Strategy(dp=4, ep=2, micro_batch_size=2), 4, moe_reference, tmp_path)
    assert result.outcome == "ok", f"{result.reason}\n{result.stderr_tail}"
    assert result.parity.passed and result.parity.grad_rel_error is not None
    assert len(result.ranks) == 4 and result.step_time_s > 0 and result.peak_memory_bytes > 0
    dense = num_params(TINY_MOE) - expert_params(TINY_MOE)
    assert {r.num_params_local for r in result.ranks} == {dense + expert_params(TINY_MOE) // 2}


@pytest.mark.executor
def test_expert_gradients_reduced_like_dense_ones_fail_parity(tmp_path, moe_reference):
    """Expert gradients all-reduced over the whole dp group (as DDP would) add the gradient of
    expert e on one ep rank to that of expert e + 2 on the other: the update is wrong, but
    nearly orthogonally to the gradient, so the loss change stays within its tolerance; the
    step-1 gradient norms catch it (experts' |g|² about doubled)."""
    result = _run(Strategy(dp=2, ep=2), 2, moe_reference, tmp_path, fault="expert_grad_dense")
    assert result.outcome == "wrong", f"{result.outcome}: {result.reason}\n{result.stderr_tail}"
    assert result.step_time_s is None and "squared gradient norms" in result.reason
    parity = result.parity
    assert parity.update_rel_error < parity.update_rtol  # the loss alone would not have caught it
    assert parity.grad_rel_error > 0.5  # first order: 1 (the experts' |g|² doubles)


@pytest.mark.executor
def test_validate_reports_predicted_and_measured_for_ep2(tmp_path):
    """`meshplan validate` on the local-cpu profile: the planner's best ep = 2 plan runs, passes
    parity, and its predicted step time and memory (with the all-to-all term) sit next to the
    measured ones."""
    import io
    from contextlib import redirect_stdout

    from planner.cli import main

    model_yaml = tmp_path / "tiny-moe.yaml"
    model_yaml.write_text(yaml.safe_dump(TINY_MOE.model_dump()))
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["validate", "--model", str(model_yaml), "--cluster", "local-cpu", "--gpus", "2",
                     "--global-batch-size", str(TRAIN.global_batch_size), "--seq-len", str(TRAIN.seq_len),
                     "--precision", "fp32", "--top", "1", "-C", "ep=2", "-C", "zero_stage=0", "--warmup", "1",
                     "--steps", "2", "--device", "cpu", "--work-dir", str(tmp_path / "runs"), "--format", "json"])
    assert code == 0, out.getvalue()
    (c,) = json.loads(out.getvalue())["comparisons"]
    assert c["strategy"]["ep"] == 2 and " ep2 " in c["label"]
    assert c["outcome"] == "ok" and c["parity"]["passed"] and c["parity"]["grad_rel_error"] is not None
    assert c["predicted_step_time_s"] > 0 and c["measured_step_time_s"] > 0 and c["time_s"]["ep_comm"] > 0
    assert c["predicted_memory_bytes"] > 0 and c["measured_memory_bytes"] > 0
    assert c["step_time_error"] is not None and c["memory_error"] is not None


def test_the_megatron_engine_refuses_moe_models_instead_of_building_them_dense():
    from executors.validate import engine_config

    emitted, why = engine_config("megatron", TINY_MOE, None, TRAIN, 2, Strategy(dp=2, ep=2).resolve(2), None)
    assert emitted is None and "num_experts (4)" in why and "torch engine" in why
