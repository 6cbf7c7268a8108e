"""Pictures of plans as matplotlib Figures: speed against memory over every candidate (`pareto`), the step-time
terms of the ranked plans (`breakdown`), memory per pipeline rank (`memory_stages`), the 1F1B / interleaved
schedule (`schedule`), predicted against measured step times (`predicted_vs_measured`) and two plans side by
side (`comparison`). `plan_figure` and `explain_figure` are what `meshplan plan --plot` and `explain --plot` write.

Each function builds a `matplotlib.figure.Figure` from the objects the planner returns (read by attribute, no
file read) and, given `path` (.png or .svg), writes it there too. No pyplot and no global backend: the figures
draw headless and show in a notebook as they are. matplotlib (the `plot` extra) is imported only when a figure
is drawn; without it each function says so in one line.

The artists carry SVG ids (`gid`) naming what they draw, so a saved SVG can be read back and checked: points
`candidates`, `pareto-front`, `plans`; bars `bar-<term>-<plan rank>`, `mem-<term>-r<pipeline rank>`; schedule
blocks `block-<F|B>-r<rank>-m<micro-batch>-c<chunk>` over their row `row-r<rank>`; lines `memory-limit`,
`memory-capacity`, `identity` (above RASTER_POINTS candidates the points are one raster image, without an id).
SVG text is written as text (`svg.fonttype` none), so labels stay searchable.

This module sits in the bottom layer with planner.specs, which imports it: it imports nothing of planner.specs
(types for checking only). Writing a picture is planner.show.files'.
"""

from __future__ import annotations

import math
import os
import textwrap
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from planner.errors import SpecError
from planner.show.files import PLOT_SUFFIXES, check_plot_target, figure_bytes, save  # noqa: F401  (public here)
from planner.show.labels import (GIB, MEMORY_TERM_WORDS, TIME_TERM_WORDS, layout_label, memory_word, plan_label,
                                 plans_shown, time_word)
from planner.show.schedule import Schedule, simulate, stage_times

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from planner.specs import Estimate, Plan, PlanResult, Strategy
    from planner.show.compare import Comparison

#: Above this many candidates the scatter is drawn as one raster image inside the SVG (a vector file of a
#: million markers is hundreds of MB and slow to open); the points stay exact in a PNG either way.
RASTER_POINTS = 2000
#: Schedule blocks drawn at most: beyond, only the first micro-batches' time is drawn (said in the title).
MAX_DRAWN_BLOCKS = 4000
#: Pixels per inch of the figures (and of their PNG files).
DPI = 100
#: Longest plan label beside a bar before it is cut (the label names the plan: `#2 dp8 tp8 pp2 ...`).
LABEL_CHARS = 70


def _figure(width_in: float, height_in: float) -> "Figure":
    """A new Figure, or one SpecError line where matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SpecError("plots need matplotlib: pip install 'meshplan[plot]'") from None
    return Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")


def _colour(term: str, words: dict[str, str], cmap: str) -> Any:
    """The same colour for a term in every picture: its place in the word table picks it from `cmap`."""
    import matplotlib

    keys = list(words)
    colours = matplotlib.colormaps[cmap]
    i = keys.index(term) if term in keys else len(keys) + sum(map(ord, term))
    return colours(i % colours.N)


def _cut(text: str, n: int = LABEL_CHARS) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _done(fig: "Figure", path: str | os.PathLike | None) -> "Figure":
    if path is not None:
        save(fig, path)
    return fig


# ---- speed against memory -------------------------------------------------------------------------------
def draw_pareto(ax: "Axes", result: "PlanResult") -> None:
    """Every fitting candidate's tokens/s/GPU against its peak memory, the Pareto front, the limit and the
    capacity, the ranked plans numbered."""
    c = result.candidates  # refuses a result read from JSON
    fits = np.flatnonzero(c.fits)
    speed = c.tokens_per_s_per_gpu
    many = len(fits) > RASTER_POINTS
    pts = ax.scatter(c.peak_memory_bytes[fits] / GIB, speed[fits], s=4 if many else 12, color="#8d99a6",
                     alpha=0.5 if many else 0.8, linewidths=0, rasterized=many,
                     label=f"{len(fits):,} fitting candidates")
    pts.set_gid("candidates")
    front = c.pareto()
    if len(front):
        (line,) = ax.plot(c.peak_memory_bytes[front] / GIB, speed[front], marker="o", ms=3, lw=1.2,
                          color="#1f4e79", label=f"Pareto front ({len(front)}: no other is faster with less memory)")
        line.set_gid("pareto-front")
    limit = ax.axvline(c.memory_limit_bytes / GIB, color="#c0392b", ls="--", lw=1.2,
                       label=f"limit {c.memory_limit_bytes / GIB:.1f} GiB (headroom {result.headroom:.0%})")
    limit.set_gid("memory-limit")
    cap = ax.axvline(c.memory_capacity_bytes / GIB, color="#444444", ls=":", lw=1.2,
                     label=f"GPU memory {c.memory_capacity_bytes / GIB:.1f} GiB")
    cap.set_gid("memory-capacity")
    plans = result.plans
    if plans:
        xs = [p.estimate.peak_memory_bytes / GIB for p in plans]
        ys = [p.estimate.tokens_per_s_per_gpu for p in plans]
        marks = ax.scatter(xs, ys, s=60, marker="*", color="#e67e22", edgecolors="black", linewidths=0.5, zorder=3,
                           label="ranked plans (numbered)")
        marks.set_gid("plans")
        for p, x, y in zip(plans, xs, ys):
            ax.annotate(str(p.rank), (x, y), xytext=(4, 4), textcoords="offset points", fontsize=8,
                        gid=f"plan-number-{p.rank}")
    else:
        ax.text(0.5, 0.5, "no candidate fits under the limit", transform=ax.transAxes, ha="center")
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(f"{_question(result)}: speed against memory", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _question(result: "PlanResult") -> str:
    return f"{result.model.name} on {result.num_gpus} x {result.cluster.gpu.name} ({result.cluster.name})"


def pareto(result: "PlanResult", path: str | os.PathLike | None = None) -> "Figure":
    """Tokens/s/GPU against peak memory (GiB) for every fitting candidate of the search that made `result`."""
    result.candidates  # refuse before a figure is made
    fig = _figure(9, 5.5)
    draw_pareto(fig.add_subplot(), result)
    return _done(fig, path)


# ---- step-time terms ------------------------------------------------------------------------------------
def _terms(dicts: list[dict[str, float]]) -> list[str]:
    """Every key in first-seen order, less those zero in every dict."""
    keys: list[str] = []
    for d in dicts:
        keys += [k for k in d if k not in keys]
    return [k for k in keys if any(d.get(k, 0.0) for d in dicts)]


def draw_breakdown(ax: "Axes", plans: list["Plan"]) -> None:
    """One horizontal bar per plan, its exposed time terms stacked (seconds)."""
    times = [p.estimate.time_s for p in plans]
    y = np.arange(len(plans))
    left = np.zeros(len(plans))
    for term in _terms(times):
        values = np.array([t.get(term, 0.0) for t in times])
        bars = ax.barh(y, values, left=left, height=0.6, color=_colour(term, TIME_TERM_WORDS, "tab10"),
                       label=time_word(term))
        for p, bar in zip(plans, bars.patches):
            bar.set_gid(f"bar-{term}-{p.rank}")
        left += values
    ax.set_yticks(y, [_cut(plan_label(p)) for p in plans], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("exposed step time (s)")
    ax.set_title("step time by term", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them


def breakdown(plans: "list[Plan] | PlanResult", top: int = 5, path: str | os.PathLike | None = None) -> "Figure":
    """Stacked bars of the first `top` plans' exposed step-time terms (a PlanResult: its ranked plans, or the
    closest candidates when nothing fits)."""
    if not isinstance(top, int) or top < 1:
        raise SpecError(f"top ({top!r}) must be a positive integer")
    chosen = list(plans_shown(plans) if hasattr(plans, "plans") else plans)[:top]
    if not chosen:
        raise SpecError("breakdown needs at least one plan")
    fig = _figure(10, 1.6 + 0.55 * len(chosen))
    draw_breakdown(fig.add_subplot(), chosen)
    return _done(fig, path)


# ---- memory per pipeline rank ---------------------------------------------------------------------------
def draw_memory_stages(ax: "Axes", estimate: "Estimate", headroom: float | None, title: str) -> None:
    """Stacked bars of memory by term per pipeline rank, with the GPU's capacity and (given `headroom`) limit."""
    if estimate.stages:
        ranks = [(s.pipeline_rank, s.memory_bytes) for s in estimate.stages]
        note = ""
    else:
        ranks = [(estimate.binding_pipeline_rank, estimate.memory_bytes)]
        note = f" (per-rank memory not kept: rank {estimate.binding_pipeline_rank}, the most loaded, alone)"
    x = np.arange(len(ranks))
    bottom = np.zeros(len(ranks))
    mems = [mem for _, mem in ranks]
    for term in _terms(mems):
        values = np.array([mem.get(term, 0.0) for mem in mems]) / GIB
        bars = ax.bar(x, values, bottom=bottom, width=0.7, color=_colour(term, MEMORY_TERM_WORDS, "tab20"),
                      label=memory_word(term))
        for (r, _), bar in zip(ranks, bars.patches):
            bar.set_gid(f"mem-{term}-r{r}")
        bottom += values
    cap = estimate.memory_capacity_bytes / GIB
    ax.axhline(cap, color="#444444", ls=":", lw=1.2, label=f"GPU memory {cap:.1f} GiB").set_gid("memory-capacity")
    if headroom is not None:
        lim = cap * (1 - headroom)
        ax.axhline(lim, color="#c0392b", ls="--", lw=1.2,
                   label=f"limit {lim:.1f} GiB (headroom {headroom:.0%})").set_gid("memory-limit")
    ax.set_xticks(x, [str(r) for r, _ in ranks])
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_title(title + note, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2)


def memory_stages(plan: "Plan", headroom: float | None = None, path: str | os.PathLike | None = None) -> "Figure":
    """Memory by term on each pipeline rank of `plan` (one rank of each stage), capacity and limit lines."""
    fig = _figure(max(6.0, 2.5 + 0.5 * max(len(plan.estimate.stages), 1)), 5)
    draw_memory_stages(fig.add_subplot(), plan.estimate, headroom,
                       f"memory per pipeline rank\n{_cut(plan_label(plan))}")
    return _done(fig, path)


# ---- the pipeline schedule ------------------------------------------------------------------------------
def simulated(strategy: "Strategy", estimate: "Estimate") -> tuple[Schedule, bool]:
    """The schedule of `strategy` from `estimate`'s per-rank times, and whether those are the estimate's own."""
    forward, backward, own = stage_times(estimate, strategy.pp)
    if len(forward) != strategy.pp:
        raise SpecError(f"the estimate has {len(forward)} pipeline stages, the strategy pp {strategy.pp}")
    return simulate(strategy.pp, strategy.vpp, int(estimate.num_microbatches), forward, backward), own


def draw_schedule(ax: "Axes", strategy: "Strategy", estimate: "Estimate", max_microbatches: int | None = None,
                  title: str = "") -> Schedule:
    """One row per pipeline rank, forward and backward blocks of every micro-batch and chunk on it, the gaps
    (idle time: the bubble) left grey; the simulated schedule returned."""
    from matplotlib.patches import Patch, Rectangle

    if max_microbatches is not None and (not isinstance(max_microbatches, int) or max_microbatches < 1):
        raise SpecError(f"max_microbatches ({max_microbatches!r}) must be a positive integer")
    sched, own = simulated(strategy, estimate)
    pp, vpp, m = sched.pp, sched.vpp, sched.num_microbatches
    shown_mb = max_microbatches
    if shown_mb is None and 2 * pp * vpp * m > MAX_DRAWN_BLOCKS:
        shown_mb = max(1, MAX_DRAWN_BLOCKS // (2 * pp * vpp))
    end = sched.makespan_s
    if shown_mb is not None and shown_mb < m:  # up to the end of micro-batch shown_mb - 1 on the first rank
        end = max(b.end_s for b in sched.blocks[0] if b.kind == "B" and b.microbatch == shown_mb - 1)
    else:
        shown_mb = None
    width_px = ax.figure.get_figwidth() * DPI * 0.8
    for r in range(pp):
        ax.add_patch(Rectangle((0, r - 0.42), end, 0.84, color="#ececec", gid=f"row-r{r}", zorder=1))
        for b in sched.blocks[r]:
            if b.start_s >= end:
                break
            shade = 0.45 + 0.4 * (b.chunk / (vpp - 1) if vpp > 1 else 0.0)
            colour = _shade("Blues" if b.kind == "F" else "Oranges", shade)
            ax.add_patch(Rectangle((b.start_s, r - 0.4), b.end_s - b.start_s, 0.8, facecolor=colour,
                                   edgecolor="white", linewidth=0.3, zorder=2,
                                   gid=f"block-{b.kind}-r{r}-m{b.microbatch}-c{b.chunk}"))
            if (b.end_s - b.start_s) / end * width_px >= 7 * len(str(b.microbatch)) + 2:
                ax.text((b.start_s + b.end_s) / 2, r, str(b.microbatch), ha="center", va="center", fontsize=6,
                        zorder=3)
    ax.set_xlim(0, end)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp), [f"rank {r}\nidle {100 * max(0.0, sched.idle_s[r]) / sched.makespan_s:.0f}%"
                              if sched.makespan_s else f"rank {r}" for r in range(pp)], fontsize=7)
    ax.set_xlabel("time in the step's micro-batches (s)")
    kind = "interleaved 1F1B" if vpp > 1 else "1F1B"
    parts = [f"{kind}: pp {pp}, vpp {vpp}, m {m}, simulated bubble {100 * max(0.0, sched.bubble_fraction):.1f}% "
             f"(cost model {100 * estimate.bubble_fraction:.1f}%)"]
    if shown_mb is not None:
        parts.append(f"first {shown_mb} of {m} micro-batches' time shown")
    if not own:
        parts.append("per-rank times not kept: equal stages assumed")
    ax.set_title("\n".join(([title] if title else []) + ["; ".join(parts)]), fontsize=9)
    chunks = " (darker: later chunks)" if vpp > 1 else ""
    ax.legend(handles=[Patch(color=_shade("Blues", 0.6), label="forward" + chunks),
                       Patch(color=_shade("Oranges", 0.6), label="backward"),
                       Patch(color="#ececec", label="idle")], fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return sched


def _shade(cmap: str, level: float) -> Any:
    import matplotlib

    return matplotlib.colormaps[cmap](level)


def schedule(plan: "Plan", max_microbatches: int | None = None, path: str | os.PathLike | None = None) -> "Figure":
    """The plan's pipeline schedule (1F1B or interleaved) from its per-rank times; only the first
    `max_microbatches` micro-batches' time is drawn when given (or when the whole would exceed MAX_DRAWN_BLOCKS)."""
    fig = _figure(12, 1.8 + 0.45 * plan.strategy.pp)
    draw_schedule(fig.add_subplot(), plan.strategy, plan.estimate, max_microbatches, _cut(plan_label(plan)))
    return _done(fig, path)


# ---- predicted against measured -------------------------------------------------------------------------
def draw_predicted_vs_measured(ax: "Axes", pairs: Sequence[tuple], band: float | tuple[float, float] | None = None,
                               title: str = "") -> None:
    """Each (label, predicted_s, measured_s[, predicted_low_s, predicted_high_s]) as a point, the y = x line and,
    given `band` (relative errors (low, high), or ±b), where the prediction claims the measurement lands."""
    kept = [p for p in pairs if all(v is not None and math.isfinite(v) and v > 0 for v in p[1:3])]
    if not kept:
        raise SpecError("nothing to plot: no run has both a predicted and a measured step time")
    pred = np.array([p[1] for p in kept], dtype=float)
    meas = np.array([p[2] for p in kept], dtype=float)
    pts = ax.scatter(meas, pred, s=30, color="#1f4e79", zorder=3, label=f"{len(kept)} runs")
    pts.set_gid("pairs")
    lows = [(i, p[3], p[4]) for i, p in enumerate(kept) if len(p) >= 5 and p[3] is not None and p[4] is not None]
    if lows:
        i, lo, hi = (np.array(v, dtype=float) for v in zip(*lows))
        i = i.astype(int)
        bars = ax.errorbar(meas[i], pred[i], yerr=[pred[i] - lo, hi - pred[i]], fmt="none", ecolor="#5d6d7e",
                           lw=1, capsize=2, label="predicted band")
        bars.lines[2][0].set_gid("pair-bands")
    lo_ax, hi_ax = 0.8 * min(pred.min(), meas.min()), 1.25 * max(pred.max(), meas.max())
    line = np.linspace(lo_ax, hi_ax, 50)
    ax.plot(line, line, color="#444444", lw=1, label="predicted = measured")[0].set_gid("identity")
    if band is not None:
        low, high = (-band, band) if isinstance(band, (int, float)) else band
        ax.fill_between(line, line * (1 + low), line * (1 + high), color="#f5b041", alpha=0.25,
                        label=f"band {100 * low:+.0f}% .. {100 * high:+.0f}%").set_gid("band")
    for (label, *_), x, y in zip(kept, meas, pred):
        ax.annotate(_cut(str(label), 30), (x, y), xytext=(4, -10), textcoords="offset points", fontsize=7)
    if hi_ax / lo_ax > 20:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(lo_ax, hi_ax)
    ax.set_ylim(lo_ax, hi_ax)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(title or "predicted against measured step time", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def predicted_vs_measured(pairs: Sequence[tuple], band: float | tuple[float, float] | None = None, title: str = "",
                          path: str | os.PathLike | None = None) -> "Figure":
    """Predicted against measured step time, one point per run (`validate`, `tune`)."""
    fig = _figure(7, 6.5)
    draw_predicted_vs_measured(fig.add_subplot(), pairs, band, title)
    return _done(fig, path)


# ---- two plans side by side -----------------------------------------------------------------------------
def comparison(comp: "Comparison", estimate_a: "Estimate", estimate_b: "Estimate",
               path: str | os.PathLike | None = None) -> "Figure":
    """Plan A and plan B: their step-time terms stacked side by side, and their most-loaded rank's memory terms
    (`meshplan compare --plot`)."""
    fig = _figure(15, 6)
    t_ax, d_ax, m_ax = fig.subplots(1, 3, width_ratios=(1, 1.3, 1))
    names = ["a", "b"]
    x = np.arange(2)
    for ax, diffs, words, cmap, scale, prefix in ((t_ax, comp.time, TIME_TERM_WORDS, "tab10", 1.0, "bar"),
                                                  (m_ax, comp.memory, MEMORY_TERM_WORDS, "tab20", GIB, "mem")):
        bottom = np.zeros(2)
        for d in diffs:
            if not (d.a or d.b):
                continue
            values = np.array([d.a, d.b]) / scale
            word = time_word(d.term) if prefix == "bar" else memory_word(d.term)
            bars = ax.bar(x, values, bottom=bottom, width=0.55, color=_colour(d.term, words, cmap), label=word)
            for n, bar in zip(names, bars.patches):
                bar.set_gid(f"{prefix}-{d.term}-{n}")
            bottom += values
        ax.set_xticks(x, [_cut(comp.a, 30), _cut(comp.b, 30)])
        ax.grid(axis="y", alpha=0.3)
    for e, n in ((estimate_a, 0), (estimate_b, 1)):
        cap = e.memory_capacity_bytes / GIB
        m_ax.hlines(cap, n - 0.35, n + 0.35, color="#444444", ls=":", lw=1.2).set_gid(f"memory-capacity-{names[n]}")
    # the difference term by term, as a share of the faster step: what the sentence names, largest first
    shown = sorted((d for d in comp.time if d.a or d.b), key=lambda d: -abs(d.share))
    y = np.arange(len(shown))
    diff = d_ax.barh(y, [100 * d.share for d in shown], color=[_colour(d.term, TIME_TERM_WORDS, "tab10")
                                                                for d in shown], height=0.6)
    for d, bar in zip(shown, diff.patches):
        bar.set_gid(f"diff-{d.term}")
    d_ax.set_yticks(y, [time_word(d.term) for d in shown], fontsize=7)
    d_ax.invert_yaxis()
    d_ax.axvline(0, color="#444444", lw=0.8)
    d_ax.set_xlabel(f"{comp.b} - {comp.a}, % of the faster step ({comp.b} loses where positive)")
    d_ax.set_title("the difference, term by term", fontsize=10)
    d_ax.grid(axis="x", alpha=0.3)
    t_ax.set_ylabel("exposed step time (s)")
    t_ax.set_title("step time by term", fontsize=10)
    t_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=2)
    m_ax.set_ylabel("memory of the most-loaded rank (GiB)")
    m_ax.set_title("memory by term (dotted: GPU memory)", fontsize=10)
    m_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=2)
    fig.suptitle("\n".join(textwrap.wrap(comp.sentence, 130)), fontsize=9)
    return _done(fig, path)


# ---- what the CLI writes --------------------------------------------------------------------------------
def draw_closest(ax: "Axes", result: "PlanResult") -> None:
    """When nothing fits: the closest candidates' memory by term against the limit."""
    plans = result.closest
    y = np.arange(len(plans))
    left = np.zeros(len(plans))
    mems = [p.estimate.memory_bytes for p in plans]
    for term in _terms(mems):
        values = np.array([m.get(term, 0.0) for m in mems]) / GIB
        bars = ax.barh(y, values, left=left, height=0.6, color=_colour(term, MEMORY_TERM_WORDS, "tab20"),
                       label=memory_word(term))
        for p, bar in zip(plans, bars.patches):
            bar.set_gid(f"mem-{term}-{p.rank}")
        left += values
    cap = result.cluster.gpu.memory_bytes / GIB
    lim = cap * (1 - result.headroom)
    ax.axvline(lim, color="#c0392b", ls="--", lw=1.2, label=f"limit {lim:.1f} GiB").set_gid("memory-limit")
    ax.axvline(cap, color="#444444", ls=":", lw=1.2, label=f"GPU memory {cap:.1f} GiB").set_gid("memory-capacity")
    ax.set_yticks(y, [_cut(plan_label(p)) for p in plans], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("peak memory of the most-loaded rank (GiB)")
    ax.set_title(f"{_question(result)}: no strategy fits; the closest candidates' memory", fontsize=10)
    ax.legend(fontsize=7, loc="lower right", ncols=2)


def plan_figure(result: "PlanResult", top: int = 5, path: str | os.PathLike | None = None) -> "Figure":
    """`meshplan plan --plot`: speed against memory over every candidate above the first `top` plans' step-time
    terms; when nothing fits, the closest candidates' memory against the limit."""
    if not result.plans:
        if not result.closest:
            raise SpecError("nothing to plot: no valid strategy")
        fig = _figure(10, 2 + 0.55 * len(result.closest))
        draw_closest(fig.add_subplot(), result)
        return _done(fig, path)
    plans = result.plans[:top]
    fig = _figure(10, 6.5 + 0.55 * len(plans))
    top_ax, bottom_ax = fig.subplots(2, 1, height_ratios=[6, 1.5 + 0.55 * len(plans)])
    draw_pareto(top_ax, result)
    draw_breakdown(bottom_ax, plans)
    return _done(fig, path)


def explain_figure(strategy: "Strategy", estimate: "Estimate", headroom: float | None = None,
                   max_microbatches: int | None = None, path: str | os.PathLike | None = None) -> "Figure":
    """`meshplan explain --plot`: memory per pipeline rank beside the pipeline schedule of one strategy."""
    fig = _figure(14, max(4.5, 2.0 + 0.45 * strategy.pp))
    mem_ax, sched_ax = fig.subplots(1, 2, width_ratios=[1, 2.6])
    draw_memory_stages(mem_ax, estimate, headroom, "memory per pipeline rank")
    draw_schedule(sched_ax, strategy, estimate, max_microbatches, _cut(layout_label(strategy)))
    return _done(fig, path)
