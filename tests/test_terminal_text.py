"""User-given text on the terminal: rich markup, control and bidi characters and very long names in
model, cluster and GPU names (and in values quoted by errors) print as visible text, bounded, never as
markup, raw control bytes or a traceback."""

from __future__ import annotations

import pytest
import yaml

from planner.cli import main
from planner.cli.text import NAME_CHARS, message_lines, plain, shown
from planner.errors import short_repr, unknown_name_message
from profiles import PROFILES_DIR

#: Names an outside test broke the terminal output with; each is a model, GPU and cluster name below.
NAMES = {
    "closing-tag": "x[/]",
    "link": "[link=https://e]click[/link]",
    "style": "[bold red]x",
    "controls": "a\x1b[31mb\x07c\u202ed\ne\x00f\u2028g\rh",
    "long": "n" * 100_000,
}
#: Raw bytes that must never reach the terminal (each is shown as an escape instead).
RAW = ("\x1b", "\x07", "\u202e", "\x00", "\u2028", "\r")
QUESTION = ["-n", "8", "-b", "64", "-s", "4096"]
#: Characters a command may print for a handful of plan rows and its legend, names cut to NAME_CHARS.
MAX_OUTPUT_CHARS = 20_000


def _yaml(path, doc: dict) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.fixture
def profiles_root(tmp_path, monkeypatch):
    """A MESHPLAN_PROFILES root with a GPU and a cluster named after each of NAMES."""
    gpu = yaml.safe_load((PROFILES_DIR / "gpus" / "h100-sxm.yaml").read_text())
    cluster = yaml.safe_load((PROFILES_DIR / "clusters" / "dgx-h100.yaml").read_text())
    for key, name in NAMES.items():
        _yaml(tmp_path / "gpus" / f"gpu-{key}.yaml", gpu | {"name": name})
        _yaml(tmp_path / "clusters" / f"cluster-{key}.yaml", cluster | {"name": name, "gpu": f"gpu-{key}"})
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    return tmp_path


def _model_file(tmp_path, name: str) -> str:
    doc = yaml.safe_load((PROFILES_DIR / "models" / "llama3-8b.yaml").read_text())
    return _yaml(tmp_path / "model.yaml", doc | {"name": name})


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _check_safe(text: str) -> None:
    assert "Traceback" not in text and "MarkupError" not in text
    assert not any(ch in text for ch in RAW), [ch for ch in RAW if ch in text]
    assert len(text) < MAX_OUTPUT_CHARS


def _expected(name: str) -> str:
    """How a name is printed: its first NAME_CHARS characters, controls as escapes, markup as text."""
    return plain(name)


@pytest.mark.parametrize("key", NAMES)
def test_plan_prints_any_model_name_as_text(tmp_path, capsys, key):
    name = NAMES[key]
    code, out, err = _run(capsys, "plan", "-m", _model_file(tmp_path, name), "-c", "dgx-h100", *QUESTION,
                          "--top", "2")
    assert code == 0, err
    _check_safe(out + err)
    assert out.splitlines()[0].startswith(_expected(name) + " (8.0B params)")
    if key == "long":
        assert "n" * NAME_CHARS + "…" in out and "n" * (NAME_CHARS + 1) not in out


@pytest.mark.parametrize("key", NAMES)
def test_plan_prints_any_gpu_and_cluster_name_as_text(profiles_root, capsys, key):
    code, out, err = _run(capsys, "plan", "-m", "llama3-8b", "-c", f"cluster-{key}", *QUESTION, "--top", "2")
    assert code == 0, err
    _check_safe(out + err)
    assert f"on 8 x {_expected(NAMES[key])} ({_expected(NAMES[key])})" in out.splitlines()[0]


def test_clusters_lists_any_gpu_and_cluster_name_as_text(profiles_root, capsys):
    code, out, err = _run(capsys, "clusters")
    assert code == 0, err
    assert "Traceback" not in out + err and not any(ch in out + err for ch in RAW)
    for name in NAMES.values():  # table cells may fold a name over lines: its first part is on one
        assert _expected(name)[:12] in out
    assert "n" * (NAME_CHARS + 1) not in out.replace("\n", "").replace(" ", "").replace("│", "")


@pytest.mark.parametrize("command", ["evaluate", "explain"])
@pytest.mark.parametrize("key", NAMES)
def test_evaluate_and_explain_take_any_names(tmp_path, profiles_root, capsys, command, key):
    code, out, err = _run(capsys, command, "-m", _model_file(tmp_path, NAMES[key]), "-c", f"cluster-{key}",
                          *QUESTION, "--tp", "2", "--sp", "--zero", "1", "--recompute", "selective")
    assert code == 0, err
    _check_safe(out + err)


def test_an_error_quoting_a_user_value_is_one_plain_bounded_line(tmp_path, capsys):
    bad = tmp_path / "m.yaml"
    bad.write_text("name: x\nnum_layers: '[/]\x1b\u202e" + "z" * 50_000 + "'\n")
    code, out, err = _run(capsys, "plan", "-m", str(bad), "-c", "dgx-h100", *QUESTION)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1
    _check_safe(err)
    code, out, err = _run(capsys, "plan", "-m", "llama3-8b[/]\u202e", "-c", "dgx-h100", *QUESTION)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    _check_safe(err)


def test_the_helpers():
    assert shown("x[/]") == "x\\[/]"  # rich prints x[/]
    assert plain("a\x1bb\u202ec\nd\x00") == "a\\x1bb\\u202ec\\x0ad\\x00"
    assert plain("\U000e0001") == "\\U000e0001"  # a format character beyond the BMP
    assert plain("é中 ok") == "é中 ok"  # printable text is left alone
    assert plain("n" * 100, 10) == "n" * 10 + "…"
    assert message_lines("one\x1b\ntwo") == "one\\x1b\ntwo"  # the message's own lines stay lines
    assert len(short_repr(10**5000)) < 60 and "bits" in short_repr(10**5000)
    assert len(short_repr([10**5000, "y" * 10_000])) < 200
    assert len(unknown_name_message("model preset", "q" * 5000, ["llama3-8b"])) < 300


def test_models_lists_any_preset_file_and_model_name_as_text(tmp_path, monkeypatch, capsys):
    doc = yaml.safe_load((PROFILES_DIR / "models" / "llama3-8b.yaml").read_text())
    _yaml(tmp_path / "models" / "[bold]m[-].yaml", doc | {"name": NAMES["controls"], "source": NAMES["link"]})
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    code, out, err = _run(capsys, "models")
    assert code == 0, err
    assert "Traceback" not in out + err and not any(ch in out + err for ch in RAW)
    assert "[bold]m[-]" in out and "[link=https://e]click[/link]" in out


def test_a_bad_option_value_is_one_plain_line(capsys):
    code, out, err = _run(capsys, "plan", "-m", "llama3-8b", "-c", "dgx-h100", *QUESTION,
                          "--precision", "x[/]\x1b\u202e")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    _check_safe(err)
    assert "x[/]\\x1b\\u202e" in err  # typer's message quotes the value: shown with escapes
