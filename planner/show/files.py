"""Writing a picture: the target checked (suffix, folder, nothing in the way) and the file written whole.

planner.specs imports planner.show, so this module cannot use planner.specs.files' writer: it writes the same
way (a temporary file beside the target, then os.replace, which replaces the name and never follows a link).
matplotlib is imported only when a figure is rendered.
"""

from __future__ import annotations

import io
import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from planner.errors import SpecError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The files a picture is written as (by suffix).
PLOT_SUFFIXES = (".png", ".svg")


def check_plot_target(path: str | os.PathLike, suffixes: Sequence[str] = PLOT_SUFFIXES,
                      option: str = "plot path") -> Path:
    """`path` as a picture may be written there: a suffix of `suffixes`, not a directory, not an existing link or
    non-regular file, in an existing folder. Callers check before any planning or drawing."""
    target = Path(path)
    if target.suffix.lower() not in suffixes:
        raise SpecError(f"{option} {str(path)!r} must name a {' or '.join(suffixes)} file")
    if target.is_symlink():
        raise SpecError(f"{option} {str(path)!r} is a symbolic link; the picture is written only as a regular file")
    if target.is_dir():
        raise SpecError(f"{option} {str(path)!r} is a directory, not a file")
    if target.exists() and not stat.S_ISREG(target.stat().st_mode):
        raise SpecError(f"{option} {str(path)!r} exists and is not a regular file; it is not replaced")
    folder = target.parent
    if not folder.is_dir():
        raise SpecError(f"{option} {str(path)!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpecError(f"{option} {str(path)!r}: folder {str(folder)!r} is not writable")
    return target


def figure_bytes(fig: "Figure", suffix: str) -> bytes:
    """The figure as a PNG or SVG file's bytes (SVG text kept as text, ids fixed: the same figure gives the same
    file)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    buf = io.BytesIO()
    if suffix.lower() == ".png":
        FigureCanvasAgg(fig).print_png(buf)
    elif suffix.lower() == ".svg":
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "meshplan"}):
            FigureCanvasSVG(fig).print_svg(buf, metadata={"Date": None})
    else:
        raise SpecError(f"a picture is written as {' or '.join(PLOT_SUFFIXES)} (got {suffix!r})")
    return buf.getvalue()


def save(fig: "Figure", path: str | os.PathLike) -> Path:
    """Write `fig` to `path` (.png or .svg by its suffix) whole: a temporary file beside it, then os.replace (which
    replaces the name, never follows a link). The picture is drawn before the folder is checked again."""
    target = check_plot_target(path)
    data = figure_bytes(fig, target.suffix)
    check_plot_target(target)
    mask = os.umask(0)
    os.umask(mask)
    fd, tmp = tempfile.mkstemp(prefix=".meshplan-", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return target
