"""Capacity planning (planner.capacity, `meshplan plan --gpus A:B --tokens ...`): the GPU counts a range
names, the figures of each row, the deadline's choice, the CLI's table, JSON and refusals."""

from __future__ import annotations

import json

import pytest

import planner
from planner.capacity import J_PER_MWH, gpu_sizes, parse_duration, parse_tokens
from planner.cli import main
from planner.errors import SpecError
from planner.specs.capacity import CapacityResult

SMALL = dict(model="llama3-8b", cluster="dgx-h100", global_batch_size=64, seq_len=4096)
ARGS = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch-size", "64", "--seq-len", "4096"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def small():
    return planner.plan_capacity(gpus=[8, 16, 32], tokens="100B", price_per_gpu_hour=2.5, **SMALL)


@pytest.mark.parametrize("text,per_node,sizes", [
    ("256:4096", 8, [256, 512, 1024, 2048, 4096]),
    ("300:1000", 8, [300, 512, 1000]),
    ("8:8", 8, [8]),
    ("72:1152", 72, [72, 144, 288, 576, 1152]),
    ("8:32:8", 8, [8, 16, 24, 32]),
    ("8:30:8", 8, [8, 16, 24]),
    ("1024,256,512", 8, [256, 512, 1024]),
    ("64", 8, [64]),
])
def test_gpu_sizes_rule(text, per_node, sizes):
    assert gpu_sizes(text, per_node)[0] == sizes


@pytest.mark.parametrize("text,match", [("8:4", "1 <= A <= B"), ("0:8", "1 <= A <= B"), ("8:x", "whole number"),
                                        ("8:16:0", "at least 1"), ("1:2:3:4", "A:B"), ("1,2,1", "each count once"),
                                        ("1:1000:1", "at most 64"), ("+8", "whole number"), ("8,", "whole number"),
                                        ("", "whole number")])
def test_malformed_gpu_sizes_are_refused(text, match):
    with pytest.raises(SpecError, match=match):
        gpu_sizes(text, 8)


def test_token_budgets_and_durations():
    assert parse_tokens("15T") == 15e12 and parse_tokens("300b") == 300e9 and parse_tokens("2.5M") == 2.5e6
    assert parse_tokens("1K") == 1e3 and parse_tokens(1e9) == 1e9 and parse_tokens("1e12") == 1e12
    assert parse_duration("36h") == 36 * 3600 and parse_duration("30d") == 30 * 86400
    assert parse_duration("2w") == 14 * 86400 and parse_duration(3600.0) == 3600.0
    for bad in ("0", "-1T", "T", "15X", "nan", "inf", 0, -5, True, None):
        with pytest.raises(SpecError, match="tokens must be a positive number"):
            parse_tokens(bad)
    for bad in ("0d", "30", "-2w", "d", "nand", 0, -1.0):
        with pytest.raises(SpecError, match="deadline must be a positive duration"):
            parse_duration(bad)


def test_rows_hold_each_counts_best_plan_and_its_figures(small):
    assert [r.num_gpus for r in small.rows] == [8, 16, 32]
    assert small.tokens == 100e9 and small.chosen is None
    for r in small.rows:
        best = planner.plan(num_gpus=r.num_gpus, top_k=1, **SMALL).plans[0]
        assert r.plan.strategy == best.strategy and r.step_time_s == best.estimate.step_time_s
        assert r.time_to_train_s == pytest.approx(100e9 / r.tokens_per_s)
        assert r.time_to_train_goodput_s == pytest.approx(r.time_to_train_s / r.goodput.fraction)
        assert r.gpu_hours == pytest.approx(r.num_gpus * r.time_to_train_goodput_s / 3600)
        assert r.cost == pytest.approx(2.5 * r.gpu_hours)
        assert r.energy_j == pytest.approx(700.0 * r.gpu_hours * 3600)  # H100 SXM board power
    times = [r.time_to_train_goodput_s for r in small.rows]
    assert times == sorted(times, reverse=True)


def test_deadline_picks_the_cheapest_count_that_meets_it(small):
    """A deadline between the 16- and 8-GPU times: 16 and 32 meet it, and the cheaper of the two is chosen."""
    t8, t16 = small.rows[0].time_to_train_goodput_s, small.rows[1].time_to_train_goodput_s
    result = planner.plan_capacity(gpus="8,16,32", tokens="100B", price_per_gpu_hour=2.5, deadline_s=(t8 + t16) / 2,
                                   **SMALL)
    meeting = [r for r in result.rows if r.meets_deadline]
    assert [r.num_gpus for r in meeting] == [16, 32]
    assert result.chosen == min(meeting, key=lambda r: r.cost).num_gpus
    assert not result.row(8).meets_deadline


def test_deadline_needs_tokens_and_sizes_no_count_fits_are_refused():
    with pytest.raises(SpecError, match="deadline_s needs tokens"):
        planner.plan_capacity(gpus=[8, 16], deadline_s="30d", **SMALL)
    with pytest.raises(SpecError, match="no count is valid.*3: shares no factor.*5: shares no factor"):
        planner.plan_capacity(gpus="3,5", tokens="1T", **SMALL)
    with pytest.raises(SpecError, match="exceeds cluster llama3-h100-24k's max_gpus"):
        planner.plan_capacity(gpus="32768,65536", tokens="1T", **(SMALL | {"cluster": "llama3-h100-24k"}))


def test_energy_is_refused_for_a_gpu_without_a_published_board_power():
    result = planner.plan_capacity(model="llama3-8b", cluster="tpu-v5p-128", gpus=64, global_batch_size=64,
                                   seq_len=4096, tokens="1T")
    row = result.rows[0]
    assert row.energy_j is None and "TPU-v5p" in row.energy_note and row.gpu_hours > 0


def test_capacity_table_and_json_round_trip(capsys):
    code, out, err = run(capsys, "plan", *ARGS, "--gpus", "8:32", "--tokens", "100T", "--price", "2.5")
    assert code == 0, err
    for col in ("GPUs", "layout", "Mtok/s", "MFU %", "goodput %", "ideal days", "days w/ goodput",
                "GPU-hours (M)", "cost (M)", "MWh"):
        assert col in out
    # a small budget in small units: hours, plain GPU-hours and cost, kWh
    code, out, err = run(capsys, "plan", *ARGS, "--gpus", "8:32", "--tokens", "1B", "--price", "2.5")
    assert code == 0, err
    for col in ("ideal hours", "hours w/ goodput", "GPU-hours", "cost", "kWh"):
        assert col in out
    assert "(M)" not in out and "to train: 1B tokens" in out
    assert "GPU counts: 8, 32 and every power-of-two number of 8-GPU nodes between" in out
    code, out, err = run(capsys, "plan", *ARGS, "--gpus", "8:32", "--tokens", "100B", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    result = CapacityResult.model_validate(data)
    assert result.model_dump(mode="json") == data
    assert [r.num_gpus for r in result.rows] == [8, 16, 32]
    code, out, err = run(capsys, "plan", *ARGS, "--gpus", "8,16", "--tokens", "100B", "--format", "csv")
    assert code == 0, err
    assert out.splitlines()[0].startswith("num_gpus,num_nodes,layout") and len(out.splitlines()) == 3


def test_cli_deadline_marks_the_choice_or_exits_1_with_the_fastest(capsys):
    code, out, err = run(capsys, "plan", *ARGS, "--gpus", "8,16", "--tokens", "100B", "--deadline", "52w")
    assert code == 0, err
    assert "the cheapest count that meets it is " in out
    code, out, err = run(capsys, "plan", *ARGS, "--gpus", "8,16", "--tokens", "100B", "--deadline", "1h")
    assert code == 1
    assert "no GPU count meets the deadline of 1.0 h: the fastest, 16 GPUs, takes" in err
    assert "Traceback" not in err


def test_single_count_prints_time_cost_energy_and_goodput_under_the_plan_table(capsys):
    code, out, err = run(capsys, "plan", *ARGS, "--gpus", "16", "--top", "1", "--tokens", "100B", "--price", "2")
    assert code == 0, err
    assert "ranked plans" in out and "goodput: " in out and "time to train 100B tokens:" in out
    assert "cost: " in out and "MWh (700 W board power" in out
    code, out, err = run(capsys, "plan", *ARGS, "--gpus", "16", "--top", "1")
    assert code == 0 and "goodput" not in out  # a small job without --tokens: the plan table alone
    code, out, err = run(capsys, "plan", *ARGS, "--gpus", "1024", "--global-batch-size", "1024", "--top", "1")
    assert code == 0, err
    assert "goodput: " in out and "failures every" in out and "checkpoint" in out


@pytest.mark.parametrize("extra,message", [
    (["--tokens", "0"], "--tokens must be a positive number"),
    (["--tokens", "-3T"], "--tokens must be a positive number"),
    (["--tokens", "1T", "--price", "-1"], "--price must be a finite price"),
    (["--tokens", "1T", "--deadline", "0d"], "--deadline must be a positive duration"),
    (["--deadline", "30d"], "--deadline needs --tokens"),
    (["--price", "2"], "--price needs --tokens"),
    (["--tokens", "1T", "--pue", "0.9"], "--pue must be a power usage effectiveness"),
    (["--failure-rate", "-1"], "--failure-rate must be a positive"),
    (["--ckpt-bandwidth", "0"], "--ckpt-bandwidth (GB/s) must be a positive"),
    (["--gpus", "16:8"], "gpus: a range A:B needs 1 <= A <= B"),
    (["--gpus", "8:16:x"], "gpus: the STEP of A:B[:STEP] must be a whole number"),
    (["--gpus", "3,5,7"], "no count is valid for cluster dgx-h100 and global_batch_size 64"),
    (["--gpus", "8,16", "--plot", "x.png"], "--plot draws one plan's pictures"),
])
def test_bad_capacity_input_is_one_line_exit_2(capsys, extra, message):
    argv = ["plan", *ARGS, "--gpus", "16", *extra]
    code, out, err = run(capsys, *argv)
    assert code == 2, (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert "Traceback" not in err + out


def test_energy_in_the_table_is_megawatt_hours(small):
    r = small.rows[0]
    assert r.energy_j / J_PER_MWH == pytest.approx(0.7 * r.gpu_hours / 1000)
