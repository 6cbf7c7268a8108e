"""Names never become code: model, cluster and GPU names, a plan file's model.name, a Hugging Face config's
_name_or_path and --script reach every backend's output as quoted data or escaped comments only.

Each output is parsed in its language (bash -n, ast, tomllib, json) and a marker word put in the name is
checked to stand only where it cannot run (injection_checks); nothing emitted is executed.
"""

from __future__ import annotations

import json
import shlex
from functools import lru_cache
from pathlib import Path
from typing import get_args

import pytest
import yaml
from emit_plans import make_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from injection_checks import (
    check_file_marker,
    check_json_marker,
    check_python_marker,
    check_shell_marker,
    check_toml_marker,
    check_yaml_marker,
    shell_words,
)
from pydantic import ValidationError

import profiles
from planner.cli import main
from planner.cli.emit_cmd import LaunchFor
from planner.emit import EmitOptions, backends, emit, emit_data, get_emitter
from planner.emit.base import LaunchTarget
from planner.emit.quoting import (
    clip,
    comment,
    heredoc,
    heredoc_terminator,
    one_line,
    python_literal,
    shell_command,
    toml_string,
)
from planner.errors import SpecError
from planner.specs import Plan

#: a word no emitter writes: where it stands in the output is what the checks look at
MARKER = "PWNEDc0ffee"
LAUNCH_TARGETS = list(get_args(LaunchTarget))
COMBOS = [(b, t) for b in backends() for t in ([None] if get_emitter(b).runs else LAUNCH_TARGETS)]
SOURCES = ("model.name", "cluster.name", "cluster.gpu.name")
#: the reported attack and its variations, with the injected command spelled as MARKER
REGRESSIONS = ["x\nid > marker\n#", "MESHPLAN_EOF", "$(id)", "`id`", "\"; import os; os.system('id') #"]
INJECTIONS = [f"x\n{MARKER} > marker\n#", f"\nMESHPLAN_EOF\n{MARKER}\n", f"MESHPLAN_EOF\n{MARKER}\nMESHPLAN_EOF_1\n",
              f"$({MARKER})", f"`{MARKER}`", f"\"; import os; os.{MARKER}('id') #", f"'; {MARKER}; '",
              f"\r{MARKER}\r", f"\u2028{MARKER}\u2029", f"\x85{MARKER}", f"\u202e{MARKER}", f"\0\n{MARKER}",
              f"\\\n{MARKER}", f"\"\"\"\n{MARKER}()\n\"\"\"", f"'''\n{MARKER}()\n'''", f"\"\n{MARKER} = 1\n",
              f"]\n[{MARKER}]\n", f"&& {MARKER} ||", f"| {MARKER} &", f"<<'E'\n{MARKER}\nE"]
FRAGMENTS = ["\n", "\r", "\r\n", "'", '"', "`", "$(", ")", ";", "#", "\\", "MESHPLAN_EOF", "\nMESHPLAN_EOF\n",
             "MESHPLAN_EOF_1", "\0", "\x1b[2J", "\x07", "\t", "\u2028", "\u2029", "\u0085", "\u202e", "\u200b", " ",
             "{", "}", "[", "]", "=", "<<", "&&", "|", "${", "'''", '"""', "Llama 3.1 405B", "meta-llama/Llama-3.1-8B"]
NOISE = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(st.characters(blacklist_categories=("Cs",)), max_size=4)),
                 max_size=4).map("".join)
NAMES = st.tuples(NOISE, st.sampled_from(INJECTIONS), NOISE).map("".join)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


#: the backends for fine-tuning plans: their base plan is a LoRA fine-tune, and the model they load is named by
#: --hf-model (a renamed model has no Hugging Face id of its own)
FINETUNE_BACKENDS = ("axolotl", "llamafactory")


@lru_cache(maxsize=2)
def base_plan_json(finetune: bool = False) -> str:
    """One plan every backend and launch target can express (tp 2, ZeRO-1 on one DGX H100); for the fine-tuning
    toolkits, a LoRA fine-tune with ZeRO-1 (they run data parallelism only)."""
    if finetune:
        return make_plan("llama3-8b", "dgx-h100", 8, 64, 4096, strategy={"zero_stage": 1},
                         finetune="lora").model_dump_json()
    return make_plan("llama3-8b", "dgx-h100", 8, 64, 4096, strategy={"tp": 2, "zero_stage": 1}).model_dump_json()


def named(source: str, name: str, backend: str | None = None) -> Plan:
    """The base plan (`backend`'s) read back from plan JSON whose `source` field is `name` (a plan file's path in)."""
    data = json.loads(base_plan_json(backend in FINETUNE_BACKENDS))
    node = data
    *parents, leaf = source.split(".")
    for key in parents:
        node = node[key]
    node[leaf] = name
    return Plan.model_validate_json(json.dumps(data))


def options_for(target: str | None, backend: str | None = None, **kw) -> EmitOptions:
    if backend in FINETUNE_BACKENDS:
        kw["hf_model"] = "meta-llama/Meta-Llama-3-8B"
    return EmitOptions(launch_for=target, **kw) if target else EmitOptions(**kw)


def check_output(backend: str, plan: Plan, options: EmitOptions, marker: str, tmp_path: Path,
                 bare_arguments: bool = False) -> str:
    """Emit `plan` for `backend` and check `marker` stands only as data in it (and in the files it writes)."""
    emitter = get_emitter(backend)
    text = emit(plan, backend, options)
    if emitter.syntax == "shell":
        check_shell_marker(text, marker, tmp_path, bare_arguments)
        if emitter.runs is None:  # a launch script: the files it writes are checked in their own language
            for path, body in emit_data(plan, backend, options)["files"].items():
                assert heredoc(path, body) in text
                check_file_marker(path, body, marker)
    elif emitter.syntax == "python":
        check_python_marker(text, marker)
    elif emitter.syntax == "toml":
        check_toml_marker(text, marker)
    elif emitter.syntax == "json":
        check_json_marker(text, marker)
    elif emitter.syntax == "yaml":
        check_yaml_marker(text, marker)
    else:
        raise AssertionError(f"no check for {emitter.syntax} output of {backend}")
    return text


def test_every_backend_and_launch_target_is_covered():
    assert sorted(LAUNCH_TARGETS) == sorted(t.value for t in LaunchFor)
    assert {b for b, _ in COMBOS} == {"megatron", "megatron-bridge", "deepspeed", "megatron-deepspeed", "colossalai",
                                      "torchtitan", "maxtext", "torchrun", "slurm", "axolotl", "llamafactory"}
    assert len(COMBOS) == 17


@pytest.mark.parametrize(("backend", "target"), COMBOS)
@SETTINGS
@given(name=NAMES, source=st.sampled_from(SOURCES))
def test_names_stay_data(backend, target, name, source, tmp_path):
    plan = named(source, name, backend)
    text = check_output(backend, plan, options_for(target, backend), MARKER, tmp_path)
    if get_emitter(backend).syntax != "json":  # the name is still shown, escaped, in the comment naming the plan
        assert one_line(clip(name)) in text


@pytest.mark.parametrize("target", LAUNCH_TARGETS)
@pytest.mark.parametrize("backend", ["torchrun", "slurm"])
@SETTINGS
@given(script=NAMES)
def test_script_words_stay_arguments(backend, target, script, tmp_path):
    try:
        options = options_for(target, script=f"train.py {script}")
    except ValidationError as exc:  # unbalanced quotes or a non-printing character: refused, naming the field
        assert "script" in str(exc)
        with pytest.raises(SpecError, match="script"):
            shell_command("script", f"train.py {script}")
        return
    plan = named("model.name", "llama3-8b")
    check_output(backend, plan, options, MARKER, tmp_path, bare_arguments=True)
    words = shlex.split(f"train.py {script}")
    command = emit_data(plan, backend, options)["command"]
    assert shlex.split(command, comments=True)[:len(words)] == words  # the entry point's words, unchanged


@pytest.mark.parametrize(("backend", "target"), COMBOS)
@pytest.mark.parametrize("source", SOURCES)
def test_regressions(backend, target, source, tmp_path):
    """The reported payloads, literally (no output line is the injected command) and with the injected command
    spelled as the marker (which the checks then find only as data)."""
    for payload in REGRESSIONS:
        text = emit(named(source, payload, backend), backend, options_for(target, backend))
        assert not any(line.strip() in ("id > marker", "id", "$(id)", "`id`") for line in text.splitlines())
        assert "import os" not in [line.strip() for line in text.splitlines()]
        check_output(backend, named(source, payload.replace("id", MARKER), backend), options_for(target, backend),
                     MARKER, tmp_path)


def test_before_after_count():
    """`x\\nid > marker\\n#` as a model, cluster or GPU name comes out as a line of code in none of the 51
    backend / --launch-for / source combinations (39 of the first 42 did before names were quoted)."""
    hits = [(b, t, s) for b, t in COMBOS for s in SOURCES
            if any(line.strip() == "id > marker"
                   for line in emit(named(s, REGRESSIONS[0], b), b, options_for(t, b)).splitlines())]
    assert len(COMBOS) * len(SOURCES) == 51 and hits == []


# ---- the files a user gives: model YAML, Hugging Face config, cluster YAML (its GPU), plan JSON ------------
PAYLOAD = f"x\n{MARKER} > marker\n#\nMESHPLAN_EOF\n{MARKER}\n$({MARKER})"
PROFILES = Path(profiles.__file__).parent
HF_CONFIG = Path(__file__).parents[1] / "fixtures" / "hf" / "llama-3.1-8b.json"
SEARCH = ["--gpus", "8", "--global-batch-size", "64", "--seq-len", "4096"]


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _files(tmp_path: Path) -> dict[str, list[str]]:
    model = yaml.safe_load((PROFILES / "models" / "llama3-8b.yaml").read_text()) | {"name": PAYLOAD}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model))
    hf = json.loads(HF_CONFIG.read_text()) | {"_name_or_path": PAYLOAD}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    gpu = yaml.safe_load((PROFILES / "gpus" / "h100-sxm.yaml").read_text()) | {"name": PAYLOAD}
    cluster = yaml.safe_load((PROFILES / "clusters" / "dgx-h100.yaml").read_text()) | {"name": PAYLOAD, "gpu": gpu}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    (tmp_path / "plan.json").write_text(named("model.name", PAYLOAD).model_dump_json())
    return {"model YAML": ["--model", str(tmp_path / "model.yaml"), "--cluster", "dgx-h100", *SEARCH],
            "Hugging Face _name_or_path": ["--model", str(tmp_path / "config.json"), "--cluster", "dgx-h100", *SEARCH],
            "cluster and GPU YAML": ["--model", "llama3-8b", "--cluster", str(tmp_path / "cluster.yaml"), *SEARCH],
            "plan JSON": [str(tmp_path / "plan.json")]}


@pytest.mark.parametrize("source", ["model YAML", "Hugging Face _name_or_path", "cluster and GPU YAML", "plan JSON"])
@pytest.mark.parametrize(("backend", "target"), [("slurm", "torchtitan"), ("torchrun", "colossalai"),
                                                 ("colossalai", None)])
def test_cli_file_sources(source, backend, target, capsys, tmp_path):
    args = ["emit", *_files(tmp_path)[source], "--backend", backend] + (["--launch-for", target] if target else [])
    code, out, err = _run(capsys, *args)
    assert code == 0, err
    assert one_line(PAYLOAD) in out  # the name is shown, escaped
    if backend == "colossalai":
        check_python_marker(out, MARKER)
    else:
        check_shell_marker(out, MARKER, tmp_path)


@pytest.mark.parametrize(("option", "value"), [("--script", 'train.py "x'), ("--script", "train.py 'x"),
                                               ("--script", ""), ("--script", "train.py \x00"),
                                               ("--job-name", "a\nb"), ("--job-name", "x; id"), ("--job-name", "")])
def test_cli_refuses_bad_options_in_one_line(option, value, capsys):
    code, out, err = _run(capsys, "emit", "--model", "llama3-8b", "--cluster", "dgx-h100", *SEARCH, "--backend",
                          "slurm", option, value)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and option in err and "Traceback" not in err


# ---- the helpers, and the checks themselves (each must catch what it is for) ----------------------------------
@given(st.text(st.characters(blacklist_categories=("Cs",))))
def test_one_line_is_one_printable_line(text):
    line = one_line(text)
    assert line.isprintable() and len(line) <= 1000
    line = comment("# note: ", text * 50)
    assert line.isprintable() and len(line) <= 1000 and line.startswith("# note: ")


@given(st.text(st.characters(blacklist_categories=("Cs",))))
def test_literals_round_trip(text):
    import ast
    import tomllib

    assert tomllib.loads(f"k = {toml_string(text)}")["k"] == text
    assert ast.literal_eval(python_literal([text, {text: 1.5}])) == [text, {text: 1.5}]
    assert heredoc_terminator(text) not in text.replace("\0", "")
    with pytest.raises(ValueError):
        python_literal(float("inf"))


@pytest.mark.parametrize(("bad", "why"), [("# c\nPWN\n", "command"), ("echo 'a' ; PWN x\n", "command"),
                                          ('echo "$(PWN)"\n', "substitution"), ("echo `PWN`\n", "command"),
                                          ("X=1 PWN\n", "command"), ("echo a && 'PWN'\n", "command"),
                                          ("cat <<'E'\nx\nE\nPWN\n", "command"), ("cat <<E\n$(PWN)\nE\n", "expanding"),
                                          ("A=(\n x\n)\nPWN\n", "command"), ("echo PWN\n", "unquoted")])
def test_shell_check_catches(bad, why, tmp_path):
    with pytest.raises(AssertionError, match=why):
        check_shell_marker(bad, "PWN", tmp_path)


@pytest.mark.parametrize("ok", ["# PWN\n", "echo 'PWN'\n", "cat <<'E'\nPWN\nE\n", "A=(\n  'PWN'\n)\n", 'echo "a PWN"\n'])
def test_shell_check_passes_data(ok, tmp_path):
    check_shell_marker(ok, "PWN", tmp_path)
    assert shell_words(ok) is not None


@pytest.mark.parametrize(("check", "bad"), [(check_python_marker, "# x\nPWN()\n"), (check_python_marker, "os.PWN('id')\n"),
                                            (check_toml_marker, "# x\nPWN = 1\n"), (check_toml_marker, "[PWN]\na = 1\n"),
                                            (check_json_marker, '{"PWN": 1}')])
def test_language_checks_catch(check, bad):
    with pytest.raises(AssertionError):
        check(bad, "PWN")
