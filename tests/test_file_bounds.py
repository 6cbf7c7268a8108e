"""Every input file is read by the one bounded reader (planner.specs.files): model and cluster YAML,
Hugging Face config.json and the plan files of `emit`, `evaluate --plan` and `validate --plan`. Each
refuses, with one SpecError (CLI: one line, exit 2) naming the file and the rule: a device (/dev/zero
grew memory until killed), a pipe (hung), a binary file (UnicodeDecodeError), an oversized file,
nesting deeper than MAX_DEPTH (RecursionError), more than MAX_VALUES values (a 4 MiB list took close to
a minute and over a GB before it was refused) and a key repeated in one mapping (silently the last one won)."""

from __future__ import annotations

import importlib
import io
import json
import os
import sys
import threading
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

from planner.specs import files
from planner.cli import main
from planner.errors import SpecError
from planner.specs.files import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_PLAN_FILE_BYTES,
    MAX_PLAN_VALUES,
    MAX_VALUES,
    parse_json,
    parse_yaml,
    read_input,
)
from planner.specs.hf import read_hf_config
from profiles import PROFILES_DIR, load_cluster, load_model


def _cli(*args: str) -> str:
    """The CLI's one error line (exit 2, no traceback) as a SpecError, so every reader is checked alike."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    text = err.getvalue()
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in text, (code, text)
    raise SpecError(lines[0][len("error: "):])


READERS = {
    "model-yaml": (".yaml", lambda p: load_model(str(p))),
    "cluster-yaml": (".yaml", lambda p: load_cluster(str(p))),
    "hf-config": (".json", lambda p: read_hf_config(str(p))),
    "plan-emit": (".json", lambda p: _cli("emit", str(p))),
    "plan-evaluate": (".json", lambda p: _cli("evaluate", "--plan", str(p))),
    "plan-validate": (".json", lambda p: _cli("validate", "--plan", str(p))),
}


def refusal(reader: str, path: Path | str, timeout_s: float = 60.0) -> str:
    """The message `reader` refuses `path` with; run in a thread, so that a read that blocks (a pipe)
    fails the test instead of hanging it."""
    result: dict[str, BaseException | None] = {}

    def target():
        try:
            READERS[reader][1](path)
            result["error"] = None
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{reader} still reading {path} after {timeout_s} s"
    error = result["error"]
    assert isinstance(error, SpecError), f"{reader} on {path}: {error!r}"
    message = str(error)
    assert "\n" not in message and "Traceback" not in message
    return message


def write(tmp_path: Path, reader: str, text: str) -> Path:
    path = tmp_path / f"input{READERS[reader][0]}"
    path.write_text(text)
    return path


def is_json(reader: str) -> bool:
    return READERS[reader][0] == ".json"


ALL = list(READERS)


# ---- what the file is ----------------------------------------------------------------------------
@pytest.mark.parametrize("reader", ALL)
def test_a_device_is_refused(reader):
    message = refusal(reader, "/dev/zero")
    assert "'/dev/zero'" in message and "not a regular file" in message


@pytest.mark.parametrize("reader", ALL)
def test_a_pipe_is_refused_without_blocking(tmp_path, reader):
    fifo = tmp_path / f"pipe{READERS[reader][0]}"
    os.mkfifo(fifo)
    message = refusal(reader, fifo, timeout_s=30)
    assert str(fifo) in message and "not a regular file" in message


@pytest.mark.parametrize("reader", ALL)
def test_a_binary_file_is_refused(tmp_path, reader):
    path = tmp_path / f"binary{READERS[reader][0]}"
    path.write_bytes(bytes(range(256)) * 4)
    message = refusal(reader, path)
    assert str(path) in message and "not UTF-8" in message


def bounds(reader: str) -> tuple[int, int]:
    """(bytes, values) a reader accepts at most: plan files (JSON) have larger bounds than the specs."""
    return (MAX_PLAN_FILE_BYTES, MAX_PLAN_VALUES) if reader.startswith("plan-") else (MAX_FILE_BYTES, MAX_VALUES)


@pytest.mark.parametrize("reader", ALL)
def test_an_oversized_file_is_refused_unread(tmp_path, reader):
    path = tmp_path / f"big{READERS[reader][0]}"
    max_bytes = bounds(reader)[0]
    with open(path, "wb") as fh:
        fh.truncate(max_bytes + 1)  # sparse: large on paper, nothing to read
    message = refusal(reader, path)
    assert str(path) in message and f"at most {max_bytes:,}" in message


@pytest.mark.parametrize("reader", ALL)
def test_a_directory_is_refused(tmp_path, reader):
    assert "is a directory" in refusal(reader, tmp_path)


# ---- what the file holds -------------------------------------------------------------------------
@pytest.mark.parametrize("reader", ALL)
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_deep_nesting_is_refused(tmp_path, reader, depth):
    text = ('{"a": ' if is_json(reader) else "a: ") + "[" * depth + "]" * depth + ("}" if is_json(reader) else "\n")
    path = write(tmp_path, reader, text)
    message = refusal(reader, path)
    assert str(path) in message and f"nests deeper than {MAX_DEPTH} levels" in message


@pytest.mark.parametrize("reader", ALL)
@pytest.mark.parametrize("shape", ["flow-list", "block-list", "flat-keys"])
def test_more_values_than_the_bound_are_refused(tmp_path, reader, shape):
    max_values = bounds(reader)[1]
    n = max_values + 1
    if shape == "flat-keys":
        text = ("{" + ", ".join(f'"k{i}": 1' for i in range(n)) + "}" if is_json(reader)
                else "".join(f"k{i}: 1\n" for i in range(n)))
    elif shape == "block-list" and not is_json(reader):
        text = "a:\n" + "- 1\n" * n
    else:
        text = '{"a": [' + "1, " * (n - 1) + "1]}"  # a flow list is YAML too
    path = write(tmp_path, reader, text)
    message = refusal(reader, path)
    assert str(path) in message and f"holds more than {max_values:,} values" in message


@pytest.mark.parametrize("reader", ALL)
def test_a_repeated_key_is_refused(tmp_path, reader):
    text = '{"plans": [], "other": 1, "plans": []}' if is_json(reader) else "name: a\nother: 1\nname: b\n"
    path = write(tmp_path, reader, text)
    message = refusal(reader, path)
    key = "plans" if is_json(reader) else "name"
    assert str(path) in message and f"repeats the key {key!r}" in message
    if not is_json(reader):
        assert "line 3" in message


def test_a_repeated_key_in_a_real_model_file_names_the_line(tmp_path):
    lines = (PROFILES_DIR / "models" / "llama3-8b.yaml").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("num_layers:"))
    lines.append("num_layers: 2")
    path = tmp_path / "model.yaml"
    path.write_text("\n".join(lines) + "\n")
    message = refusal("model-yaml", path)
    assert f"model file {str(path)!r} repeats the key 'num_layers' on line {len(lines)}" in message
    del lines[at]
    path.write_text("\n".join(lines) + "\n")
    assert load_model(str(path)).num_layers == 2  # once is fine


def test_repeated_keys_in_nested_mappings_and_json_objects():
    with pytest.raises(SpecError, match="repeats the key 'x' on line 3"):
        parse_yaml("a:\n  x: 1\n  x: 2\n", "f")
    with pytest.raises(SpecError, match="repeats the key 'x' in one object"):
        parse_json('{"a": [{"x": 1, "x": 1}]}', "f")
    assert parse_yaml("a: {x: 1}\nb: {x: 2}\n", "f") == {"a": {"x": 1}, "b": {"x": 2}}
    assert parse_json('{"a": {"x": 1}, "b": {"x": 2}}', "f") == {"a": {"x": 1}, "b": {"x": 2}}


def test_a_merged_key_may_be_overridden():
    """`<<: *base` then the key again is YAML's override, not a repeat."""
    assert parse_yaml("base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n", "f")["c"] == {"x": 3, "y": 2}


def test_values_up_to_the_bound_are_read():
    n = MAX_VALUES - 10
    assert len(parse_yaml("a: [" + ", ".join(["1"] * n) + "]\n", "f")["a"]) == n
    assert len(parse_json("[" + ",".join(["1"] * n) + "]", "f")) == n
    assert parse_json('["a,b[c{", "\\"],["]', "f") == ["a,b[c{", '"],[']  # commas and brackets in strings


def test_an_alias_bomb_is_still_refused():
    levels = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    levels += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    with pytest.raises(SpecError, match="expands to more than"):
        parse_yaml("\n".join(levels) + "\n", "f")


def test_the_pure_python_parser_keeps_every_bound(monkeypatch):
    """Without libyaml the same checks run on PyYAML's own parser."""
    monkeypatch.delattr(yaml, "CSafeLoader", raising=False)
    pure = importlib.reload(files)
    try:
        assert pure._BASE_LOADER is yaml.SafeLoader
        with pytest.raises(SpecError, match="holds more than"):
            pure.parse_yaml("a: [" + ", ".join(["1"] * (MAX_VALUES + 1)) + "]\n", "f")
        with pytest.raises(SpecError, match="nests deeper"):
            pure.parse_yaml("a: " + "[" * 3000 + "]" * 3000 + "\n", "f")
        with pytest.raises(SpecError, match="repeats the key 'a' on line 2"):
            pure.parse_yaml("a: 1\na: 2\n", "f")
        assert pure.parse_yaml("base: &b {x: 1}\nc: {<<: *b, y: 2}\n", "f")["c"] == {"x": 1, "y": 2}
    finally:
        monkeypatch.undo()
        importlib.reload(files)


# ---- standard input ------------------------------------------------------------------------------
def test_stdin_is_read_at_most_to_the_bound(monkeypatch):
    zero = open("/dev/zero", "rb")  # noqa: SIM115 - closed below
    try:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(zero))
        with pytest.raises(SpecError, match=f"on standard input is larger than {MAX_FILE_BYTES:,} bytes"):
            read_input("-", "plan")
    finally:
        zero.close()


def test_stdin_plan_refusals_are_one_line(monkeypatch):
    for data, message in ((b"\xff\xfe", "not UTF-8"), (b"[" * 1000 + b"]" * 1000, "nests deeper"),
                          (b'{"plans": [], "plans": []}', "repeats the key 'plans'")):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        with pytest.raises(SpecError, match=message):
            _cli("emit", "-")


def test_a_plan_file_over_the_spec_bound_but_within_the_plan_bound_is_read(tmp_path):
    """`plan --top 500` writes more than MAX_FILE_BYTES; emit reads it back (plan files are JSON, bounded by
    MAX_PLAN_FILE_BYTES and MAX_PLAN_VALUES)."""
    from planner import plan

    result = plan("llama3-8b", "dgx-h100", 8, 64, 4096, top_k=1)
    data = result.model_dump(mode="json")
    one = data["plans"][0]
    copies = MAX_FILE_BYTES // len(json.dumps(one)) + 10
    data["plans"] = [dict(one, rank=i + 1) for i in range(copies)]
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(data))
    assert MAX_FILE_BYTES < path.stat().st_size < MAX_PLAN_FILE_BYTES
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["emit", str(path), "--backend", "megatron", "--rank", str(copies)])
    assert code == 0, err.getvalue()
    assert "--tensor-model-parallel-size" in out.getvalue()
