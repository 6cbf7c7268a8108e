"""A user calibration file (profiles.calibration_file): its format, its checks, and its use by plan(),
evaluate() and the CLI's --calibration."""

from __future__ import annotations

import warnings

import pytest
import yaml

from planner import evaluate, plan
from planner.calibrate import write_calibration_profile
from planner.cli import main
from planner.cli.provenance import constants_provenance
from planner.errors import InputWarning, SpecError
from profiles import Calibration, apply_calibration, load_calibration, load_cluster

GIB = 2**30
H100 = {"model": "llama3-8b", "cluster": "dgx-h100", "num_gpus": 8, "global_batch_size": 16, "seq_len": 2048}
#: A CPU cluster without kernel tables: every collective is priced from the link tiers.
CPU = {"model": "mpt-760m", "cluster": "local-cpu", "num_gpus": 2, "global_batch_size": 4, "seq_len": 256,
       "precision": "fp32"}
CLI_H100 = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size", "16",
            "--seq-len", "2048"]


def _write(tmp_path, data, name="tune-cal.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _doc(**values):
    return {**values, "fit": "test", "fitted_on": "synthetic runs", "method": "by hand"}


def test_a_file_is_read_in_si_units_and_the_tuner_keys_are_ignored(tmp_path):
    path = _write(tmp_path, _doc(sustained_compute_fraction=0.7, kernel_overhead_us=4.5, framework_reserve_gib=1.5,
                                 comm_overlap=0.6, intra_node_bw_gb_per_s=300, inter_node_bw_gb_per_s=40)
                  | {"gpu": "h100-sxm", "cluster": "dgx-h100", "standard_errors": {"comm_overlap": 0.01},
                     "residuals": [{"row": "trial 1", "error": 0.01}],
                     "trials": [{"number": 1, "params": {"tp": 2}}], "study": {"name": "s", "direction": "minimize"}})
    calib = load_calibration(path)
    assert isinstance(calib, Calibration)
    assert calib.values == {"sustained_compute_fraction": 0.7, "kernel_overhead_s": pytest.approx(4.5e-6),
                            "framework_reserve_bytes": 1.5 * GIB, "comm_overlap": 0.6,
                            "intra_node_bw_bytes_per_s": 300e9, "inter_node_bw_bytes_per_s": 40e9}
    assert (calib.gpu, calib.cluster, calib.source) == ("h100-sxm", "dgx-h100", str(path))
    assert load_calibration(calib) is calib
    with pytest.warns(InputWarning, match="intra_node_bw_gb_per_s"):  # H100's collectives come from its table
        cluster = apply_calibration(load_cluster("dgx-h100"), str(path))
    assert cluster.gpu.sustained_compute_fraction == 0.7
    assert cluster.gpu.kernel_overhead_s == pytest.approx(4.5e-6)
    assert cluster.gpu.framework_reserve_bytes == 1.5 * GIB
    assert cluster.comm_overlap == 0.6
    assert (cluster.intra_node.bw_bytes_per_s, cluster.inter_node.bw_bytes_per_s) == (300e9, 40e9)
    assert cluster.gpu.has_tables  # the GPU keeps its kernel tables
    assert cluster.gpu.calibration.startswith("tune-cal.yaml: fitted on synthetic runs; user calibration of ")
    assert "user calibration tune-cal.yaml" in constants_provenance(cluster.gpu)


@pytest.mark.parametrize("data,message", [
    (_doc(intra_node_bw_gb_per_s=-5), r"calibration .*tune-cal\.yaml: intra_node_bw_gb_per_s must be > 0 \(got -5\)"),
    (_doc(inter_node_bw_gb_per_s=0), "inter_node_bw_gb_per_s must be > 0"),
    (_doc(comm_overlap=1.5), "comm_overlap must be between 0 and 1"),
    (_doc(sustained_compute_fraction=0.0), "sustained_compute_fraction must be between 0.001 and 1"),
    (_doc(host_time_scale=0.5), "host_time_scale must be between 1 and 100"),
    (_doc(backward_gemm_ratio=0), "backward_gemm_ratio must be > 0"),
    (_doc(kernel_overhead_us=2e6), "kernel_overhead_us must be between 0 and 1e[+]06"),
    (_doc(gemm_efficiency="0.5"), "gemm_efficiency must be a finite number"),
    (_doc(gemm_efficiency=True), "gemm_efficiency must be a finite number"),
    (_doc(gemm_efficiency=float("nan")), "gemm_efficiency must be a finite number"),
    (_doc(gemm_efficiency=0.5, warp_speed=9), "unknown key.* warp_speed"),
    (_doc(kernel_overhead_s=5e-6), "unknown key.* kernel_overhead_s"),  # SI names are not file keys
    (_doc(), "sets no value"),
    ({"gemm_efficiency": 0.5}, "fitted_on is required"),
    (_doc(gemm_efficiency=0.5, gpu=""), "gpu must be a non-empty text"),
    (_doc(gemm_efficiency=0.5, standard_errors={"comm_overlap": -1}), "standard_errors.comm_overlap"),
    (_doc(gemm_efficiency=0.5, residuals=[{"row": "a"}]), r"residuals\[0\]"),
    ([1, 2], "must hold a mapping"),
])
def test_a_bad_file_is_refused_in_one_line_naming_the_key(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(SpecError, match=message) as err:
        load_calibration(path)
    assert "\n" not in str(err.value)


def test_a_missing_file_and_a_bad_reference_are_refused(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_calibration(tmp_path / "none.yaml")
    with pytest.raises(SpecError, match="must be a file path, a mapping or a Calibration"):
        load_calibration(3)


def test_the_gpu_must_be_the_clusters_by_preset_or_name():
    h100, cpu = load_cluster("dgx-h100"), load_cluster("local-cpu")
    for ref in ("h100-sxm", "H100-SXM5-80GB", "h100-sxm5-80gb"):
        assert apply_calibration(h100, _doc(gemm_efficiency=0.5, gpu=ref)).gpu.gemm_efficiency == 0.5
    assert apply_calibration(cpu, _doc(comm_overlap=0.3, gpu="local-cpu")).comm_overlap == 0.3
    with pytest.raises(SpecError, match=r"gpu 'a100-80gb' is not the GPU of cluster 'dgx-h100' \(H100-SXM5-80GB"):
        apply_calibration(h100, _doc(gemm_efficiency=0.5, gpu="a100-80gb"))
    with pytest.raises(SpecError, match="gpu 'local-cpu' is not the GPU of cluster 'dgx-h100'"):
        apply_calibration(h100, _doc(gemm_efficiency=0.5, gpu="local-cpu"))


def test_network_values_need_their_cluster_gpu_values_do_not():
    h200 = load_cluster("dgx-h200")
    assert apply_calibration(h200, _doc(gemm_efficiency=0.5, cluster="dgx-h100")).gpu.gemm_efficiency == 0.5
    with pytest.raises(SpecError, match="cluster 'dgx-h100' is not 'dgx-h200'.*comm_overlap"):
        apply_calibration(h200, _doc(comm_overlap=0.5, cluster="dgx-h100"))


def test_a_reserve_beyond_the_gpu_memory_is_refused():
    with pytest.raises(SpecError, match=r"framework_reserve_gib \(80\) must be less than"):
        apply_calibration(load_cluster("dgx-h100"), _doc(framework_reserve_gib=80))


def test_an_intra_node_bandwidth_a_collectives_table_overrides_is_flagged():
    with pytest.warns(InputWarning, match="intra_node_bw_gb_per_s prices only pipeline transfers"):
        apply_calibration(load_cluster("dgx-h100"), _doc(intra_node_bw_gb_per_s=100))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_calibration(load_cluster("local-cpu"), _doc(intra_node_bw_gb_per_s=0.5))


def test_a_slower_compute_fraction_makes_a_plan_slower():
    base = plan(**H100, top_k=1)
    calibrated = plan(**H100, top_k=1, calibration=_doc(sustained_compute_fraction=0.35))
    assert calibrated.plans[0].estimate.step_time_s > 1.5 * base.plans[0].estimate.step_time_s
    assert calibrated.cluster.gpu.sustained_compute_fraction == 0.35
    assert calibrated.cluster.gpu.calibration.startswith("calibration mapping: fitted on synthetic runs")


def test_a_slower_link_makes_a_tensor_parallel_plan_slower():
    strategy = {"tp": 2, "sequence_parallel": True}
    base = evaluate(**CPU, strategy=strategy)
    slow = evaluate(**CPU, strategy=strategy, calibration=_doc(intra_node_bw_gb_per_s=0.1, gpu="local-cpu"))
    assert slow.time_s["tp_comm"] > 2 * base.time_s["tp_comm"]
    assert slow.step_time_s > base.step_time_s
    pipeline = evaluate(**CPU, strategy={"pp": 2})  # the pipeline's transfers cross the same link
    slow_pipeline = evaluate(**CPU, strategy={"pp": 2}, calibration=_doc(intra_node_bw_gb_per_s=0.1))
    assert slow_pipeline.time_s["pp_comm"] > 2 * pipeline.time_s["pp_comm"]


def test_the_document_round_trips_through_the_file(tmp_path):
    from planner.calibrate import user_calibration_document

    values = {"sustained_compute_fraction": 0.7123, "kernel_overhead_s": 3.21e-6, "framework_reserve_bytes": 1.25 * GIB,
              "comm_overlap": 0.5, "tp_comm_overlap": 0.25, "intra_node_bw_bytes_per_s": 312.5e9,
              "inter_node_bw_bytes_per_s": 41.75e9}
    doc = user_calibration_document(values, fit="tune", method="least squares", fitted_on="4 trials",
                                    standard_errors={"kernel_overhead_s": 1e-7, "comm_overlap": None},
                                    residuals=[{"row": "trial 0", "error": 0.01}], gpu="h100-sxm",
                                    cluster="dgx-h100", extra={"trials": [{"number": 0}], "study": {"name": "s"}})
    assert doc["kernel_overhead_us"] == 3.21 and doc["intra_node_bw_gb_per_s"] == 312.5
    assert doc["standard_errors"] == {"kernel_overhead_us": 0.1, "comm_overlap": None}
    path = write_calibration_profile(tmp_path / "tune-cal.yaml", doc, kind="user")
    calib = load_calibration(path)
    assert calib.values == pytest.approx(values)
    assert (calib.gpu, calib.cluster, calib.fit, calib.fitted_on) == ("h100-sxm", "dgx-h100", "tune", "4 trials")
    # written again with fewer values: the file is the new document, no value of the old one stays
    write_calibration_profile(path, user_calibration_document({"comm_overlap": 0.4}, "tune", "m", "2 trials"),
                              kind="user")
    assert load_calibration(path).values == {"comm_overlap": 0.4}


def test_the_writer_refuses_what_the_loader_would_refuse(tmp_path):
    from planner.calibrate import user_calibration_document
    from profiles import PROFILES_DIR

    with pytest.raises(SpecError, match="values_si.*'warp'"):
        user_calibration_document({"warp": 1.0}, "f", "m", "x")
    with pytest.raises(SpecError, match="intra_node_bw_gb_per_s must be > 0"):
        user_calibration_document({"intra_node_bw_bytes_per_s": -1.0}, "f", "m", "x")
    with pytest.raises(SpecError, match="extra.*'notes'"):
        user_calibration_document({"comm_overlap": 0.5}, "f", "m", "x", extra={"notes": "n"})
    with pytest.raises(SpecError, match="unknown key"):
        write_calibration_profile(tmp_path / "c.yaml", {"comm_overlap": 0.5, "fitted_on": "x", "junk": 1}, kind="user")
    assert not (tmp_path / "c.yaml").exists()
    doc = user_calibration_document({"comm_overlap": 0.5}, "f", "m", "x")
    with pytest.raises(SpecError, match="shipped profiles"):
        write_calibration_profile(PROFILES_DIR / "calibration" / "mine.yaml", doc, kind="user")
    # a GPU's calibration profile keeps refusing the values only a user calibration holds
    (tmp_path / "calibration").mkdir()
    with pytest.raises(SpecError, match="GPU's calibration profile holds only.*'comm_overlap'"):
        write_calibration_profile(tmp_path / "calibration" / "h100-sxm.yaml", doc)
    with pytest.raises(SpecError, match="kernel_overhead_s"):
        write_calibration_profile(tmp_path / "calibration" / "h100-sxm.yaml", {"kernel_overhead_s": 5e-6})


# ---- the command line ----------------------------------------------------------------------------------------
def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("data,words", [
    (_doc(intra_node_bw_gb_per_s=-5), ("intra_node_bw_gb_per_s must be > 0 (got -5)", "tune-cal.yaml")),
    (_doc(gemm_efficiency=0.5, tuning_knob=3), ("unknown key(s) tuning_knob",)),
    (_doc(gemm_efficiency=0.5, gpu="a100-80gb"), ("gpu 'a100-80gb'", "H100-SXM5-80GB")),
    ("just text", ("must hold a mapping",)),
])
@pytest.mark.parametrize("command", [["plan"], ["evaluate", "--tp", "2"], ["explain"]])
def test_a_bad_calibration_exits_2_with_one_line(capsys, tmp_path, data, words, command):
    path = _write(tmp_path, data)
    code, out, err = run(capsys, *command, *CLI_H100, "--calibration", str(path))
    assert code == 2
    line = _one_error_line(err)
    for word in words:
        assert word in line
    assert out == ""


def test_emit_takes_the_calibration_when_it_searches(capsys, tmp_path):
    path = _write(tmp_path, _doc(gemm_efficiency=0.5, gpu="a100-80gb"))
    code, _, err = run(capsys, "emit", *CLI_H100, "--calibration", str(path))
    assert code == 2 and "gpu 'a100-80gb'" in _one_error_line(err)
    code, _, err = run(capsys, "emit", "plans.json", "--calibration", str(path))
    assert code == 2 and "--calibration" in _one_error_line(err)


def test_a_calibration_changes_the_cli_prediction_and_is_named(capsys, tmp_path):
    path = _write(tmp_path, _doc(sustained_compute_fraction=0.35, gpu="h100-sxm", cluster="dgx-h100"))
    args = ["evaluate", *CLI_H100, "--tp", "2", "--sp", "--zero", "1", "--format", "json"]
    code, base, err = run(capsys, *args)
    assert code == 0, err
    code, slow, err = run(capsys, *args, "--calibration", str(path))
    assert code == 0, err
    assert yaml.safe_load(slow)["step_time_s"] > 1.5 * yaml.safe_load(base)["step_time_s"]
    code, out, err = run(capsys, "explain", *CLI_H100, "--tp", "2", "--sp", "--zero", "1", "--calibration", str(path))
    assert code == 0, err
    assert "calibration: tune-cal.yaml (sustained_compute_fraction 0.35" in out
    code, out, err = run(capsys, "plan", *CLI_H100, "--top", "1", "--calibration", str(path))
    assert code == 0, err
    assert "calibration: tune-cal.yaml" in out
    code, out, err = run(capsys, "plan", *CLI_H100, "--top", "1", "--format", "json", "--calibration", str(path))
    assert yaml.safe_load(out)["cluster"]["gpu"]["calibration"].startswith("tune-cal.yaml: fitted on synthetic runs")


def test_a_plan_file_carries_its_calibration_so_the_option_is_refused_beside_it(capsys, tmp_path):
    path = _write(tmp_path, _doc(sustained_compute_fraction=0.35))
    code, out, err = run(capsys, "plan", *CLI_H100, "--top", "1", "--format", "json", "--calibration", str(path))
    assert code == 0, err
    plans = tmp_path / "plans.json"
    plans.write_text(out)
    code, again, err = run(capsys, "evaluate", "--plan", str(plans), "--format", "json")
    assert code == 0, err
    assert yaml.safe_load(again)["step_time_s"] == pytest.approx(yaml.safe_load(out)["plans"][0]["estimate"]
                                                                 ["step_time_s"])
    code, _, err = run(capsys, "evaluate", "--plan", str(plans), "--calibration", str(path))
    assert code == 2 and "--calibration" in _one_error_line(err)
