"""`meshplan clusters --show NAME` (the topology in words and numbers, a plan's groups on it) and `--plot FILE.png`
(planner/cli/topology_view.py, topology_plot.py): the summary's numbers, the groups against the rank
arithmetic, the PNG written (and only there) for the DGX SuperPOD and the 24,576-GPU Llama 3 cluster with and
without a plan, and every refusal one line with exit 2."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from planner.cli import main
from planner.cli.topology_plot import draw_topology
from planner.cli.topology_view import group_index, group_spans
from planner.specs import Strategy
from profiles import load_cluster
from profiles.topology import build_graph

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "two-rack-cluster.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LLAMA_PLAN = ["--model", "llama3-70b", "--gpus", "1024", "--global-batch-size", "512", "--seq-len", "8192"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *args: str) -> str:
    code, out, err = run(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (code, err)
    assert "Traceback" not in out + err
    return lines[0]


def png_ok(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 800 and height >= 400 and len(data) > 20_000


# ---- the summary ---------------------------------------------------------------------------------------
def test_show_dgx_h100_as_text(capsys):
    code, out, err = run(capsys, "clusters", "--show", "dgx-h100")
    assert code == 0, err
    assert "cluster dgx-h100: fat-tree (rail-optimised) topology, any size" in out
    assert "graph: 1,105 nodes, 1,552 edges, 512 GPUs (two units of the largest level" in out
    assert "switches tier 1: 16, tier 2: 1" in out
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    assert [[c.strip() for c in r] for r in rows] == [["nvlink-domain", "8", "50", "1", "6", "no"],
                                                      ["su", "256", "50", "1", "6", "no"]]


def test_show_llama3_as_json(capsys):
    code, out, err = run(capsys, "clusters", "--show", "llama3-h100-24k", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["kind"] == "fat-tree" and data["max_gpus"] == 24576 and data["plan"] is None
    assert [(lv["name"], lv["unit_gpus"]) for lv in data["levels"]] == [("nvlink-domain", 8), ("rack", 16),
                                                                        ("pod", 3072)]
    pod = data["levels"][2]
    assert pod["egress_gb_per_s"] == pytest.approx(50 / 7, abs=1e-3) and pod["oversubscription"] == 7.0
    assert data["graph"]["gpus"] == 6144 and data["graph"]["switches_by_tier"] == {"1": 384, "2": 2, "3": 1}
    assert "1:7" in data["source"]


def test_show_a_user_graph_with_a_given_strategy(capsys):
    code, out, err = run(capsys, "clusters", "--show", str(EXAMPLE), "--model", "llama3-8b", "--gpus", "32",
                         "--global-batch-size", "64", "--seq-len", "4096", "--strategy", '{"tp": 4, "pp": 2}',
                         "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["kind"] == "graph" and data["graph"]["file"].endswith("two-rack-fabric.graphml")
    assert [lv["egress_gb_per_s"] for lv in data["levels"]] == [50, 25]
    assert [lv["oversubscription"] for lv in data["levels"]] == [1, 2]
    plan = data["plan"]
    assert plan["label"] == "dp4 tp4 pp2" and plan["how"] == "the given strategy"
    assert plan["rank_order"] == "tp-cp-ep-dp-pp"
    assert plan["groups"] == [
        {"dim": "tp", "size": 4, "stride": 1, "inside": "nvlink-domain", "crosses": []},
        {"dim": "dp", "size": 4, "stride": 4, "inside": "rack", "crosses": ["nvlink-domain"]},
        {"dim": "pp", "size": 2, "stride": 16, "inside": "cluster", "crosses": ["nvlink-domain", "rack"]},
    ]


def test_groups_follow_the_rank_arithmetic():
    """The 16-GPU example of cost_models/layout.py (tp=2, dp=2, pp=4): DP pairs {0, 2} stay in an 8-GPU
    domain, pipelines {0, 4, 8, 12} leave it; groups are checked against the members listed by hand."""
    cluster = load_cluster("dgx-h100")
    s = Strategy(tp=2, dp=2, pp=4)
    spans = {g["dim"]: (g["inside"], g["crosses"]) for g in group_spans(s, 8, 16, cluster)}
    assert spans == {"tp": ("nvlink-domain", []), "dp": ("nvlink-domain", []), "pp": ("su", ["nvlink-domain"])}
    ranks = np.arange(16)
    assert group_index(ranks, 4, 4).tolist() == [0, 1, 2, 3] * 4
    assert group_index(ranks, 2, 1).tolist() == [r // 2 for r in range(16)]


def test_best_plan_groups_on_llama3(capsys):
    code, out, err = run(capsys, "clusters", "--show", "llama3-h100-24k", *LLAMA_PLAN, "-C", "tp=8", "-C", "pp=4")
    assert code == 0, err
    assert "on 1,024 GPUs (the best plan), rank order tp-cp-ep-dp-pp" in out
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("│")[1:-1]]
                                              for line in out.splitlines() if line.startswith("│"))}
    assert rows["tp"] == ["8", "1", "nvlink-domain", "-"]
    assert rows["dp"] == ["32", "8", "pod", "nvlink-domain, rack"]  # 256 GPUs of one pipeline stage
    assert rows["pp"] == ["4", "256", "pod", "nvlink-domain, rack"]  # 1,024 GPUs: inside the first pod


# ---- the picture ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cluster", ["dgx-h100", "llama3-h100-24k"])
@pytest.mark.parametrize("with_plan", [False, True], ids=["topology", "plan"])
def test_plot_writes_a_png(capsys, tmp_path, cluster, with_plan):
    target = tmp_path / "topo.png"
    plan = [*LLAMA_PLAN, "-C", "pp=2"] if with_plan else []
    code, out, err = run(capsys, "clusters", "--show", cluster, "--plot", str(target), *plan)
    assert code == 0, err
    png_ok(target)
    assert f"wrote {target}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["topo.png"]  # nothing else, no temporary left


def test_the_picture_marks_a_plans_groups():
    """Figure-level check (no file): with a plan, the legend names the TP fill, the pipeline outline and the
    links the DP and PP groups cross; without one, only link kinds."""
    cluster = load_cluster("dgx-h100")
    graph = build_graph(cluster)
    bare = [t.get_text() for t in draw_topology(cluster, graph).axes[0].get_legend().get_texts()]
    assert bare and all(t.endswith(" link") for t in bare)
    s = Strategy(tp=8, pp=4, dp=32)
    fig = draw_topology(cluster, graph, num_gpus=1024, strategy=s, num_layers=80)
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "fill: tp group (8 GPUs each)" in texts and "outline: pipeline stage" in texts
    assert "dp groups (32 GPUs) cross these links, inside su" in texts
    assert "pp groups (4 GPUs) cross these links, inside the cluster" in texts
    blocks = [t.get_text() for t in fig.axes[0].texts if "more" in t.get_text()]
    assert "2 more\nsu units\n512 GPUs" in blocks and "30 more\nnvlink-domain units\n240 GPUs" in blocks


def test_the_24k_cluster_is_summarised():
    cluster = load_cluster("llama3-h100-24k")
    fig = draw_topology(cluster, build_graph(cluster))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "6 more\npod units\n18,432 GPUs" in texts and "190 more\nrack units\n3,040 GPUs" in texts
    assert sum(t.isdigit() for t in texts) == 64  # 2 pods x 2 racks x 2 servers x 8 GPUs drawn, numbered
    assert fig.get_size_inches()[0] <= 40


def test_an_existing_png_is_replaced(capsys, tmp_path):
    target = tmp_path / "topo.png"
    target.write_bytes(b"old")
    code, _, err = run(capsys, "clusters", "--show", "dgx-h100", "--plot", str(target))
    assert code == 0, err
    png_ok(target)


# ---- refusals ------------------------------------------------------------------------------------------
def test_plot_targets_are_refused(capsys, tmp_path):
    folder = tmp_path / "dir.png"
    folder.mkdir()
    assert "is a directory, not a file" in refused(capsys, "clusters", "--show", "dgx-h100", "--plot", str(folder))
    assert "must name a .png file" in refused(capsys, "clusters", "--show", "dgx-h100", "--plot",
                                              str(tmp_path / "topo.svg"))
    assert "does not exist" in refused(capsys, "clusters", "--show", "dgx-h100", "--plot",
                                       str(tmp_path / "missing" / "topo.png"))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "link.png"
    link.symlink_to(victim)
    assert "is a symbolic link" in refused(capsys, "clusters", "--show", "dgx-h100", "--plot", str(link))
    assert victim.read_text() == "precious\n"
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    assert "exists and is not a regular file" in refused(capsys, "clusters", "--show", "dgx-h100", "--plot",
                                                         str(fifo))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.png", "fifo.png", "link.png", "victim.txt"]
    assert list(folder.iterdir()) == []


def test_plot_without_matplotlib(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    line = refused(capsys, "clusters", "--show", "dgx-h100", "--plot", str(tmp_path / "t.png"))
    assert "--plot needs matplotlib: pip install 'meshplan[plot]'" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--plot", "t.png"], "--plot work with --show NAME"),
    (["--model", "llama3-8b"], "--model work with --show NAME"),
    (["--show", "dgx-h100", "--model", "llama3-8b", "--gpus", "8"],
     "--show with a plan needs --global-batch-size, --seq-len too"),
    (["--show", "dgx-h100", "--strategy", '{"tp": 2}'], "--strategy and constraints need --model"),
    (["--show", "dgx-h100", *LLAMA_PLAN, "--strategy", '{"tp": 8}', "-C", "pp=2"],
     "--strategy fixes the strategy; drop --constraint"),
    (["--show", "dgx-h100", *LLAMA_PLAN, "--strategy", "[8]"], "--strategy must be a JSON object"),
    (["--show", "dgx-h100", *LLAMA_PLAN, "--strategy", '{"tp": 3}'], "invalid strategy"),
    (["--show", "no-such-cluster"], "unknown cluster preset"),
])
def test_bad_show_input_is_one_line(capsys, args, message):
    code, out, err = run(capsys, "clusters", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in out + err
