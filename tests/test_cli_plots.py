"""`--plot FILE` on plan, explain and validate: the picture written, `plot: FILE` on stderr, a bad target refused
in one line before any work."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from planner.cli import main

pytest.importorskip("matplotlib")

PLAN_ARGS = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size", "32",
             "--seq-len", "4096", "-C", "pp=1,2", "-C", "zero_stage=1", "-C", "recompute=none"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def ids(path) -> set[str]:
    return {e.get("id") for e in ET.parse(path).getroot().iter() if e.get("id")}


def test_plan_plot_writes_both_panels(capsys, tmp_path):
    target = tmp_path / "plan.svg"
    code, out, err = run(capsys, "plan", *PLAN_ARGS, "--top", "3", "--plot", str(target))
    assert code == 0, err
    assert f"plot: {target}" in err
    drawn = ids(target)
    assert {"candidates", "pareto-front", "plans", "memory-limit"} <= drawn
    assert {i for i in drawn if i.startswith("bar-compute-")} == {"bar-compute-1", "bar-compute-2", "bar-compute-3"}


@pytest.mark.parametrize("name,message", [("plan.pdf", "must name a .png or .svg file"),
                                          ("missing/plan.png", "does not exist")])
def test_bad_plot_target_is_refused_before_the_search(capsys, tmp_path, name, message):
    code, out, err = run(capsys, "plan", *PLAN_ARGS, "--plot", str(tmp_path / name))
    assert code == 2 and message in err
    assert out == "" and "Traceback" not in err  # refused before any table


def test_explain_plot_draws_memory_per_rank_and_the_schedule(capsys, tmp_path):
    target = tmp_path / "explain.png"
    code, out, err = run(capsys, "explain", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                         "--global-batch-size", "32", "--seq-len", "4096", "--tp", "2", "--pp", "4", "--vpp", "2",
                         "--plot", str(target))
    assert code == 0, err
    assert f"plot: {target}" in err and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "explain.svg"
    assert run(capsys, "explain", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
               "--global-batch-size", "32", "--seq-len", "4096", "--tp", "2", "--pp", "4", "--vpp", "2",
               "--plot", str(svg))[0] == 0
    drawn = ids(svg)
    assert {"row-r0", "row-r3", "mem-params-r0", "mem-params-r3", "memory-limit"} <= drawn


def test_plan_that_fits_nothing_still_draws_and_exits_1(capsys, tmp_path):
    target = tmp_path / "closest.svg"
    code, out, err = run(capsys, "plan", "--model", "llama3.1-405b", "--cluster", "dgx-a100-40gb", "--gpus", "8",
                         "--global-batch-size", "8", "--seq-len", "8192", "--top", "3", "--plot", str(target))
    assert code == 1
    assert f"plot: {target}" in err and "memory-limit" in ids(target)


def test_validate_plot_refused_with_prepare(capsys, tmp_path):
    code, out, err = run(capsys, "validate", "--plan", str(tmp_path / "p.json"), "--prepare", str(tmp_path),
                         "--plot", str(tmp_path / "v.png"))
    assert code == 2 and "not with --prepare" in err
