"""`meshplan clusters --show NAME`: a cluster's topology in words and numbers (its levels, what leaves a unit of
each, the graph they come from) and, with a plan, where the plan's parallel groups fall on it; `--plot FILE.png`
draws it (planner.cli.topology_plot).

The summary is plain data (`topology_summary`, `group_spans`), printed as a table or given as JSON; the
groups come from the rank arithmetic of cost_models.layout.ParallelLayout, the units from the cluster's fabric
(profiles.topology.derive_fabric): a group stays inside a unit of a level when its first and last members fall
in one unit (a unit's GPUs have consecutive ranks).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
from rich.table import Table

from cost_models.layout import DEFAULT_RANK_ORDER, ParallelLayout
from planner.cli.common import stdout
from planner.cli.text import MESSAGE_CHARS, plain, shown
from planner.show.files import check_plot_target
from planner.specs import ClusterSpec, Strategy
from planner.specs.files import write_whole
from profiles.topology import graph_file

#: The dimensions whose groups are placed, in the order they are listed (ep: the expert mesh's).
GROUP_DIMS = ("tp", "cp", "ep", "dp", "pp")
GB = 1e9
MICRO = 1e-6


def rank_order(strategy: Strategy) -> str:
    """The strategy's rank order (innermost first), Megatron-core's default where it names none."""
    return getattr(strategy, "rank_order", None) or DEFAULT_RANK_ORDER


def dim_groups(strategy: Strategy, num_layers: int) -> dict[str, tuple[int, int]]:
    """(size, stride) of each dimension's groups: the members of a group are base + j·stride, j < size."""
    lay = ParallelLayout.of_strategy(strategy, num_layers, rank_order=rank_order(strategy))
    out = {d: (int(getattr(lay, d)[0]), int(lay.stride(d)[0])) for d in ("tp", "cp", "dp", "pp")}
    size, stride = lay.expert_group("ep")
    out["ep"] = (int(size[0]), int(stride[0]))
    return {d: out[d] for d in GROUP_DIMS}


def group_index(ranks: np.ndarray, size: int, stride: int) -> np.ndarray:
    """Which group of a dimension (numbered by the group's lowest rank, in rank order) each rank is in."""
    coord = (ranks // stride) % size
    base = ranks - coord * stride
    _, index = np.unique(base, return_inverse=True)
    return index.ravel()


def span_level(size: int, stride: int, num_gpus: int, units: list[int]) -> int:
    """The innermost level (index into `units`, the GPUs per unit of each level) one of whose units holds every
    group of a dimension whole; len(units) when none does (the groups cross every level)."""
    ranks = np.arange(num_gpus)
    base = ranks[(ranks // stride) % size == 0]
    last = base + (size - 1) * stride
    for k, unit in enumerate(units):
        if np.array_equal(base // unit, last // unit):
            return k
    return len(units)


def group_spans(strategy: Strategy, num_layers: int, num_gpus: int, cluster: ClusterSpec) -> list[dict[str, Any]]:
    """For each dimension of degree > 1: its size and stride, the level a unit of which holds each of its groups
    (`inside`; 'cluster' when no level's does) and the levels its groups leave (`crosses`), the job's ranks
    placed in each level's units as `cluster.job_units(num_gpus)` says."""
    levels = cluster.levels
    units = cluster.job_units(num_gpus)
    out = []
    for dim, (size, stride) in dim_groups(strategy, num_layers).items():
        if size <= 1:
            continue
        k = span_level(size, stride, num_gpus, units)
        out.append({"dim": dim, "size": size, "stride": stride,
                    "inside": levels[k].name if k < len(levels) else "cluster",
                    "crosses": [lv.name for lv in levels[:k]]})
    return out


def level_rows(cluster: ClusterSpec) -> list[dict[str, Any]]:
    """Each fabric level: GPUs per unit, egress per GPU (GB/s), the oversubscription that implies (what enters a
    unit over what leaves it: the level below's egress, or the NIC rate for the first level, over this one's),
    latency (µs) and in-network reduction."""
    rows = []
    below = cluster.inter_node.bw_bytes_per_s
    for lv in cluster.levels:
        rows.append({"name": lv.name, "unit_gpus": lv.unit_gpus,
                     "egress_gb_per_s": round(lv.egress_bytes_per_s / GB, 3),
                     "oversubscription": round(below / lv.egress_bytes_per_s, 3),
                     "latency_us": round(lv.latency_s / MICRO, 3), "sharp": lv.sharp})
        below = lv.egress_bytes_per_s
    return rows


def topology_summary(cluster: ClusterSpec, graph: nx.Graph) -> dict[str, Any]:
    """What `--show` prints: the topology's kind and source, its levels and the graph behind them."""
    spec = cluster.topology
    kinds: dict[str, int] = {}
    tiers: dict[int, int] = {}
    for _, data in graph.nodes(data=True):
        kinds[data["kind"]] = kinds.get(data["kind"], 0) + 1
        if data["kind"] == "switch":
            tiers[int(data["tier"])] = tiers.get(int(data["tier"]), 0) + 1
    gpus = kinds.get("gpu", 0)
    whole = spec is not None and spec.kind == "graph"
    return {
        "name": cluster.name,
        "kind": spec.kind if spec is not None else "two-tier",
        "rails": bool(spec is not None and spec.rails),
        "max_gpus": cluster.max_gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "nvlink_domain": cluster.domain_size,
        "intra_node_gb_per_s": round(cluster.intra_node.bw_bytes_per_s / GB, 3),
        "inter_node_gb_per_s": round(cluster.inter_node.bw_bytes_per_s / GB, 3),
        "levels": level_rows(cluster),
        "graph": {"nodes": graph.number_of_nodes(), "edges": graph.number_of_edges(), "gpus": gpus,
                  "nodes_by_kind": kinds, "switches_by_tier": {str(t): tiers[t] for t in sorted(tiers)},
                  "whole_cluster": whole or cluster.max_gpus == gpus,
                  "file": str(graph_file(cluster)) if whole else None},
        "source": spec.source if spec is not None else "",
        "fabric_source": cluster.fabric.source if cluster.fabric is not None else "",
    }


def print_summary(summary: dict[str, Any], plan: dict[str, Any] | None = None) -> None:
    """The summary (and a plan's groups) as text on stdout."""
    g = summary["graph"]
    kind = summary["kind"] + (" (rail-optimised)" if summary["rails"] else "")
    size = f"{summary['max_gpus']:,} GPUs" if summary["max_gpus"] else "any size"
    lines = [f"cluster {summary['name']}: {kind} topology, {size}; NVLink domains of {summary['nvlink_domain']} "
             f"GPUs ({summary['intra_node_gb_per_s']:g} GB/s per GPU), {summary['inter_node_gb_per_s']:g} GB/s NIC "
             "per GPU"]
    where = f"graph file {g['file']}" if g["file"] else (
        "the whole cluster" if g["whole_cluster"] else "two units of the largest level: the units of a level are "
        "alike, so its figures are the whole cluster's")
    tiers = ", ".join(f"tier {t}: {n}" for t, n in g["switches_by_tier"].items()) or "none"
    lines.append(f"graph: {g['nodes']:,} nodes, {g['edges']:,} edges, {g['gpus']:,} GPUs ({where}); switches "
                 f"{tiers}")
    if summary["source"]:
        lines.append(f"source: {summary['source']}")
    for line in lines:
        stdout.print(plain(line, MESSAGE_CHARS), markup=False, highlight=False)
    table = Table(title="levels (egress: max-flow out of one unit per GPU, all its GPUs sending)",
                  title_justify="left")
    for col in ("level", "GPUs/unit", "egress/GPU (GB/s)", "oversubscription (x)", "latency (us)", "SHARP"):
        table.add_column(col, justify="left" if col in ("level", "SHARP") else "right")
    for r in summary["levels"]:
        table.add_row(shown(r["name"]), f"{r['unit_gpus']:,}", f"{r['egress_gb_per_s']:,.3g}",
                      f"{r['oversubscription']:.3g}", f"{r['latency_us']:.3g}", "yes" if r["sharp"] else "no")
    stdout.print(table)
    if plan is not None:
        stdout.print(plain(f"plan: {plan['label']} on {plan['num_gpus']:,} GPUs ({plan['how']}), rank order "
                           f"{plan['rank_order']}, {plan['domain_gpus']:,} GPUs of each NVLink domain",
                           MESSAGE_CHARS), markup=False, highlight=False)
        groups = Table(title="parallel groups on the topology", title_justify="left")
        for col in ("group", "size", "stride", "inside a unit of", "crosses"):
            groups.add_column(col, justify="right" if col in ("size", "stride") else "left")
        for s in plan["groups"]:
            groups.add_row(s["dim"], str(s["size"]), str(s["stride"]), shown(s["inside"]),
                           shown(", ".join(s["crosses"]) or "-"))
        stdout.print(groups)


# ---- writing the picture ------------------------------------------------------------------------------
def check_png_target(path: str) -> Path:
    """The --plot path, refused unless it names a .png file that may be written (planner.show.files
    .check_plot_target: not a directory, not an existing link or non-regular file, in an existing writable
    folder). Checked before any planning or drawing."""
    return check_plot_target(path, (".png",), "--plot")


def write_png(target: Path, figure: Any) -> int:
    """Render `figure` to PNG in memory and write it as `target` whole (a temporary file beside it, then
    os.replace, which replaces the name and never follows a link); the bytes written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buf = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buf)
    data = buf.getvalue()
    check_png_target(str(target))  # again: the drawing took a while
    write_whole(target, data)
    return len(data)
