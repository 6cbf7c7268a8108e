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
from profiles.bundle import load_tables


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
            "attention": synthetic_attention(), "small_kernel": {"time_per_kernel_s": 2e-6, "method": "test"},
            "optimizer": {"tensors": 2, "params": 10**6, "time_s": 2.8e-3, "dtype": "fp32",
                          "implementation": "torch.optim.Adam(foreach=True)"},
            "capability": None, "cuda_context_bytes": None}


def synthetic_attention() -> dict:
    """Every (direction, causal, head dim) at two sequence lengths: rate = d x s x (1 + bwd) GFLOP/s."""
    rows = [{"direction": di, "causal": c, "head_dim": d, "seq_len": s, "batch": 1, "heads": 1, "time_s": 1.0,
             "flop": 1.0, "flop_per_s": d * s * (2 if di == "bwd" else 1) * 1e9}
            for di in ("fwd", "bwd") for c in (False, True) for d in (64, 128) for s in (64, 128)]
    return {"dtype": "float32", "tokens": 256, "hidden": 256, "seq_lens": [64, 128], "head_dims": [64, 128],
            "rows": rows, "skipped": [], "kernel": "sdpa"}


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
def test_profile_then_validate_from_the_command_line(tmp_path, monkeypatch):
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
    check_measured_kernel_tables(tmp_path, raw, monkeypatch)


def check_measured_kernel_tables(root, raw: dict, monkeypatch) -> None:
    """The real quick profile's attention, element-wise and memory tables load through the cost model's
    loaders, `meshplan clusters` reports every topic measured, and an estimate on the profile uses them."""
    from executor_fixtures import TINY

    from cost_models.elementwise import elementwise_model
    from planner import evaluate

    att = raw["attention"]
    assert att["skipped"] == [] and len(att["rows"]) == 4 * len(att["head_dims"]) * len(att["seq_lens"])
    monkeypatch.setenv("MESHPLAN_PROFILES", str(root))
    table = load_tables("ci-cpu").attention.get("flash")
    assert set(table.head_dims) == {(d, c) for d in ("fwd", "bwd") for c in (False, True)}
    fwd = next(r for r in att["rows"] if (r["direction"], r["causal"], r["head_dim"]) == ("fwd", True, 64))
    assert float(table.rate("fwd", True, 64, fwd["seq_len"])) == pytest.approx(fwd["flop_per_s"], rel=1e-3)
    gpu = load_gpu("ci-cpu")
    ew = elementwise_model(gpu)
    assert ew.fp8_recipes == () and 0 < ew.bw_bytes_per_s <= gpu.hbm_bw_bytes_per_s
    assert ew.host_per_kernel_s == pytest.approx(raw["op_overhead"]["time_per_op_s"], rel=1e-3)
    mem = load_tables("ci-cpu").memory
    assert mem.cuda_context_bytes == pytest.approx(raw["runtime_baseline_bytes"], rel=1e-3) and mem.nccl_channels == 0
    code, text = _cli(["clusters", "--format", "json"])
    assert code == 0
    where = next(r["provenance"] for r in json.loads(text) if r["name"] == "ci-cpu")
    assert all(where[t].startswith("measured") for t in ("gemm", "attention", "elementwise", "collectives", "memory"))
    est = evaluate(TINY, "ci-cpu", 2, 8, 64, precision="bf16", strategy={"dp": 2})
    assert est.step_time_s > 0 and est.memory_bytes["cuda_context"] == pytest.approx(mem.cuda_context_bytes)


def test_measured_gemm_table_is_written_in_the_public_format_and_used(tmp_path, monkeypatch):
    """A profile whose GEMM sweep holds a full (m, n, k) grid writes kernels/gemm/<name>.yaml
    (kind: measured); with its root on MESHPLAN_PROFILES the planner uses it and says so."""
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
    t = load_tables("boxgrid").gemm
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


def test_attention_elementwise_memory_tables_are_written_and_load(tmp_path, monkeypatch):
    """A profile writes kernels/{attention,elementwise,memory}/<name>.yaml (kind: measured) that the cost
    model's own loaders read back with the measured values; fields not measured name where they come from."""
    from cost_models.elementwise import elementwise_model
    from profiles.elementwise import _FIELDS
    from planner.cli.provenance import kernel_provenance

    write_profiles(synthetic_raw(), "boxkern", tmp_path)
    gpu_doc = yaml.safe_load((tmp_path / "gpus" / "boxkern.yaml").read_text())
    assert "kernels/gemm/" not in gpu_doc["kernel_tables_source"]  # the synthetic sweep has no full GEMM grid
    assert all(f"kernels/{t}/boxkern.yaml" in gpu_doc["kernel_tables_source"]
               for t in ("attention", "elementwise", "collectives", "memory"))
    ew_doc = yaml.safe_load((tmp_path / "kernels" / "elementwise" / "boxkern.yaml").read_text())
    for field in _FIELDS:
        key = "host_per_expert_source" if field.startswith("host_per_expert") else field.removesuffix("_us") + "_source"
        assert ew_doc[key].startswith(("measured by `meshplan profile` on test cpu", "carried from profiles/kernels/",
                                       "a CPU runs no FP8")), field
    assert "carried from profiles/kernels/elementwise/h100-sxm.yaml" in ew_doc["backward_kernels_per_forward_source"]

    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    att = load_tables("boxkern").attention.get("flash")
    # synthetic rate d x s GFLOP/s forward, twice that backward; the causal backward was measured, not derived
    assert float(att.rate("fwd", False, 64, 128)) == pytest.approx(64 * 128 * 1e9, rel=1e-3)
    assert float(att.rate("bwd", True, 128, 64)) == pytest.approx(2 * 128 * 64 * 1e9, rel=1e-3)
    gpu = load_gpu("boxkern")
    ew = elementwise_model(gpu)
    assert ew.bw_bytes_per_s == pytest.approx(20e9)  # hbm_fraction 1 of the profile's copy rate
    assert ew.optimizer_bw_bytes_per_s == pytest.approx(10e9)  # 1e6 params x 28 B / 2.8 ms
    assert ew.kernel_fixed_s == pytest.approx(2e-6) and ew.host_per_kernel_s == pytest.approx(5e-6)
    assert ew.fp8_recipes == () and ew.backward_kernels_per_forward == 2.0
    mem = load_tables("boxkern").memory
    assert mem.cuda_context_bytes == 2**28 and mem.nccl_channels == 0 and mem.allocator_slack_fraction == 0.1
    where = kernel_provenance(gpu)
    assert where["attention"] == "measured (test cpu)" and where["gemm"] == "none"
    assert where["elementwise"] == "measured (test cpu; some fields carried from h100-sxm)"
    assert where["memory"].startswith("measured (test cpu; some fields carried")


def test_planning_on_the_profile_uses_each_measured_table(tmp_path, monkeypatch):
    """An estimate on the profiled cluster changes when any one of the three tables is taken away:
    each of them is read by the cost model, not only written."""
    from executor_fixtures import TINY

    from planner import evaluate

    write_profiles(synthetic_raw(), "boxplan", tmp_path)
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))

    def estimate():
        return evaluate(TINY, "boxplan", 2, 8, 64, precision="bf16", strategy={"dp": 2})

    full = estimate()
    assert full.memory_bytes["cuda_context"] == 2**28 and full.memory_bytes["framework_reserve"] == 0
    (tmp_path / "kernels" / "attention" / "boxplan.yaml").unlink()
    no_attention = estimate()
    assert no_attention.step_time_s != pytest.approx(full.step_time_s, rel=1e-9)
    (tmp_path / "kernels" / "elementwise" / "boxplan.yaml").unlink()
    no_elementwise = estimate()
    assert no_elementwise.time_s["optimizer"] != pytest.approx(no_attention.time_s["optimizer"], rel=1e-9)
    (tmp_path / "kernels" / "memory" / "boxplan.yaml").unlink()
    bare = estimate()
    assert bare.memory_bytes["framework_reserve"] == 2**28 and bare.memory_bytes["cuda_context"] == 0


@pytest.mark.parametrize("topic, edit, message", [
    ("attention", lambda d: d.update(curves=[c for c in d["curves"] if c["direction"] == "bwd" or c["causal"]]),
     "needs forward curves with and without the causal mask"),
    ("attention", lambda d: d["curves"][0]["tflops"].pop(), "tflops must be 2 positive numbers"),
    ("elementwise", lambda d: d.pop("kernel_fixed_us"), "lacks kernel_fixed_us"),
    ("elementwise", lambda d: d.update(optimizer_hbm_fraction=1.5), r"optimizer_hbm_fraction must be in \(0, 1\]"),
    ("memory", lambda d: d.pop("nccl_channels"), "nccl_channels must be a number >= 0"),
    ("memory", lambda d: d.update(cuda_context_mib=-1), "cuda_context_mib must be a number >= 0"),
])
def test_a_malformed_measured_table_is_refused(tmp_path, monkeypatch, topic, edit, message):
    from cost_models.elementwise import elementwise_model
    from planner.errors import SpecError

    write_profiles(synthetic_raw(), "boxbad", tmp_path)
    path = tmp_path / "kernels" / topic / "boxbad.yaml"
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    load = {"attention": lambda: load_tables("boxbad").attention.get("flash"), "memory": lambda: load_tables("boxbad").memory,
            "elementwise": lambda: elementwise_model(load_gpu("boxbad"))}[topic]
    with pytest.raises(SpecError, match=message):
        load()


def test_attention_table_needs_the_forward_both_ways_and_the_unmasked_backward():
    """A device that could not run a required curve gets no attention table (the cost model then keeps its
    roofline) rather than one the loader refuses; a missing optional curve only drops that curve."""
    from executors.profile_tables import attention_table_profile

    raw = synthetic_raw()
    raw["attention"]["rows"] = [r for r in raw["attention"]["rows"]
                                if not (r["direction"] == "bwd" and r["causal"] and r["head_dim"] == 128)]
    table = attention_table_profile(raw, "src")
    assert len(table["curves"]) == 7
    raw["attention"]["rows"] = [r for r in raw["attention"]["rows"] if not (r["direction"] == "bwd" and not r["causal"])]
    assert attention_table_profile(raw, "src") is None


def test_fp8_support_follows_the_compute_capability():
    from executors.profile_tables import fp8_support

    assert fp8_support(None)[:2] == ([], False)
    assert fp8_support([8, 0])[:2] == ([], False)
    assert fp8_support([9, 0])[:2] == (["delayed", "tensorwise", "blockwise"], True)
    assert fp8_support([10, 0])[:2] == (["delayed", "tensorwise", "blockwise", "mxfp8"], False)


def test_carried_fields_come_from_the_gpus_own_shipped_set():
    from executors.profile_tables import carried_table, shipped_set

    assert shipped_set("NVIDIA H100 80GB HBM3") == "h100-sxm" and shipped_set("NVIDIA GB200") == "gb200"
    assert shipped_set("NVIDIA H100 PCIe") is None and shipped_set("AMD EPYC (2 logical cores)") is None
    table, path, why = carried_table("memory", "NVIDIA GB300")  # a same_as file: the table it names
    assert path == "profiles/kernels/memory/gb200.yaml" and "gb300" in why and "nccl_channels" in table


def test_a_stale_measured_table_is_removed(tmp_path):
    """Re-profiling under the same name (--force) leaves no table of the earlier run the new one could not write."""
    raw = synthetic_raw()
    write_profiles(raw, "boxstale", tmp_path)
    raw["attention"]["rows"] = []
    write_profiles(raw, "boxstale", tmp_path, force=True)
    assert not (tmp_path / "kernels" / "attention" / "boxstale.yaml").exists()
    assert (tmp_path / "kernels" / "memory" / "boxstale.yaml").exists()


def test_attention_flop_follows_the_tables_convention():
    """4·b·s²·heads·d forward, halved with the causal mask; backward 2.5 x (FlashAttention's `flops()`)."""
    pytest.importorskip("torch")
    from executors.profile_worker import attention_flop

    assert attention_flop(2, 1024, 16, 128, False, "fwd") == 4 * 2 * 1024**2 * 16 * 128
    assert attention_flop(2, 1024, 16, 128, True, "bwd") == 2.5 * 4 * 2 * 1024**2 * 16 * 128 / 2


def test_a_cuda_profile_writes_flashattention2_as_the_flash2_section(tmp_path, monkeypatch):
    """On CUDA the profile times SDPA's cuDNN backend (attention_kernel flash) and its FLASH_ATTENTION backend
    (FlashAttention-2, attention_kernel flash2) apart; the second becomes the table's flash2 section, which the
    cost model reads for flash2. An incomplete FlashAttention-2 sweep writes no section (flash2 is then refused)."""
    from cost_models.attention_kernels import kernel_problem
    from executors.profile_tables import attention_table_profile
    from executors.profile_worker import SDPA_BACKENDS

    assert SDPA_BACKENDS == {"flash": "CUDNN_ATTENTION", "flash2": "FLASH_ATTENTION"}
    raw = synthetic_raw()
    fa2 = synthetic_attention()
    for r in fa2["rows"]:
        r["flop_per_s"] /= 2
    raw["attention_flash2"] = fa2 | {"kernel": "sdpa FLASH_ATTENTION"}
    table = attention_table_profile(raw, "src")
    assert table["flash2"]["kernel"].startswith("sdpa FLASH_ATTENTION") and "kind" not in table["flash2"]
    write_profiles(raw, "boxfa2", tmp_path)
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    main, second = load_tables("boxfa2").attention.get("flash"), load_tables("boxfa2").attention.get("flash2")
    assert float(second.rate("fwd", True, 64, 128)) == pytest.approx(float(main.rate("fwd", True, 64, 128)) / 2)
    assert kernel_problem(load_gpu("boxfa2"), "flash2", windowed=False) is None
    raw["attention_flash2"]["rows"] = [r for r in fa2["rows"] if r["direction"] == "fwd"]
    assert "flash2" not in attention_table_profile(raw, "src")
