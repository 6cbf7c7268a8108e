"""`meshplan emit`: from plan JSON (file or stdin) or plan options; errors and exit codes (issue 3)."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
import typer

from planner import plan
from planner.cli import app, main
from planner.emit import ds_config, emit, megatron_args, omissions

PLAN_ARGS = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
             "--seq-len", "4096"]
# Frozen `emit` surface: extend it, never rename (users' scripts depend on it).
FROZEN_EMIT = sorted(["--allow-partial", "--attention-kernel", "--backend", "--best-expressible", "--bridge-version",
                      "--calibration", "--cluster",
                      "--constraint", "--constraints", "--cross-entropy-fusion", "--cross-entropy-fusion-impl",
                      "--cuda-graph-impl", "--cuda-graph-scope",
                      "--format", "--fp8-param-gather", "--fp8-recipe", "--framework", "--global-batch-size", "--gpus",
                      "--grad-precision", "--headroom", "--job-name", "--launch-for", "--master-port", "--model",
                      "--moe-dispatcher", "--moe-flex-num-sms", "--moe-load-imbalance",
                      "--moe-router-padding-for-quantization", "--optimizer", "--plan", "--precision", "--rank",
                      "--script", "--seq-len", "--strict-numerics", "--torch-compile", "--zero3-impl",
                      # the fine-tuning plans' options (as `meshplan plan` takes them) and the model the
                      # fine-tuning toolkits' configs load
                      "--finetune", "--lora-rank", "--lora-alpha", "--lora-dropout", "--lora-targets",
                      "--lora-layers", "--adapter-precision", "--double-quant", "--paged-optimizer", "--hf-model"])


def run(capsys, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        code = main(list(args))
    finally:
        sys.stdin = sys.__stdin__
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def result():
    # fp32 gradient reduction: the plan file is emitted for every backend, Megatron-Bridge's bf16 recipe included,
    # which reduces in fp32 whatever the overrides say (the planner would choose bf16 for Megatron-LM)
    return plan(model="llama3-8b", cluster="dgx-h100", num_gpus=16, global_batch_size=64, seq_len=4096, top_k=3,
                grad_precision="fp32")


@pytest.fixture
def plan_file(result, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(result.model_dump(mode="json")))
    return path


def test_emit_surface_is_frozen():
    cmd = typer.main.get_command(app).commands["emit"]
    assert sorted(o for p in cmd.params for o in p.opts if o.startswith("--")) == FROZEN_EMIT


def test_bridge_version_picks_the_release_and_refuses_others(capsys, result, plan_file):
    from planner.cli.emit_cmd import BRIDGE_CHOICES
    from planner.emit import EmitOptions
    from planner.emit.base import BRIDGE_VERSIONS, DEFAULT_BRIDGE_VERSION

    # the help's list is the emitter's table
    others = [f"{k} ({v})" for k, v in BRIDGE_VERSIONS.items() if k != DEFAULT_BRIDGE_VERSION]
    assert BRIDGE_CHOICES == (f"{DEFAULT_BRIDGE_VERSION} (Megatron-Bridge {BRIDGE_VERSIONS[DEFAULT_BRIDGE_VERSION]}, "
                              "the default), " + ", ".join(others[:-1]) + " or " + others[-1])
    best = result.plans[0]
    for version, key in (("0.6", "dataset.seq_length=4096"), ("0.3", "dataset.sequence_length=4096"),
                         ("main", "dataset.seq_length=4096"), (None, None)):
        code, out, err = run(capsys, "emit", str(plan_file), "--backend", "megatron-bridge",
                             *(["--bridge-version", version] if version else []))
        assert code == 0, err
        assert out == emit(best, "megatron-bridge", EmitOptions(bridge_version=version or DEFAULT_BRIDGE_VERSION))
        assert (key or "dataset.seq_length=4096") in out
        # llama3-8b: main's Llama recipes nest the transformer fields, the releases' take them flat
        assert ("  model.transformer.tensor_model_parallel_size=" in out) == (version == "main")
        assert ("  model.tensor_model_parallel_size=" in out) == (version != "main")
    code, out, err = run(capsys, "emit", str(plan_file), "--backend", "megatron-bridge", "--bridge-version", "0.5")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: --bridge-version must be one of 0.6 (0.6.0), 0.3 (0.3.1), main (main@067f987df) (got '0.5')"]
    # refused before a search starts
    code, out, err = run(capsys, "emit", *PLAN_ARGS, "--backend", "megatron-bridge", "--bridge-version", "1.0")
    assert code == 2 and "--bridge-version must be one of" in err and "Traceback" not in err


@pytest.mark.parametrize("backend", ["megatron", "megatron-bridge", "torchtitan", "torchrun", "slurm"])
def test_emit_from_plan_file_matches_the_api(capsys, result, plan_file, backend):
    code, out, err = run(capsys, "emit", str(plan_file), "--backend", backend, "--rank", "2", "--allow-partial")
    assert code == 0, err
    assert out == emit(result.plans[1], backend)
    # the file's plans were ranked as Megatron-LM runs them: emitted for torchtitan, a note says so first
    note = ("note: plan 2 was costed and ranked as megatron runs it, not torchtitan: its predicted step time and memory "
            "are megatron's (`meshplan plan --framework torchtitan` costs and ranks the plans as torchtitan runs them)\n")
    assert err == (note if backend == "torchtitan" else "") + "".join(
        f"{backend} text drops part of plan 2: {r}\n" for r in omissions(result.plans[1], backend))
    if backend == "torchtitan":
        assert "# torchtitan plan 2: " in out and "; predicted (as megatron runs it, not torchtitan) " in out
    else:
        assert "; predicted (as" not in out


def test_emit_from_stdin_and_json_format(capsys, result, plan_file):
    code, out, err = run(capsys, "emit", "-", "--backend", "megatron", "--format", "json", stdin=plan_file.read_text())
    assert code == 0, err
    assert json.loads(out)["args"] == megatron_args(result.plans[0])


def test_emit_from_plan_options(capsys, result):
    code, out, err = run(capsys, "emit", "-B", "megatron", "--allow-partial", *PLAN_ARGS, "--grad-precision", "fp32")
    assert code == 0, err
    assert out == emit(result.plans[0], "megatron")


def test_emit_launch_for_torchtitan(capsys, plan_file):
    code, out, err = run(capsys, "emit", str(plan_file), "-B", "torchrun", "--launch-for", "torchtitan")
    assert code == 0, err
    assert "-m torchtitan.train --job.config_file meshplan_torchtitan.toml" in out


@pytest.mark.parametrize("args,message", [
    (["emit", "-B", "megatorn", *PLAN_ARGS], "unknown emit backend 'megatorn'; close matches: megatron"),
    (["emit"], "give a plan: PLAN_JSON"),
    (["emit", "--model", "llama3-8b"], "missing plan option(s) --cluster, --gpus, --global-batch-size, --seq-len"),
    (["emit", "--rank", "0", *PLAN_ARGS], "--rank must be >= 1 (got 0)"),
    (["emit", "missing.json"], "plan file 'missing.json' does not exist"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_plan_file_and_options_together_are_refused(capsys, plan_file):
    code, _, err = run(capsys, "emit", str(plan_file), "--model", "llama3-8b")
    assert code == 2 and "give either PLAN_JSON or plan options, not both" in err


def test_rank_not_in_file(capsys, plan_file):
    code, _, err = run(capsys, "emit", str(plan_file), "--rank", "7")
    assert code == 2 and "--rank 7 is not in" in err and "plans ranked 1, 2, 3" in err


def test_not_json_and_not_a_plan(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run(capsys, "emit", str(bad))
    assert code == 2 and f"plan file {str(bad)!r} is not valid JSON" in err
    bad.write_text('{"hello": 1}')
    code, _, err = run(capsys, "emit", str(bad))
    assert code == 2 and "is not a meshplan plan" in err


def test_not_expressible_is_a_clear_error(capsys, result, plan_file):
    # searched here, DeepSpeed's own rules reject the constrained layout: no valid strategy, as `plan` says it
    code, out, err = run(capsys, "emit", "-B", "deepspeed", *PLAN_ARGS, "-C", "cp=2", "-C", "tp=1")
    assert code == 2 and out == ""
    assert err.startswith("error: 0 valid strategies for 16 GPUs") and "not expressible in deepspeed: cp > 1" in err
    # a plan file searched for Megatron: the DeepSpeed emitter refuses the plan it cannot run
    cp = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=16, global_batch_size=64, seq_len=4096, top_k=1,
              constraints={"cp": 2, "tp": 1})
    plan_file.write_text(json.dumps(cp.model_dump(mode="json")))
    code, out, err = run(capsys, "emit", str(plan_file), "-B", "deepspeed")
    assert code == 2 and out == ""
    assert err.startswith("error: not expressible in DeepSpeed: cp (2) > 1")


@pytest.mark.parametrize("backend,launch_for,framework", [
    ("deepspeed", None, "deepspeed"), ("megatron-deepspeed", None, "deepspeed"), ("colossalai", None, "colossalai"),
    ("torchtitan", None, "torchtitan"), ("megatron-bridge", None, "megatron"),
    ("torchrun", "torchtitan", "torchtitan"), ("slurm", "deepspeed", "deepspeed")])
def test_searched_plans_are_ranked_by_the_backends_framework(capsys, backend, launch_for, framework):
    from planner.emit import imposed_settings

    """Plans searched by `emit` are costed and filtered as the framework that runs the emitted text runs them
    (`plan --framework`), not as Megatron does. Llama 3 8B at 8K on 8 H100s: Megatron's best plan (tp2, ZeRO 1)
    is not the other frameworks' (tp4, ZeRO 2-3)."""
    args = dict(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=32, seq_len=8192)
    launch = ["--launch-for", launch_for] if launch_for else []
    code, out, err = run(capsys, "emit", "-B", backend, *launch, "--allow-partial", "--model", "llama3-8b",
                         "--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size", "32", "--seq-len", "8192")
    assert code == 0, err
    imposed = imposed_settings(backend, "bf16", "delayed")  # as `emit` searches
    best = plan(top_k=1, framework=framework, **args, **imposed).plans[0]
    assert best.train.framework == framework
    if framework != "megatron":  # the case tells the frameworks apart
        assert best.strategy != plan(top_k=1, **args).plans[0].strategy
    from planner.emit import EmitOptions

    assert out == emit(best, backend, EmitOptions(launch_for=launch_for) if launch_for else None)


def test_a_framework_other_than_the_backends_is_refused(capsys):
    code, out, err = run(capsys, "emit", "-B", "deepspeed", "--framework", "megatron", *PLAN_ARGS)
    assert code == 2 and out == ""
    assert "--framework megatron disagrees with --backend deepspeed, which runs framework deepspeed" in err
    code, out, err = run(capsys, "emit", "-B", "torchtitan", "--framework", "torchtitan", *PLAN_ARGS)
    assert code == 0, err
    code, out, err = run(capsys, "emit", "-B", "megatron", "--framework", "megatorn", *PLAN_ARGS)
    assert code == 2 and out == ""
    assert "--framework must be one of colossalai, deepspeed, megatron, torchtitan (got 'megatorn')" in err


def test_search_options_reach_the_search(capsys):
    """Every `plan` search option shapes `emit`'s search the same way: an FP8 recipe, the MoE dispatcher,
    the headroom and the other training options."""
    args = ["--model", "qwen3-30b-a3b", "--cluster", "dgx-b200", "--gpus", "8", "--global-batch-size", "64",
            "--seq-len", "4096", "--precision", "fp8", "--fp8-recipe", "mxfp8", "--moe-dispatcher", "hybridep",
            "--moe-router-padding-for-quantization", "--moe-load-imbalance", "1.2", "--headroom", "10%",
            "--cross-entropy-fusion-impl", "te", "-C", "ep=8"]
    code, out, err = run(capsys, "emit", "-B", "megatron", "-f", "json", *args)
    assert code == 0, err
    best = plan(model="qwen3-30b-a3b", cluster="dgx-b200", num_gpus=8, global_batch_size=64, seq_len=4096,
                precision="fp8", fp8_recipe="mxfp8", moe_dispatcher="hybridep",
                moe_router_padding_for_quantization=True, moe_load_imbalance=1.2, headroom=0.10,
                cross_entropy_fusion_impl="te", constraints={"ep": 8}, top_k=1).plans[0]
    emitted = json.loads(out)["args"]
    assert emitted == megatron_args(best)
    for flag in ("--fp8-recipe", "--moe-flex-dispatcher-backend", "--moe-router-padding-for-quantization"):
        assert flag in emitted, flag
    assert emitted[emitted.index("--fp8-recipe") + 1] == "mxfp8"


@pytest.mark.parametrize("option", [["--precision", "fp8"], ["--fp8-recipe", "mxfp8"], ["--framework", "megatron"],
                                    ["--moe-dispatcher", "hybridep"], ["--headroom", "10%"], ["-C", "tp=2"],
                                    ["--grad-precision", "bf16"], ["--moe-router-padding-for-quantization"]])
def test_search_options_with_a_plan_file_are_refused(capsys, plan_file, option):
    """A plan file's plans were searched already: a search option beside it would be ignored, so it is refused."""
    code, out, err = run(capsys, "emit", str(plan_file), *option)
    assert code == 2 and out == ""
    assert "give either PLAN_JSON or plan options, not both (got PLAN_JSON and " + option[0].replace("-C", "--constraint") in err


def test_nothing_fits_exits_1(capsys):
    code, out, err = run(capsys, "emit", "--model", "llama3-70b", "--cluster", "dgx-a100-40gb", "--gpus", "8",
                         "--global-batch-size", "8", "--seq-len", "4096")
    assert code == 1 and out == "" and "no strategy fits" in err


def test_best_expressible_walks_down_the_ranking(capsys, tmp_path):
    # Llama 3.1 405B on 64 H100s: the top plans pipeline with ZeRO 2-3 or interleave, which DeepSpeed's
    # pipeline engine cannot run; a lower-ranked plan without them can
    args = ["--model", "llama3.1-405b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch-size", "256",
            "--seq-len", "8192"]
    # a Megatron-ranked plan file: its best plans pipeline with ZeRO 2-3 or interleave
    ranked = plan(model="llama3.1-405b", cluster="dgx-h100", num_gpus=64, global_batch_size=256, seq_len=8192,
                  top_k=200)
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(ranked.model_dump(mode="json")))
    code, out, err = run(capsys, "emit", str(path), "-B", "deepspeed", "--best-expressible", "-f", "json")
    assert code == 0, err
    skipped, note = err.splitlines()
    assert skipped.startswith("emitting plan ") and "are not expressible in DeepSpeed (" in skipped
    # the skipped plans are counted by reason ("reason: count, ..."), whichever reasons the ranking has today
    reasons = skipped.split("in DeepSpeed (", 1)[1].rsplit(")", 1)[0]
    rank = int(skipped.split()[2])
    assert note.startswith(f"note: plan {rank} was costed and ranked as megatron runs it, not deepspeed: ")
    counts = [int(n) for n in re.findall(r": (\d+)(?=, |$)", reasons)]
    assert counts and sum(counts) == rank - 1, reasons  # every skipped plan counted under one reason
    assert json.loads(out)["config"] == ds_config(ranked.plans[rank - 1])
    code, out, err = run(capsys, "emit", "-B", "megatron", "--best-expressible", "--format", "json", *args)
    assert code == 0 and err == ""  # rank 1 is expressible: nothing skipped
    # searched here for DeepSpeed, its own rules have removed what its engine cannot run: nothing skipped
    code, out, err = run(capsys, "emit", "-B", "deepspeed", "--best-expressible", "--format", "json", *args)
    assert code == 0 and err == "", err
    best = plan(model="llama3.1-405b", cluster="dgx-h100", num_gpus=64, global_batch_size=256, seq_len=8192,
                top_k=1, framework="deepspeed").plans[0]
    assert json.loads(out)["config"] == ds_config(best)


def test_best_expressible_with_too_short_a_file(capsys, tmp_path):
    result = plan(model="llama3.1-405b", cluster="dgx-h100", num_gpus=64, global_batch_size=256, seq_len=8192, top_k=2)
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(result.model_dump(mode="json")))
    code, _, err = run(capsys, "emit", str(path), "-B", "deepspeed", "--best-expressible")
    assert code == 2 and "not expressible in DeepSpeed: none of the 2 plans: " in err


def test_single_plan_json_is_accepted(capsys, result, tmp_path):
    path = tmp_path / "one.json"
    path.write_text(result.plans[2].model_dump_json())
    code, out, err = run(capsys, "emit", str(path), "-B", "megatron", "--allow-partial")
    assert code == 0, err
    assert out == emit(result.plans[2], "megatron")


def test_text_that_drops_part_of_the_plan_exits_2_unless_allowed(capsys, tmp_path):
    """DeepSpeed's bare ds_config.json has no key for tp or sequence parallelism: emit says so on
    stderr and prints nothing (exit 2); --allow-partial prints it; --format json carries both parts."""
    result = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=16, global_batch_size=64, seq_len=4096, top_k=1,
                  constraints={"tp": 4, "sequence_parallel": True, "zero_stage": 1}, framework="deepspeed")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(result.model_dump(mode="json")))
    code, out, err = run(capsys, "emit", str(path), "-B", "deepspeed")
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "deepspeed text drops part of plan 1: tp (4), sequence_parallel (true): ds_config.json has no key for them "
        "(DeepSpeed takes them from the training code's model parallel unit); emit --backend megatron-deepspeed for "
        "the pretrain_gpt.py flags that carry them, or --format json for both",
        "not emitted: pass --allow-partial to print it anyway"]
    code, out, err = run(capsys, "emit", str(path), "-B", "deepspeed", "--allow-partial")
    assert code == 0 and json.loads(out) == ds_config(result.plans[0]) and "drops part" in err
    code, out, err = run(capsys, "emit", str(path), "-B", "deepspeed", "-f", "json")
    assert code == 0 and err == "" and "--tensor-model-parallel-size" in json.loads(out)["megatron_deepspeed_args"]
    code, out, err = run(capsys, "emit", str(path), "-B", "megatron-deepspeed")
    assert code == 0 and err == "" and "--sequence-parallel" in out


def test_rope_base_is_written_or_named(capsys, plan_file, result):
    """Megatron's --rotary-base is the model's rope_theta; a spec without one would leave Megatron's
    default 10000 in place, so the text is withheld (exit 2) unless --allow-partial."""
    p = result.plans[0]
    theta = getattr(p.model, "rope_theta", None)
    code, out, err = run(capsys, "emit", str(plan_file), "-B", "megatron")
    if theta is None:
        assert code == 2 and out == "" and "--rotary-base: model llama3-8b has no rope_theta" in err
    else:
        assert code == 0 and f"--rotary-base {int(theta)}" in out
    with_theta = p.model_copy(update={"model": p.model.model_copy(update={"rope_theta": 500000.0})})
    assert omissions(with_theta, "megatron") == [] and "  --rotary-base 500000\n" in emit(with_theta, "megatron")
