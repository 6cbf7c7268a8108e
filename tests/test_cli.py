"""The command line: surface, formats, errors and exit codes."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys

import pytest
import typer

from planner import PlanResult, Strategy, evaluate, plan
from planner.cli import app, main
from planner.cli.plan_cmds import COMM_HIDDEN_WARN_FRACTION

PLAN_ARGS = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
             "--seq-len", "4096"]

# Frozen CLI surface (issue 2): commands and their long options. Changing it is a
# breaking change for users' scripts: extend it, never rename.
FROZEN = {
    "plan": ["--adapter-precision", "--double-quant", "--finetune", "--lora-alpha", "--lora-dropout", "--lora-layers", "--lora-rank",
             "--lora-targets", "--model-code", "--paged-optimizer", "--attention-kernel", "--calibration",
             "--ckpt-bandwidth", "--deadline", "--failure-rate", "--price", "--pue", "--tokens",
             "--cluster", "--constraint", "--constraints", "--cross-entropy-fusion",
             "--cross-entropy-fusion-impl", "--cuda-graph-impl", "--cuda-graph-scope",
             "--format", "--fp8-param-gather", "--fp8-recipe", "--framework", "--global-batch-size",
             "--gpus", "--grad-precision", "--headroom", "--model", "--moe-dispatcher", "--moe-flex-num-sms", "--moe-load-imbalance", "--moe-router-padding-for-quantization", "--optimizer", "--plot", "--precision",
             "--seq-len", "--strict-numerics", "--top", "--torch-compile", "--wide", "--zero3-impl"],
    "evaluate": ["--adapter-precision", "--double-quant", "--finetune", "--lora-alpha", "--lora-dropout", "--lora-layers", "--lora-rank",
             "--lora-targets", "--model-code", "--paged-optimizer", "--attention-kernel", "--calibration",
                 "--cluster", "--cp", "--cross-entropy-fusion", "--cross-entropy-fusion-impl", "--cuda-graph-impl", "--cuda-graph-scope",
                 "--dp", "--embedding-as-layer",
                 "--ep", "--etp", "--first-stage-layers", "--format", "--fp8-param-gather", "--fp8-recipe", "--framework", "--global-batch-size", "--gpus",
                 "--grad-precision", "--last-stage-layers", "--loss-as-layer", "--mbs", "--model", "--moe-dispatcher", "--moe-flex-num-sms", "--moe-load-imbalance", "--moe-router-padding-for-quantization",
                 "--offload-activation-layers", "--offload-optimizer", "--optimizer", "--overlap-grad-reduce",
                 "--overlap-moe-comm", "--overlap-p2p-comm", "--overlap-param-gather", "--plan", "--plot", "--pp", "--precision",
                 "--rank", "--rank-order", "--recompute-modules",
                 "--recompute",
                 "--recompute-num-layers", "--seq-len", "--sp", "--stage-layers", "--strict-numerics", "--torch-compile", "--tp", "--vpp", "--zero", "--zero-stage", "--zero3-impl"],
    "emit": ["--adapter-precision", "--double-quant", "--finetune", "--lora-alpha", "--lora-dropout", "--lora-layers",
             "--lora-rank", "--lora-targets", "--paged-optimizer",
             "--allow-partial", "--attention-kernel", "--backend", "--best-expressible", "--bridge-version",
             "--calibration",
             "--cluster", "--constraint",
             "--constraints", "--cross-entropy-fusion", "--cross-entropy-fusion-impl", "--cuda-graph-impl", "--cuda-graph-scope", "--format",
             "--fp8-param-gather", "--fp8-recipe", "--framework", "--global-batch-size", "--gpus",
             "--grad-precision", "--headroom", "--hf-model", "--job-name", "--launch-for", "--master-port", "--model",
             "--moe-dispatcher", "--moe-flex-num-sms", "--moe-load-imbalance",
             "--moe-router-padding-for-quantization", "--optimizer", "--plan", "--precision", "--rank", "--script",
             "--seq-len", "--strict-numerics", "--torch-compile", "--zero3-impl"],
    "models": ["--format"],
    "clusters": ["--constraint", "--constraints", "--format", "--global-batch-size", "--gpus", "--model", "--plot",
                 "--seq-len", "--show", "--strategy"],
    "validate": ["--adapter-precision", "--double-quant", "--finetune", "--framework", "--lora-alpha", "--lora-dropout",
                 "--lora-layers", "--lora-rank", "--lora-targets", "--paged-optimizer",
                 "--attention-kernel", "--autoshard", "--calibration", "--factory-arg", "--input-shape", "--ranks",
                 "--cluster", "--collect", "--constraint", "--constraints", "--device", "--engine",
                 "--format", "--global-batch-size", "--gpus", "--grad-precision", "--hsdp-replicate", "--keep",
                 "--max-host-memory", "--model", "--num-layers", "--optimizer", "--parity-steps", "--plan", "--plot", "--precision", "--prepare", "--seed",
                 "--seq-len", "--steps", "--strategy", "--timeout", "--top", "--warmup", "--work-dir"],
    "profile": ["--device", "--force", "--format", "--keep", "--name", "--nproc", "--out-dir", "--output", "--quick", "--timeout"],
}
FROZEN["explain"] = FROZEN["evaluate"]


def _surface() -> dict[str, list[str]]:
    cmd = typer.main.get_command(app)
    return {name: sorted(o for p in c.params for o in p.opts if o.startswith("--"))
            for name, c in cmd.commands.items()}


def test_cli_surface_is_frozen():
    surface = _surface()
    for name, options in FROZEN.items():
        assert surface.get(name) == sorted(options), name


def test_documented_commands_exist():
    assert {"plan", "evaluate", "explain", "emit", "validate", "profile", "models", "clusters"} <= set(_surface())


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_table(capsys):
    code, out, err = run(capsys, "plan", *PLAN_ARGS, "--top", "3")
    assert code == 0, err
    for header in ("layout", "zero", "recompute", "split", "step (s)", "MFU %", "GiB/GPU"):
        assert header in out
    code, out, err = run(capsys, "plan", *PLAN_ARGS, "--top", "3", "--wide")
    assert code == 0, err
    for header in ("step (s)", "tok/s/GPU", "model TFLOP/s/GPU", "MFU %", "mem/GPU (GiB)", "headroom (GiB)"):
        assert header in out
    assert "candidates evaluated" in out and "rejected by reason" in out and "search time" in out


def test_plan_json_is_the_python_result(capsys):
    code, out, _ = run(capsys, "plan", *PLAN_ARGS, "--top", "2", "--format", "json")
    assert code == 0
    data = json.loads(out)
    result = PlanResult.model_validate(data)
    direct = plan("llama3-8b", "dgx-h100", 16, 64, 4096, top_k=2)
    assert [p.strategy for p in result.plans] == [p.strategy for p in direct.plans]
    assert [p.estimate for p in result.plans] == [p.estimate for p in direct.plans]
    assert set(data) == set(direct.model_dump(mode="json"))


def test_plan_csv(capsys):
    code, out, _ = run(capsys, "plan", *PLAN_ARGS, "--top", "4", "--format", "csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 4 and rows[0]["rank"] == "1"
    assert {"tp", "pp", "step_time_s", "mfu", "time_s.compute", "memory_bytes.activations"} <= set(rows[0])


def test_plan_constraints(capsys):
    code, out, _ = run(capsys, "plan", *PLAN_ARGS, "-C", "tp=2", "-C", "pp=1,2", "--format", "json")
    assert code == 0
    assert all(p["strategy"]["tp"] == 2 and p["strategy"]["pp"] in (1, 2) for p in json.loads(out)["plans"])


def test_evaluate_and_explain(capsys):
    args = ["--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--gpus", "1024", "--global-batch-size", "1536",
            "--seq-len", "2048", "--tp", "8", "--pp", "8", "--mbs", "1", "--recompute", "selective", "--sp"]
    code, out, err = run(capsys, "evaluate", *args)
    assert code == 0, err
    assert "dp16 tp8 pp8" in out and "MFU" in out and "fits" in out
    code, out, _ = run(capsys, "explain", *args)
    assert code == 0
    assert "memory of the most-loaded rank" in out and "activations" in out and "pp_bubble" in out
    code, out, _ = run(capsys, "explain", *args, "--format", "json")
    assert json.loads(out)["binding_stage"] in ("first", "middle", "last")


# ---- the stage split and overlap (issue 7) -------------------------------------------------------------
SPLIT_ARGS = ["--model", "llama3.1-405b", "--cluster", "dgx-h100", "--gpus", "512", "--global-batch-size", "256",
              "--seq-len", "8192"]


def _split_flags(label: str) -> list[str]:
    """What a user types into evaluate for a plan table's split cell."""
    if label == "even":
        return []
    flags: list[str] = []
    for part in label.split():
        key, _, value = part.partition("=")
        flags += {"split": ["--stage-layers", value], "first": ["--first-stage-layers", value],
                  "last": ["--last-stage-layers", value]}.get(key, [])
        if part.endswith("-as-layer"):
            flags += [f"--{'embedding' if n == 'emb' else 'loss'}-as-layer" for n in part[:-len("-as-layer")].split("+")]
    return flags


@pytest.mark.parametrize("constraints", [["-C", "tp=8", "-C", "pp=16"],
                                         ["-C", "tp=8", "-C", "pp=4", "-C", "stage_layers=30,33,33,30"],
                                         ["-C", "tp=8", "-C", "pp=2", "-C", "vpp=4", "-C", "embedding_as_layer=true",
                                          "-C", "loss_as_layer=true"]])
def test_plan_table_split_retypes_into_evaluate(capsys, constraints):
    code, out, _ = run(capsys, "plan", *SPLIT_ARGS, *constraints, "--top", "1", "--format", "json")
    data = json.loads(out)
    top = (data["plans"] or data["closest"])[0]
    st = Strategy.model_validate(top["strategy"])
    label = st.split_label()
    assert label  # every case is a non-even split
    code, table, _ = run(capsys, "plan", *SPLIT_ARGS, *constraints, "--top", "1")
    assert "split" in table and label in table
    flags = ["--tp", str(st.tp), "--pp", str(st.pp), "--cp", str(st.cp), "--vpp", str(st.vpp), "--zero",
             str(st.zero_stage), "--mbs", str(st.micro_batch_size), "--recompute", st.recompute]
    flags += ["--sp"] if st.sequence_parallel else []
    flags += ["--recompute-num-layers", str(st.recompute_num_layers)] if st.recompute_num_layers else []
    flags += ["--offload-optimizer"] if st.offload_optimizer else []
    code, out, err = run(capsys, "evaluate", *SPLIT_ARGS, *flags, *_split_flags(label), "--format", "json")
    assert "Traceback" not in err
    assert json.loads(out)["step_time_s"] == top["estimate"]["step_time_s"]


def test_evaluate_split_options_are_the_strategy_fields(capsys):
    args = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
            "--seq-len", "4096", "--tp", "2", "--pp", "4"]
    for flags, fields in [(["--stage-layers", "7,9,10,6"], {"stage_layers": [7, 9, 10, 6]}),
                          (["--pp", "2", "--embedding-as-layer", "--loss-as-layer"],
                           {"pp": 2, "embedding_as_layer": True, "loss_as_layer": True})]:
        code, out, _ = run(capsys, "evaluate", *args, *flags, "--format", "json")
        direct = evaluate("llama3-8b", "dgx-h100", 16, 64, 4096, strategy=Strategy(**{"tp": 2, "pp": 4, **fields}))
        assert json.loads(out) == direct.model_dump(mode="json")
    code, _, err = run(capsys, "evaluate", *args, "--stage-layers", "7,9,x")
    assert code == 2 and "--stage-layers must be comma-separated layer counts" in err and "Traceback" not in err


# ---- activation offloading (Megatron's --cpu-offloading-num-layers) ------------------------------------
OFFLOAD_ARGS = ["--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch-size", "128",
                "--seq-len", "8192"]


def test_evaluate_offload_activation_layers_is_the_strategy_field(capsys):
    flags = ["--tp", "8", "--sp", "--zero", "1", "--offload-activation-layers", "20"]
    code, out, _ = run(capsys, "evaluate", *OFFLOAD_ARGS, *flags, "--format", "json")
    direct = evaluate("llama3-70b", "dgx-h100", 64, 128, 8192,
                      strategy=Strategy(tp=8, sequence_parallel=True, zero_stage=1, offload_activation_layers=20))
    assert json.loads(out) == direct.model_dump(mode="json")
    plain = evaluate("llama3-70b", "dgx-h100", 64, 128, 8192,
                     strategy=Strategy(tp=8, sequence_parallel=True, zero_stage=1))
    assert direct.memory_bytes["activations"] < plain.memory_bytes["activations"]  # the option reached the model
    code, out, _ = run(capsys, "explain", *OFFLOAD_ARGS, *flags)
    assert "act-offload20" in out
    assert "activation_offload (copies to and from the host the compute waits for)" in out
    code, out, err = run(capsys, "evaluate", *OFFLOAD_ARGS, *flags, "--pp", "2")
    assert code == 2 and "offload_activation_layers (20) needs pp 1" in err and "Traceback" not in err + out


def test_plan_constraint_offload_activation_layers_shows_in_the_table_and_retypes_into_evaluate(capsys):
    constraints = ["-C", "offload_activation_layers=20", "-C", "pp=1", "-C", "tp=8"]
    code, out, err = run(capsys, "plan", *OFFLOAD_ARGS, *constraints, "--top", "3", "--format", "json")
    assert code == 0, err
    plans = json.loads(out)["plans"]
    assert plans and all(p["strategy"]["offload_activation_layers"] == 20 for p in plans)
    code, table, _ = run(capsys, "plan", *OFFLOAD_ARGS, *constraints, "--top", "3")
    assert "none+cpu(20)" in table
    assert "recompute none+cpu(N): the activations of the first N layers offloaded to host memory" in table
    s = plans[0]["strategy"]
    flags = ["--dp", str(s["dp"]), "--tp", str(s["tp"]), "--cp", str(s["cp"]), "--zero", str(s["zero_stage"]),
             "--mbs", str(s["micro_batch_size"]), "--offload-activation-layers", "20"]
    flags += ["--sp"] if s["sequence_parallel"] else []
    flags += ["--offload-optimizer"] if s["offload_optimizer"] else []
    code, out, _ = run(capsys, "evaluate", *OFFLOAD_ARGS, *flags, "--format", "json")
    assert json.loads(out)["step_time_s"] == plans[0]["estimate"]["step_time_s"]
    code, table, _ = run(capsys, "plan", *OFFLOAD_ARGS, "-C", "pp=1", "-C", "tp=8", "-C", "offload_activation_layers=null",
                         "--top", "3")
    assert "+cpu(" not in table and "none+cpu(N)" not in table  # no offloading plan, no legend line


def test_plan_warns_when_the_top_plan_assumes_nearly_all_communication_hidden(capsys):
    # an A100 cluster: its profile credits full overlap (the H100 and newer ones charge NCCL's share of the SMs)
    args = [a if a != "dgx-h100" else "dgx-a100-80gb" for a in PLAN_ARGS]
    code, _, err = run(capsys, "plan", *args, "--top", "1")
    top = plan("llama3-8b", "dgx-a100-80gb", 16, 64, 4096, top_k=1).plans[0].estimate
    assert top.comm_hidden_fraction > COMM_HIDDEN_WARN_FRACTION
    assert f"the prediction assumes {100 * top.comm_hidden_fraction:.0f}% of communication hidden behind compute; " \
           "real overlap is often lower" in err
    gpt3 = ["--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--gpus", "1024", "--global-batch-size", "1536",
            "--seq-len", "2048", "--precision", "fp16", "-C", "tp=8", "-C", "pp=8", "-C", "recompute=selective",
            "-C", "sequence_parallel=true", "-C", "zero_stage=0", "--top", "1"]
    code, _, err = run(capsys, "plan", *gpt3)  # a tp8/pp8 plan exposes most of its communication
    assert code == 0 and "communication hidden" not in err


def test_explain_names_the_binding_ranks_and_the_hidden_communication(capsys):
    args = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size", "32",
            "--seq-len", "4096", "--tp", "2", "--pp", "4", "--stage-layers", "5,10,10,7"]
    code, out, _ = run(capsys, "explain", *args, "--format", "json")
    est = json.loads(out)
    code, out, _ = run(capsys, "explain", *args)
    r = est["binding_pipeline_rank"]
    assert r == 1  # the first 10-layer stage holds more micro-batches in flight than the second
    # tp 2 innermost, pp outermost: pipeline stage r is ranks 2r and 2r+1
    assert f"memory of the most-loaded rank: pipeline stage 1 ({est['binding_stage']}), ranks 2-3" in out
    assert f"communication hidden behind compute (assumed): {100 * est['comm_hidden_fraction']:.0f} %" in out


def test_evaluate_not_fitting_exits_1(capsys):
    code, out, _ = run(capsys, "evaluate", "--model", "llama3-70b", "--cluster", "dgx-a100-40gb", "--gpus", "8",
                       "--global-batch-size", "8", "--seq-len", "4096", "--tp", "8")
    assert code == 1 and "does not fit" in out


def test_presets_listing(capsys):
    code, out, _ = run(capsys, "models", "--format", "json")
    assert code == 0 and any(m["name"] == "llama3.1-405b" for m in json.loads(out))
    code, out, _ = run(capsys, "clusters")
    assert code == 0 and "gb200-nvl72" in out


@pytest.mark.parametrize("args,message", [
    (["--model", "llama3-7b"], "close matches"),
    (["--gpus", "0"], "num_gpus must be a positive integer"),
    (["--cluster", "nowhere.yaml"], "does not exist"),
    (["-C", "tp=3", "-C", "pp=3"], "no strategy has dp·tp·cp·pp"),
    (["-C", "tensor=2"], "unknown constraint field"),
    (["--constraints", "{bad"], "--constraints is not valid JSON"),
])
def test_bad_input_one_line_exit_2(capsys, args, message):
    base = dict(zip(PLAN_ARGS[::2], PLAN_ARGS[1::2]))
    base.update(dict(zip(args[::2], args[1::2])))
    argv = ["plan"] + [x for kv in base.items() for x in kv if kv[0] not in ("-C", "--constraints")]
    argv += [x for i in range(0, len(args), 2) if args[i] in ("-C", "--constraints") for x in args[i:i + 2]]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err + out


def test_malformed_cluster_yaml(capsys, tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("- just\n- a list\n")
    code, _, err = run(capsys, "plan", *PLAN_ARGS[:2], "--cluster", str(bad), *PLAN_ARGS[4:])
    assert code == 2 and "must hold a mapping" in err


def test_no_fit_exits_1_with_closest(capsys):
    code, out, err = run(capsys, "plan", "--model", "llama3.1-405b", "--cluster", "dgx-a100-40gb", "--gpus", "8",
                         "--global-batch-size", "8", "--seq-len", "8192")
    assert code == 1
    assert "no strategy fits" in err and "closest" in err and "GiB" in err


def test_python_dash_m_and_console_script_agree():
    # `python -m planner` is the same CLI, in a fresh process: real exit code, no traceback.
    proc = subprocess.run([sys.executable, "-m", "planner", "plan", *PLAN_ARGS[:6], "--global-batch-size", "64",
                           "--seq-len", "0"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "seq_len" in proc.stderr and "Traceback" not in proc.stderr


def test_deepseek_v3_plan_has_expert_columns_and_explain_shows_the_all_to_all(capsys, tmp_path):
    """Issue 8's acceptance question, end to end through the CLI."""
    args = ["--model", "deepseek-v3", "--cluster", "dgx-h100", "--gpus", "2048", "--global-batch-size", "4096",
            "--seq-len", "4096"]
    code, out, err = run(capsys, "plan", *args, "--top", "3", "--wide")
    assert code == 0, err
    header = next(line for line in out.splitlines() if "step (s)" in line)
    assert " ep " in header and " etp " in header
    code, out, err = run(capsys, "plan", *args, "--top", "3")
    assert code == 0, err
    assert re.search(r"\bep\d+\b", out)  # the default table's layout cell names the expert degree
    code, out, _ = run(capsys, "plan", *args, "--top", "1", "--format", "json")
    # the plan's own settings (dispatcher, all-to-all overlap, graphs) travel in the plan file
    plan_file = tmp_path / "plans.json"
    plan_file.write_text(out)
    code, out, err = run(capsys, "explain", "--plan", str(plan_file), "--rank", "1")
    assert code == 0, err
    line = next(row for row in out.splitlines() if "ep_comm (MoE token all-to-all" in row)
    assert float(line.split("│")[2]) > 0  # seconds of exposed all-to-all


def _readme_plan_examples() -> list[list[str]]:
    """Every concrete `meshplan plan --model ...` command in the README (code blocks and inline code),
    without its shell comment, redirection and the `pip install ... &&` before it."""
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    commands = []
    for match in re.finditer(r"meshplan plan --model [^`\n]*", text):
        words = shlex.split(match.group(0), comments=True)
        words = words[:words.index(">")] if ">" in words else words
        commands.append(words[1:])
    return commands


def test_readme_plan_examples_rank_plans(capsys):
    """The README's plan examples (the GPT-3 first line, DeepSeek-V3, the saved llama3-70b plans, the CPU
    profile's) each print a ranked plan, not "no strategy fits"."""
    examples = _readme_plan_examples()
    assert len(examples) >= 4 and any("local-cpu" in words for words in examples)
    for words in examples:
        code, out, err = run(capsys, *words)
        assert code == 0, (words, err)
        assert "ranked plans" in out or out.lstrip().startswith("{"), words
