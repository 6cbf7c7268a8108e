"""`--plot FILE.png|svg` of `plan`, `explain`, `validate` and `tune`: the target checked before any work, the
picture (planner.show.plots) written after the command's output, and `plot: FILE` said on stderr.

A command that ends without a result to draw (nothing measured, nothing valid) says on one line why no picture
was written, and keeps its own exit code: the picture never turns a finished command into a failed one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from planner.cli.common import stderr
from planner.cli.text import MESSAGE_CHARS, plain
from planner.errors import SpecError
from planner.show.files import check_plot_target, save

PlotFileOpt = Annotated[Optional[str], typer.Option(
    "--plot", metavar="FILE.png|FILE.svg", help="Also draw the result to this PNG or SVG file (needs matplotlib: "
    "pip install 'meshplan[plot]'); `plot: FILE` is said on stderr.")]


def check_plot(path: str | None) -> Path | None:
    """The --plot target, refused in one line (bad suffix, no such folder, not writable, no matplotlib) before
    the command does any work; None without --plot."""
    if path is None:
        return None
    target = check_plot_target(path, option="--plot")
    try:
        import matplotlib  # noqa: F401  (the plot extra)
    except ImportError:
        raise SpecError("--plot needs matplotlib: pip install 'meshplan[plot]'") from None
    return target


def write_plot(target: Path | None, draw: Callable[[], Any]) -> None:
    """Draw (`draw()` returns a Figure) and write the picture to `target`; `plot: FILE` on stderr, or one line
    saying why nothing was written."""
    if target is None:
        return
    try:
        save(draw(), target)
    except SpecError as exc:
        stderr.print(plain(f"plot: {target} not written: {exc}", MESSAGE_CHARS), markup=False, highlight=False)
        return
    stderr.print(plain(f"plot: {target}", MESSAGE_CHARS), markup=False, highlight=False)
