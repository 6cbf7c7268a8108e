"""ZeRO-3 / FSDP gathers hide layer by layer, only as far as each layer's compute allows
(cost_models/sharding.py)."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from benchmarks.calibration import RowError, Summary, torchtitan_fsdp2
from benchmarks.validation import predict
from cost_models.sharding import per_layer_exposed_s
from planner import Strategy, evaluate
from profiles import PROFILES_DIR, load_cluster
from profiles.bundle import load_tables
from profiles.frameworks import ZERO3_IMPLS

Z3 = Strategy(dp=16, tp=1, pp=1, cp=1, zero_stage=3, micro_batch_size=1, recompute="none")


def _a100_cluster(gpus_per_node: int):
    doc = yaml.safe_load((PROFILES_DIR / "clusters" / "dgx-a100-80gb.yaml").read_text())
    doc["gpus_per_node"] = gpus_per_node
    doc["name"] = f"a100-{gpus_per_node}-per-node"
    return load_cluster(doc)


def _z3(cluster, model="llama3-8b", seq_len=1024, strategy=Z3, **train):
    return evaluate(model=model, cluster=cluster, num_gpus=16, global_batch_size=16, seq_len=seq_len,
                    strategy=strategy, **train)


def test_exposed_gather_grows_when_the_group_crosses_nodes():
    inside = _z3(_a100_cluster(16))  # the 16 ranks share one NVLink domain
    across = _z3(_a100_cluster(8))  # the same ranks on two nodes: NICs between them
    assert across.time_s["dp_comm"] > 1.2 * inside.time_s["dp_comm"]
    assert across.step_time_s > inside.step_time_s


def test_deepspeed_is_slower_across_nodes_than_fsdp2():
    fsdp2 = _z3(_a100_cluster(8), zero3_impl="fsdp2")
    deepspeed = _z3(_a100_cluster(8), zero3_impl="deepspeed")
    assert deepspeed.time_s["dp_comm"] > fsdp2.time_s["dp_comm"]


def test_a_small_models_gathers_do_not_hide_behind_tiny_layers():
    # 1.7B GPT at 256 tokens per rank: a layer computes for far less time than its gather takes.
    small = _z3("dgx-a100-80gb", model="gpt3-1.7b", seq_len=256)
    assert small.time_s["dp_comm"] > 0.5 * small.time_s["compute"]
    # the same job at 32x the tokens per rank hides most of it
    big = _z3("dgx-a100-80gb", model="gpt3-1.7b", seq_len=8192)
    assert big.time_s["dp_comm"] / big.time_s["compute"] < small.time_s["dp_comm"] / small.time_s["compute"] / 5


def test_without_prefetch_every_gather_is_exposed():
    hidden = _z3("dgx-a100-80gb")
    exposed = _z3("dgx-a100-80gb", strategy=Z3.model_copy(update={"overlap_param_gather": False}))
    assert exposed.time_s["dp_comm"] > hidden.time_s["dp_comm"]


@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_per_layer_exposure_is_never_negative_nor_more_than_the_traffic(overlap):
    rng = np.random.default_rng(0)
    n = 2000
    gather, reduce, fwd, bwd = (rng.lognormal(-6, 2, n) for _ in range(4))
    opg, ogr = rng.random(n) < 0.7, rng.random(n) < 0.7
    out = per_layer_exposed_s(gather, reduce, fwd, bwd, opg, ogr, overlap)
    assert np.all(out >= 0)
    assert np.all(out <= 2 * gather + reduce + 1e-15)
    # compute that dwarfs the traffic hides all of it, when overlapped and the overlap is real
    hidden = per_layer_exposed_s(gather, reduce, 1e3 + fwd, 1e3 + bwd, True, True, 1.0)
    assert np.allclose(hidden, 0.0)


def test_torchtitan_fsdp2_a100_rows_stay_accurate():
    rows = [RowError(c.label, c.measured_step_s, predict(c).predicted_step_s) for c in torchtitan_fsdp2()]
    assert Summary.of(rows).median_abs <= 0.07


def test_every_zero3_number_names_its_source():
    doc = yaml.safe_load((PROFILES_DIR / "frameworks" / "zero3.yaml").read_text())
    assert str(doc.get("source", "")).strip()
    for name in ZERO3_IMPLS:
        for key, value in doc[name].items():
            if not key.endswith("_source"):
                assert str(doc[name].get(f"{key}_source", "")).strip(), f"{name}.{key}"
    assert set(load_tables(None).zero3) == set(ZERO3_IMPLS)


def test_the_cross_node_fit_rows_are_calibration_rows():
    """The SC'21 rows benchmarks/zero3.py fits DeepSpeed's cross_node_nic_fraction on are the accuracy report's
    calibration rows (benchmarks.generations.calibration_rows), under the labels of its SC'21 Table 2 ZeRO-3 table,
    so no table or summary counts them as held out."""
    from benchmarks.calibration import sc21_zero3
    from benchmarks.generations import calibration_rows
    from benchmarks.zero3 import FIT_ROWS, SC21_ZERO3_TABLE, cases

    fit = [case for case, _, role in cases() if role == "fit"]
    assert len(FIT_ROWS) == len(fit) == 2
    labels = {c.label for c in sc21_zero3()}
    assert {label for _, label in FIT_ROWS} <= labels
    assert {(c.num_gpus, c.constraints["micro_batch_size"]) for c in fit} == {
        (c.num_gpus, c.constraints["micro_batch_size"]) for c in sc21_zero3() if (SC21_ZERO3_TABLE, c.label) in FIT_ROWS}
    assert set(FIT_ROWS) <= calibration_rows()
