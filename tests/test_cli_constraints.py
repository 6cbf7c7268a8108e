"""Constraints on the command line: malformed or oversized input is one `error:` line and exit 2 (never a
RecursionError or ValueError traceback), and a field given twice is refused naming both values instead of
the last one silently winning."""

from __future__ import annotations

import json

import pytest

from planner.cli import main
from planner.cli.common import MAX_INT_DIGITS, parse_constraints

QUESTION = ["plan", "-m", "llama3-8b", "-c", "dgx-h100", "-n", "16", "-b", "64", "-s", "4096", "--top", "3"]
HUGE = "1" * 4400  # beyond Python's 4,300-digit limit on reading integers


def _error(capsys, *extra: str) -> str:
    code = main([*QUESTION, *extra])
    out = capsys.readouterr()
    assert code == 2 and out.out == "", out.err
    assert out.err.startswith("error: ") and out.err.count("\n") == 1 and "Traceback" not in out.err
    assert len(out.err) < 1000
    return out.err


@pytest.mark.parametrize("extra,words", [
    (["--constraints", "[" * 60_000], ["nests deeper"]),
    (["--constraints", '{"tp": ' + "[" * 60_000 + "]" * 60_000 + "}"], ["nests deeper"]),
    (["--constraints", '{"tp": ' + HUGE + "}"], [f"at most {MAX_INT_DIGITS} digits", "4,400"]),
    (["-C", "tp=" + HUGE], ["'tp'", f"at most {MAX_INT_DIGITS} digits"]),
    (["-C", "pp=1," + HUGE], ["'pp'", f"at most {MAX_INT_DIGITS} digits"]),
    (["--constraints", '{"tp": NaN}'], ["NaN"]),
    (["--constraints", '{"tp": 8'], ["not valid JSON"]),
    (["-C", "tp=8", "-C", "tp=2"], ["'tp' is given twice", "8", "2"]),
    (["--constraints", '{"tp": 8}', "-C", "tp=2"], ["'tp' is given twice", "8 (--constraints)", "2 (-C)"]),
    (["--constraints", '{"zero_stage": 1}', "-C", "zero-stage=2"], ["'zero_stage' is given twice"]),
    (["--constraints", '{"tp": 8, "tp": 2}'], ["repeats the key 'tp'", "8 and 2"]),
])
def test_bad_constraints_are_one_line(capsys, extra, words):
    err = _error(capsys, *extra)
    for word in words:
        assert word in err, err


def test_constraints_on_different_fields_combine(capsys):
    code = main([*QUESTION, "--constraints", '{"tp": 2}', "-C", "pp=1", "-C", "zero_stage=1,2", "--format", "json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    plans = json.loads(out.out)["plans"]
    assert plans and all(p["strategy"]["tp"] == 2 and p["strategy"]["pp"] == 1 for p in plans)
    assert {p["strategy"]["zero_stage"] for p in plans} <= {1, 2}


def test_parse_constraints_keeps_long_digit_strings_inside_json_strings():
    digits = "9" * 40
    assert parse_constraints(None, json.dumps({"recompute_modules": [digits]})) == {"recompute_modules": [digits]}
    assert parse_constraints(["tp=" + "9" * MAX_INT_DIGITS], None) == {"tp": int("9" * MAX_INT_DIGITS)}


def test_the_help_says_a_field_is_given_once(capsys):
    main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "once per field" in text and "-C may add other fields, not repeat one" in text


def test_word_valued_fields_keep_their_words(capsys):
    """`-C recompute=none` is recompute's first value, not a missing one; a rank order is a word too."""
    assert parse_constraints(["recompute=none,full", "rank_order=tp-cp-ep-pp-dp"], None) == {
        "recompute": ["none", "full"], "rank_order": "tp-cp-ep-pp-dp"}
    code = main([*QUESTION, "-C", "recompute=none", "-C", "pp=2", "-C", "rank_order=tp-cp-ep-pp-dp",
                 "--format", "json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    plans = json.loads(out.out)["plans"]
    assert plans and all(p["strategy"]["recompute"] == "none" and p["strategy"]["rank_order"] == "tp-cp-ep-pp-dp"
                         for p in plans)
