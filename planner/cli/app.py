"""The typer application every `meshplan` sub-command registers on.

A command module does `from planner.cli.app import app` and decorates its
functions with `@app.command(...)`; `planner/cli/__init__.py` imports the
modules listed in `COMMAND_MODULES`.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="meshplan",
    help="Plan, score, explain, emit and validate parallelism strategies for training large models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: wraps descriptions, never cuts option names in a narrow terminal
)
