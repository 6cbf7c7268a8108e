"""LLaMA-Factory YAML for fine-tuning plans, parsed by LLaMA-Factory's own argument parser (its dataclasses
through HfArgumentParser, then its model-argument checks), its DeepSpeed JSON as the Trainer completes it read by
DeepSpeed's config class, its accelerate FSDP2 config file by accelerate; and every plan it cannot run refused."""

from __future__ import annotations

import subprocess

import pytest

from emit_plans import make_plan
from finetune_checks import check_llamafactory
from planner.emit import EmitOptions, NotExpressibleError, emit, emit_data
from planner.emit.llamafactory import template

LLAMA8 = ("llama3-8b", "dgx-h100", 8, 64, 4096)


@pytest.fixture(autouse=True)
def _comm(deepspeed_comm):
    return deepspeed_comm


PLANS = [
    (LLAMA8, dict(zero_stage=2, recompute="full"), dict(finetune="qlora", paged_optimizer=True)),
    (LLAMA8, dict(zero_stage=3, recompute="full"), dict(finetune="qlora", qlora_double_quant=False, lora_rank=64,
                                                        lora_alpha=16)),
    (LLAMA8, dict(zero_stage=1, micro_batch_size=2), dict(finetune="lora", lora_target_modules=["q_proj", "v_proj"],
                                                          lora_dropout=0.05, adapter_precision="bf16")),
    (LLAMA8, dict(zero_stage=0), dict(finetune="lora", grad_precision="bf16")),
    (LLAMA8, dict(zero_stage=3, offload_optimizer=True, recompute="full"),
     dict(finetune="full", framework="deepspeed", model_code="transformers")),
    (LLAMA8, dict(zero_stage=3, recompute="full"), dict(finetune="qlora", framework="torchtitan")),
    (LLAMA8, dict(zero_stage=2), dict(finetune="lora", framework="torchtitan", torch_compile=True)),
    (LLAMA8, dict(zero_stage=0, micro_batch_size=2), dict(finetune="lora", framework="torchtitan")),
    (LLAMA8, dict(zero_stage=3, recompute="full"), dict(finetune="full", framework="torchtitan", precision="fp16",
                                                        model_code="transformers")),
    (("llama3-70b", "dgx-h100", 16, 64, 4096), dict(zero_stage=3, recompute="full"),
     dict(finetune="qlora", framework="torchtitan")),
    (("qwen2.5-72b", "dgx-h100", 16, 32, 2048), dict(zero_stage=3, recompute="full"), dict(finetune="lora")),
]


@pytest.mark.parametrize("question,strategy,train", PLANS,
                         ids=lambda v: "-".join(f"{k}{x}" for k, x in v.items()) if isinstance(v, dict) else v[0])
def test_llamafactory_parser_accepts_the_plan(question, strategy, train, tmp_path):
    train = dict(train)
    precision = train.pop("precision", "bf16")
    plan = make_plan(*question, strategy=strategy, precision=precision, **train)
    data = emit_data(plan, "llamafactory")
    check_llamafactory(plan, data, tmp_path / "data")
    run = tmp_path / "run"
    run.mkdir()
    subprocess.run(["bash", "-c", emit(plan, "llamafactory")], cwd=run, check=True, timeout=60)
    assert {p.name: p.read_text() for p in run.iterdir()} == data["files"]


def test_templates_are_llamafactorys():
    """Every template written is one LLaMA-Factory registers (read from its data/template.py: importing it needs
    torchaudio and the multimodal stack, which its argument parser does not)."""
    import importlib.util
    import re
    from pathlib import Path

    from planner.emit.llamafactory import DEFAULT_TEMPLATE, TEMPLATES

    spec = importlib.util.find_spec("llamafactory")
    if spec is None:
        pytest.skip("llamafactory is not installed (scripts/test.sh installs it)")
    source = (Path(spec.origin).parent / "data" / "template.py").read_text()
    registered = set(re.findall(r'register_template\(\s*name="([\w.-]+)"', source))
    assert len(registered) > 50
    assert set(TEMPLATES.values()) | {DEFAULT_TEMPLATE} <= registered


def test_templates_follow_the_model_family():
    assert [template(m) for m in ("llama2-7b", "llama3.1-8b", "mixtral-8x7b", "qwen3-30b-a3b", "gpt3-1.7b")] == [
        "llama2", "llama3", "mistral", "qwen3", "default"]


def test_a_model_without_an_id_takes_hf_model(tmp_path):
    from profiles import load_model
    own = load_model("llama3.2-1b").model_dump() | {"name": "my-llama", "num_layers": 12}  # a Llama without an id
    plan = make_plan(own, "dgx-h100", 8, 64, 2048, strategy=dict(zero_stage=1), finetune="lora")
    with pytest.raises(NotExpressibleError, match="^not expressible in LLaMA-Factory: model 'my-llama' has no "
                                                  "Hugging Face id here"):
        emit(plan, "llamafactory")
    data = emit_data(plan, "llamafactory", EmitOptions(hf_model="org/my-gpt"))
    assert data["config"]["model_name_or_path"] == "org/my-gpt" and data["config"]["template"] == "default"
    check_llamafactory(plan, data, tmp_path)


@pytest.mark.parametrize("plan_args,reason", [
    ((dict(tp=2), dict(finetune="full", framework="deepspeed")), r"tp \(2\) > 1; LLaMA-Factory shards"),
    ((dict(pp=2), dict(finetune="full", framework="deepspeed")), r"pp \(2\) > 1"),
    ((dict(zero_stage=1), dict()), r"finetune 'none' \(pre-training\)"),
    ((dict(recompute="selective"), dict(finetune="lora")), r"recompute 'selective'"),
    ((dict(recompute="full", recompute_num_layers=4), dict(finetune="lora")), r"recompute_num_layers \(4\) of 32"),
    ((dict(zero_stage=3, offload_optimizer=True), dict(finetune="lora", framework="torchtitan")),
     r"offload_optimizer with framework torchtitan"),
    ((dict(zero_stage=1), dict(finetune="lora", lora_layers=[0, 1])), r"lora_layers \[0, 1\]; LLaMA-Factory has no"),
    ((dict(zero_stage=1), dict(finetune="lora", lora_alpha=12.5)), r"lora_alpha 12.5; LLaMA-Factory takes an integer"),
    ((dict(zero_stage=3), dict(finetune="lora", adapter_precision="bf16")),
     r"adapter_precision 'bf16' with zero_stage 3"),
    ((dict(zero_stage=1), dict(finetune="lora", adapter_precision="bf16", precision="fp16")),
     r"adapter_precision 'bf16' with precision 'fp16'"),
    ((dict(zero_stage=1), dict(finetune="lora", attention_kernel="flash1")), r"attention_kernel 'flash1'"),
    ((dict(zero_stage=0), dict(finetune="lora", grad_precision="fp32")),
     r"zero_stage 0 with bf16 and grad_precision 'fp32'.* \(its DeepSpeed config\)$"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_what_llamafactory_cannot_run_is_refused(plan_args, reason):
    strategy, train = plan_args
    train = dict(train)
    precision = train.pop("precision", "bf16")
    plan = make_plan(*LLAMA8, strategy=strategy, precision=precision, **train)
    with pytest.raises(NotExpressibleError, match="^not expressible in LLaMA-Factory: " + reason):
        emit_data(plan, "llamafactory")
    with pytest.raises(NotExpressibleError):
        emit(plan, "llamafactory")


def test_framework_megatron_and_fp8_are_refused():
    plan = make_plan(*LLAMA8, strategy=dict(zero_stage=1))
    for update, reason in ((dict(finetune="full"), "framework 'megatron'"),
                           (dict(finetune="full", framework="colossalai"), "framework 'colossalai'"),
                           (dict(finetune="full", framework="deepspeed", precision="fp8"), "precision 'fp8'")):
        edited = plan.model_copy(update={"train": plan.train.model_copy(update=update)})
        with pytest.raises(NotExpressibleError, match=f"^not expressible in LLaMA-Factory: {reason}"):
            emit(edited, "llamafactory")


# ---- the command line -----------------------------------------------------------------------------------------
SEARCH = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size", "64",
          "--seq-len", "4096"]


def _run(capsys, *args: str) -> tuple[int, str, str]:
    from planner.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("backend", ["llamafactory", "axolotl"])
def test_cli_searches_a_finetune_and_emits_it(backend, capsys, tmp_path):
    """`meshplan emit --finetune qlora` searches QLoRA plans as DeepSpeed runs them (the toolkits' default) and
    writes the script; `--framework torchtitan` searches FSDP2's; a plan file from `meshplan plan` emits the same."""
    from planner import plan
    from planner.emit import get_emitter

    code, out, err = _run(capsys, "emit", *SEARCH, "--backend", backend, "--finetune", "qlora", "--paged-optimizer")
    assert code == 0, err
    best = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=64, seq_len=4096, top_k=1,
                finetune="qlora", paged_optimizer=True).plans[0]
    assert best.train.framework == "deepspeed"
    assert out == emit(best, backend)
    code, out, err = _run(capsys, "emit", *SEARCH, "--backend", backend, "--finetune", "lora", "--framework",
                          "torchtitan")
    assert code == 0 and "costed" not in err, err
    assert "deepspeed: ds_config.json" not in out and get_emitter(backend).also_runs == ("torchtitan",)
    (tmp_path / "plans.json").write_text(_plan_json(capsys, "--finetune", "qlora", "--framework", "torchtitan"))
    code, out, err = _run(capsys, "emit", str(tmp_path / "plans.json"), "--backend", backend)
    assert code == 0 and err == "", err  # a torchtitan plan runs as costed: no note


def _plan_json(capsys, *args: str) -> str:
    code, out, err = _run(capsys, "plan", *SEARCH, *args, "--format", "json")
    assert code == 0, err
    return out


@pytest.mark.parametrize("backend", ["llamafactory", "axolotl"])
def test_cli_hf_model_and_refusals_are_one_line(backend, capsys):
    code, out, err = _run(capsys, "emit", *SEARCH, "--backend", backend)  # pre-training plans
    assert code == 2 and out == "" and err.count("\n") == 1 and "finetune 'none' (pre-training)" in err
    code, out, err = _run(capsys, "emit", *SEARCH, "--backend", backend, "--finetune", "lora", "--hf-model",
                          "x; rm -rf /")
    assert code == 2 and out == "" and err.count("\n") == 1 and "hf_model" in err and "Traceback" not in err
    code, out, err = _run(capsys, "emit", *SEARCH, "--backend", backend, "--finetune", "lora", "--hf-model",
                          "/models/llama-3-8b")
    assert code == 0 and "/models/llama-3-8b" in out


def test_cli_hf_model_is_for_the_toolkits_only(capsys):
    code, out, err = _run(capsys, "emit", *SEARCH, "--backend", "megatron", "--hf-model", "org/model")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--hf-model" in err
