"""`meshplan` command line (also `python -m planner`)."""

from __future__ import annotations

import importlib
import sys

from planner.cli.app import app

# Each module registers its commands on `app`; add new command modules here.
COMMAND_MODULES = [
    "planner.cli.plan_cmds",
    "planner.cli.emit_cmd",
    "planner.cli.validate_cmd",
    "planner.cli.profile_cmd",
    "planner.cli.tune_cmd",
    "planner.cli.autoshard_cmd",
    "planner.cli.compare_cmd",
    "planner.cli.report_cmd",
]

for _name in COMMAND_MODULES:
    importlib.import_module(_name)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; user errors print one clear line on stderr and exit non-zero."""
    from planner.cli.common import run_app

    return run_app(app, argv if argv is not None else sys.argv[1:])
