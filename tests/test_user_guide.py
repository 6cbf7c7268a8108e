"""docs/user-guide.md stays true: every command of its ```console blocks runs, exits as the block says, and
prints the lines shown under it.

Block format. A fenced block whose info string starts with `console` holds commands: a line starting with
`$ meshplan ` is one (a line ending with a backslash continues on the next); the lines after it, up to the
next `$` line, are an excerpt of its output, each non-empty line of which (stripped) must appear in what it
prints. The info string may add `exit=N` (every command of the block exits N, and the excerpt is looked for
in stdout and stderr, where errors go; otherwise stdout alone) or `no-run` (the block is listed, not run,
and the paragraph after it must say why, with the words "not run").

The commands run in order in one working folder (files one writes, a later one reads), with the guide's
example files at docs/examples/ below it, as `python -m planner` from this checkout (never a shell).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "user-guide.md"
EXAMPLES = ROOT / "docs" / "examples"
PROMPT = "$ meshplan "
#: Most `no-run` blocks the guide may have: everything it shows should run here.
MAX_NO_RUN_BLOCKS = 3
#: Seconds one command may take (the tuner's trials are the slowest, well under a minute on 2 cores).
COMMAND_TIMEOUT_S = 240
#: Sub-commands that launch torch.distributed runs (profile, tune, validate): they need torch.
PROCESS_COMMANDS = {"profile", "tune", "validate"}
FENCE = re.compile(r"^```(.*)$")


@dataclass
class Command:
    """One `$ meshplan ...` line of a console block, with its expected excerpt and exit code."""

    args: list[str]
    line: int
    exit_code: int = 0
    run: bool = True
    expected: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        """`L<line>-<sub-command>[-<model or cluster file>]`, e.g. L107-plan-llama3-70b."""
        words = [self.args[0]]
        for flag in ("--model", "-m", "--show"):
            if flag in self.args[:-1]:
                words.append(Path(self.args[self.args.index(flag) + 1]).name)
                break
        return f"L{self.line}-" + "-".join(words)


@dataclass
class Block:
    """A console block: where it ends in the text and how it is marked."""

    end_line: int
    run: bool
    commands: list[Command]


def parse_info(info: str, line: int) -> tuple[bool, int]:
    """(run, exit code) from a console block's info string: `console`, `console exit=1`, `console no-run`."""
    words = info.split()
    run, code = True, 0
    for word in words[1:]:
        if word == "no-run":
            run = False
        elif word.startswith("exit=") and word[5:].isdigit():
            code = int(word[5:])
        else:
            raise ValueError(f"line {line}: unknown console block option {word!r}")
    return run, code


def extract_blocks(markdown: str) -> list[Block]:
    """Every ```console block of a markdown text, with its commands and their excerpts."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        info, start = fence.group(1).strip(), i + 1
        j = start
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            raise ValueError(f"line {i + 1}: fenced block not closed")
        if info.split()[:1] == ["console"]:
            run, code = parse_info(info, i + 1)
            blocks.append(Block(end_line=j + 1, run=run, commands=parse_commands(lines[start:j], start + 1, run, code)))
        i = j + 1
    return blocks


def parse_commands(body: list[str], first_line: int, run: bool, code: int) -> list[Command]:
    commands: list[Command] = []
    k = 0
    while k < len(body):
        text = body[k]
        if text.startswith("$ "):
            if not text.startswith(PROMPT):
                raise ValueError(f"line {first_line + k}: only meshplan commands may be shown: {text!r}")
            line, joined = first_line + k, text[len(PROMPT):]
            while joined.endswith("\\"):
                k += 1
                if k == len(body):
                    raise ValueError(f"line {line}: continuation line missing")
                joined = joined[:-1] + " " + body[k].strip()
            commands.append(Command(args=shlex.split(joined), line=line, exit_code=code, run=run))
        elif text.strip():
            if not commands:
                raise ValueError(f"line {first_line + k}: output before any command")
            commands[-1].expected.append(text.strip())
        k += 1
    return commands


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The expected lines (each stripped, non-empty) that do not appear in the output."""
    return [line for line in (e.strip() for e in expected) if line and line not in output]


def paragraph_after(markdown: str, end_line: int) -> str:
    """The first paragraph after line `end_line` (1-based): the text up to the next blank line."""
    rest = markdown.splitlines()[end_line:]
    while rest and not rest[0].strip():
        rest.pop(0)
    para = []
    for text in rest:
        if not text.strip():
            break
        para.append(text)
    return " ".join(para)


# ---- the extractor and the checker, on a small inline text (so that they can fail) ----

SAMPLE = """\
Intro.

```console
$ meshplan plan --model llama3-8b --cluster dgx-h100 \\
    --gpus 8 -b 64 -s 8192
ranked plans

  memory safety margin
$ meshplan models
```

```console exit=1
$ meshplan plan -C 'zero_stage=0' --gpus 8
no strategy fits
```

```bash
$ meshplan not-a-console-block
```

```console no-run
$ meshplan profile --device cuda
```

These are not run by the test: they need GPUs.
"""


def test_extractor_reads_commands_excerpts_exit_codes_and_continuations():
    blocks = extract_blocks(SAMPLE)
    assert [b.run for b in blocks] == [True, True, False]
    first, second = blocks[0].commands
    assert first.args == ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "-b", "64", "-s",
                          "8192"]
    assert first.expected == ["ranked plans", "memory safety margin"] and first.line == 4
    assert second.args == ["models"] and second.expected == [] and second.exit_code == 0
    (failing,) = blocks[1].commands
    assert failing.exit_code == 1 and failing.args == ["plan", "-C", "zero_stage=0", "--gpus", "8"]
    assert failing.expected == ["no strategy fits"]
    assert not blocks[2].commands[0].run
    assert "not run" in paragraph_after(SAMPLE, blocks[2].end_line)
    assert first.id == "L4-plan-llama3-8b"


def test_extractor_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="unknown console block option"):
        extract_blocks("```console exit=x\n$ meshplan models\n```\n")
    with pytest.raises(ValueError, match="only meshplan commands"):
        extract_blocks("```console\n$ rm -rf /\n```\n")
    with pytest.raises(ValueError, match="not closed"):
        extract_blocks("```console\n$ meshplan models\n")
    with pytest.raises(ValueError, match="continuation"):
        extract_blocks("```console\n$ meshplan models \\\n```\n")


def test_checker_finds_a_wrong_excerpt():
    output = "llama3-8b on 8 x H100\nranked plans\n 1  dp8 tp1 pp1   1.2\n"
    assert missing_lines(["ranked plans", "  dp8 tp1 pp1  ", ""], output) == []
    assert missing_lines(["ranked plans", "no strategy fits"], output) == ["no strategy fits"]
    assert missing_lines(["dp8 tp2"], output) == ["dp8 tp2"]


# ---- the guide itself ----

GUIDE_TEXT = GUIDE.read_text(encoding="utf-8")
GUIDE_BLOCKS = extract_blocks(GUIDE_TEXT)
GUIDE_COMMANDS = [c for b in GUIDE_BLOCKS if b.run for c in b.commands]


def test_guide_shows_commands_and_few_unrun_blocks_each_explained():
    assert len(GUIDE_COMMANDS) >= 10
    unrun = [b for b in GUIDE_BLOCKS if not b.run]
    assert len(unrun) <= MAX_NO_RUN_BLOCKS, f"{len(unrun)} no-run blocks: the guide should show what runs here"
    for block in unrun:
        assert block.commands, f"no-run block ending at line {block.end_line} shows no command"
        why = paragraph_after(GUIDE_TEXT, block.end_line)
        assert "not run" in why, f"the no-run block ending at line {block.end_line} is not followed by why"


def test_guide_reserves_the_compare_section_and_is_listed_in_the_readme():
    assert "\n## Compare, plot and report\n" in GUIDE_TEXT
    assert "docs/user-guide.md" in (ROOT / "README.md").read_text(encoding="utf-8")


#: Where the guide's `meshplan profile --output` writes: the commands that read it run in its test, after it.
PROFILE_OUTPUT = "profiles/"


def guide_runs(commands: list[Command]) -> list[list[Command]]:
    """The guide's commands as the tests run them: each on its own, except that a command reading what the last
    `profile` wrote (PROFILE_OUTPUT) joins that profile's run, after it. No test depends on another's files."""
    runs: list[list[Command]] = []
    profile_run: list[Command] | None = None
    for c in commands:
        if profile_run is not None and any(arg.startswith(PROFILE_OUTPUT) for arg in c.args):
            profile_run.append(c)
            continue
        runs.append([c])
        if c.args[0] == "profile":
            profile_run = runs[-1]
    return runs


GUIDE_RUNS = guide_runs(GUIDE_COMMANDS)


def _marks(run: list[Command]) -> list:
    # A run that starts processes (profile, tune, validate) goes in the group of the tests that do
    # (tests/conftest.py: one after another on one worker); the others run wherever pytest-xdist puts them.
    if any(c.args[0] in PROCESS_COMMANDS for c in run):
        return [pytest.mark.xdist_group("processes"), pytest.mark.executor, pytest.mark.slow]
    return []


def test_a_profiles_readers_run_in_its_test():
    blocks = extract_blocks(
        "```console\n$ meshplan profile --output profiles\n$ meshplan plan -c profiles/clusters/x.yaml\n```\n"
        "```console\n$ meshplan models\n$ meshplan tune -c profiles/clusters/x.yaml\n```\n")
    runs = guide_runs([c for b in blocks for c in b.commands])
    assert [[c.args[0] for c in run] for run in runs] == [["profile", "plan", "tune"], ["models"]]
    assert [[c.args[0] for c in run] for run in GUIDE_RUNS if run[0].args[0] == "profile"] == [["profile", "plan",
                                                                                                "tune"]]


@pytest.mark.parametrize("run", [pytest.param(r, id=r[0].id, marks=_marks(r)) for r in GUIDE_RUNS])
def test_guide_command(run: list[Command], tmp_path: Path):
    """Each run in a fresh folder holding a copy of docs/examples/, its commands in the guide's order."""
    if any(c.args[0] in PROCESS_COMMANDS for c in run):
        pytest.importorskip("torch")
    shutil.copytree(EXAMPLES, tmp_path / "docs" / "examples")
    (tmp_path / "xdg").mkdir()
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=str(ROOT), XDG_DATA_HOME=str(tmp_path / "xdg"))
    env.pop("MESHPLAN_PROFILES", None)
    for command in run:
        proc = subprocess.run([sys.executable, "-m", "planner", *command.args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        shown = (f"line {command.line}: meshplan {shlex.join(command.args)}\nstdout:\n{proc.stdout}\n"
                 f"stderr:\n{proc.stderr}")
        assert proc.returncode == command.exit_code, shown
        output = proc.stdout if command.exit_code == 0 else proc.stdout + proc.stderr
        missing = missing_lines(command.expected, output)
        assert not missing, f"not in the output: {missing}\n{shown}"
