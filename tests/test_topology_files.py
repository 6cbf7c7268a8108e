"""A user's own topology graph (profiles/topology/files.py): GraphML and YAML edge lists read into the graph
conventions, a cluster of topology kind 'graph' planned end to end from the CLI, and every bad graph file
refused through the CLI with one line (exit 2, no traceback) naming the node or edge and the rule."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import networkx as nx
import pytest
import yaml

from planner.cli import main
from planner.errors import SpecError
from profiles import load_cluster
from profiles.topology import build_graph, files, read_graph

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"
CLUSTER = EXAMPLES / "two-rack-cluster.yaml"
GRAPHML = EXAMPLES / "two-rack-fabric.graphml"
EDGE_LIST = EXAMPLES / "two-rack-fabric.yaml"
PLAN = ["--model", "llama3-8b", "--gpus", "32", "--global-batch-size", "64", "--seq-len", "4096", "--top", "3"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def cluster_with(tmp_path: Path, graph_file: str, **changes) -> Path:
    """A copy of the example cluster in `tmp_path` whose topology reads `graph_file`."""
    data = yaml.safe_load(CLUSTER.read_text())
    data["topology"]["graph_file"] = graph_file
    data.update(changes)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def edge_list() -> dict:
    return yaml.safe_load(EDGE_LIST.read_text())


def write_edge_list(tmp_path: Path, data: dict, name: str = "fabric.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---- reading --------------------------------------------------------------------------------------------
def test_graphml_and_edge_list_give_the_same_graph_in_si_units():
    a, b = read_graph(GRAPHML), read_graph(EDGE_LIST)
    assert nx.utils.graphs_equal(a, b)
    assert a.number_of_nodes() == 74 and a.number_of_edges() == 104
    assert a.nodes["gpu5"] == {"kind": "gpu", "rank": 5}
    assert a.nodes["rack1.leaf0"] == {"kind": "switch", "tier": 1, "level": "rack"}
    assert a.edges["gpu0", "nvsw0"] == {"bw": 450e9, "latency": pytest.approx(3e-6), "link": "nvlink"}
    assert a.edges["rack0.leaf1", "spine1"] == {"bw": 100e9, "latency": pytest.approx(1e-6), "link": "fabric"}
    assert "not a published system" in a.graph["source"]


def test_the_example_cluster_reads_its_graph_relative_to_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    c = load_cluster(str(CLUSTER))
    assert Path(c.topology.graph_file) == GRAPHML and c.max_gpus == 32
    assert [(lv.name, lv.unit_gpus) for lv in c.fabric.levels] == [("nvlink-domain", 8), ("rack", 16)]
    # a server's eight 50 GB/s NICs; a rack's four 100 GB/s leaf uplinks over its 16 GPUs (2:1)
    assert [lv.egress_bytes_per_s for lv in c.fabric.levels] == [50e9, 25e9]
    assert [lv.latency_s for lv in c.fabric.levels] == pytest.approx([6e-6, 7e-6])
    assert nx.utils.graphs_equal(build_graph(c), read_graph(GRAPHML))


def test_an_edited_graph_file_is_read_again(tmp_path):
    shutil.copy(EDGE_LIST, tmp_path / "fabric.yaml")
    cluster = cluster_with(tmp_path, "fabric.yaml")
    assert load_cluster(str(cluster)).fabric.levels[1].egress_bytes_per_s == 25e9
    data = edge_list()
    for e in data["edges"]:
        if e["link"] == "fabric":
            e["bw_gb_per_s"] = 200  # full bisection above the rack
    path = write_edge_list(tmp_path, data)
    os.utime(path, ns=(1, 1))  # a different version even within one clock tick
    assert load_cluster(str(cluster)).fabric.levels[1].egress_bytes_per_s == 50e9


def test_whole_float_ranks_and_tiers_are_integers(tmp_path):
    text = GRAPHML.read_text().replace('attr.name="rank" attr.type="long"', 'attr.name="rank" attr.type="double"')
    path = tmp_path / "f.graphml"
    path.write_text(text.replace("<data key=\"rank\">3</data>", "<data key=\"rank\">3.0</data>"))
    assert read_graph(path).nodes["gpu3"]["rank"] == 3


def test_graphml_key_defaults_apply(tmp_path):
    text = GRAPHML.read_text().replace(
        '<key id="latency_us" for="edge" attr.name="latency_us" attr.type="double" />',
        '<key id="latency_us" for="edge" attr.name="latency_us" attr.type="double"><default>2.5</default></key>')
    text = text.replace('<data key="latency_us">1.0</data>', "")
    path = tmp_path / "f.graphml"
    path.write_text(text)
    assert read_graph(path).edges["rack0.leaf0", "spine0"]["latency"] == pytest.approx(2.5e-6)


def test_a_graph_file_is_the_whole_cluster(tmp_path):
    c = load_cluster(str(CLUSTER))
    with pytest.raises(SpecError, match="holds 32 GPUs, not 64"):
        build_graph(c, num_gpus=64)
    assert load_cluster(str(cluster_with(tmp_path, str(GRAPHML), max_gpus=16))).max_gpus == 16


# ---- end to end -----------------------------------------------------------------------------------------
def test_plan_on_the_example_cluster(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = run(capsys, "plan", "--cluster", "docs/examples/two-rack-cluster.yaml", *PLAN)
    assert code == 0, err
    assert "ranked plans" in out and "two-rack-h100" in out and " 1  dp" in out


def test_plan_on_the_edge_list_copy(capsys, tmp_path):
    shutil.copy(EDGE_LIST, tmp_path / "fabric.yaml")
    code, out, err = run(capsys, "plan", "--cluster", str(cluster_with(tmp_path, "fabric.yaml")), *PLAN)
    assert code == 0, err
    assert "ranked plans" in out


def test_more_gpus_than_the_graph_holds_is_refused(capsys):
    code, _, err = run(capsys, "plan", "--cluster", str(CLUSTER), *PLAN[:2], "--gpus", "64", *PLAN[4:])
    assert code == 2 and "exceeds cluster two-rack-h100's max_gpus (32)" in err


# ---- bad input through the CLI ------------------------------------------------------------------------
def refused(capsys, tmp_path: Path, graph: Path, **changes) -> str:
    """Plan on a cluster reading `graph`: exit 2 with one `error:` line and no traceback; the line."""
    code, out, err = run(capsys, "plan", "--cluster", str(cluster_with(tmp_path, str(graph), **changes)), *PLAN)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (code, err)
    assert "Traceback" not in out + err
    return lines[0]


def _graphml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fabric.graphml"
    path.write_text(text)
    return path


BOMB = """<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>
<graphml xmlns="http://graphml.graphdrawing.org/xmlns"><graph edgedefault="undirected">
<node id="&lol3;"/></graph></graphml>
"""
EXTERNAL = """<?xml version="1.0"?>
<!DOCTYPE graphml [<!ENTITY secret SYSTEM "file:///etc/passwd">]>
<graphml xmlns="http://graphml.graphdrawing.org/xmlns"><graph edgedefault="undirected">
<node id="&secret;"/></graph></graphml>
"""


NOT_GRAPHML = [
    (BOMB, "is not a GraphML file: it declares a document type"),
    (EXTERNAL, "is not a GraphML file: it declares a document type"),
    ("<html><body>a web page</body></html>", "is not a GraphML file: its root element is <html>"),
    ('<graphml xmlns="http://example.com/other"/>', "is not a GraphML file: its root element is <graphml> in "
     "namespace 'http://example.com/other'"),
    ("nodes: [a, b]\n", "is not a GraphML file: not well-formed XML"),
    ('<graphml xmlns="http://graphml.graphdrawing.org/xmlns"/>', "is not a GraphML file: it holds no <graph>"),
]


@pytest.mark.parametrize("text, message", NOT_GRAPHML, ids=[m for _, m in NOT_GRAPHML])
def test_a_file_that_is_not_graphml_is_refused(capsys, tmp_path, text, message):
    line = refused(capsys, tmp_path, _graphml(tmp_path, text))
    assert message in line and "fabric.graphml" in line


def _edit(text: str, old: str, new: str, count: int = 1) -> str:
    assert old in text
    return text.replace(old, new, count)


GRAPHML_TEXT = GRAPHML.read_text()
GRAPHML_CASES = [
    (_edit(GRAPHML_TEXT, 'edgedefault="undirected"', 'edgedefault="directed"'), "is a directed graph"),
    (_edit(GRAPHML_TEXT, "</graph>", '<edge source="gpu0" target="nvsw0"><data key="bw_gb_per_s">450</data>'
           "</edge></graph>"), "edge 'gpu0' - 'nvsw0' is given more than once"),
    (_edit(GRAPHML_TEXT, '<data key="bw_gb_per_s">450.0</data>', '<data key="bw_gb_per_s">0</data>'),
     "edge 'gpu0' - 'nvsw0' has bw_gb_per_s 0.0; it must be a number from 0.001 to 1e+06 GB/s"),
    (_edit(GRAPHML_TEXT, '<data key="bw_gb_per_s">450.0</data>', ""), "edge 'gpu0' - 'nvsw0' lacks bw_gb_per_s"),
    (_edit(GRAPHML_TEXT, '<data key="bw_gb_per_s">450.0</data>', '<data key="bw_gb_per_s">fast</data>'),
     "a value does not match its key's attr.type"),
    (_edit(GRAPHML_TEXT, '<data key="kind">switch</data>', '<data key="kind">router</data>'),
     "node 'rack0.leaf0' has kind 'router'; kind must be one of gpu, nvswitch, nic, switch"),
    (_edit(GRAPHML_TEXT, '<data key="rank">5</data>', '<data key="rank">4</data>'),
     "GPU nodes 'gpu4' and 'gpu5' both have rank 4"),
    (_edit(GRAPHML_TEXT, "</graph>", '<edge source="gpu0" target="gpu99"><data key="bw_gb_per_s">1</data>'
           "</edge></graph>"), "edge 'gpu0' - 'gpu99' names node 'gpu99', which is not listed among the nodes"),
]


@pytest.mark.parametrize("text, message", GRAPHML_CASES, ids=[m for _, m in GRAPHML_CASES])
def test_bad_graphml_is_refused_naming_the_node_or_edge(capsys, tmp_path, text, message):
    assert message in refused(capsys, tmp_path, _graphml(tmp_path, text))


def _without_edges_of(data: dict, node: str) -> dict:
    data["edges"] = [e for e in data["edges"] if node not in (e["a"], e["b"])]
    return data


def _set(data: dict, section: str, index: int, **values) -> dict:
    data[section][index].update(values)
    return data


def _drop(data: dict, section: str, index: int, key: str) -> dict:
    del data[section][index][key]
    return data


def _uneven_racks(data: dict) -> dict:
    """Server 2 (ranks 16-23) moves its NICs to rack 0: racks of 24 and 8 GPUs."""
    for e in data["edges"]:
        if e["link"] == "nic" and 16 <= int(e["a"].removeprefix("nic")) < 24:
            e["b"] = e["b"].replace("rack1", "rack0")
    return data


def _gap_in_a_rack(data: dict) -> dict:
    """Servers 1 and 2 swap racks: rack 0 holds ranks 0-7 and 16-23."""
    for e in data["edges"]:
        if e["link"] == "nic":
            server = int(e["a"].removeprefix("nic")) // 8
            rack = {0: 0, 1: 1, 2: 0, 3: 1}[server]
            e["b"] = f"rack{rack}." + e["b"].split(".", 1)[1]
    return data


def _isolated_switch(data: dict) -> dict:
    data["nodes"].append({"id": "spare", "kind": "switch", "tier": 1})
    return data


EDGE_LIST_CASES = [
    (lambda d: _without_edges_of(d, "gpu31"), "GPU node 'gpu31' (rank 31) has no link"),
    (lambda d: _set(d, "edges", 0, bw_gb_per_s=0), "edge 'gpu0' - 'nvsw0' has bw_gb_per_s 0"),
    (lambda d: _set(d, "edges", 0, bw_gb_per_s=-50), "edge 'gpu0' - 'nvsw0' has bw_gb_per_s -50"),
    (lambda d: _set(d, "edges", 0, bw_gb_per_s="450"), "edge 'gpu0' - 'nvsw0' has bw_gb_per_s '450'"),
    (lambda d: _drop(d, "edges", 0, "bw_gb_per_s"), "edge 'gpu0' - 'nvsw0' lacks bw_gb_per_s"),
    (lambda d: _set(d, "edges", 0, latency_us=-1), "edge 'gpu0' - 'nvsw0' has latency_us -1"),
    (lambda d: _set(d, "nodes", 0, kind="tpu"), "node 'gpu0' has kind 'tpu'; kind must be one of"),
    (lambda d: _set(d, "nodes", 1, rank=0), "GPU nodes 'gpu0' and 'gpu1' both have rank 0"),
    (lambda d: _set(d, "nodes", 1, rank=-1), "GPU node 'gpu1' needs rank, a non-negative integer"),
    (lambda d: _set(d, "nodes", 70, tier=0), "switch node 'rack1.leaf0' needs tier, an integer >= 1"),
    (lambda d: _set(d, "nodes", 0, tier=1), "node 'gpu0' of kind 'gpu' has tier; only switch nodes take tier"),
    (lambda d: _set(d, "nodes", 0, colour="red"), "node 'gpu0' has unknown field(s) 'colour'"),
    (lambda d: _set(d, "edges", 0, bandwidth=1), "edge 'gpu0' - 'nvsw0' has unknown field(s) 'bandwidth'"),
    (lambda d: _set(d, "edges", 0, b="gpu0"), "edge 'gpu0' - 'gpu0' joins a node to itself"),
    (lambda d: d | {"edges": d["edges"] + [{"a": "nvsw0", "b": "gpu0", "bw_gb_per_s": 1}]},
     "edge 'nvsw0' - 'gpu0' is given more than once"),
    (lambda d: d | {"nodes": d["nodes"] + [{"id": "gpu3", "kind": "nic"}]}, "node 'gpu3' is listed twice"),
    (lambda d: d | {"directed": True}, "says directed: True; a topology graph is undirected"),
    (lambda d: d | {"multigraph": True}, "says multigraph: True"),
    (lambda d: d | {"switches": []}, "has unknown key(s) 'switches'"),
    (_isolated_switch, "is not connected: node 'spare' cannot reach GPU 'gpu0' (rank 0)"),
    (_uneven_racks, "the rack units differ in size (24 and 8 GPUs, the latter holding GPU 'gpu24')"),
    (_gap_in_a_rack, "the rack unit of GPU 'gpu0' skips rank 8"),
]


@pytest.mark.parametrize("mutate, message", EDGE_LIST_CASES, ids=[m for _, m in EDGE_LIST_CASES])
def test_bad_edge_list_is_refused_naming_the_node_or_edge(capsys, tmp_path, mutate, message):
    path = write_edge_list(tmp_path, mutate(edge_list()))
    line = refused(capsys, tmp_path, path)
    assert message in line and "fabric.yaml" in line


def test_a_repeated_key_is_refused(capsys, tmp_path):
    path = tmp_path / "fabric.yaml"
    path.write_text(EDGE_LIST.read_text().replace("nodes:\n", "edges: []\nnodes:\n", 1))
    assert "repeats the key 'edges'" in refused(capsys, tmp_path, path)


@pytest.mark.parametrize("name, content, message", [
    ("fabric.json", "{}", "must end in .graphml, .yaml, .yml"),
    ("missing.graphml", None, "does not exist"),
    ("folder.graphml", "dir", "is a directory, not a file"),
    ("latin1.yaml", b"source: caf\xe9\n", "is not UTF-8 text"),
])
def test_files_are_read_safely(capsys, tmp_path, name, content, message):
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert message in refused(capsys, tmp_path, path)


def test_an_oversized_graphml_file_is_refused_before_parsing(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_GRAPHML_BYTES", 1000)
    line = refused(capsys, tmp_path, GRAPHML)
    assert f"{GRAPHML.stat().st_size:,} bytes; at most 1,000 are read" in line


def test_the_graph_must_match_the_cluster(capsys, tmp_path):
    line = refused(capsys, tmp_path, GRAPHML, gpus_per_node=4, nvlink_domain_size=4)
    assert "NVLink domains hold 8 GPUs but nvlink_domain_size is 4" in line
    line = refused(capsys, tmp_path, GRAPHML, max_gpus=64)
    assert "max_gpus (64) exceeds the 32 GPUs of its topology graph" in line
