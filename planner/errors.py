"""Errors meshplan raises for bad user input.

`SpecError` is the one exception type the CLI turns into a clear message and a
non-zero exit. Infeasible strategies are *not* errors: the search counts them
and keeps their reasons (see `planner.rules`).
"""

from __future__ import annotations

import difflib


class SpecError(ValueError):
    """User input that breaks a rule; the message names the field, the rule and the value."""


class NoFeasibleStrategyError(SpecError):
    """No candidate fits; the message says which came closest and by how much."""


def unknown_name_message(kind: str, name: str, choices: list[str]) -> str:
    """`unknown model preset 'llama3-7b'; close matches: llama3-8b, llama2-7b`."""
    close = difflib.get_close_matches(name, choices, n=4, cutoff=0.5)
    hint = f"close matches: {', '.join(close)}" if close else f"choices: {', '.join(sorted(choices))}"
    return f"unknown {kind} {name!r}; {hint}"
