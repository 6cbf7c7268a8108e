"""Structural checks that a marker word placed in a name stays data in emitted code (shell, Python, TOML, JSON).

None of them runs the emitted text. The shell check lexes bash itself (`shell_words`): quotes, `$'...'`,
escapes, comments, here-documents, `${...}`, `$(...)` and backticks, and which words stand where a command
starts; it is written for the scripts the emitters write and refuses what it does not know how to read
(a here-document with an unquoted terminator, a substitution inside double quotes) where the marker is.
"""

from __future__ import annotations

import ast
import io
import json
import shutil
import subprocess
import tokenize
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

#: words after which the next word is again a command
_KEYWORDS = {"if", "then", "else", "elif", "do", "while", "until", "!", "time", "{", "exec", "eval", "command",
             "builtin", "nohup", "env", "sudo", "xargs"}
#: operators after which a command starts
_COMMAND_OPS = (";;", "&&", "||", ";", "&", "|", "(", "\n")
#: redirection operators (the word after one is a file, not a command)
_REDIRECTS = ("<<-", "<<", ">>", "&>", ">&", "<&", ">|", "<>", ">", "<")


@dataclass
class Word:
    """One shell word: where it stands, and which of its characters are quoted."""

    command_position: bool
    depth: int  # nesting of $( ) and backticks around it
    chars: list[tuple[int, str]] = field(default_factory=list)  # (index in the script, 'bare'|'single'|'double'|'ansi')
    dq_substitution: bool = False  # a double-quoted part held $( or a backtick


@dataclass
class Lexed:
    words: list[Word]
    inert: list[tuple[int, int, str]]  # (start, end, 'comment'|'heredoc') spans that are never code
    raw_heredoc: list[tuple[int, int]]  # bodies of here-documents with an unquoted terminator (expanded)


def shell_words(script: str) -> Lexed:
    """Split a bash script into words, comments and here-document bodies (see the module docstring)."""
    words: list[Word] = []
    inert: list[tuple[int, int, str]] = []
    raw: list[tuple[int, int]] = []
    frames: list[str] = ["top"]  # "top", "subst" ($( ... )), "bq" (backticks), "array" (NAME=( ... ))
    command = True
    word: Word | None = None
    pending: list[tuple[str, bool, bool]] = []  # here-documents to read at the next newline: (end, quoted, strip)
    expect_heredoc = None  # "<<" or "<<-" just seen: the next word is a terminator
    after_redirect = False
    i, n = 0, len(script)

    def start() -> Word:
        nonlocal word
        if word is None:
            word = Word(command_position=command and not after_redirect,
                        depth=sum(f in ("subst", "bq") for f in frames))
        return word

    def finish() -> None:
        nonlocal word, command, expect_heredoc, after_redirect
        if word is None:
            return
        words.append(word)
        if expect_heredoc is not None:
            end = "".join(script[j] for j, _ in word.chars)
            quoted = any(kind != "bare" for _, kind in word.chars)
            pending.append((end, quoted, expect_heredoc == "<<-"))
            expect_heredoc = None
        elif after_redirect:
            pass
        elif word.command_position:
            text = "".join(script[j] for j, _ in word.chars)
            is_assignment = "=" in text and text.split("=", 1)[0].isidentifier()
            command = is_assignment or text in _KEYWORDS
        else:
            command = False
        after_redirect = False
        word = None

    while i < n:
        ch = script[i]
        if ch == "\\" and i + 1 < n and script[i + 1] == "\n":  # line continuation
            i += 2
            continue
        if ch == "\\" and i + 1 < n:
            w = start()
            w.chars.append((i + 1, "single"))  # an escaped character: quoted
            i += 2
            continue
        if ch == "#" and word is None:
            end = script.find("\n", i)
            end = n if end < 0 else end
            inert.append((i, end, "comment"))
            i = end
            continue
        if ch == "\n":
            finish()
            i += 1
            for end, quoted, strip in pending:  # here-document bodies follow the line that opened them
                body_start = i
                while i < n:
                    line_end = script.find("\n", i)
                    line_end = n if line_end < 0 else line_end
                    line = script[i:line_end]
                    if (line.lstrip("\t") if strip else line) == end:
                        (inert.append((body_start, i, "heredoc")) if quoted else raw.append((body_start, i)))
                        i = line_end + 1
                        break
                    i = line_end + 1
                else:
                    raise AssertionError(f"here-document {end!r} is never closed")
            pending.clear()
            command = frames[-1] != "array"
            continue
        if ch in " \t":
            finish()
            i += 1
            continue
        if ch == "'":
            close = script.index("'", i + 1)
            w = start()
            w.chars += [(j, "single") for j in range(i + 1, close)]
            i = close + 1
            continue
        if script.startswith("$'", i):
            w = start()
            j = i + 2
            while script[j] != "'":
                j += 2 if script[j] == "\\" else 1
            w.chars += [(k, "ansi") for k in range(i + 2, j)]
            i = j + 1
            continue
        if ch == '"':
            w = start()
            j = i + 1
            while script[j] != '"':
                if script[j] == "\\":
                    j += 2
                    continue
                if script.startswith("$(", j) or script[j] == "`":
                    w.dq_substitution = True
                j += 1
            w.chars += [(k, "double") for k in range(i + 1, j)]
            i = j + 1
            continue
        if script.startswith("${", i):
            w = start()
            depth, j = 1, i + 2
            while depth:
                depth += {"{": 1, "}": -1}.get(script[j], 0)
                j += 1
            w.chars += [(k, "bare") for k in range(i, j)]
            i = j
            continue
        if script.startswith("$(", i):
            finish()
            frames.append("subst")
            command = True
            i += 2
            continue
        if ch == "`":
            finish()
            if frames[-1] == "bq":
                frames.pop()
                command = False
            else:
                frames.append("bq")
                command = True
            i += 1
            continue
        if ch == "(" and word is not None and word.command_position and script[i - 1] == "=":  # an array literal
            finish()
            frames.append("array")
            command = False
            i += 1
            continue
        if ch == ")" and frames[-1] == "array":
            finish()
            frames.pop()
            command = True
            i += 1
            continue
        if ch == ")" and frames[-1] == "subst":
            finish()
            frames.pop()
            command = False
            i += 1
            continue
        op = next((o for o in _REDIRECTS if script.startswith(o, i)), None)
        if op is not None:
            finish()
            if op in ("<<", "<<-"):
                expect_heredoc = op
            else:
                after_redirect = True
            i += len(op)
            continue
        op = next((o for o in _COMMAND_OPS if script.startswith(o, i)), None)
        if op is not None:
            finish()
            command = True
            i += len(op)
            continue
        w = start()
        w.chars.append((i, "bare"))
        i += 1
    finish()
    if pending:
        raise AssertionError(f"here-documents {pending} never start")
    return Lexed(words, inert, raw)


def check_shell_marker(script: str, marker: str, tmp_dir: Path, bare_arguments: bool = False) -> None:
    """`bash -n` parses the script, and every occurrence of `marker` is in a comment, in the body of a
    here-document with a quoted terminator, or in a word that is not a command, outside any `$( )` or
    backticks; quoted in that word unless `bare_arguments` (a user's entry point's own arguments)."""
    if shutil.which("bash") is not None:
        path = tmp_dir / "emitted.sh"
        path.write_bytes(script.encode("utf-8", "surrogatepass"))
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30, check=False)
        assert proc.returncode == 0, proc.stderr
    lexed = shell_words(script)
    owner: dict[int, tuple[Word, str]] = {}
    for w in lexed.words:
        for j, kind in w.chars:
            owner[j] = (w, kind)
    start = script.find(marker)
    while start >= 0:
        span = range(start, start + len(marker))
        if any(a <= start and start + len(marker) <= b for a, b, _ in lexed.inert):
            start = script.find(marker, start + 1)
            continue
        assert not any(a <= start < b for a, b in lexed.raw_heredoc), \
            f"marker in an expanding here-document at {start}: {script[max(0, start - 80):start + 80]!r}"
        for j in span:
            assert j in owner, f"marker character {j} is neither in a word, a comment nor a here-document: " \
                               f"{script[max(0, start - 80):start + 80]!r}"
            w, kind = owner[j]
            where = script[max(0, start - 80):start + 80]
            assert not w.command_position, f"marker in a command word: {where!r}"
            assert w.depth == 0, f"marker inside a command substitution: {where!r}"
            assert not (kind == "double" and w.dq_substitution), f"marker beside a substitution: {where!r}"
            assert bare_arguments or kind != "bare", f"marker unquoted: {where!r}"
        start = script.find(marker, start + 1)


def check_python_marker(source: str, marker: str) -> None:
    """The snippet parses, and `marker` is only ever in a comment or a string literal."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for attr in ("id", "attr", "name", "arg", "module"):
            value = getattr(node, attr, None)
            assert not (isinstance(value, str) and marker in value), f"marker as {type(node).__name__}.{attr}"
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if marker in tok.string:
            assert tok.type in (tokenize.COMMENT, tokenize.STRING), f"marker in a {tokenize.tok_name[tok.type]} token"


def _keys(value, out: list[str]) -> list[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            out.append(k)
            _keys(v, out)
    elif isinstance(value, list):
        for v in value:
            _keys(v, out)
    return out


def check_toml_marker(text: str, marker: str) -> None:
    """The file parses as TOML, no key holds `marker`, and every line with it is a comment or inside a string."""
    keys = _keys(tomllib.loads(text), [])
    assert not any(marker in k for k in keys), keys
    for line in text.splitlines():
        if marker in line:
            in_string = '"' in line and line.index('"') < line.index(marker) and "=" in line[:line.index('"')]
            assert line.lstrip().startswith("#") or in_string, line


def check_yaml_marker(text: str, marker: str) -> None:
    """The file parses as YAML (safe_load), no key or value holds `marker`, and every line with it is a comment."""
    import yaml

    doc = yaml.safe_load(text)
    keys = _keys(doc, [])
    assert not any(marker in k for k in keys), keys
    assert marker not in repr(doc)
    for line in text.splitlines():
        if marker in line:
            assert line.lstrip().startswith("#"), line


def check_json_marker(text: str, marker: str) -> None:
    """The file parses as JSON and no key holds `marker`."""
    keys = _keys(json.loads(text), [])
    assert not any(marker in k for k in keys), keys


def check_file_marker(path: str, text: str, marker: str) -> None:
    """A file a launch script writes: checked in its own language (by its suffix)."""
    if path.endswith(".json"):
        check_json_marker(text, marker)
    elif path.endswith(".toml"):
        check_toml_marker(text, marker)
    else:
        raise AssertionError(f"no check for file {path!r}")
