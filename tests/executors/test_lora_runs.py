"""LoRA plans run for real: peft adapters on the executor's model, 2 CPU ranks (gloo), loss parity with one process.

The adapters' lora_B starts at zero, so step 1 is the base model's loss; the parity steps after it
check that the adapters trained alike (the update moves the loss by 1% by construction of the step size,
and the test checks that it did).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from executor_fixtures import TINY  # noqa: E402

from executors.compare import predicted_adapter_params  # noqa: E402
from executors.launcher import launch, launch_reference  # noqa: E402
from executors.lora import ATTENTION_TARGETS, mlp_targets  # noqa: E402
from planner.specs.adapters import adapted_layers, targets  # noqa: E402
from executors.results import ParityReference, RunConfig, RunResult  # noqa: E402
from executors.support import unsupported_reasons  # noqa: E402
from executors.validate import PARITY_TOLERANCES, engine_reasons, ValidateOptions  # noqa: E402
from planner.specs import ModelSpec, Strategy, TrainSpec  # noqa: E402

pytestmark = pytest.mark.executor
TIMEOUT_S = 120.0
PARITY_STEPS = 3  # step 1: the base model (lora_B = 0); steps 2 and 3: the adapters' updates
#: adapters on the attention projections of layers 1 and 3 and every MLP projection of them (rank 4)
LORA = TrainSpec(global_batch_size=8, seq_len=32, precision="bf16", finetune="lora", lora_rank=4, lora_alpha=8,
                 lora_layers=[1, 3], framework="torchtitan")
QLORA = LORA.model_copy(update={"finetune": "qlora"})


def lora_params(model: ModelSpec, train: TrainSpec) -> int:
    """Adapter elements from the specs alone: r·(in + out) per adapted linear layer and adapted layer
    (lora_A is r x in, lora_B out x r; no bias)."""
    shapes = {"q_proj": (model.hidden_size, model.q_width), "k_proj": (model.hidden_size, model.kv_width),
              "v_proj": (model.hidden_size, model.kv_width), "o_proj": (model.q_width, model.hidden_size),
              "gate_proj": (model.hidden_size, model.ffn_hidden_size),
              "up_proj": (model.hidden_size, model.ffn_hidden_size),
              "down_proj": (model.ffn_hidden_size, model.hidden_size)}
    per_layer = sum(train.lora_rank * sum(shapes[name]) for name in targets(model, train))
    return per_layer * len(adapted_layers(model, train))


def reference(model: ModelSpec, train: TrainSpec, root: Path) -> ParityReference:
    cfg = RunConfig(label="ref", model=model, train=train, strategy=Strategy(dp=1), num_gpus=1,
                    parity_steps=PARITY_STEPS, timeout_s=TIMEOUT_S)
    ref, error = launch_reference(cfg, root)
    assert ref is not None, error
    return ref


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory) -> ParityReference:
    return reference(TINY, LORA, tmp_path_factory.mktemp("lora-ref"))


def run_lora(st: Strategy, tmp_path: Path, ref: ParityReference, train: TrainSpec = LORA, **overrides) -> RunResult:
    st = st.resolve(2)
    assert unsupported_reasons(TINY, train, st) == []
    rtol, update_rtol = PARITY_TOLERANCES[train.precision]
    cfg = RunConfig(label=st.short(), model=TINY, train=train, strategy=st, num_gpus=2, parity_steps=PARITY_STEPS,
                    warmup_steps=1, timed_steps=1, timeout_s=TIMEOUT_S, parity_rtol=rtol, update_rtol=update_rtol,
                    **overrides)
    return launch(cfg.with_reference(ref), tmp_path / "run")


def test_the_reference_adapters_change_the_loss_after_step_1(lora_reference):
    """lora_B = 0 at the start: step 1 sees only the base; the plain-SGD step on the adapters then lowers
    the loss by about PARITY_LOSS_DECREASE (1%), so steps 2 and 3 check the adapters' update."""
    first, second, third = lora_reference.losses
    assert (first - second) / first > 0.005
    assert third < second


#: DDP and FSDP2 (resharding after forward), each with two micro-batches a rank so that a rank's rows differ from
#: the reference's chunks; the executor's ZeRO-1 and ZeRO-2 paths are the pre-training runs' (tests/executors/
#: test_runs.py), which the adapters do not change.
LORA_PLANS = {
    "ddp": Strategy(dp=2, micro_batch_size=2),
    "fsdp2-zero3": Strategy(dp=2, zero_stage=3, micro_batch_size=2),
}


@pytest.mark.parametrize("st", list(LORA_PLANS.values()), ids=list(LORA_PLANS))
def test_lora_plans_match_the_reference(st, tmp_path, lora_reference):
    result = run_lora(st, tmp_path, lora_reference)
    assert result.outcome == "ok", f"{result.outcome}: {result.reason}\n{result.stderr_tail}"
    assert result.parity is not None and result.parity.passed and len(result.parity.measured) == PARITY_STEPS
    assert result.parity.measured[1] < result.parity.measured[0]  # the adapters moved the loss
    assert result.step_time_s and result.peak_memory_bytes
    assert [r.num_trainable_params for r in result.ranks] == [lora_params(TINY, LORA)] * 2


@pytest.fixture(scope="module")
def qlora_reference(tmp_path_factory) -> ParityReference:
    pytest.importorskip("bitsandbytes")
    return reference(TINY, QLORA, tmp_path_factory.mktemp("qlora-ref"))


@pytest.mark.parametrize("st", [LORA_PLANS["ddp"]], ids=["ddp"])  # FSDP2 leaves the 4-bit weights whole
def test_qlora_plans_match_the_reference(st, tmp_path, qlora_reference):
    """An NF4 base (bitsandbytes on the CPU) under the same adapters: its step-1 loss is not the bf16
    base's (the weights are quantised), and DDP and FSDP2 (the 4-bit weights left whole) match one process."""
    result = run_lora(st, tmp_path, qlora_reference, train=QLORA)
    assert result.outcome == "ok", f"{result.outcome}: {result.reason}\n{result.stderr_tail}"
    assert result.parity is not None and result.parity.passed
    assert result.parity.measured[1] < result.parity.measured[0]
    assert [r.num_trainable_params for r in result.ranks] == [lora_params(TINY, QLORA)] * 2


def test_qlora_quantises_every_projection_to_four_bits():
    pytest.importorskip("bitsandbytes")
    import torch

    from executors.lora import four_bit_params, prepare_adapters
    from executors.model import build_model

    module = build_model(TINY, QLORA.seq_len, 0)
    prepare_adapters(module, TINY, QLORA, 0)
    quantised = four_bit_params(module)
    assert len(quantised) == 7 * TINY.num_layers
    assert all(p.dtype == torch.uint8 and not p.requires_grad for p in quantised)
    assert type(module.layers["1"].attn.wq.base_layer).__name__ == "Linear4bit"  # adapted (lora_layers [1, 3])
    assert type(module.layers["0"].attn.wq).__name__ == "Linear4bit"  # not adapted, quantised all the same


def test_doubled_adapter_gradients_fail_parity(tmp_path, lora_reference):
    """The parity steps see the adapters' update: every adapter gradient doubled is `wrong`."""
    result = run_lora(Strategy(dp=2, micro_batch_size=2), tmp_path, lora_reference, fault="grad_x2")
    assert result.outcome == "wrong", f"{result.outcome}: {result.reason}\n{result.stderr_tail}"
    assert result.parity is not None and result.parity.update_rel_error > 0.5


@pytest.mark.parametrize("train", [LORA, LORA.model_copy(update={"lora_target_modules": ["q_proj", "down_proj"],
                                                                 "lora_layers": None, "lora_rank": 8})],
                         ids=["layers-1-3-all-modules", "all-layers-q-down"])
def test_peft_counts_the_adapters_the_specs_give(train):
    import torch

    from executors.lora import apply_lora
    from executors.model import build_model

    module = build_model(TINY, train.seq_len, 0)
    peft_model = apply_lora(module, TINY, train, 0)
    trainable, _total = peft_model.get_nb_trainable_parameters()
    assert trainable == lora_params(TINY, train) > 0
    frozen = {p.dtype for p in module.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16} and {p.dtype for p in module.parameters() if p.requires_grad} == {torch.float32}


def test_mlp_names_follow_the_gate():
    assert mlp_targets(TINY)["gate_proj"] == "mlp.w1" and mlp_targets(TINY)["up_proj"] == "mlp.w3"
    plain = TINY.model_copy(update={"gated_mlp": False})
    assert mlp_targets(plain) == {"up_proj": "mlp.w1", "down_proj": "mlp.w2"}
    assert set(ATTENTION_TARGETS.values()) == {"attn.wq", "attn.wk", "attn.wv", "attn.wo"}


def test_after_adam_steps_the_base_is_unchanged_and_the_adapters_moved(tmp_path):
    """The Runner (the workers' model and optimizer) on one gloo rank: the optimizer holds the adapters
    only, the frozen base keeps its weights, every adapter matrix changed."""
    import torch
    import torch.distributed as dist

    from executors.parallelize import build_mesh, mesh_coords
    from executors.runner import Runner

    cfg = RunConfig(label="lora", model=TINY, train=LORA, strategy=Strategy(dp=1).resolve(1), num_gpus=1,
                    parity_steps=1, learning_rate=1e-2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        mesh = build_mesh(cfg, "cpu")
        runner = Runner(cfg, mesh, mesh_coords(mesh), torch.device("cpu"))
        module = runner.modules[0]
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        for step in range(3):  # one plain-SGD parity step, then Adam
            runner.step(step)
        after = dict(module.named_parameters())
    finally:
        dist.destroy_process_group()
    optimized = {id(p) for g in runner.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in after.values() if p.requires_grad}
    adapters = [n for n in after if "lora_" in n]
    assert len(adapters) == 2 * 7 * 2  # A and B, 7 projections, layers 1 and 3
    assert all(after[n].requires_grad and not torch.equal(before[n], after[n]) for n in adapters)
    frozen = [n for n in after if "lora_" not in n]
    assert all(not after[n].requires_grad and torch.equal(before[n], after[n]) for n in frozen)


def test_what_the_executor_cannot_run_is_refused():
    tp = unsupported_reasons(TINY, LORA, Strategy(dp=1, tp=2).resolve(2))
    assert tp == ["finetune 'lora' with tp (2) > 1: adapter plans run data parallel only (tp = pp = cp = ep = 1)"]
    qlora = LORA.model_copy(update={"finetune": "qlora"})
    assert any("pp (2) > 1" in r for r in unsupported_reasons(TINY, qlora, Strategy(dp=1, pp=2).resolve(2)))
    short = unsupported_reasons(TINY.model_copy(update={"num_layers": 2}), LORA, Strategy(dp=2).resolve(2))
    assert any("lora_layers [1, 3] names layer 3, beyond the 2 layers built" in r for r in short)
    assert any("runs with the torch engine only" in r
               for r in engine_reasons(ValidateOptions(engine="deepspeed"), "cuda", LORA))


def test_the_planner_adapter_count_equals_the_specs():
    for train in (LORA, QLORA, LORA.model_copy(update={"lora_target_modules": ["v_proj"], "lora_layers": None})):
        assert predicted_adapter_params(TINY, train) == lora_params(TINY, train)


def test_validate_prints_the_trainable_count_beside_the_cost_model():
    from executors.compare import PlanComparison
    from planner.cli.validate_cmd import trainable_line

    c = PlanComparison(label="dp2", strategy=Strategy(dp=2).resolve(2), outcome="ok",
                       measured_trainable_params=8192, predicted_trainable_params=8192)
    assert trainable_line(c) == "trainable parameters: measured 8,192 (peft's adapters), predicted 8,192 (+0.0%)"
    c.predicted_trainable_params = 9216
    assert trainable_line(c).endswith("predicted 9,216 (+12.5%)")
    assert predicted_adapter_params(TINY, TrainSpec(global_batch_size=8, seq_len=32)) is None  # not a LoRA plan


def test_the_prediction_is_made_for_the_plan_s_fine_tuning():
    """validate prices a LoRA plan with its fine-tuning settings and framework (not as pre-training under
    the default framework)."""
    from executors.validate import finetune_settings, predict
    from profiles import load_cluster

    settings = finetune_settings(LORA)
    assert settings["finetune"] == "lora" and settings["lora_rank"] == 4 and settings["framework"] == "torchtitan"
    assert finetune_settings(TrainSpec(global_batch_size=8, seq_len=32)) == {}
    estimate, why = predict(TINY, load_cluster("local-cpu"), LORA, 2, Strategy(dp=2).resolve(2))
    assert estimate is not None, why
    # the plan's finetune and framework reach the planner: one that cannot run adapters is refused there
    estimate, why = predict(TINY, load_cluster("local-cpu"), LORA.model_copy(update={"framework": "megatron"}), 2,
                            Strategy(dp=2).resolve(2))
    assert estimate is None and "finetune 'lora' with framework 'megatron'" in why
