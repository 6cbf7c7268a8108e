"""The picture of `meshplan clusters --show NAME --plot FILE.png`: a cluster's topology graph, summarised so
that a 24,576-GPU cluster stays readable, optionally coloured by a plan's parallel groups.

What is drawn. The first two units of each level are expanded, recursively (two pods, two racks in each, two
servers in each, their GPUs); the other units of each level are one labelled block beside them ("190 more
racks, 3,040 GPUs"), joined by a dashed line to the switches that join them. Rows from the bottom: NVSwitches,
GPUs, NICs, then the switches by tier. Edges are coloured by link kind (`link`) and as wide as the log of their
bandwidth. With a plan: GPUs are filled by their tensor-parallel group (or the innermost dimension of degree
> 1), outlined by pipeline stage, and the scale-out links each of the other dimensions' groups cross are
overlaid in that dimension's colour (a group that stays in its NVLink domain crosses none).

`draw_topology` builds a matplotlib Figure from data and reads no file; matplotlib (the `plot` extra) is
imported when it is called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from planner.cli.topology_view import dim_groups, group_index, span_level
from planner.specs import ClusterSpec, Strategy

#: Colours of the link kinds (graph conventions' `link`); others are grey.
LINK_COLOURS = {"nvlink": "#76b900", "ici": "#76b900", "pcie": "#8c8c8c", "nic": "#1f77b4", "fabric": "#ff7f0e",
                "dcn": "#9467bd"}
#: Colours of the overlays marking the links a dimension's groups cross.
DIM_COLOURS = {"cp": "#17becf", "ep": "#8c564b", "dp": "#d62728", "pp": "#9400d3"}
#: Units of a level drawn in full; the rest become one block.
EXPANDED = 2
#: GPUs of one NVLink domain drawn one by one; a larger domain shows DOMAIN_SHOWN of them and a block.
DOMAIN_DRAWN = 16
DOMAIN_SHOWN = 8
#: Widths (x units) of a GPU, a block, and the gap closing a unit of level k (GAP · k).
GPU_W, BLOCK_W, GAP = 1.0, 3.0, 0.6


@dataclass
class _Layout:
    """Slots along x: ('gpu', rank) or ('block', text, parent level, parent's first rank, parent's GPUs)."""

    x: dict[Any, float] = field(default_factory=dict)
    blocks: list[tuple[float, str, int, int, int]] = field(default_factory=list)
    units: list[tuple[float, float, int, str]] = field(default_factory=list)  # x0, x1, level, label
    width: float = 0.0


def _slots(units: list[int], names: list[str], total: int) -> _Layout:
    """Where each drawn GPU and block goes (module docstring); `units` GPUs per unit of each level."""
    out = _Layout()

    def place(k: int, start: int) -> None:
        n = min(units[k], total - start)
        x0 = out.width
        if k == 0:
            shown = n if n <= DOMAIN_DRAWN else DOMAIN_SHOWN
            for r in range(start, start + shown):
                out.x[r] = out.width + GPU_W / 2
                out.width += GPU_W
            if n > shown:
                out.blocks.append((out.width + BLOCK_W / 2, f"{n - shown:,} more\nGPUs", 0, start, n))
                out.width += BLOCK_W
        else:
            child = units[k - 1]
            count = math.ceil(n / child)
            for c in range(min(EXPANDED, count)):
                place(k - 1, start + c * child)
            if count > EXPANDED:
                rest = n - EXPANDED * child
                out.blocks.append((out.width + BLOCK_W / 2, f"{count - EXPANDED:,} more\n{names[k - 1]} units\n"
                                   f"{rest:,} GPUs", k, start, n))
                out.width += BLOCK_W
        out.units.append((x0, out.width, k, f"{names[k]} {start // units[k]}"))
        out.width += GAP * (k + 1)

    top = len(units) - 1
    count = math.ceil(total / units[top])
    for c in range(min(EXPANDED, count)):
        place(top, c * units[top])
    if count > EXPANDED:
        rest = total - EXPANDED * units[top]
        out.blocks.append((out.width + BLOCK_W / 2, f"{count - EXPANDED:,} more\n{names[top]} units\n{rest:,} GPUs",
                           top + 1, 0, total))
        out.width += BLOCK_W
    return out


def _row(data: dict[str, Any]) -> float:
    kind = data["kind"]
    return {"nvswitch": -1.0, "gpu": 0.0, "nic": 1.0}.get(kind, 1.0 + float(data.get("tier", 1)))


def _reach(graph: nx.Graph) -> tuple[dict[Any, int], dict[Any, int]]:
    """Lowest and highest GPU rank below each node (a switch: through NICs and lower-tier switches; an NVSwitch:
    its GPUs)."""
    lo: dict[Any, int] = {}
    hi: dict[Any, int] = {}
    nodes = graph.nodes
    for n, rank in nodes(data="rank"):
        if nodes[n]["kind"] == "gpu":
            lo[n] = hi[n] = rank
    order = sorted((n for n in nodes if nodes[n]["kind"] != "gpu"), key=lambda n: _row(nodes[n]))
    for n in order:  # an NVSwitch (drawn below its GPUs) covers its GPUs, any other node what lies below it
        row = _row(nodes[n])
        below = [m for m in graph.neighbors(n) if m in lo and (_row(nodes[m]) < row or nodes[n]["kind"] == "nvswitch")]
        if below:
            lo[n] = min(lo[m] for m in below)
            hi[n] = max(hi[m] for m in below)
    return lo, hi


def _drawn_nodes(graph: nx.Graph, gpus: list[Any]) -> set[Any]:
    """The drawn GPUs, their NICs and NVSwitches, and every switch above them."""
    nodes = graph.nodes
    drawn = set(gpus)
    frontier = list(gpus)
    while frontier:
        nxt = []
        for n in frontier:
            row = _row(nodes[n])
            for m in graph.neighbors(n):
                if m not in drawn and nodes[m]["kind"] != "gpu" and (_row(nodes[m]) > row or nodes[m]["kind"] ==
                                                                     "nvswitch"):
                    drawn.add(m)
                    nxt.append(m)
        frontier = nxt
    return drawn


def _spread(xs: dict[Any, float], rows: dict[Any, float], min_gap: float = 0.9) -> None:
    """Move nodes of one row apart so that none overlaps (parallel switches above the same GPUs)."""
    by_row: dict[float, list[Any]] = {}
    for n, y in rows.items():
        by_row.setdefault(y, []).append(n)
    for y, members in by_row.items():
        if y == 0.0:
            continue
        members.sort(key=lambda n: xs[n])
        i = 0
        while i < len(members):  # nodes at one x: spread symmetrically
            j = i
            while j + 1 < len(members) and abs(xs[members[j + 1]] - xs[members[i]]) < 1e-9:
                j += 1
            if j > i:
                centre = xs[members[i]]
                for k, n in enumerate(members[i:j + 1]):
                    xs[n] = centre + (k - (j - i) / 2) * min_gap
            i = j + 1
        members.sort(key=lambda n: xs[n])
        for a, b in zip(members, members[1:]):
            if xs[b] - xs[a] < min_gap:
                xs[b] = xs[a] + min_gap


def draw_topology(cluster: ClusterSpec, graph: nx.Graph, num_gpus: int | None = None,
                  strategy: Strategy | None = None, num_layers: int = 1, title: str = "") -> Any:
    """The Figure of `graph` (the cluster's topology graph, module docstring) for a cluster of `num_gpus` GPUs
    (default: its max_gpus, else the graph's), coloured by `strategy`'s groups when given."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch, Patch

    levels = cluster.levels
    units, names = [lv.unit_gpus for lv in levels], [lv.name for lv in levels]
    by_rank = {rank: n for n, rank in graph.nodes(data="rank") if graph.nodes[n]["kind"] == "gpu"}
    total = num_gpus or cluster.max_gpus or len(by_rank)
    # the job fills `filled` GPUs of each NVLink domain (ClusterSpec.job_domain_gpus): draw the domains it uses
    domain, filled = cluster.domain_size, cluster.job_domain_gpus(total)
    spread = filled < domain and total > filled  # several domains, each filled part-way
    slots = _slots(units, names, min(len(by_rank), -(-total // filled) * domain) if spread else total)
    gpus = [by_rank[r] for r in slots.x if r in by_rank]
    drawn = _drawn_nodes(graph, gpus)
    lo, hi = _reach(graph)
    rows = {n: _row(graph.nodes[n]) for n in drawn}
    xs: dict[Any, float] = {by_rank[r]: x for r, x in slots.x.items() if r in by_rank}
    for n in sorted(drawn - set(gpus), key=lambda n: rows[n]):  # bottom-up: over the drawn nodes below
        below = [xs[m] for m in graph.neighbors(n) if m in xs and rows.get(m, 99) < rows[n]]
        xs[n] = float(np.mean(below)) if below else slots.width / 2
    for n in drawn:  # NVSwitches: under their GPUs
        if graph.nodes[n]["kind"] == "nvswitch":
            xs[n] = float(np.mean([xs[m] for m in graph.neighbors(n) if m in xs and graph.nodes[m]["kind"] == "gpu"]
                                  or [xs[n]]))
    _spread(xs, rows)

    def span(n: Any) -> int:
        if n not in lo:
            return len(units)
        return next((k for k, u in enumerate(units) if lo[n] // u == hi[n] // u), len(units))

    width_in = min(40.0, max(10.0, 3.0 + 0.2 * (slots.width + 6)))
    top_row = max(rows.values()) if rows else 1.0
    fig = Figure(figsize=(width_in, 4.0 + 1.1 * (top_row + 2)), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_axis_off()

    # edges: colour by link kind, width by log bandwidth
    edges = [(a, b, d) for a, b, d in graph.edges(drawn, data=True) if a in drawn and b in drawn]
    bws = [d["bw"] for _, _, d in edges] or [1.0]
    low, high = math.log10(min(bws)), math.log10(max(bws))

    def lw(bw: float) -> float:
        return 0.6 + 3.4 * ((math.log10(bw) - low) / (high - low) if high > low else 1.0)

    kinds_seen: dict[str, str] = {}
    for a, b, d in edges:
        link = str(d.get("link") or "other")
        colour = LINK_COLOURS.get(link, "#555555")
        kinds_seen[link] = colour
        if rows[a] == rows[b]:  # a link within one row (GPU to GPU): an arc below the row
            t = np.linspace(0, 1, 20)
            xa, xb = xs[a], xs[b]
            ax.plot(xa + (xb - xa) * t, rows[a] - 0.35 * np.sin(np.pi * t) * min(1.0, abs(xb - xa) / 4),
                    color=colour, lw=lw(d["bw"]), alpha=0.8, zorder=1)
        else:
            ax.plot([xs[a], xs[b]], [rows[a], rows[b]], color=colour, lw=lw(d["bw"]), alpha=0.8, zorder=1)

    # a plan's groups
    legend: list[Any] = [Line2D([], [], color=c, lw=2.5, label=f"{k} link") for k, c in kinds_seen.items()]
    fill = {n: "#dddddd" for n in gpus}
    outline = {n: "black" for n in gpus}
    if strategy is not None:
        groups = dim_groups(strategy, num_layers)
        place = np.array([graph.nodes[n]["rank"] for n in gpus], dtype=np.int64)
        ranks = place // domain * filled + place % domain  # the job's rank on each drawn GPU
        used = (place % domain < filled) & (ranks < total)
        colour_dim = next((d for d in ("tp", "cp", "ep", "dp", "pp") if groups[d][0] > 1), "tp")
        cmap = matplotlib.colormaps["tab20"]
        index = group_index(ranks, *groups[colour_dim])
        stages = (ranks // groups["pp"][1]) % groups["pp"][0]
        pp_cmap = matplotlib.colormaps["Dark2"]
        for n, i, s, u in zip(gpus, index, stages, used):
            fill[n] = cmap(int(i) % 20) if u else "#f4f4f4"
            outline[n] = pp_cmap(int(s) % 8) if groups["pp"][0] > 1 and u else "black"
        legend.append(Patch(facecolor=cmap(0), edgecolor="black", label=f"fill: {colour_dim} group "
                            f"({groups[colour_dim][0]} GPUs each)"))
        if groups["pp"][0] > 1:
            legend.append(Patch(facecolor="white", edgecolor=pp_cmap(1), lw=2, label="outline: pipeline stage"))
        job_units = cluster.job_units(total)
        crossing = [(d, span_level(groups[d][0], groups[d][1], total, job_units)) for d in DIM_COLOURS
                    if groups[d][0] > 1]
        crossing = [(d, s) for d, s in crossing if s >= 1]
        for j, (dim, s) in enumerate(crossing):
            off = (j - (len(crossing) - 1) / 2) * 0.18
            for a, b, d in edges:
                if rows[a] == rows[b] or str(d.get("link")) in ("nvlink", "ici"):
                    continue
                upper = a if rows[a] > rows[b] else b
                lower = b if upper is a else a
                if graph.nodes[upper]["kind"] == "nvswitch" or graph.nodes[lower]["kind"] == "nvswitch":
                    continue
                if span(upper) <= s:
                    ax.plot([xs[a] + off, xs[b] + off], [rows[a], rows[b]], color=DIM_COLOURS[dim], lw=1.6,
                            alpha=0.9, zorder=2, ls=(0, (4, 2)))
            inside = names[s] if s < len(names) else "the cluster"
            legend.append(Line2D([], [], color=DIM_COLOURS[dim], lw=1.6, ls=(0, (4, 2)),
                                 label=f"{dim} groups ({groups[dim][0]} GPUs) cross these links, inside {inside}"))

    # nodes
    style = {"gpu": ("s", 170), "nic": ("o", 40), "nvswitch": ("h", 220), "switch": ("D", 150)}
    for kind, (marker, size) in style.items():
        members = [n for n in drawn if graph.nodes[n]["kind"] == kind]
        if not members:
            continue
        faces = [fill.get(n, {"nic": "#aec7e8", "nvswitch": "#c7e9a0", "switch": "#ffbb78"}.get(kind, "white"))
                 for n in members]
        edgec = [outline.get(n, "black") for n in members]
        ax.scatter([xs[n] for n in members], [rows[n] for n in members], marker=marker, s=size, c=faces,
                   edgecolors=edgec, linewidths=1.8 if kind == "gpu" else 0.8, zorder=3)
    small = len(gpus) <= 128
    for n in gpus:
        if small:
            ax.text(xs[n], 0, str(graph.nodes[n]["rank"]), ha="center", va="center", fontsize=5.5, zorder=4)
    switches = sorted((n for n in drawn if graph.nodes[n]["kind"] == "switch"), key=lambda n: (rows[n], xs[n]))
    for i, n in enumerate(switches):  # neighbours' names at two heights, so that a row of rail leaves stays legible
        ax.text(xs[n], rows[n] + 0.2 + 0.22 * (i % 2), str(n), ha="center", va="bottom", fontsize=5.5, zorder=4)

    # blocks of units not drawn, joined to the switches that join them
    for x, text, k, start, n in slots.blocks:
        ax.add_patch(FancyBboxPatch((x - BLOCK_W * 0.42, -0.45), BLOCK_W * 0.84, 0.9, boxstyle="round,pad=0.05",
                                    facecolor="#f0f0f0", edgecolor="#777777", ls="--", zorder=2))
        ax.text(x, 0, text, ha="center", va="center", fontsize=5.5, zorder=4)
        joins = [m for m in drawn if m in lo and graph.nodes[m]["kind"] in ("switch", "nvswitch") and span(m) == k
                 and lo[m] < start + n and hi[m] >= start]  # the switches of the unit the block belongs to
        if k > len(units) - 1:
            joins = [m for m in drawn if graph.nodes[m]["kind"] == "switch" and span(m) >= len(units)]
        for m in joins:
            ax.plot([x, xs[m]], [0.45 if rows[m] > 0 else -0.45, rows[m]], color="#777777", lw=0.8, ls="--",
                    zorder=1)
    # units expanded: a bracket under the GPUs
    for x0, x1, k, label in slots.units:
        if k == 0 and units[0] == 1:
            continue
        y = -1.6 - 0.45 * k
        ax.plot([x0 + 0.1, x1 - 0.1], [y, y], color="#999999", lw=0.8)
        ax.text((x0 + x1) / 2, y - 0.08, label, ha="center", va="top", fontsize=6, color="#555555")
    # row names
    tiers = sorted({rows[n] for n in drawn if graph.nodes[n]["kind"] == "switch"})
    for y in tiers:
        level_names = {graph.nodes[n].get("level") for n in drawn if rows[n] == y and graph.nodes[n].get("level")}
        ax.text(-1.0, y, f"tier {int(y - 1)}" + (f" ({', '.join(sorted(map(str, level_names)))})"
                                                if level_names else ""), ha="right", va="center", fontsize=7)
    for y, label in ((-1.0, "NVSwitch"), (0.0, "GPU"), (1.0, "NIC")):
        if any(rows[n] == y for n in drawn):
            ax.text(-1.0, y, label, ha="right", va="center", fontsize=7)
    ax.set_xlim(-4.5, slots.width + 1)
    ax.set_ylim(-1.8 - 0.45 * len(units), top_row + 1.0)
    ax.legend(handles=legend, loc="upper right", fontsize=7, framealpha=0.9)
    lines = [title or f"{cluster.name}: {total:,} GPUs", "levels: " + "; ".join(
        f"{lv.name} {lv.unit_gpus:,} GPUs, {lv.egress_bytes_per_s / 1e9:.3g} GB/s/GPU out" for lv in levels),
        "edge width: log bandwidth; first two units of each level drawn, the rest as blocks"]
    ax.set_title("\n".join(lines), fontsize=8, loc="left")
    return fig
