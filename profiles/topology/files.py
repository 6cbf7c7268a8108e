"""A user's own topology graph, read from a file: GraphML (``.graphml``) or a YAML edge list (``.yaml``,
``.yml``), with the same attribute names in both.

Nodes: ``id`` (the YAML list's; GraphML's own node id), ``kind`` (gpu, nvswitch, nic, switch), ``rank``
(GPUs only: 0 .. N-1, each once), ``tier`` (switches only: 1 for leaf or top-of-rack switches, 2 above
them, ...), ``level`` (switches only: the name of the units their tier joins, e.g. rack, pod) and
``sharp`` (switches only: True where they reduce in the network). Edges: ``a`` and ``b`` (the YAML
list's ends; GraphML's source and target), ``bw_gb_per_s`` (GB/s per direction, required, > 0),
``latency_us`` (µs, default 0) and ``link`` (a label: nvlink, pcie, nic, fabric, ...). A YAML edge list:

    source: where the fabric's structure is published      # optional
    nodes:
      - {id: gpu0, kind: gpu, rank: 0}
      - {id: leaf0, kind: switch, tier: 1, level: rack}
    edges:
      - {a: gpu0, b: leaf0, bw_gb_per_s: 50, latency_us: 6, link: nic}

Rates and latencies are converted to the graph conventions' SI `bw` (bytes/s per direction) and
`latency` (s) on load (profiles.topology.graph). A graph is undirected with one edge per pair of
nodes: parallel cables between two switches are one edge of their summed rate.

The file is read the way every user file is (planner.specs.files): a regular UTF-8 file of bounded size;
YAML through the project's safe parser (value and depth bounds, repeated keys refused). GraphML is XML:
before networkx's reader sees it, a pass of expat refuses a document type declaration (every entity
expansion and external-entity attack needs one) and anything whose root is not GraphML's own element.
Every problem is one SpecError naming the file, the node or edge, and the rule.
"""

from __future__ import annotations

import math
import warnings
import xml.parsers.expat
from pathlib import Path
from typing import Any

import networkx as nx

from planner.errors import SpecError, short_repr
from planner.specs.files import MAX_FILE_BYTES, parse_yaml, read_text
from profiles.topology.graph import BW_RANGE, KINDS, LATENCY_RANGE, check_graph

#: GraphML's XML namespace: the root element of a GraphML file is `graphml` in it.
GRAPHML_NS = "http://graphml.graphdrawing.org/xmlns"
#: Largest GraphML file read. XML is parsed by expat (C); a 24,576-GPU fat tree with one NIC per GPU
#: (about 54,000 nodes and 75,000 edges) is 16 MB of GraphML, read in a few seconds. A YAML edge list stays under
#: planner.specs.files' bounds (MAX_FILE_BYTES, MAX_VALUES: a few ten thousand edges); larger graphs go
#: in GraphML.
MAX_GRAPHML_BYTES = 32 * 2**20
#: Most XML elements a GraphML file may hold (nodes, edges, their data elements, keys).
MAX_XML_ELEMENTS = 1_000_000
#: GB/s and µs, the units a graph file states rates and latencies in.
GB = 1e9
MICRO = 1e-6
#: The attributes a node may carry, and the kind of node each belongs to (None: every kind).
NODE_FIELDS = {"kind": None, "rank": "gpu", "tier": "switch", "level": "switch", "sharp": "switch"}
#: The attributes an edge may carry.
EDGE_FIELDS = ("bw_gb_per_s", "latency_us", "link")
#: Drawing attributes that graph editors (yEd, Gephi) and networkx's writer add to GraphML: ignored.
GRAPHML_DRAWING = ("label", "x", "y", "z", "size", "r", "g", "b", "shape_type", "id")
#: The suffixes read, and the format each names.
SUFFIXES = {".graphml": "graphml", ".yaml": "yaml", ".yml": "yaml"}


def read_graph(path: str | Path) -> nx.Graph:
    """The topology graph in the file `path` (module docstring), checked (profiles.topology.graph.check_graph);
    a SpecError naming the node or edge for anything the conventions refuse."""
    path = Path(path)
    what = f"topology graph file {str(path)!r}"
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise SpecError(f"{what} must end in {', '.join(SUFFIXES)} (GraphML or a YAML edge list)")
    if kind == "graphml":
        nodes, edges, source = _graphml(read_text(path, "topology graph", MAX_GRAPHML_BYTES), what)
    else:
        nodes, edges, source = _edge_list(parse_yaml(read_text(path, "topology graph", MAX_FILE_BYTES), what), what)
    graph = _build(nodes, edges, what)
    graph.graph["source"] = source
    check_graph(graph, what)
    return graph


# ---- GraphML ------------------------------------------------------------------------------------------
class _NotGraphML(Exception):
    """The expat pass found something a GraphML topology file may not hold (the message says what)."""


def _scan_xml(text: str) -> tuple[set[str], list[tuple[str, str]]]:
    """Refuse a document type declaration (entities), a root other than GraphML's, more or fewer than one
    graph, a nested graph or a hyperedge, and more than MAX_XML_ELEMENTS elements, before anything is built;
    the ids of the <node> elements and the ends of the <edge> elements."""
    parser = xml.parsers.expat.ParserCreate(namespace_separator=" ")
    count = {"elements": 0, "graphs": 0}
    ids: set[str] = set()
    ends: list[tuple[str, str]] = []

    def doctype(*_: Any) -> None:
        raise _NotGraphML("it declares a document type (<!DOCTYPE ...>); DTDs and entities are refused")

    def start(name: str, attrs: Any) -> None:
        ns, _, local = name.rpartition(" ")
        if count["elements"] == 0 and (ns, local) != (GRAPHML_NS, "graphml"):
            raise _NotGraphML(f"its root element is <{local}>{f' in namespace {ns!r}' if ns else ''}, not "
                              f"<graphml> in the GraphML namespace {GRAPHML_NS!r}")
        count["elements"] += 1
        if count["elements"] > MAX_XML_ELEMENTS:
            raise _NotGraphML(f"it holds more than {MAX_XML_ELEMENTS:,} elements")
        if ns == GRAPHML_NS and local == "graph":
            count["graphs"] += 1
            if count["graphs"] > 1:
                raise _NotGraphML("it holds more than one graph (or a nested graph); give one graph per file")
        if ns == GRAPHML_NS and local == "hyperedge":
            raise _NotGraphML("it holds a hyperedge; a topology graph's edges join two nodes")
        if ns == GRAPHML_NS and local == "node":
            ids.add(str(attrs.get("id")))
        if ns == GRAPHML_NS and local == "edge":
            ends.append((str(attrs.get("source")), str(attrs.get("target"))))

    parser.StartDoctypeDeclHandler = doctype
    parser.EntityDeclHandler = doctype
    parser.StartElementHandler = start
    try:
        parser.Parse(text, True)
    except xml.parsers.expat.ExpatError as exc:
        raise _NotGraphML(f"not well-formed XML ({xml.parsers.expat.errors.messages[exc.code]}, line {exc.lineno})") \
            from None
    if count["graphs"] == 0:
        raise _NotGraphML("it holds no <graph> element")
    return ids, ends


def _graphml(text: str, what: str) -> tuple[list[tuple[str, dict]], list[tuple[str, str, dict]], str]:
    """(nodes, edges, source) of a GraphML text, each with its attributes as the file states them (the
    keys' defaults applied, drawing attributes dropped)."""
    try:
        declared, ends = _scan_xml(text)
    except _NotGraphML as exc:
        raise SpecError(f"{what} is not a GraphML file: {exc}") from None
    for a, b in ends:
        stray = next((n for n in (a, b) if n not in declared), None)
        if stray is not None:
            raise SpecError(f"{what}: edge {short_repr(a)} - {short_repr(b)} names node {short_repr(stray)}, which "
                            "is not listed among the nodes")
    try:
        with warnings.catch_warnings():  # ports and untyped keys: no bearing on the topology
            warnings.simplefilter("ignore")
            graph = nx.parse_graphml(text, node_type=str)
    except (nx.NetworkXError, SyntaxError) as exc:
        raise SpecError(f"{what} is not a GraphML file: {exc}") from None
    except KeyError as exc:  # networkx's reader: an attr.type it does not know
        raise SpecError(f"{what} is not a GraphML file: unknown attr.type or key {exc}") from None
    except (ValueError, TypeError, AttributeError) as exc:  # a <data> or <default> its key's attr.type refuses
        raise SpecError(f"{what}: a value does not match its key's attr.type ({exc})") from None
    if graph.is_directed():
        raise SpecError(f"{what} is a directed graph (edgedefault=\"directed\"); a topology graph is undirected: "
                        "each edge is a full-duplex link with its bandwidth per direction")
    if graph.is_multigraph():
        a, b = next((a, b) for a, b in graph.edges() if graph.number_of_edges(a, b) > 1)
        raise SpecError(_parallel(what, a, b))
    node_default = dict(graph.graph.get("node_default", {}))
    edge_default = dict(graph.graph.get("edge_default", {}))
    keep = {k: v for k, v in graph.graph.items() if k not in ("node_default", "edge_default")}
    nodes = [(n, _drawn(node_default | d)) for n, d in graph.nodes(data=True)]
    edges = [(a, b, _drawn(edge_default | d)) for a, b, d in graph.edges(data=True)]
    return nodes, edges, str(keep.get("source", ""))


def _drawn(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in GRAPHML_DRAWING}


def _parallel(what: str, a: Any, b: Any) -> str:
    return (f"{what}: edge {short_repr(a)} - {short_repr(b)} is given more than once; a topology graph has one "
            "edge per pair of nodes (give parallel links as one edge of their summed bw_gb_per_s)")


# ---- YAML edge list -----------------------------------------------------------------------------------
#: The keys of a YAML edge list's top-level mapping.
YAML_KEYS = ("nodes", "edges", "source", "directed", "multigraph")


def _edge_list(data: Any, what: str) -> tuple[list[tuple[str, dict]], list[tuple[str, str, dict]], str]:
    """(nodes, edges, source) of a YAML edge list (module docstring)."""
    if not isinstance(data, dict):
        raise SpecError(f"{what} must hold a mapping with nodes: and edges: lists (got {type(data).__name__})")
    unknown = sorted(str(k) for k in data if k not in YAML_KEYS)
    if unknown:
        raise SpecError(f"{what} has unknown key(s) {', '.join(map(short_repr, unknown))}; a YAML edge list takes "
                        f"{', '.join(YAML_KEYS)}")
    if data.get("directed", False) is not False:
        raise SpecError(f"{what} says directed: {short_repr(data['directed'])}; a topology graph is undirected: "
                        "each edge is a full-duplex link with its bandwidth per direction")
    if data.get("multigraph", False) is not False:
        raise SpecError(f"{what} says multigraph: {short_repr(data['multigraph'])}; a topology graph has one edge "
                        "per pair of nodes (give parallel links as one edge of their summed bw_gb_per_s)")
    source = data.get("source", "")
    if not isinstance(source, str):
        raise SpecError(f"{what}: source must be text (got {short_repr(source)})")
    raw_nodes, raw_edges = data.get("nodes"), data.get("edges")
    for key, value in (("nodes", raw_nodes), ("edges", raw_edges)):
        if not isinstance(value, list) or not value:
            raise SpecError(f"{what}: {key} must be a non-empty list of mappings (got {short_repr(value)})")
    nodes: list[tuple[str, dict]] = []
    seen: set[str] = set()
    for i, item in enumerate(raw_nodes):
        if not isinstance(item, dict):
            raise SpecError(f"{what}: nodes[{i}] must be a mapping with id and kind (got {short_repr(item)})")
        item = dict(item)
        node = _node_id(item.pop("id", None), f"nodes[{i}].id", what)
        if node in seen:
            raise SpecError(f"{what}: node {short_repr(node)} is listed twice (nodes[{i}]); each id may appear once")
        seen.add(node)
        nodes.append((node, item))
    edges: list[tuple[str, str, dict]] = []
    pairs: set[frozenset[str]] = set()
    for i, item in enumerate(raw_edges):
        if not isinstance(item, dict):
            raise SpecError(f"{what}: edges[{i}] must be a mapping with a, b and bw_gb_per_s (got {short_repr(item)})")
        item = dict(item)
        a = _node_id(item.pop("a", None), f"edges[{i}].a", what)
        b = _node_id(item.pop("b", None), f"edges[{i}].b", what)
        pair = frozenset((a, b))
        if pair in pairs:
            raise SpecError(_parallel(what, a, b))
        pairs.add(pair)
        edges.append((a, b, item))
    return nodes, edges, source


def _node_id(value: Any, field: str, what: str) -> str:
    """A node id as text: YAML may write it as a number (`id: 3` and `a: 3` then name the same node)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise SpecError(f"{what}: {field} must be a node id, text or an integer (got {short_repr(value)})")
    return str(value)


# ---- both ---------------------------------------------------------------------------------------------
def _integral(value: Any) -> Any:
    """A whole float (GraphML tools may declare rank or tier as a double) as an int; anything else as it is."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _node_attrs(node: str, data: dict[str, Any], what: str) -> dict[str, Any]:
    """A node's attributes in the graph conventions; rank and tier values are left to check_graph."""
    unknown = sorted(str(k) for k in data if k not in NODE_FIELDS)
    if unknown:
        raise SpecError(f"{what}: node {short_repr(node)} has unknown field(s) {', '.join(map(short_repr, unknown))}; "
                        f"a node takes {', '.join(NODE_FIELDS)}")
    kind = data.get("kind")
    if kind not in KINDS:
        raise SpecError(f"{what}: node {short_repr(node)} has kind {short_repr(kind)}; kind must be one of "
                        f"{', '.join(KINDS)}")
    for key, owner in NODE_FIELDS.items():
        if owner is not None and key in data and kind != owner:
            raise SpecError(f"{what}: node {short_repr(node)} of kind {short_repr(kind)} has {key}; only {owner} "
                            f"nodes take {key}")
    out = {k: _integral(v) if k in ("rank", "tier") else v for k, v in data.items()}
    if "level" in out:
        if isinstance(out["level"], bool) or not isinstance(out["level"], (str, int)) or out["level"] == "":
            raise SpecError(f"{what}: switch node {short_repr(node)} has level {short_repr(out['level'])}; level is "
                            "the name of the units its tier joins (text, e.g. rack, pod)")
        out["level"] = str(out["level"])
    if "sharp" in out and not isinstance(out["sharp"], bool):
        raise SpecError(f"{what}: switch node {short_repr(node)} has sharp {short_repr(out['sharp'])}; sharp must "
                        "be true or false")
    return out


def _edge_attrs(a: str, b: str, data: dict[str, Any], what: str) -> dict[str, Any]:
    """An edge's attributes converted to the graph conventions' SI `bw`, `latency` and `link`."""
    edge = f"edge {short_repr(a)} - {short_repr(b)}"
    unknown = sorted(str(k) for k in data if k not in EDGE_FIELDS)
    if unknown:
        raise SpecError(f"{what}: {edge} has unknown field(s) {', '.join(map(short_repr, unknown))}; an edge takes "
                        f"{', '.join(EDGE_FIELDS)}")
    if "bw_gb_per_s" not in data:
        raise SpecError(f"{what}: {edge} lacks bw_gb_per_s (its bandwidth per direction, GB/s); missing "
                        "bandwidths are refused")
    gb = _number(data["bw_gb_per_s"])
    if gb is None or not BW_RANGE[0] <= gb * GB <= BW_RANGE[1]:
        raise SpecError(f"{what}: {edge} has bw_gb_per_s {short_repr(data['bw_gb_per_s'])}; it must be a number "
                        f"from {BW_RANGE[0] / GB:g} to {BW_RANGE[1] / GB:g} GB/s (zero and negative bandwidths are "
                        "refused)")
    out: dict[str, Any] = {"bw": gb * GB}
    us = _number(data.get("latency_us", 0.0))
    if us is None or not LATENCY_RANGE[0] <= us * MICRO <= LATENCY_RANGE[1]:
        raise SpecError(f"{what}: {edge} has latency_us {short_repr(data.get('latency_us'))}; it must be a number "
                        f"from {LATENCY_RANGE[0] / MICRO:g} to {LATENCY_RANGE[1] / MICRO:g} µs")
    out["latency"] = us * MICRO
    if "link" in data:
        if not isinstance(data["link"], str):
            raise SpecError(f"{what}: {edge} has link {short_repr(data['link'])}; link is a label (text, e.g. "
                            "nvlink, nic, fabric)")
        out["link"] = data["link"]
    return out


def _build(nodes: list[tuple[str, dict]], edges: list[tuple[str, str, dict]], what: str) -> nx.Graph:
    graph = nx.Graph()
    for node, data in nodes:
        graph.add_node(node, **_node_attrs(node, data, what))
    for a, b, data in edges:
        for end in (a, b):
            if end not in graph:
                raise SpecError(f"{what}: edge {short_repr(a)} - {short_repr(b)} names node {short_repr(end)}, "
                                "which is not listed among the nodes")
        graph.add_edge(a, b, **_edge_attrs(a, b, data, what))
    return graph
