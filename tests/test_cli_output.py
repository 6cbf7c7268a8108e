"""Terminal-sized output and plans read back by rank (issue #10, parts 1 and 2): the default plan
table fits 100 columns with every cell whole, `--wide` has the full detail, every command's help
fits 80 columns with option names whole, and `--plan FILE --rank N` reproduces any row."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from planner import plan
from planner.cli import app, main
from planner.cli.plan_cmds import print_plan_table

QUESTIONS = [
    dict(model="llama3.1-405b", cluster="dgx-h100", num_gpus=16384, global_batch_size=2048, seq_len=8192),
    dict(model="mixtral-8x22b", cluster="dgx-h100", num_gpus=256, global_batch_size=512, seq_len=4096),
    dict(model="llama3-8b", cluster="dgx-h100", num_gpus=16, global_batch_size=64, seq_len=4096),
    dict(model="llama3.1-405b", cluster="dgx-a100-40gb", num_gpus=8, global_batch_size=8, seq_len=8192),  # no fit
]


@pytest.mark.parametrize("question", QUESTIONS, ids=lambda q: f"{q['model']}-{q['num_gpus']}")
def test_default_table_fits_100_columns_with_every_cell_whole(question):
    result = plan(**question, top_k=10)
    buf = io.StringIO()
    print_plan_table(result, console=Console(file=buf, width=100, soft_wrap=True, color_system=None))
    text = buf.getvalue()
    assert all(len(line) <= 100 for line in text.splitlines()), max(text.splitlines(), key=len)
    assert "…" not in text
    for p in result.plans or result.closest:
        assert f"{p.estimate.step_time_s:.3f}" in text  # step time printed in full
        assert (p.strategy.split_label() or "even") in text


def _cli(*args: str, columns: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS=str(columns), PYTHONPATH=os.getcwd())
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_cli_table_in_a_100_column_terminal():
    q = QUESTIONS[0]
    proc = _cli("plan", "--model", q["model"], "--cluster", q["cluster"], "--gpus", str(q["num_gpus"]),
                "--global-batch-size", str(q["global_batch_size"]), "--seq-len", str(q["seq_len"]), columns=100)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert "…" not in proc.stdout and "step (s)" in proc.stdout


def test_wide_shows_the_full_detail(capsys):
    code = main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
                 "--seq-len", "4096", "--top", "3", "--wide"])
    out = capsys.readouterr().out
    assert code == 0
    for col in ("step band (s)", "tok/s/GPU", "model TFLOP/s/GPU", "MFU band %", "headroom (GiB)"):
        assert col in out
    assert "…" not in out


def _commands():
    import typer.main

    return typer.main.get_command(app).commands


@pytest.mark.parametrize("name", sorted(_commands()))
def test_help_fits_80_columns_and_names_every_option_whole(name):
    result = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"},
                                terminal_width=80)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    for param in _commands()[name].params:
        for opt in param.opts + param.secondary_opts:
            if opt.startswith("--"):
                assert opt in result.output, opt
    assert "…" not in result.output


@pytest.mark.parametrize("value", ["5%", "0.05"])
def test_headroom_option_takes_a_percentage_or_a_fraction(capsys, value):
    code = main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
                 "--seq-len", "4096", "--top", "1", "--headroom", value, "--format", "json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["headroom"] == pytest.approx(0.05)


@pytest.mark.parametrize("value", ["150%", "-1", "x", "1"])
def test_bad_headroom_option_is_one_line_exit_2(capsys, value):
    code = main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
                 "--seq-len", "4096", "--headroom", value])
    err = capsys.readouterr().err
    assert code == 2 and "--headroom" in err and len(err.strip().splitlines()) == 1


def _plans_file(tmp_path_factory, constraints: dict):
    path = tmp_path_factory.mktemp("plans") / "plans.json"
    result = plan(model="llama3.1-405b", cluster="dgx-h100", num_gpus=1024, global_batch_size=512, seq_len=8192,
                  top_k=6, constraints=constraints)
    path.write_text(result.model_dump_json())
    return path, result


@pytest.fixture(scope="module")
def plans_file(tmp_path_factory):
    # the best rows are pipeline layouts, with uneven splits (activation offloading ranks after any layout
    # within the tie tolerance)
    return _plans_file(tmp_path_factory, {})


@pytest.fixture(scope="module")
def offload_plans_file(tmp_path_factory):
    # without pipeline parallelism or recomputation only offloading activations fits (Megatron's
    # --cpu-offloading-num-layers)
    return _plans_file(tmp_path_factory, {"pp": 1, "recompute": "none"})


@pytest.mark.parametrize("fixture,kind", [("plans_file", "uneven split"), ("offload_plans_file", "act-offload")])
def test_plan_file_rank_reproduces_every_row_in_evaluate_explain_and_emit(capsys, request, fixture, kind):
    path, result = request.getfixturevalue(fixture)
    has = {"uneven split": lambda s: bool(s.split_label()), "act-offload": lambda s: bool(s.offload_activation_layers)}
    assert any(has[kind](p.strategy) for p in result.plans)  # the kind of row this file is for
    for p in result.plans:
        for command in ("evaluate", "explain"):
            code = main([command, "--plan", str(path), "--rank", str(p.rank), "--format", "json"])
            out = capsys.readouterr().out
            assert code == 0
            est = json.loads(out)
            assert est["step_time_s"] == p.estimate.step_time_s
            assert est["peak_memory_bytes"] == p.estimate.peak_memory_bytes
        code = main(["emit", "--plan", str(path), "--rank", str(p.rank), "--format", "json"])
        assert code == 0
        emitted = json.dumps(json.loads(capsys.readouterr().out))
        assert "--pipeline-model-parallel-size" in emitted
        assert ("--cpu-offloading-num-layers" in emitted) == bool(p.strategy.offload_activation_layers)


def test_plan_file_refuses_strategy_flags_and_a_missing_rank(capsys, plans_file):
    path, _ = plans_file
    code = main(["evaluate", "--plan", str(path), "--rank", "1", "--tp", "4"])
    assert code == 2 and "drop --tp" in capsys.readouterr().err
    code = main(["explain", "--plan", str(path), "--rank", "99"])
    assert code == 2 and "--rank 99 is not in" in capsys.readouterr().err
    code = main(["evaluate", "--rank", "2", "--model", "llama3-8b"])
    assert code == 2 and "give --plan FILE too" in capsys.readouterr().err


def test_json_output_has_no_progress_text(capsys):
    code = main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
                 "--seq-len", "4096", "--top", "1", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["plans"] and "searching" not in out + err
