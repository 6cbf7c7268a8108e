"""DeepSpeed JSON, parsed by DeepSpeed's own DeepSpeedConfig for the plan's data-parallel world size (issue 3)."""

from __future__ import annotations

import json

import pytest

from emit_checks import check_deepspeed, check_deepspeed_initialize
from emit_plans import PUBLISHED, make_plan
from planner.emit import NotExpressibleError, emit, emit_data
from planner.emit.deepspeed import ds_config, megatron_deepspeed_args

LLAMA8 = ("llama3-8b", "dgx-h100", 16, 64, 4096)


@pytest.fixture(autouse=True)
def _comm(deepspeed_comm):
    return deepspeed_comm


@pytest.mark.parametrize("strategy", [
    dict(zero_stage=0),
    dict(zero_stage=1, micro_batch_size=2),
    dict(zero_stage=2, recompute="full"),
    dict(zero_stage=3, overlap_param_gather=False),
    dict(zero_stage=3, offload_optimizer=True),
    dict(tp=2, pp=2, zero_stage=1, sequence_parallel=True, recompute="full"),
    dict(tp=4, zero_stage=3, recompute="selective"),
    dict(tp=2, recompute="full", recompute_num_layers=4),
], ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_deepspeed_parses_the_plan(strategy):
    # ZeRO 0 with bf16 accumulates bf16 gradients (fp32 ones need ZeRO >= 1; see the refusal test)
    grad = "bf16" if strategy.get("zero_stage", 0) == 0 else "fp32"
    plan = make_plan(*LLAMA8, strategy=strategy, grad_precision=grad)
    data = emit_data(plan, "deepspeed")
    check_deepspeed(plan, data["config"], data["megatron_deepspeed_args"])
    assert json.loads(emit(plan, "deepspeed")) == data["config"]


def test_gpt3_published_plan(deepspeed_comm):
    plan = PUBLISHED["gpt3-175b-1024xA100-tp8pp8"]()
    config = ds_config(plan)
    check_deepspeed(plan, config, megatron_deepspeed_args(plan))
    assert config["gradient_accumulation_steps"] == 1536 // 16 and config["fp16"]["enabled"]
    assert config["pipeline"] == {"stages": 8, "activation_checkpoint_interval": 1}


def test_bucket_sizes_follow_hidden_size():
    zero = ds_config(make_plan(*LLAMA8, strategy=dict(zero_stage=3)))["zero_optimization"]
    h = 4096
    assert zero["reduce_bucket_size"] == h * h and zero["stage3_prefetch_bucket_size"] == int(0.9 * h * h)
    assert zero["stage3_param_persistence_threshold"] == 10 * h


@pytest.mark.parametrize("strategy,precision,reason", [
    (dict(tp=2, pp=2, zero_stage=2), "bf16", r"zero_stage 2 with pp \(2\) > 1"),
    (dict(pp=4, zero_stage=3), "bf16", r"zero_stage 3 with pp \(4\) > 1"),
    (dict(pp=4, vpp=2, zero_stage=1), "bf16", r"vpp \(2\) > 1; DeepSpeed's pipeline engine has no interleaved"),
    (dict(cp=2), "bf16", r"cp \(2\) > 1; DeepSpeed's sequence parallelism is Ulysses"),
    (dict(pp=2, recompute="full", recompute_num_layers=2), "bf16", r"recompute_num_layers \(2\) with pp \(2\)"),
    (dict(pp=4, num_layers_in_first_stage=7, num_layers_in_last_stage=7), "bf16", r"uneven pipeline stages"),
    (dict(pp=4, stage_layers=[7, 9, 10, 6]), "bf16", r"stage_layers \[7, 9, 10, 6\] with pp \(4\) > 1"),
    # one count per virtual stage needs vpp > 1, which the pipeline engine refuses first
    (dict(pp=2, vpp=2, stage_layers=[10, 8, 6, 8]), "bf16", r"vpp \(2\) > 1; DeepSpeed's pipeline engine"),
    (dict(pp=2, embedding_as_layer=True, loss_as_layer=True), "bf16",  # (32 + 2) / 2 = 17 layers a stage
     r"embedding_as_layer and loss_as_layer with pp \(2\) > 1"),
    (dict(tp=2), "fp8", r"precision 'fp8'"),
])
def test_what_deepspeed_cannot_express_is_refused(strategy, precision, reason):
    plan = make_plan(*LLAMA8, strategy=strategy, precision=precision)
    for backend in ("deepspeed", "megatron-deepspeed"):
        with pytest.raises(NotExpressibleError, match="^not expressible in DeepSpeed: " + reason):
            emit(plan, backend)


def test_embedding_as_layer_without_pipeline_changes_nothing_and_is_emitted():
    plain = ds_config(make_plan(*LLAMA8, strategy=dict(zero_stage=1)))
    assert ds_config(make_plan(*LLAMA8, strategy=dict(zero_stage=1, embedding_as_layer=True))) == plain


#: plans over ZeRO stages, gradient precisions and model parallel degrees (bf16: DeepSpeed's CPU
#: accelerator refuses fp16 engines, so fp16 configs are checked by DeepSpeedConfig above)
INITIALIZE_GRID = [
    (dict(zero_stage=z, tp=tp, pp=pp, micro_batch_size=mbs), precision, grad)
    for z in (0, 1, 2, 3) for tp, pp in ((1, 1), (4, 1), (2, 2)) for mbs in (1, 2)
    for precision, grad in (("bf16", "fp32"), ("bf16", "bf16"))
    if not (pp > 1 and z >= 2)
]


@pytest.mark.parametrize("strategy,precision,grad", INITIALIZE_GRID,
                         ids=lambda v: "-".join(f"{k}{x}" for k, x in v.items()) if isinstance(v, dict) else v)
def test_deepspeed_initialize_accepts_the_config(strategy, precision, grad):
    """`deepspeed.initialize` (not only DeepSpeedConfig) builds an engine from every config emitted,
    at the plan's data-parallel world size; the one mix it rejects is refused by the emitter."""
    plan = make_plan(*LLAMA8, strategy=strategy, precision=precision, grad_precision=grad)
    try:
        config = ds_config(plan)
    except NotExpressibleError as exc:
        assert strategy["zero_stage"] == 0 and precision == "bf16" and grad == "fp32", exc
        assert "zero_stage 0 with bf16 and grad_precision 'fp32'" in exc.reason
        return
    check_deepspeed_initialize(plan, config)


@pytest.mark.slow
def test_deepspeed_initialize_with_optimizer_offload():
    """Offload: the engine takes DeepSpeedCPUAdam (its CPU op is built once, on first use)."""
    plan = make_plan(*LLAMA8, strategy=dict(zero_stage=3, offload_optimizer=True))
    engine = check_deepspeed_initialize(plan, ds_config(plan))
    assert engine.zero_cpu_offload()


def test_text_output_names_what_the_json_cannot_carry():
    from planner.emit import omissions

    assert omissions(make_plan(*LLAMA8, strategy=dict(zero_stage=1)), "deepspeed") == []
    plan = make_plan(*LLAMA8, strategy=dict(tp=4, sequence_parallel=True, zero_stage=1))
    (reason,) = omissions(plan, "deepspeed")
    assert reason.startswith("tp (4), sequence_parallel (true): ds_config.json has no key for them")
    assert omissions(plan, "megatron-deepspeed") == []
