"""Axolotl YAML for fine-tuning plans, validated by Axolotl's own schema (with its GPU capability checks), its
DeepSpeed JSON through the Hugging Face Trainer and DeepSpeed's config class, its FSDP2 settings through
accelerate; and every plan Axolotl cannot run refused in one line."""

from __future__ import annotations

import re
import subprocess

import pytest

from emit_plans import make_plan
from finetune_checks import check_axolotl
from planner.emit import EmitOptions, NotExpressibleError, emit, emit_data
from planner.emit.finetune import HF_MODELS

LLAMA8 = ("llama3-8b", "dgx-h100", 8, 64, 4096)


@pytest.fixture(autouse=True)
def _comm(deepspeed_comm):
    return deepspeed_comm


#: (strategy, training settings): LoRA, QLoRA and full fine-tuning under DeepSpeed and FSDP2, every mapped knob
PLANS = [
    (dict(zero_stage=2, recompute="full"), dict(finetune="qlora", paged_optimizer=True)),
    (dict(zero_stage=3, recompute="full"), dict(finetune="qlora", qlora_double_quant=False, lora_rank=64,
                                                lora_alpha=16)),
    (dict(zero_stage=1, micro_batch_size=2), dict(finetune="lora", lora_target_modules=["q_proj", "v_proj"],
                                                  lora_layers=[31, 30, 29], lora_dropout=0.05)),
    (dict(zero_stage=0), dict(finetune="lora", grad_precision="bf16")),
    (dict(zero_stage=3, offload_optimizer=True, recompute="full"), dict(finetune="lora")),
    (dict(zero_stage=3, recompute="full"), dict(finetune="qlora", framework="torchtitan")),
    (dict(zero_stage=2), dict(finetune="lora", framework="torchtitan", torch_compile=True)),
    (dict(zero_stage=0, micro_batch_size=2), dict(finetune="lora", framework="torchtitan")),
    (dict(zero_stage=3, recompute="full"), dict(finetune="full", framework="torchtitan", precision="fp16",
                                                model_code="transformers")),
    (dict(zero_stage=3), dict(finetune="full", framework="deepspeed", model_code="transformers")),
]


@pytest.mark.parametrize("strategy,train", PLANS, ids=lambda v: "-".join(f"{k}{x}" for k, x in v.items()))
def test_axolotl_schema_accepts_the_plan(strategy, train, tmp_path):
    train = dict(train)
    precision = train.pop("precision", "bf16")
    plan = make_plan(*LLAMA8, strategy=strategy, precision=precision, **train)
    data = emit_data(plan, "axolotl")
    check_axolotl(plan, data, tmp_path / "data")
    # the text is a script that writes the same files
    run = tmp_path / "run"
    run.mkdir()
    script = emit(plan, "axolotl")
    subprocess.run(["bash", "-c", script], cwd=run, check=True, timeout=60)
    assert {p.name: p.read_text() for p in run.iterdir()} == data["files"]


def test_a_model_without_an_id_takes_hf_model(tmp_path):
    from profiles import load_model
    own = load_model("llama3.2-1b").model_dump() | {"name": "my-llama", "num_layers": 12}  # a Llama without an id
    plan = make_plan(own, "dgx-h100", 8, 64, 2048, strategy=dict(zero_stage=1), finetune="lora")
    with pytest.raises(NotExpressibleError, match="^not expressible in Axolotl: model 'my-llama' has no Hugging "
                                                  "Face id here; pass --hf-model"):
        emit(plan, "axolotl")
    data = emit_data(plan, "axolotl", EmitOptions(hf_model="/models/my-gpt"))
    assert data["config"]["base_model"] == "/models/my-gpt"
    assert any("costed for my-llama's shape" in n for n in data["notes"])
    check_axolotl(plan, data, tmp_path)


def test_every_known_id_is_a_preset():
    from profiles import list_presets

    assert set(HF_MODELS) <= set(list_presets("models"))


@pytest.mark.parametrize("plan_args,reason", [
    ((dict(tp=2), dict(finetune="full", framework="deepspeed")),
     r"tp \(2\) > 1; Axolotl shards the Hugging Face model by data parallelism"),
    ((dict(pp=2), dict(finetune="full", framework="deepspeed")), r"pp \(2\) > 1"),
    ((dict(cp=2), dict(finetune="full", framework="deepspeed")), r"cp \(2\) > 1"),
    ((dict(zero_stage=1), dict()), r"finetune 'none' \(pre-training\)"),
    ((dict(zero_stage=1), dict(finetune="full", framework="megatron")), r"framework 'megatron'"),
    ((dict(zero_stage=1), dict(finetune="full", framework="colossalai")), r"framework 'colossalai'"),
    ((dict(zero_stage=1), dict(finetune="full", precision="fp8", framework="deepspeed")), r"precision 'fp8'"),
    ((dict(recompute="selective"), dict(finetune="lora")), r"recompute 'selective'"),
    ((dict(recompute="full", recompute_num_layers=4), dict(finetune="lora")), r"recompute_num_layers \(4\) of 32"),
    ((dict(zero_stage=1, offload_activation_layers=4), dict(finetune="full", framework="torchtitan")),
     r"offload_activation_layers \(4\)"),
    ((dict(zero_stage=3, offload_optimizer=True), dict(finetune="lora", framework="torchtitan")),
     r"offload_optimizer with framework torchtitan"),
    ((dict(zero_stage=3, offload_optimizer=True), dict(finetune="lora", paged_optimizer=True)),
     r"paged_optimizer with offload_optimizer"),
    ((dict(zero_stage=1), dict(finetune="lora", lora_alpha=12.5)), r"lora_alpha 12.5; Axolotl takes an integer"),
    ((dict(zero_stage=1), dict(finetune="lora", adapter_precision="bf16")), r"adapter_precision 'bf16'"),
    ((dict(zero_stage=1), dict(finetune="lora", attention_kernel="unfused")), r"attention_kernel 'unfused'"),
    ((dict(zero_stage=1), dict(finetune="lora", torch_compile=True)), r"torch_compile with framework deepspeed"),
    ((dict(zero_stage=1), dict(finetune="full", framework="deepspeed")), r"model_code 'framework'"),
    ((dict(zero_stage=1), dict(finetune="full", model_code="transformers", torch_compile=True)),
     r"torch_compile with framework deepspeed"),
    ((dict(zero_stage=0), dict(finetune="lora", grad_precision="fp32")),
     r"zero_stage 0 with bf16 and grad_precision 'fp32'.* \(its DeepSpeed config\)$"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_what_axolotl_cannot_run_is_refused(plan_args, reason):
    strategy, train = plan_args
    train = dict(train)
    precision = train.pop("precision", "bf16")
    framework = train.get("framework")
    if framework in ("megatron", "colossalai") or precision == "fp8":
        plan = _relabelled(strategy, precision, train)
    else:
        plan = make_plan(*LLAMA8, strategy=strategy, precision=precision, **train)
    with pytest.raises(NotExpressibleError, match="^not expressible in Axolotl: " + reason):
        emit_data(plan, "axolotl")
    with pytest.raises(NotExpressibleError):
        emit(plan, "axolotl")


def _relabelled(strategy, precision, train):
    """A plan the cost model refuses to cost (a fine-tune under Megatron-LM or Colossal-AI, or in fp8): the
    pre-training plan with its training settings set afterwards, as a hand-edited plan file would carry them."""
    plan = make_plan(*LLAMA8, strategy=strategy, precision=precision)
    return plan.model_copy(update={"train": plan.train.model_copy(update=train)})


def test_backends_that_train_every_parameter_refuse_adapter_plans():
    """A LoRA plan emitted as a pre-training config would train every parameter: only the toolkits, and DeepSpeed's
    bare JSON (the engine around a peft model's own script), take one."""
    from planner.emit import backends, get_emitter

    plan = make_plan(*LLAMA8, strategy=dict(zero_stage=1), finetune="lora")
    taken = []
    for backend in backends():
        launch = ("megatron", "deepspeed", "colossalai", "torchtitan") if get_emitter(backend).runs is None else (None,)
        for target in launch:
            options = EmitOptions(launch_for=target) if target else EmitOptions()
            try:
                emit(plan, backend, options)
            except NotExpressibleError as exc:
                assert re.search(r"finetune 'lora' \(adapters over a frozen base\); [\w-]+'s (output|pretrain_gpt.py) "
                                 "trains every parameter", exc.reason), exc.reason
                continue
            taken.append(backend)
    assert taken == ["deepspeed", "axolotl", "llamafactory"]
    assert emit_data(plan, "deepspeed")["megatron_deepspeed_args"] is None
