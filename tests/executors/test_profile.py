"""Hardware profiles: measurements -> GPU/cluster YAML the planner loads (no torch for the
conversion; the real measurement and the CLI round trip carry the `executor` marker)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
import yaml

from executors.profiler import cluster_profile, gpu_profile, write_profiles
from profiles import load_cluster, load_gpu


def synthetic_raw(world: int = 2) -> dict:
    gemm = [{"dtype": d, "m": s, "n": s, "k": s, "time_s": 1.0, "flop_per_s": rate}
            for d, base in (("fp32", 50e9), ("bf16", 100e9)) for s, rate in ((256, base / 2), (512, base))]
    colls = []
    for op, factor in (("all_reduce", 1.0), ("all_gather", 0.5), ("reduce_scatter", 0.5), ("all_to_all", 0.5),
                       ("send_recv", 1.0)):
        for nbytes in (4, 4096, 2**20, 2**22):
            t = 200e-6 + nbytes / 1e9
            colls.append({"op": op, "group_size": world, "bytes": nbytes, "time_s": t,
                          "algbw_bytes_per_s": nbytes / t, "busbw_bytes_per_s": nbytes / t * factor})
    return {"device": "cpu", "backend": "gloo", "description": "test cpu", "hostname": "host", "world_size": world,
            "local_world_size": world, "threads_per_rank": 1, "torch_version": "x", "started_utc": "2025-01-01",
            "quick": True, "runtime_baseline_bytes": 2**28, "memory_total_bytes": 8 * 2**30,
            "gemm": gemm, "memory": {"bytes": 2**26, "time_s": 0.01, "bytes_per_s": 20e9},
            "op_overhead": {"time_per_op_s": 5e-6}, "collectives": colls, "duration_s": 3.0,
            "elementwise": {"ops": {"add": {"bytes": 1, "time_s": 1.0, "bytes_per_s": 10e9}}, "bytes_per_s": 10e9},
            "attention": {"shape_b_a_s_d": [1, 1, 1, 1], "time_s": 1.0, "flop_per_s": 1e9}}


def test_profile_values_follow_their_documented_rules():
    raw = synthetic_raw()
    gpu = gpu_profile(raw, "box")
    assert gpu["peak_tflops"] == {"bf16": 0.1, "fp32": 0.05}
    assert gpu["gemm_efficiency"] == 0.75  # median of 0.5 and 1.0
    assert gpu["memory_gib"] == pytest.approx(8 * 0.9 / 2, rel=1e-3)
    assert gpu["hbm_bw_gb_per_s"] == 20.0 and gpu["kernel_overhead_us"] == 5.0
    assert gpu["hbm_efficiency"] == 0.5  # element-wise mix 10 GB/s of the 20 GB/s copy rate
    cluster = cluster_profile(raw, "box", "box")
    tier = cluster["intra_node"]
    # small messages: 200 us + 4 ns / 4.3 us; the model's all-reduce pays 2*log2(2) = 2 hops
    assert tier["latency_us"] == pytest.approx((200 + (4 + 4096) / 1e3 / 2) / 2, rel=1e-3)
    assert 0.8 < tier["bw_gb_per_s"] < 1.0
    assert cluster["max_gpus"] == 2 and cluster["gpus_per_node"] == 2


def test_written_profiles_load_by_path(tmp_path):
    gpu_path, cluster_path = write_profiles(synthetic_raw(), "box", tmp_path)
    text = cluster_path.read_text()
    assert text.startswith("# Written by `meshplan profile`") and "all_reduce" in text
    cluster = load_cluster(str(cluster_path))
    assert cluster.gpu.peak("fp32") == pytest.approx(50e9)
    assert cluster.intra_node.efficiency == 1.0
    assert load_gpu(str(gpu_path)).framework_reserve_bytes == 2**28
    assert isinstance(yaml.safe_load(text)["gpu"], dict)  # embedded: tmp_path is not on the search path


def _cli(argv: list[str]) -> tuple[int, str]:
    from planner.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


@pytest.mark.executor
def test_profile_then_validate_from_the_command_line(tmp_path):
    pytest.importorskip("torch")
    from executor_fixtures import TINY, TRAIN

    code, text = _cli(["profile", "--nproc", "2", "--device", "cpu", "--quick", "--name", "ci-cpu",
                       "--out-dir", str(tmp_path), "--format", "json"])
    assert code == 0
    raw = json.loads(text)["profile"]
    assert {r["op"] for r in raw["collectives"]} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                     "send_recv"}
    assert {r["dtype"] for r in raw["gemm"]} >= {"fp32"}
    cluster_yaml = tmp_path / "clusters" / "ci-cpu.yaml"
    assert load_cluster(str(cluster_yaml)).gpu.peak("fp32") > 0

    model_yaml = tmp_path / "tiny.yaml"
    model_yaml.write_text(yaml.safe_dump(TINY.model_dump()))
    code, text = _cli(["validate", "--model", str(model_yaml), "--cluster", str(cluster_yaml), "--gpus", "2",
                       "--global-batch-size", str(TRAIN.global_batch_size), "--seq-len", str(TRAIN.seq_len),
                       "--precision", "fp32", "--top", "1", "--strategy", '{"cp": 2}', "--warmup", "1",
                       "--steps", "1", "--device", "cpu", "--work-dir", str(tmp_path / "runs"), "--format", "json"])
    assert code == 0, text
    report = json.loads(text)
    first, second = report["comparisons"]
    assert first["outcome"] == "ok" and first["parity"]["passed"]
    assert first["predicted_step_time_s"] > 0 and first["measured_step_time_s"] > 0
    assert second["outcome"] == "unsupported" and "cp (2)" in second["reason"]
    assert report["measured_best"] == first["label"] and report["measured_best_in_predicted_top2"]


def test_measured_gemm_table_is_written_in_the_public_format_and_used(tmp_path, monkeypatch):
    """A profile whose GEMM sweep holds a full (m, n, k) grid writes kernels/gemm/<name>.yaml
    (kind: measured); with its root on MESHPLAN_PROFILES the planner uses it and says so."""
    from cost_models.gemm_tables import gemm_table
    from profiles.tables import provenance

    raw = synthetic_raw()
    grid = (128, 256)
    raw["gemm"] += [{"dtype": d, "m": m, "n": n, "k": k, "time_s": 1.0, "flop_per_s": base * (m * n * k) / 256**3}
                    for d, base in (("fp32", 50e9), ("bf16", 100e9)) for m in grid for n in grid for k in grid
                    if (m, n, k) != (256, 256, 256)]
    write_profiles(raw, "boxgrid", tmp_path)
    table = yaml.safe_load((tmp_path / "kernels" / "gemm" / "boxgrid.yaml").read_text())
    assert table["kind"] == "measured" and table["columns"] == ["b", "m", "n", "k", "bf16", "fp32"]
    assert len(table["rows"]) == 8
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    gpu = load_gpu("boxgrid")
    assert gpu.kernel_tables == "boxgrid"
    assert provenance("boxgrid")["gemm"].startswith("measured")
    t = gemm_table("boxgrid")
    # the peak is the sweep's fastest GEMM (512³ at 50 GFLOP/s); 256³ ran at half of it
    assert float(t.efficiency(256, 256, 256, "fp32")) == pytest.approx(0.5)
    assert float(t.efficiency(128, 128, 128, "fp32")) == pytest.approx(1 / 8)


def test_no_table_without_a_full_grid():
    from executors.profiler import gemm_table_profile

    assert gemm_table_profile(synthetic_raw(), "box") is None


def test_measured_collective_curves_are_written_and_used(tmp_path, monkeypatch):
    """The profile's collective measurements become kernels/collectives/<name>.yaml (kind: measured);
    on MESHPLAN_PROFILES the cluster's communication model reads them back: a 4 MiB all-reduce over
    the 2 measured ranks takes the measured time."""
    from cost_models.collectives import CurveCommModel, comm_model_for
    from profiles.tables import provenance

    raw = synthetic_raw()
    write_profiles(raw, "boxnet", tmp_path)
    doc = yaml.safe_load((tmp_path / "kernels" / "collectives" / "boxnet.yaml").read_text())
    assert doc["kind"] == "measured" and set(doc["tiers"]["nvlink"]) == {"all_reduce", "all_gather",
                                                                           "reduce_scatter", "all_to_all"}
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    assert provenance("boxnet")["collectives"].startswith("measured")
    cluster = load_cluster("boxnet")
    comm = comm_model_for(cluster)
    assert isinstance(comm, CurveCommModel)
    measured = next(r["time_s"] for r in raw["collectives"] if r["op"] == "all_reduce" and r["bytes"] == 2**22)
    assert float(comm.all_reduce_s(2**22, 2, 1)) == pytest.approx(measured, rel=1e-6)
