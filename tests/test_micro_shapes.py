"""Micro-batch shape deduplication (`Micro.distinct`) keeps every non-shape field: the FP8 recipe
and the cross-entropy fusion must reach the per-shape kernel lookups of a search, as they reach a
single evaluation."""

from __future__ import annotations

import numpy as np

from cost_models.blocks import Micro, model_blocks
from cost_models.compute import head_times, layer_times
from profiles import load_cluster, load_model


def _micro(n: int, **kw) -> Micro:
    return Micro(8192, np.ones(n, dtype=np.int64) * 2, np.ones(n, dtype=np.int64) * 2, np.ones(n, dtype=np.int64),
                 np.ones(n, dtype=bool), "fp8", "flash", **kw)


def test_distinct_keeps_recipe_and_loss_fusion():
    small, index = _micro(4, fp8_recipe="mxfp8", cross_entropy_fusion=False).distinct
    assert index is not None and small.fp8_recipe == "mxfp8" and small.cross_entropy_fusion is False


def test_search_shapes_cost_the_same_as_one_candidate():
    """Four identical candidates (deduplicated to one shape) cost what one candidate costs, for a
    recipe and loss other than the defaults."""
    gpu = load_cluster("dgx-b200").gpu
    blocks = model_blocks(load_model("llama3-8b"))
    kw = {"fp8_recipe": "mxfp8", "cross_entropy_fusion": False}
    many, one = layer_times(blocks, _micro(4, **kw), gpu), layer_times(blocks, _micro(1, **kw), gpu)
    assert np.allclose(many.fwd_s[:, 0], one.fwd_s[:, 0]) and np.allclose(many.bwd_s[:, 0], one.bwd_s[:, 0])
    default = layer_times(blocks, _micro(1), gpu)
    assert not np.allclose(one.fwd_s, default.fwd_s)  # the recipe does change the cost
    h_many, h_one = head_times(blocks.head, _micro(4, **kw), gpu), head_times(blocks.head, _micro(1, **kw), gpu)
    assert np.isclose(h_many[0][0], h_one[0][0]) and np.isclose(h_many[1][0], h_one[1][0])
