"""planner.calibrate: typed measured runs, the bounded robust fit, leave-one-set-out, profiles written.

The runs here are synthetic: the cost model's own step times with a known parameter value, so a
fit that recovers the value shows the parameter reaches the predictions and the optimizer finds it.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from planner.calibrate import (
    FitParameter,
    FitSettings,
    MeasuredRun,
    apply_parameters,
    calibrate,
    calibration_document,
    leave_one_set_out,
    parameter_document,
    predict_run,
    write_calibration_profile,
)
from planner.errors import SpecError
from profiles import load_cluster, load_gpu

TRUE_FRACTION = 0.8
STRATEGY = {"tp": 2, "pp": 1, "cp": 1, "dp": 4, "sequence_parallel": True, "zero_stage": 1, "recompute": "full",
            "recompute_num_layers": None, "offload_optimizer": False, "offload_activation_layers": None}
#: (set, global batch, micro-batch, sequence): two sets of two runs
JOBS = (("a", 16, 1, 4096), ("a", 32, 2, 4096), ("b", 8, 1, 8192), ("b", 64, 1, 2048))


def _run(set_name: str, batch: int, micro: int, seq: int, step_s: float = 1.0) -> MeasuredRun:
    return MeasuredRun(label=f"llama3-8b gbs{batch} mbs{micro} s{seq}", source="synthetic", set_name=set_name,
                       model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=batch, seq_len=seq,
                       strategy=STRATEGY | {"micro_batch_size": micro}, measured_step_s=step_s)


@pytest.fixture(scope="module")
def runs() -> list[MeasuredRun]:
    """The jobs 'measured' as the cost model predicts them with sustained_compute_fraction TRUE_FRACTION."""
    cluster = apply_parameters(load_cluster("dgx-h100"), {"sustained_compute_fraction": TRUE_FRACTION})
    out = []
    for job in JOBS:
        step = predict_run(_run(*job), cluster).step_s
        assert step is not None
        out.append(_run(*job, step_s=step))
    return out


def _settings(lower=0.5, upper=1.0, **kw) -> FitSettings:
    return FitSettings(parameters=(FitParameter(name="sustained_compute_fraction", lower=lower, upper=upper,
                                                start=lower),), **kw)


def test_the_fit_recovers_the_parameter_the_runs_were_made_with(runs):
    result = calibrate(runs, _settings())
    assert result.fitted == ("sustained_compute_fraction",)
    assert result.values["sustained_compute_fraction"] == pytest.approx(TRUE_FRACTION, abs=2e-3)
    assert max(abs(r.error) for r in result.residuals) < 5e-3
    assert [r.row for r in result.residuals] == [r.label for r in runs]


def test_the_robust_loss_resists_an_outlier(runs):
    """One run measured 60 % slower than the model can explain: soft_l1 on log errors stays near the
    value the other runs give, plain least squares on relative errors is pulled further away."""
    bad = runs[:-1] + [runs[-1].model_copy(update={"measured_step_s": runs[-1].step_s * 1.6})]
    robust = calibrate(bad, _settings()).values["sustained_compute_fraction"]
    plain = calibrate(bad, _settings(loss="linear", error="relative")).values["sustained_compute_fraction"]
    assert abs(robust - TRUE_FRACTION) < abs(plain - TRUE_FRACTION)


def test_bounds_are_honoured(runs):
    result = calibrate(runs, _settings(lower=0.5, upper=0.7))
    assert result.values["sustained_compute_fraction"] == pytest.approx(0.7)
    assert all(r.error > 0 for r in result.residuals)  # a slower GPU than the runs': every step too long


def test_leave_one_set_out_reports_each_set(runs):
    held = leave_one_set_out(runs, _settings())
    assert [h.set_name for h in held] == ["a", "b"]
    for h in held:
        assert h.summary.n == 2
        assert [r.set_name for r in h.residuals] == [h.set_name] * 2
        assert h.values["sustained_compute_fraction"] == pytest.approx(TRUE_FRACTION, abs=2e-3)
        assert h.summary.max_abs < 5e-3


def test_the_written_profile_round_trips_through_the_loader(runs, tmp_path, monkeypatch):
    (tmp_path / "calibration").mkdir()
    path = tmp_path / "calibration" / "h100-sxm.yaml"
    result = calibrate(runs, _settings())
    write_calibration_profile(path, parameter_document(result, "planner.calibrate test"))
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    gpu = load_gpu("h100-sxm")
    assert gpu.sustained_compute_fraction == result.values["sustained_compute_fraction"]
    assert "sustained_compute_fraction fitted on 4 end-to-end rows" in gpu.calibration
    doc = yaml.safe_load(path.read_text())
    assert [r["row"] for r in doc["sustained_compute_fraction_fit"]["residuals"]] == [r.label for r in runs]
    assert doc["sustained_compute_fraction_fit"]["fitted_on"].startswith("synthetic: llama3-8b gbs16")

    # the main fit's shape, merged over the parameter block (kept) and written again atomically
    main = result.model_copy(update={"values": result.values | {"gemm_efficiency": 0.61}})
    write_calibration_profile(path, calibration_document(main, fit="synthetic", method="test"),
                              keep=("sustained_compute_fraction_fit",))
    doc = yaml.safe_load(path.read_text())
    assert list(doc)[:4] == ["sustained_compute_fraction", "gemm_efficiency", "fit", "fitted_on"]
    assert "sustained_compute_fraction_fit" in doc
    assert load_gpu("h100-sxm").gemm_efficiency == 0.61
    assert [p.name for p in tmp_path.joinpath("calibration").iterdir()] == ["h100-sxm.yaml"]  # no temporary left


@pytest.mark.parametrize("make,field", [
    (lambda: _run("a", 16, 1, 4096, step_s=0.0), "measured_step_s"),
    (lambda: _run("a", 16, 1, 4096).model_validate(_run("a", 16, 1, 4096).model_dump() | {"num_gpus": 0}),
     "num_gpus"),
    (lambda: MeasuredRun(label="x", source="s", model="llama3-8b", cluster="dgx-h100", num_gpus=8,
                         global_batch_size=8, seq_len=2048, measured_step_s=1.0, tokens_per_s_per_gpu=1e3),
     "measured_step_s"),
    (lambda: FitParameter(name="sustained_compute_fraction", lower=1.0, upper=0.5), "lower"),
    (lambda: FitParameter(name="host_time_scale", lower=1.0, upper=2.0, start=3.0), "start"),
    (lambda: FitSettings(parameters=(FitParameter(name="warp_speed", lower=0, upper=1),)), "warp_speed"),
    (lambda: _settings(fixed={"sustained_compute_fraction": 0.9}), "fixed"),
    (lambda: calibrate([], _settings()), "runs"),
    (lambda: calibrate([_run("a", 16, 1, 4096)] * 2, _settings()), "label"),
    (lambda: leave_one_set_out([_run("a", 16, 1, 4096)], _settings()), "set_name"),
])
def test_bad_input_is_refused_naming_the_field(make, field):
    with pytest.raises(SpecError, match=field):
        make()


def test_only_calibrated_gpu_fields_are_written(runs, tmp_path):
    result = calibrate(runs[:1], FitSettings(parameters=(FitParameter(name="ep_comm_overlap", lower=0, upper=1),)))
    assert result.standard_errors == {"ep_comm_overlap": None}  # a dense model's runs do not identify it
    with pytest.raises(SpecError, match="parameters.*ep_comm_overlap"):
        parameter_document(result, "test")
    with pytest.raises(SpecError, match="path"):
        write_calibration_profile(tmp_path / "missing" / "h100-sxm.yaml", {"host_time_scale": 1.0})


def test_a_shipped_calibration_file_is_written_only_when_asked_for(tmp_path):
    """meshplan's own calibration files are refused unless shipped=True (the benchmarks that refit
    them pass it); nothing is written."""
    from profiles import PROFILES_DIR

    target = PROFILES_DIR / "calibration" / "h100-sxm.yaml"
    before = target.read_bytes()
    with pytest.raises(SpecError, match="shipped profiles"):
        write_calibration_profile(target, {"host_time_scale": 1.0})
    assert target.read_bytes() == before


def test_tier_bandwidths_and_cluster_fields_are_parameters():
    cluster = load_cluster("dgx-h100")
    out = apply_parameters(cluster, {"intra_node_bw_bytes_per_s": 3e11, "inter_node_bw_bytes_per_s": 2e10,
                                     "comm_overlap": 0.4, "framework_reserve_bytes": 2.0 * 2**30})
    assert (out.intra_node.bw_bytes_per_s, out.inter_node.bw_bytes_per_s) == (3e11, 2e10)
    assert out.intra_node.latency_s == cluster.intra_node.latency_s  # the rest of the tier kept
    assert out.comm_overlap == 0.4 and out.gpu.framework_reserve_bytes == 2.0 * 2**30
    assert out.gpu.has_tables
    for name in ("intra_node", "inter_node", "tiers", "gpu"):
        with pytest.raises(SpecError, match=f"parameter '{name}'"):
            apply_parameters(cluster, {name: 1.0})


def test_a_fit_recovers_comm_overlap_with_a_fixed_reserve():
    """Two nodes, so the gradient reduction crosses the network and the overlap shows in the step time;
    the reserve, held fixed, is applied in every prediction (the runs were made with it)."""
    reserve = {"framework_reserve_bytes": 4.0 * 2**30}
    cluster = apply_parameters(load_cluster("dgx-h100"), {"comm_overlap": 0.4} | reserve)
    runs = []
    for batch in (16, 32):
        run = MeasuredRun(label=f"n16 gbs{batch}", source="synthetic", model="llama3-8b", cluster="dgx-h100",
                          num_gpus=16, global_batch_size=batch, seq_len=4096, measured_step_s=1.0,
                          strategy=STRATEGY | {"dp": 8, "micro_batch_size": 1})
        runs.append(run.model_copy(update={"measured_step_s": predict_run(run, cluster).step_s}))
    result = calibrate(runs, FitSettings(parameters=(FitParameter(name="comm_overlap", lower=0.0, upper=1.0),),
                                         fixed=reserve))
    assert result.values["comm_overlap"] == pytest.approx(0.4, abs=5e-3)
    assert result.values["framework_reserve_bytes"] == reserve["framework_reserve_bytes"]


def test_a_run_weight_changes_the_fit(runs):
    """One run measured 30 % slow: at full weight it pulls the fitted fraction down, at weight 0.01 the
    fit stays near the value the other runs give. Reported errors stay unweighted."""
    slow = runs[-1].model_copy(update={"measured_step_s": runs[-1].step_s * 1.3})
    settings = _settings(loss="linear")
    full = calibrate(runs[:-1] + [slow], settings)
    light = calibrate(runs[:-1] + [slow.model_copy(update={"weight": 0.01})], settings)
    value = "sustained_compute_fraction"
    assert abs(light.values[value] - TRUE_FRACTION) < abs(full.values[value] - TRUE_FRACTION) / 5
    assert light.residuals[-1].error == pytest.approx(
        light.residuals[-1].predicted_s / light.residuals[-1].measured_s - 1)
    assert light.residuals[-1].error < -0.15  # the slow run's own error, not shrunk by its weight
    with pytest.raises(SpecError, match="weight"):
        runs[0].model_validate(runs[0].model_dump() | {"weight": 0.0})
    with pytest.raises(SpecError, match="weight"):
        runs[0].model_validate(runs[0].model_dump() | {"weight": 1.5})


def test_values_in_seconds_and_bytes_per_second_round_in_their_file_unit():
    """fit_parameters rounds kernel_overhead_s in microseconds and a bandwidth in GB/s: 4 decimals of
    seconds would round a few microseconds to nothing."""
    from planner.calibrate import fit_parameters

    target = {"kernel_overhead_s": 3.21234e-6, "intra_node_bw_bytes_per_s": 312.345678e9}

    def residuals(v):
        return np.array([v["kernel_overhead_s"] / target["kernel_overhead_s"] - 1,
                         v["intra_node_bw_bytes_per_s"] / target["intra_node_bw_bytes_per_s"] - 1])

    fit = fit_parameters(residuals, [FitParameter(name="kernel_overhead_s", lower=0.0, upper=2e-5),
                                     FitParameter(name="intra_node_bw_bytes_per_s", lower=1e11, upper=9e11)],
                         loss="linear")
    assert fit.values["kernel_overhead_s"] == pytest.approx(3.2123e-6, rel=1e-9)
    assert fit.values["intra_node_bw_bytes_per_s"] == pytest.approx(312.3457e9, rel=1e-9)
