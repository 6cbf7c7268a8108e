"""User-given text made safe for the terminal.

Every string the user gave (a model, cluster or GPU name, a file path, a constraint echoed back, an
error message quoting a value) goes through `shown` before it reaches a rich Table cell, title or a
markup-interpreted `console.print`, and through `plain` before a `markup=False` print: control and
format characters (ESC, BEL, NUL, CR, LF, U+202E and the other bidi controls, U+2028...) become
visible escapes such as `\\x1b` and `\\u202e`, very long strings are cut to their first `limit`
characters and `…`, and `shown` escapes rich markup, so `x[/]` prints as `x[/]` instead of failing.
"""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from planner.errors import escape_hidden

#: Characters of a name kept before it is cut with `…`: enough for any real model, GPU or file name.
NAME_CHARS = 80
#: Characters of a message line (an error or a warning) kept before it is cut with `…`.
MESSAGE_CHARS = 2000


def plain(text: object, limit: int = NAME_CHARS) -> str:
    """`text` as a string with no non-printing character (`planner.errors.escape_hidden`) and at most
    `limit` characters of it (then `…`); for a print with markup=False."""
    s = str(text)
    cut = len(s) > limit
    s = s[:limit]
    return escape_hidden(s) + ("…" if cut else "")


def shown(text: object, limit: int = NAME_CHARS) -> str:
    """`plain(text, limit)` with rich markup escaped: for a Table cell, title or caption and for a
    print that interprets markup."""
    return escape(plain(text, limit))


def message_lines(text: object, limit: int = MESSAGE_CHARS) -> str:
    """A message of one or more lines (the CLI's own line breaks kept), each line made `plain`."""
    return "\n".join(plain(line, limit) for line in str(text).split("\n"))


def cells_table(cells) -> Table:
    """A planner.show.labels.TextTable as a rich Table: title and every cell `shown` (user text escaped, cut at
    MESSAGE_CHARS), its left columns left-aligned, the others right-aligned."""
    table = Table(title=shown(cells.title, MESSAGE_CHARS))
    for col in cells.columns:
        table.add_column(col, justify="left" if col in cells.left else "right")
    for row in cells.rows:
        table.add_row(*(shown(v, MESSAGE_CHARS) for v in row))
    return table
