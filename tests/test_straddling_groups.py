"""Groups whose blocks do not divide an NVLink domain: where they sit depends on the job's size.

The groups of a dimension tile the ranks in blocks of size·stride ranks; a job fills `job_domain_gpus` GPUs of
each NVLink domain and rank r sits in unit r // that. When a block does not divide the unit (expert parallelism
64, or TP 16, on NVL72 racks filled to 72), some block straddles two units once the job spans more than one, and
its members in the smaller part carry the group's traffic out of that unit. The communication model must price
the slowest such group, as `meshplan clusters --show` places it; these tests check both against ranks
enumerated one by one.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from types import SimpleNamespace as S

import numpy as np
import pytest

from cost_models.collectives import comm_model_for
from cost_models.comm import TierCommModel, fewest_in_unit
from planner import Strategy, evaluate
from planner.cli import main
from planner.cli.topology_plot import draw_topology
from planner.cli.topology_view import group_spans
from profiles import load_cluster, load_model
from profiles.topology import build_graph

GB = 1e9


def _enumerated(unit: int, size: int, stride: int, world: int) -> tuple[bool, int]:
    """(whether some group leaves its unit, the fewest members a leaving group has in one unit), by listing every
    group's ranks."""
    fewest, crossed = size, False
    for base in range(world):
        if (base // stride) % size:
            continue  # not a group's first rank
        counts = Counter((base + j * stride) // unit for j in range(size))
        if len(counts) > 1:
            crossed = True
            fewest = min(fewest, min(counts.values()))
    return crossed, fewest


def _one_level(unit: int) -> TierCommModel:
    tier = S(bus_bw_bytes_per_s=4e11, latency_s=1e-6, gather_scatter_bw_bytes_per_s=4e11, efficiency=1.0,
             gather_scatter_efficiency=None)
    level = S(unit_gpus=unit, egress_bytes_per_s=5e10, latency_s=5e-6, sharp=False, name="domain")
    return TierCommModel(S(domain_size=unit, intra_node=tier, inter_node=tier, levels=[level]))


CASES = [(unit, size, stride, world)
         for unit, size, stride in itertools.product([8, 36, 72], [2, 3, 4, 6, 8, 16, 24, 32, 64], [1, 2, 3, 4, 8, 16])
         for world in (size * stride * m for m in (1, 2, 3, 5, 9))]


def test_the_model_places_groups_as_their_ranks_do():
    """For 810 (unit, size, stride, world) cases: the model says a group crosses exactly where a listed group
    does, and its members per unit are the fewest a crossing group has."""
    mismatches = []
    for unit, size, stride, world in CASES:
        comm = _one_level(unit).with_world(world)
        crossed = bool(comm.crosses_domain(size, stride))
        members = float(comm.members(size, stride)[0])
        want_crossed, want_fewest = _enumerated(unit, size, stride, world)
        if crossed != want_crossed or (crossed and members != want_fewest):
            mismatches.append((unit, size, stride, world, crossed, members, want_crossed, want_fewest))
    assert len(CASES) == 810
    assert not mismatches, mismatches[:5]


def test_pipeline_neighbours_cross_where_their_ranks_do():
    """A point-to-point transfer crosses the unit where some pair of pipeline neighbours sits in two units."""
    comm = _one_level(72)
    for pp, stride, m in itertools.product([2, 4, 8], [1, 4, 8, 16, 32], [1, 2, 3]):
        world = pp * stride * m
        ranks = np.arange(world)
        first = ranks[(ranks // stride) % pp < pp - 1]
        want = bool(np.any(first // 72 != (first + stride) // 72))
        sent = float(comm.with_world(world).p2p_s(1e9, stride, pp * stride))
        assert (sent > 1e9 / 4e11 + 1e-6) == want, (pp, stride, world)


def test_without_a_world_groups_tile_the_units():
    assert fewest_in_unit(72, 64, None) == 0 and fewest_in_unit(72, 144, None) == 72
    assert fewest_in_unit(72, 100, None) == 72 and fewest_in_unit(8, 16, None) == 8 and fewest_in_unit(8, 8, None) == 0


def test_one_rack_has_no_straddling_group():
    comm = _one_level(72).with_world(64)
    assert not comm.crosses_domain(64, 1) and not comm.crosses_domain(16, 1)
    assert float(comm.all_to_all_s(1e8, 64, 1)) < float(comm.with_world(128).all_to_all_s(1e8, 64, 1)) / 5


def test_one_model_prices_one_job():
    with pytest.raises(ValueError, match="one job"):
        _one_level(72).with_world(np.array([64, 144]))
    assert _one_level(72).with_world(np.array([144, 144])).world == 144


def test_a_job_fills_each_rack_as_its_launcher_segments_it():
    """Megatron-Bridge's launcher gives Slurm --segment = the largest divisor of the job's servers up to 18 on
    4-GPU-server systems: 512 GPUs (128 servers) fill 64 GPUs of each NVL72 rack, 576 GPUs (144) all 72."""
    c = load_cluster("gb200-nvl72")
    assert [c.job_domain_gpus(n) for n in (64, 256, 512, 576, 1152, 2048, 100, 76)] == [64, 64, 64, 72, 72, 64, 20, 72]
    assert load_cluster("dgx-h100").job_domain_gpus(512) == 8
    fixed = c.model_copy(update={"segment_nodes": 18})
    assert fixed.job_domain_gpus(512) == 72
    comm = comm_model_for(c)
    assert not comm.with_world(512).crosses_domain(64, 1)
    assert comm.with_world(576).crosses_domain(64, 1)
    assert float(comm.with_world(576).all_to_all_s(1e8, 64, 1)) > 5 * float(comm.with_world(512).all_to_all_s(1e8, 64, 1))
    assert comm_model_for(fixed).with_world(512).crosses_domain(64, 1)
    # the scale-out unit (8 racks) holds 8 · 64 of a 512-GPU job's ranks
    assert comm.with_world(512).unit[:, 0].tolist() == [64.0, 512.0]


@pytest.mark.parametrize("cluster", ["gb200-nvl72", "gb300-nvl72"])
def test_ep64_straddles_full_racks_and_is_priced_so(cluster):
    """DeepSeek-V3 with expert parallelism 64 on 576 GPUs, 72 in each of 8 NVL72 racks: ranks 64-127 put 8 members
    in the first rack and 56 in the second. The explanation and `clusters --show` agree that EP leaves the
    domain, and the 8 members' NICs bound its bandwidth. On 512 GPUs the launcher fills 64 of each rack and EP
    stays on NVLink."""
    c = load_cluster(cluster)
    st = Strategy(tp=1, pp=1, ep=64, zero_stage=1, sequence_parallel=False, micro_batch_size=1)
    q = dict(model="deepseek-v3", cluster=cluster, strategy=st, global_batch_size=1152, seq_len=4096)
    full = evaluate(num_gpus=576, **q)
    link = {g.dim: g for g in full.groups}["ep"]
    assert link.level == c.levels[0].name
    spans = {g["dim"]: g for g in group_spans(st.resolve(576), load_model("deepseek-v3").num_layers, 576, c)}
    assert spans["ep"]["crosses"][:1] == [c.levels[0].name]
    assert link.shares_bytes_per_s[c.levels[0].name] == pytest.approx(
        c.levels[0].egress_bytes_per_s * c.inter_node.efficiency * 63 / 56)
    segmented = evaluate(num_gpus=512, **{**q, "global_batch_size": 1024})
    assert {g.dim: g for g in segmented.groups}["ep"].level is None
    assert segmented.time_s["ep_comm"] < full.time_s["ep_comm"]


@pytest.mark.parametrize("num_gpus", [512, 576])
@pytest.mark.parametrize("strategy", [dict(tp=16, pp=4), dict(tp=8, pp=8), dict(tp=4, cp=4, pp=4),
                                      dict(tp=2, ep=8), dict(tp=1, ep=64), dict(tp=4, ep=32), dict(tp=8, pp=2)])
def test_explanations_agree_with_the_topology_view(strategy, num_gpus):
    """On eight NVL72 racks, every dimension of the explanation crosses the NVLink domain exactly where the
    topology view (ranks listed one by one) says its groups leave it."""
    c = load_cluster("gb200-nvl72")
    st = Strategy(zero_stage=1, sequence_parallel=strategy.get("tp", 1) > 1, **strategy)
    model = "deepseek-v3" if "ep" in strategy else "gpt3-175b"
    est = evaluate(model=model, cluster=c, num_gpus=num_gpus, strategy=st, global_batch_size=4608, seq_len=2048)
    spans = {g["dim"]: g for g in group_spans(st.resolve(num_gpus), load_model(model).num_layers, num_gpus, c)}
    assert est.valid and est.groups
    for g in est.groups:
        if g.dim == "edp":
            continue
        assert (g.level is not None) == bool(spans[g.dim]["crosses"]), (g.dim, g.level, spans[g.dim])


@pytest.mark.parametrize("num_gpus, filled, crosses", [(512, 64, False), (576, 72, True)])
def test_clusters_show_and_its_picture_place_the_job_so(capsys, num_gpus, filled, crosses):
    """`meshplan clusters --show` names the GPUs the job fills in each rack and the levels the ep groups cross;
    its picture's legend says whether they cross links."""
    strategy = json.dumps({"tp": 1, "ep": 64, "zero_stage": 1, "sequence_parallel": False})
    code = main(["clusters", "--show", "gb200-nvl72", "-m", "deepseek-v3", "-n", str(num_gpus), "-b", str(2 * num_gpus),
                 "-s", "4096", "--strategy", strategy, "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert code in (0, 1)  # 1: the given strategy does not fit in memory, which is said; the placement is shown
    assert out["plan"]["domain_gpus"] == filled
    ep = {g["dim"]: g for g in out["plan"]["groups"]}["ep"]
    assert bool(ep["crosses"]) is crosses
    c = load_cluster("gb200-nvl72")
    fig = draw_topology(c, build_graph(c), num_gpus=num_gpus, strategy=Strategy(tp=1, ep=64, dp=num_gpus),
                        num_layers=61)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert ("ep groups (64 GPUs) cross these links, inside su" in legend) is crosses
