"""Tables as HTML: the report's and a notebook's (`PlanResult._repr_html_`), from the same cells the CLI prints
(planner.show.labels.TextTable). Every cell is escaped: names come from the input."""

from __future__ import annotations

import html

from planner.show.labels import TextTable


def html_table(cells: TextTable, table_id: str | None = None, row_classes: list[str] | None = None) -> str:
    """`cells` as an HTML table: a caption from the title, numbers right-aligned (class `num`), `row_classes[i]`
    on row i where given."""
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in cells.columns)
    body = []
    for n, row in enumerate(cells.rows):
        klass = row_classes[n] if row_classes and n < len(row_classes) and row_classes[n] else ""
        tds = "".join(f'<td{"" if c in cells.left else " class=num"}>{esc(v)}</td>'
                      for c, v in zip(cells.columns, row))
        body.append(f'<tr{f" class={esc(klass)}" if klass else ""}>{tds}</tr>')
    caption = f"<caption>{esc(cells.title)}</caption>" if cells.title else ""
    ident = f' id="{esc(table_id)}"' if table_id else ""
    return f"<table{ident}>{caption}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def lines_html(lines: list[str]) -> str:
    """Lines of text as one paragraph, escaped."""
    return "<p>" + "<br>".join(html.escape(line) for line in lines) + "</p>"
