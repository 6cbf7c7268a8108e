"""One self-contained HTML page a person can open and pass around: the ranked table, the pictures, why the
winner wins (its breakdowns, where its groups sit, what the runner-up loses to), the candidates set aside by
reason, and the configs emitted for it (`meshplan report --out report.html`, `write_report`).

The page carries everything inline (CSS, pictures as PNG data URIs, no script, no external link), so it opens
from a mail attachment or a shared drive with no network. Every text that comes from the input (model, GPU and
cluster names, file paths in messages) is HTML-escaped. The cells and sentences are the CLI's
(planner.show.labels, planner.show.compare): the page and the terminal never disagree.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from cost_models.params import num_active_params, num_params
from planner.api import evaluate, plan
from planner.emit import (NotExpressibleError, backends, costed_elsewhere, emit, first_expressible, imposed_settings,
                          runs_framework)
from planner.errors import SpecError
from planner.misses import Miss, rejected_by_reason
from planner.ranking import TIE_FRACTION
from planner.show.files import figure_bytes
from planner.show.html import html_table
from planner.show.labels import (TIME_TERM_LABELS, TextTable, estimate_lines, header_line, memory_rows,
                                 plan_label, plan_legend, plan_table, plans_shown, stats_lines)
from planner.specs import Plan, PlanResult
from planner.specs.files import write_whole

GIB = 2**30
#: The configs the page shows, in this order: the training frameworks (launch scripts left out: they wrap
#: one of these).
REPORT_BACKENDS = ("megatron", "megatron-bridge", "deepspeed", "colossalai", "torchtitan", "maxtext")
#: The largest page written (bytes): pictures of a search of millions of candidates stay far below it.
MAX_REPORT_BYTES = 64 * 2**20


@dataclass
class Figure:
    """One picture of the page: its id, caption and PNG bytes."""

    id: str
    caption: str
    png: bytes


STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2rem auto; max-width: 1200px;
       padding: 0 1rem; color: #1d1d1f; line-height: 1.45; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.25rem; border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2rem; }
p.question { color: #444; margin-top: 0; }
nav a { margin-right: 1rem; }
div.scroll { overflow-x: auto; }
table { border-collapse: collapse; margin: 0.5rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #d0d0d0; padding: 0.25rem 0.5rem; }
th { background: #f3f3f5; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.best td { background: #eef7ee; }
tr.tie td { background: #fbf8e8; }
ul.legend { color: #555; font-size: 0.85rem; }
figure { margin: 1rem 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.85rem; }
pre { background: #f7f7f9; padding: 0.75rem; overflow-x: auto; font-size: 0.8rem; }
p.sentence { font-weight: 600; }
.note { color: #8a5a00; }
footer { margin-top: 3rem; color: #777; font-size: 0.8rem; }
"""


def build_report(result: PlanResult, figures: list[Figure] | None = None, configs: bool = True) -> str:
    """The page for `result` (a search's result: the candidates set aside need its candidate table; one read
    back from JSON gets a note instead). `figures`: the pictures to show (`report_figures`)."""
    if not result.plans:
        raise SpecError("a report needs at least one plan that fits: nothing fits this question "
                        "(`meshplan plan` shows the closest candidates and what would make one fit)")
    esc = html.escape
    best = result.plans[0]
    m = result.model
    title = f"meshplan report: {m.name} on {result.num_gpus} x {result.cluster.gpu.name}"
    parts = [
        "<!doctype html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>", f"<style>{STYLE}</style>", "</head>", "<body>",
        f'<header><h1>{esc(title)}</h1><p class="question">'
        f"{esc(header_line(result, num_params(m), num_active_params(m)))}</p></header>",
        '<nav><a href="#plans">Ranked plans</a><a href="#pictures">Pictures</a><a href="#winner">Why plan 1</a>'
        '<a href="#rejected">Set aside</a><a href="#configs">Configs</a></nav>',
        '<section id="plans"><h2>Ranked plans</h2>', '<div class="scroll">' + _table(plan_table(result, wide=True),
                                                                                  "plan-table", _row_classes(result))
        + "</div>",
        '<ul class="legend">' + "".join(f"<li>{esc(line)}</li>" for text in
                                        plan_legend(result, plans_shown(result), True, TIE_FRACTION)
                                        for line in text.split("\n") if line) + "</ul>",
        '<p class="stats">' + "<br>".join(esc(line) for line in stats_lines(result)) + "</p></section>",
        '<section id="pictures"><h2>Pictures</h2>', _figures(figures or []), "</section>",
        '<section id="winner"><h2>Why plan 1</h2>', _winner(result, best), "</section>",
        '<section id="rejected"><h2>Candidates set aside</h2>', _rejected(result), "</section>",
        '<section id="configs"><h2>Configs</h2>', _configs(result) if configs else "<p>not asked for</p>", "</section>",
        f"<footer>meshplan {esc(_version())}, {esc(_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))}"
        f"; search of {result.stats.num_candidates:,} candidates in {result.stats.search_time_s:.2f} s.</footer>",
        "</body></html>",
    ]
    return "\n".join(parts)


def write_report(result: PlanResult, path: str | Path, figures: list[Figure] | None = None,
                 configs: bool = True) -> Path:
    """Write the page as `path` whole (a temporary file beside it, then a rename; a link there is refused)."""
    target = check_report_target(path)
    text = build_report(result, figures, configs)
    data = text.encode("utf-8")
    if len(data) > MAX_REPORT_BYTES:
        raise SpecError(f"the report would be {len(data):,} bytes, above the {MAX_REPORT_BYTES:,} written")
    check_report_target(target)  # again: building took a while
    write_whole(target, data)
    return target


def check_report_target(path: str | Path) -> Path:
    """The --out path, refused unless it names an .html file that may be written: not a directory, not a link
    or other non-regular file, in an existing folder."""
    target = Path(path)
    if target.suffix.lower() not in (".html", ".htm"):
        raise SpecError(f"--out {str(path)!r} must name an .html file")
    if target.is_symlink():
        raise SpecError(f"--out {str(path)!r} is a symbolic link; the report is written only as a regular file")
    if target.is_dir():
        raise SpecError(f"--out {str(path)!r} is a directory, not a file")
    if target.exists() and not target.is_file():
        raise SpecError(f"--out {str(path)!r} exists and is not a regular file; it is not replaced")
    if not target.parent.is_dir():
        raise SpecError(f"--out {str(path)!r}: folder {str(target.parent)!r} does not exist")
    return target


def report_figures(result: PlanResult) -> tuple[list[Figure], list[str]]:
    """The page's pictures (planner.show.plots, through the result's plot methods): speed against memory of every
    fitting candidate (a search's result only), the step-time terms of the top plans, and the memory per pipeline
    rank and the schedule of plan 1, or, where plan 1 has no pipeline, of the best ranked plan with one (the
    caption says which). Returns them with a note for each left out and why."""
    try:
        import matplotlib  # noqa: F401  (the `plot` extra; its absence is said, not raised)
    except ImportError:
        return [], ["no pictures: matplotlib is not installed (pip install 'meshplan[plot]')"]
    figures, notes = [], []
    if result.has_candidates:
        figures.append(Figure("fig-pareto", "Tokens/s per GPU against peak memory of every candidate that fits, "
                              "with the Pareto front and the memory limit; the ranked plans numbered.",
                              figure_bytes(result.plot_pareto(), ".png")))
    else:
        notes.append("no speed-against-memory picture: a result read from a file keeps no candidate table")
    figures.append(Figure("fig-breakdown", "Exposed step time of the top plans, term by term.",
                          figure_bytes(result.plot_breakdown(), ".png")))
    piped = next((p for p in result.plans if p.strategy.pp > 1), result.plans[0])
    which = ("plan 1" if piped.rank == 1 else
             f"plan {piped.rank}, the best ranked plan with a pipeline (plan 1 has none: one stage, no bubble)")
    figures.append(Figure("fig-memory", f"Memory of {which} per pipeline rank ({piped.strategy.pp} ranks), term by "
                          "term, against the GPU's capacity and the limit.",
                          figure_bytes(result.plot_memory(rank=piped.rank), ".png")))
    figures.append(Figure("fig-schedule", f"Pipeline schedule of {which}: each rank's forward and backward passes "
                          "of every micro-batch; the gaps are the bubble.",
                          figure_bytes(result.plot_schedule(rank=piped.rank), ".png")))
    return figures, notes


# ---- parts -------------------------------------------------------------------------------------------
def _version() -> str:
    try:
        return metadata.version("meshplan")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _row_classes(result: PlanResult) -> list[str]:
    return ["best" if p.rank == 1 else ("tie" if p.rank in result.worth_a_real_run else "")
            for p in plans_shown(result)]


def _table(cells: TextTable, table_id: str, row_classes: list[str] | None = None) -> str:
    return html_table(cells, table_id, row_classes)


def _figures(figures: list[Figure]) -> str:
    if not figures:
        return "<p>No pictures (matplotlib is not installed, or they were not asked for).</p>"
    out = []
    for f in figures:
        data = base64.b64encode(f.png).decode("ascii")
        out.append(f'<figure id="{html.escape(f.id)}"><img alt="{html.escape(f.caption)}" '
                   f'src="data:image/png;base64,{data}"><figcaption>{html.escape(f.caption)}</figcaption></figure>')
    return "\n".join(out)


def _winner(result: PlanResult, best: Plan) -> str:
    esc = html.escape
    est = evaluate(strategy=best.strategy, model=best.model, cluster=best.cluster, num_gpus=best.num_gpus,
                   **{k: v for k, v in best.train.model_dump().items() if v is not None})
    out = [f"<p><strong>{esc(plan_label(best))}</strong></p>",
           "<p>" + "<br>".join(esc(line) for line in estimate_lines(est)) + "</p>"]
    out.append(_table(TextTable("step time (exposed seconds per term)", ["term", "s", "% of step"],
                                _step_rows(est), left={"term"}), "winner-time"))
    out.append(_table(TextTable("memory of the most-loaded rank", ["term", "GiB", "% of peak"], memory_rows(est),
                                left={"term"}), "winner-memory"))
    if est.groups:
        rows = [[g.dim, str(g.size), str(g.stride), g.collective, g.tier, f"{g.bus_bw_bytes_per_s / 1e9:.1f}",
                 g.limited_by] for g in est.groups]
        out.append(_table(TextTable("where each parallel group sits (all groups of a dimension at once)",
                                    ["dim", "group", "ranks apart", "collective", "crosses", "GB/s per group",
                                     "limited by"], rows, left={"dim", "collective", "crosses", "limited by"}),
                          "winner-groups"))
    if len(result.plans) > 1:
        runner = result.plans[1]
        c = best.compare(runner)
        out.append(f"<h3>Against plan 2: {esc(plan_label(runner))}</h3>")
        out += [f'<p class="sentence">{esc(line)}</p>' for line in c.lines()]
        out.append(_table(c.time_table(), "compare-time"))
        out.append(_table(c.memory_table(), "compare-memory"))
    return "\n".join(out)


def _step_rows(est) -> list[list[str]]:
    return [[TIME_TERM_LABELS.get(t, t), f"{v:.4f}", f"{100 * v / est.step_time_s:.1f}"]
            for t, v in est.time_s.items()] + [["step", f"{est.step_time_s:.4f}", "100.0"]]


def _rejected(result: PlanResult) -> str:
    if not result.has_candidates:
        return ('<p class="note">This result was read from a file, which keeps no candidate table: run the report '
                "from the question to list the candidates set aside.</p>")
    misses: list[Miss] = rejected_by_reason(result)
    if not misses:
        return "<p>None: every candidate fits.</p>"
    rows = [[m.reason, f"{m.count:,}", m.nearest.short() if m.nearest is not None else "-", m.detail]
            for m in misses]
    return _table(TextTable("each candidate under the first reason it meets, with the nearest miss",
                            ["reason", "candidates", "nearest miss", "why"], rows,
                            left={"reason", "nearest miss", "why"}), "rejected-table")


def _configs(result: PlanResult) -> str:
    """Each framework's config for the best plan it can run. A backend whose config imposes training settings the
    ranked plans do not have (Megatron-Bridge's mixed-precision recipe) gets plans searched again with them, as
    `meshplan emit --backend megatron-bridge` searches; a plan ranked as another framework runs it says so."""
    esc = html.escape
    out = []
    for backend in REPORT_BACKENDS:
        if backend not in backends():
            continue
        plans, again = result.plans, ""
        try:
            try:
                chosen, refused = first_expressible(plans, backend)
            except NotExpressibleError:
                fixed = imposed_settings(backend, result.train.precision, result.train.fp8_recipe)
                if not fixed:
                    raise
                plans = _searched_with(result, fixed).plans
                again = ("searched again with the settings its config imposes (" +
                         ", ".join(f"{k} {v}" for k, v in fixed.items()) + "): ")
                chosen, refused = first_expressible(plans, backend)
            text = emit(chosen, backend)
        except NotExpressibleError as exc:
            out.append(f"<h3>{esc(backend)}</h3><p class=note>{esc(str(exc))}</p>")
            continue
        which = f"plan {chosen.rank}" + ("" if chosen.rank == 1 else ", the best it can run")
        note = (f" (plans {', '.join(str(p.rank) for p, _ in refused)} it cannot run)" if refused else "")
        out.append(f"<h3>{esc(backend)}: {esc(again + which)}{esc(note)}</h3>")
        elsewhere = costed_elsewhere(chosen, runs_framework(backend))
        if elsewhere:
            out.append(f"<p class=note>{esc(elsewhere)}</p>")
        out.append(f"<pre>{esc(text)}</pre>")
    return "\n".join(out)


def _searched_with(result: PlanResult, settings: dict[str, Any]) -> PlanResult:
    """The result's question searched again with `settings` fixed: its model, cluster, batch, the training
    settings it was given, and its constraints where the result keeps them."""
    train = result.train
    given = {k: getattr(train, k) for k in train.model_fields_set
             if k not in ("global_batch_size", "seq_len", "precision")}
    constraints = result.candidates.constraints if result.has_candidates else {}
    return plan(result.model, result.cluster, result.num_gpus, train.global_batch_size, train.seq_len,
                train.precision, constraints=dict(constraints), top_k=max(len(result.plans), 1),
                headroom=result.headroom, **(given | settings))
