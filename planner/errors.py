"""Errors and warnings meshplan gives for user input.

`SpecError` is the one exception type the CLI turns into a clear message and a
non-zero exit. Infeasible strategies are *not* errors: the search counts them
and keeps their reasons (see `planner.rules`). `InputWarning` flags input that is
accepted but probably not what the user meant (a sequence longer than the model's
context, a batch no data-parallel degree divides); the CLI prints each once on
stderr as one `warning:` line.
"""

from __future__ import annotations

import difflib
import reprlib
from typing import Any

class _ShortRepr(reprlib.Repr):
    """reprlib.Repr that describes an integer too long to write out (Python refuses to turn more than
    sys.get_int_max_str_digits() digits into text) by its size instead of failing."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * self.maxother:  # far more digits than are shown anyway
            return f"<an integer of {x.bit_length():,} bits>"
        return super().repr_int(x, level)


#: How input values are echoed in messages: bounded, whatever their size or nesting.
_SHORT = _ShortRepr()
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlevel = 2
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6


def short_repr(value: Any) -> str:
    """`repr(value)` cut to a few dozen characters, without building the full repr of a large value (a
    very long integer is described by its size)."""
    return _SHORT.repr(value)


def _escape(ch: str) -> str:
    if ch.isprintable():
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else (f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")


def escape_hidden(text: str) -> str:
    """`text` with every character `str.isprintable` refuses (control and format characters, bidi
    overrides such as U+202E, line and paragraph separators, ESC, NUL, newlines) written as `\\xNN`,
    `\\uNNNN` or `\\UNNNNNNNN`: text that can neither break its line nor hide what follows it. The
    terminal output (planner.cli.text) and the emitted comments (planner.emit.quoting) both use it."""
    return "".join(map(_escape, text))


class SpecError(ValueError):
    """User input that breaks a rule; the message names the field, the rule and the value."""


class SpecValidationError(SpecError):
    """A spec's fields broke their declared types or bounds; `problems` lists them on one line
    (`tp: Input should be greater than or equal to 1 (got 0)`), `spec` names the class."""

    def __init__(self, spec: str, problems: str) -> None:
        super().__init__(f"invalid {spec}: {problems}")
        self.spec = spec
        self.problems = problems


class ConfigWarning(UserWarning):
    """Input was accepted with an assumption or a doubt the user should see (the CLI prints each
    such warning once on stderr as one `warning:` line)."""


class InputWarning(ConfigWarning):
    """Input that is accepted but is probably not what was meant; the message names the field,
    the rule and the value, as a SpecError would."""


def unknown_name_message(kind: str, name: str, choices: list[str]) -> str:
    """`unknown model preset 'llama3-7b'; close matches: llama3-8b, llama2-7b`."""
    close = difflib.get_close_matches(name, choices, n=4, cutoff=0.5)
    hint = f"close matches: {', '.join(close)}" if close else f"choices: {', '.join(sorted(choices))}"
    return f"unknown {kind} {short_repr(name)}; {hint}"


def format_validation_error(exc: Any) -> str:
    """A pydantic ValidationError as one line: `field: message (got value)` per problem, joined by `; `
    (a rule checked across fields has no field: its message names them)."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        value = err.get("input")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field (extra fields are not allowed)"
        shown = (f" (got {short_repr(value)})" if err.get("type") != "value_error" and not isinstance(value, dict)
                 else "")
        parts.append(f"{loc + ': ' if loc else ''}{msg}{shown}")
    return "; ".join(parts).replace("\n", " ")
