"""The torch executor lays ranks and layers out as the plan's ParallelLayout does (issue 7).

The DeviceMesh is torch's own `init_device_mesh` on a fake process group (one per
rank, no communication), so the coordinates compared are the ones the worker gets.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from executor_fixtures import TINY, TRAIN  # noqa: E402

from cost_models.layout import ParallelLayout  # noqa: E402
from executors.model import build_model  # noqa: E402
from executors.parallelize import build_mesh, mesh_axes, mesh_coords  # noqa: E402
from executors.pipeline import build_stage_modules  # noqa: E402
from executors.results import RunConfig  # noqa: E402
from planner.specs import Strategy  # noqa: E402

MESHES = {
    "tp2-dp2-pp2": (Strategy(dp=2, tp=2, pp=2), 1),
    "tp2-cp2-dp2": (Strategy(dp=2, tp=2, cp=2), 1),
    "pp2-cp2-tp2": (Strategy(dp=1, tp=2, cp=2, pp=2), 1),
    "hsdp2x2-pp2": (Strategy(dp=4, pp=2, zero_stage=3), 2),
    "dp8": (Strategy(dp=8), 1),
}


def _config(st: Strategy, hsdp_replicate: int, model=TINY) -> RunConfig:
    return RunConfig(label=st.short(), model=model, train=TRAIN, strategy=st, num_gpus=st.num_gpus,
                     hsdp_replicate=hsdp_replicate)


@pytest.mark.parametrize("name", list(MESHES))
def test_device_mesh_coordinates_are_the_layouts(name):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    st, rep = MESHES[name]
    cfg = _config(st, rep)
    lay = ParallelLayout.of_strategy(st, TINY.num_layers)
    names, shape = mesh_axes(cfg)
    assert [n for n in names if not n.startswith("dp_")] == [d for d in lay.mesh_dims() if d != "dp"]
    world = st.num_gpus
    assert int(np.prod(shape)) == world
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            mesh = build_mesh(cfg, "cpu")
            coords = mesh_coords(mesh)
            local = tuple(mesh.get_local_rank(n) for n in names)
        finally:
            dist.destroy_process_group()
        assert local == tuple(int(i) for i in np.unravel_index(rank, shape))  # DeviceMesh is row-major
        assert {d: coords[d] for d in lay.mesh_dims()} == lay.coords(rank), (name, rank)
        assert lay.rank(**lay.coords(rank)) == rank


SIX = TINY.model_copy(update={"num_layers": 6, "tie_embeddings": False})
SPLITS = {
    "even-vpp": (SIX, Strategy(dp=1, pp=2, vpp=3)),
    "uneven-first-last-vpp": (SIX.model_copy(update={"num_layers": 8}),
                              Strategy(dp=1, pp=3, vpp=2, num_layers_in_first_stage=2, num_layers_in_last_stage=2)),
    "explicit-vpp": (SIX, Strategy(dp=1, pp=2, vpp=2, stage_layers=[2, 4])),
    # one count per virtual stage: rank 0 runs chunks of 2 and 1 layers, rank 1 of 1 and 2
    "per-virtual-stage": (SIX, Strategy(dp=1, pp=2, vpp=2, stage_layers=[2, 1, 1, 2])),
    "embedding-loss-as-layer-vpp": (TINY.model_copy(update={"tie_embeddings": False}),
                                    Strategy(dp=1, pp=2, vpp=3, embedding_as_layer=True, loss_as_layer=True)),
}


@pytest.mark.parametrize("name", list(SPLITS))
def test_pipeline_chunks_hold_the_layouts_layers(name):
    model, st = SPLITS[name]
    lay = ParallelLayout.of_strategy(st, model.num_layers)
    counts = lay.layers_per_chunk()
    full = build_model(model, TRAIN.seq_len, seed=0)
    built: dict[int, list[int]] = {}
    for r in range(st.pp):
        for stage, module in build_stage_modules(full, r, st.pp, st.vpp, st):
            assert stage % st.pp == r  # virtual stage c·pp + r runs on rank r
            built[stage] = [int(n) for n in module.layers]
            assert (module.embed is not None) == (stage == 0)
            assert (module.output is not None) == (stage == st.pp * st.vpp - 1)
    assert [len(built[i]) for i in range(len(counts))] == counts
    assert [n for i in range(len(counts)) for n in built[i]] == list(range(model.num_layers))  # in order


def test_uneven_first_last_counts_are_per_pipeline_rank_split_over_its_chunks():
    # Megatron's rule: the first rank's 2 layers are one per chunk (not 2 on chunk 0 and 0 after)
    _, st = SPLITS["uneven-first-last-vpp"]
    assert ParallelLayout.of_strategy(st, 8).layers_per_chunk() == [1, 2, 1, 1, 2, 1]


EXPERT_MESHES = {"dp2-ep2": Strategy(dp=2, ep=2), "dp4-ep2": Strategy(dp=4, ep=2), "dp8-ep4": Strategy(dp=8, ep=4)}


@pytest.mark.parametrize("name", list(EXPERT_MESHES))
def test_expert_mesh_folds_ep_over_dp_as_the_layout_does(name):
    """Megatron-core's expert layout with tp = cp = 1: the ep group is ep consecutive dp ranks,
    the expert-data-parallel group the ranks ep apart (issue 8)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from executors.parallelize import EXPERT_AXES, build_expert_mesh, expert_mesh_shape
    from executor_fixtures import TINY_MOE

    st = EXPERT_MESHES[name].resolve(EXPERT_MESHES[name].dp)
    cfg = RunConfig(label=st.short(), model=TINY_MOE, train=TRAIN, strategy=st, num_gpus=st.num_gpus)
    lay = ParallelLayout.of_strategy(st, TINY_MOE.num_layers)
    assert expert_mesh_shape(cfg) == (1, st.dp // st.ep, st.ep, 1)
    for rank in range(st.num_gpus):
        dist.init_process_group("fake", rank=rank, world_size=st.num_gpus, store=FakeStore())
        try:
            mesh = build_expert_mesh(cfg, "cpu")
            local = {a: mesh.get_local_rank(a) for a in EXPERT_AXES}
            ep_ranks = sorted(int(r) for r in mesh["ep"].mesh.flatten())
            edp_ranks = sorted(int(r) for r in mesh["edp"].mesh.flatten())
        finally:
            dist.destroy_process_group()
        dp = lay.coords(rank)["dp"]
        assert (local["ep"], local["edp"]) == (dp % st.ep, dp // st.ep)
        assert ep_ranks == list(range(rank - rank % st.ep, rank - rank % st.ep + st.ep))
        assert edp_ranks == list(range(rank % st.ep, st.num_gpus, st.ep))
