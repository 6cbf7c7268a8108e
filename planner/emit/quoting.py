"""How user text enters emitted code: quoted as data, or checked as a name, never as code.

Model, cluster and GPU names (a model YAML's `name`, a Hugging Face config's
`_name_or_path`, a plan file's `model.name`), entry points and other option
values reach shell scripts, Python snippets, TOML files and JSON. Every emitter
puts them there through these helpers only:

- `comment(prefix, text)`: a comment line. The text becomes one printable line
  (`one_line`): newlines, carriage returns, other control characters, line and
  paragraph separators (U+2028, U+2029, U+0085), bidirectional overrides
  (U+202E) and every other character `str.isprintable` refuses are written as
  backslash escapes, a backslash itself is doubled, and the line is cut at
  `COMMENT_MAX_CHARS`. So no text can end a comment early in any language.
- `shell_word(value)`: one shell word (`shlex.quote`).
- `python_literal(value)`: a Python literal of a JSON-like value (`repr` of
  str, int, float, bool, None, lists and dicts; no name a non-finite float
  would need).
- `toml_value(value)`: a TOML value; strings are basic strings with every
  control and non-printing character escaped; `toml_key` and
  `python_identifier` check the names an emitter writes itself.
- `heredoc(path, text)`: a shell command writing `text` to `path` through a quoted
  here-document whose terminator is proven absent from `text`.
- `check_name(field, value, pattern)`: a value used as a name (a job name)
  must match its pattern, else a SpecError naming the field, the rule and the value.
JSON is `json.dumps` (ASCII, escaped) and needs no helper.
"""

from __future__ import annotations

import math
import re
import shlex
from typing import Any

from planner.errors import SpecError, escape_hidden, short_repr

#: longest comment line an emitter writes (user text beyond it is cut and marked)
COMMENT_MAX_CHARS = 1000
#: longest a name (model, cluster, GPU) is shown in a comment line, so the rest of the line survives
NAME_MAX_CHARS = 200
#: the mark a cut comment ends with
CUT_MARK = "..."
#: the here-document terminator, made longer while it occurs in the payload
HEREDOC_TERMINATOR = "MESHPLAN_EOF"
#: a name used as an identifier in emitted output (a Slurm job name)
NAME_PATTERN = r"[A-Za-z0-9_.-]+"
#: a shell variable (an exported name, an array)
SHELL_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
#: escapes Python, TOML and C share for the common control characters
_SHORT_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def one_line(text: str, max_chars: int = COMMENT_MAX_CHARS) -> str:
    """`text` as one printable line: a backslash doubled, the usual control characters as `\\n`, `\\r`, `\\t`,
    every other character `str.isprintable` refuses (control, format and bidi characters, separators) as
    `\\xNN`, `\\uNNNN` or `\\UNNNNNNNN`; cut to `max_chars` characters (ending in `CUT_MARK`) when longer."""
    out = escape_hidden("".join(_SHORT_ESCAPES.get(ch, ch) for ch in str(text)))
    if len(out) > max_chars:
        out = out[:max_chars - len(CUT_MARK)] + CUT_MARK
    return out


def clip(text: str, max_chars: int = NAME_MAX_CHARS) -> str:
    """`text` cut to `max_chars` characters (ending in `CUT_MARK`) when longer; nothing escaped (`comment`
    escapes the line it goes into)."""
    text = str(text)
    return text if len(text) <= max_chars else text[:max_chars - len(CUT_MARK)] + CUT_MARK


def comment(prefix: str, text: str) -> str:
    """A comment line (without its newline): `prefix` (the language's comment marker and any fixed words,
    e.g. `"# note: "`) followed by `one_line(text)`, the whole line at most `COMMENT_MAX_CHARS` characters."""
    return prefix + one_line(text, max(len(CUT_MARK), COMMENT_MAX_CHARS - len(prefix)))


def shell_word(value: Any) -> str:
    """`value` (a string, or a number or flag written as its text) as one shell word, quoted where needed."""
    return shlex.quote(str(value))


def python_literal(value: Any) -> str:
    """A Python literal for a JSON-like value: `repr` of str, bool, None, int and finite float, and lists
    and dicts of them. A NaN or infinity (whose repr is a name) or another type is a ValueError."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"no Python literal for the non-finite float {value!r}")
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python_literal(k)}: {python_literal(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"no Python literal for {type(value).__name__} {short_repr(value)}")


def toml_string(value: str) -> str:
    """A TOML basic string: backslash and quote escaped, the control characters as TOML's short escapes
    or `\\uXXXX`, and every other character `str.isprintable` refuses as `\\uXXXX` or `\\UXXXXXXXX`."""
    out = []
    for ch in value:
        if ch == '"':
            out.append('\\"')
        elif ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\u{code:04X}" if code < 0x10000 else f"\\U{code:08X}")
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    """A TOML value for a bool, int, finite float, str, or a list of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"no TOML value for the non-finite float {value!r} here")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {short_repr(value)}")


def toml_key(key: str) -> str:
    """A bare TOML key (the emitters' keys are framework field names); anything else is a ValueError."""
    if re.fullmatch(r"[A-Za-z0-9_-]+", key) is None:
        raise ValueError(f"not a bare TOML key: {short_repr(key)}")
    return key


def python_identifier(name: str) -> str:
    """`name` when it is a Python identifier (a class or keyword the emitter names); else a ValueError."""
    if not name.isidentifier():
        raise ValueError(f"not a Python identifier: {short_repr(name)}")
    return name


def heredoc_terminator(text: str) -> str:
    """`HEREDOC_TERMINATOR`, lengthened (`_1`, `_2`, ...) until it does not occur anywhere in `text`, not even
    with NUL bytes (which bash drops while reading a script) removed: no line of `text` can end the document."""
    visible = text.replace("\0", "")
    terminator, n = HEREDOC_TERMINATOR, 0
    while terminator in visible:
        n += 1
        terminator = f"{HEREDOC_TERMINATOR}_{n}"
    return terminator


def heredoc(path: str, text: str) -> str:
    """A shell command writing `text` (a newline is added when it lacks its last one) to `path` through a
    quoted here-document (no expansion inside) whose terminator `text` does not contain."""
    if not text.endswith("\n"):
        text += "\n"
    end = heredoc_terminator(text)
    return f"cat > {shell_word(path)} <<'{end}'\n{text}{end}\n"


def check_name(field: str, value: str, pattern: str = NAME_PATTERN) -> str:
    """`value`, used as a name in emitted output, when it matches `pattern` in full; else a SpecError naming the
    field, the rule and the value."""
    if not isinstance(value, str) or re.fullmatch(pattern, value) is None:
        raise SpecError(f"{field} must match {pattern} in full to be used as a name in the emitted output "
                        f"(got {short_repr(value)})")
    return value


def shell_command(field: str, text: str) -> list[str]:
    """The words of a command line given as one string (`--script 'train.py --fast'`), split as a POSIX shell
    splits them; unbalanced quotes, no word at all, or a non-printing character (a NUL cannot be in an argument)
    is a SpecError naming the field, the rule and the value."""
    bad = next((ch for ch in text if not ch.isprintable() and ch not in " \t"), None)
    if bad is not None:
        raise SpecError(f"{field} must hold printable characters only (got {short_repr(text)}, with "
                        f"{short_repr(bad)})")
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise SpecError(f"{field} must be a command line a shell can split ({exc}: got {short_repr(text)})") from None
    if not words:
        raise SpecError(f"{field} must name the entry point to run (got {short_repr(text)})")
    return words
