"""TPU clusters as torus graphs: the generator's conventions, the fabric derived from it, and the presets."""

from __future__ import annotations

import pytest

from planner.errors import SpecError
from profiles import load_cluster
from profiles.topology import build_graph, check_graph, derive_fabric, torus_graph, with_fabric
from profiles.topology.torus import chip_coords

GB = 1e9


def _cluster(shape, wrap, slices=1, **extra):
    chips = 1
    for a in shape:
        chips *= a
    data = {"name": "t", "gpu": "tpu-v5p", "gpus_per_node": 1, "nvlink_domain_size": chips,
            "max_gpus": chips * slices,
            "intra_node": {"name": "ici", "bw_gb_per_s": 100, "latency_us": 1},
            "inter_node": {"name": "dcn", "bw_gb_per_s": 6.25, "latency_us": 10},
            "topology": {"kind": "torus", "torus": {"shape": shape, "wraparound": wrap, "num_slices": slices}}}
    data.update(extra)
    return load_cluster(data)


def _ici_degree(g, node):
    return sum(1 for _, _, d in g.edges(node, data=True) if d["link"] == "ici")


def test_ranks_run_x_fastest_and_every_chip_has_its_neighbours():
    c = _cluster([4, 4, 8], [True, True, True])
    g = torus_graph(c)
    gpus = check_graph(g)
    assert len(gpus) == 128
    assert g.nodes["chip5"]["coords"] == (1, 1, 0) == chip_coords([4, 4, 8], 5)
    assert g.nodes["chip16"]["coords"] == (0, 0, 1)
    assert all(_ici_degree(g, f"chip{r}") == 6 for r in range(128))  # a 3-D torus: 6 links each
    assert g.has_edge("chip3", "chip0") and g.has_edge("chip112", "chip0")  # x and z wraparound
    edge = g.edges["chip0", "chip1"]
    assert edge["bw"] == pytest.approx(100 * GB) and edge["link"] == "ici" and edge["latency"] == pytest.approx(1e-6)
    assert g.edges["nic0", "dcn"]["bw"] == pytest.approx(6.25 * GB)


def test_open_axes_and_axes_of_two_have_no_wraparound_link():
    g = torus_graph(_cluster([4, 2], [False, True]))
    assert not g.has_edge("chip3", "chip0")  # open x
    assert g.has_edge("chip0", "chip4")  # the one link of the y axis of two
    assert [_ici_degree(g, f"chip{r}") for r in range(4)] == [2, 3, 3, 2]


def test_one_slice_is_one_level_and_chips_per_slice_is_the_domain():
    c = load_cluster("tpu-v5p-128")
    assert c.domain_size == 128 and c.fabric is not None
    assert [lv.name for lv in c.levels] == ["ici-slice"] and c.levels[0].unit_gpus == 128
    assert c.fabric.torus is not None and c.fabric.torus.shape == [4, 4, 8]


def test_two_slices_are_joined_by_the_dcn_at_its_rate_per_chip():
    c = load_cluster("tpu-v5p-2x128")
    level = c.levels[0]
    assert level.name == "ici-slice" and level.unit_gpus == 128
    assert level.egress_bytes_per_s == pytest.approx(c.inter_node.bw_bytes_per_s)
    assert level.latency_s == pytest.approx(c.inter_node.latency_s)
    g = build_graph(c)
    assert g.nodes["chip128"]["slice"] == 1 and g.nodes["chip128"]["coords"] == (0, 0, 0)
    ici_peers = [
        (g.nodes[a]["slice"], g.nodes[b]["slice"]) for a, b, d in g.edges(data=True) if d["link"] == "ici"]
    assert ici_peers and all(sa == sb for sa, sb in ici_peers)  # no ICI link between slices


def test_v5e_256_is_a_16x16_2d_torus():
    c = load_cluster("tpu-v5e-256")
    g = build_graph(c)
    assert all(_ici_degree(g, f"chip{r}") == 4 for r in range(256))
    assert c.levels[0].unit_gpus == 256 == c.domain_size


def test_a_domain_that_is_not_the_slice_is_refused():
    with pytest.raises(SpecError, match="nvlink_domain_size is 16"):
        _cluster([4, 4, 8], [True, True, True], nvlink_domain_size=16)


def test_max_gpus_must_be_the_chips_of_all_slices():
    with pytest.raises(SpecError, match="max_gpus .64. must be the chips of all its slices"):
        _cluster([4, 4, 8], [True, True, True], max_gpus=64)


def test_a_graph_of_part_of_a_slice_is_refused():
    with pytest.raises(SpecError, match="not a whole number of 4x4x8 slices"):
        torus_graph(load_cluster("tpu-v5p-128"), 96)


def test_derive_fabric_names_the_slice_level():
    c = load_cluster("tpu-v5p-2x128")
    fabric = derive_fabric(build_graph(c), torus=c.topology.torus)
    assert fabric.levels[0].name == "ici-slice" and fabric.torus.num_slices == 2
    assert with_fabric(c) is c  # a loaded cluster carries its fabric already
