"""The error band on every estimate (planner.error_band) and where each GPU's numbers come from
(`meshplan clusters`).

The band rests on step-time residuals of published end-to-end runs that no fit used, written into
profiles/calibration/<gpu>.yaml by `python -m benchmarks.residuals --write`; a GPU without such runs
gets the pooled band widened. Checked here: the band contains the point estimate for plan() and
evaluate() on every shipped cluster; a GPU without an end-to-end check has a wider band than the
A100; the plan table shows the band and marks the plans whose band overlaps the best's; the shipped
residuals are what the script recomputes; `clusters` names the provenance of every preset.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as hs

from planner import ModelSpec, TrainSpec, plan
from planner.cli import main
from planner.error_band import (MIN_KIND_ROWS, WIDEN_FACTOR, WIDEN_FLOOR, band_fields, errors_of, interval,
                                 overlaps_best, widened)
from planner.rules import Context, check
from planner.search import evaluate_one
from planner.space import enumerate_space
from planner.specs import Estimate, Strategy
from planner.specs.hardware import StepTimeResiduals
from profiles import PROFILES_DIR, gpu_from_yaml, list_presets, load_cluster, load_gpu
from profiles.tables import TOPICS

CLUSTERS = list_presets("clusters")
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _contains(e: Estimate) -> None:
    assert e.band_basis
    assert e.step_time_s_low <= e.step_time_s <= e.step_time_s_high
    assert e.tokens_per_s_per_gpu_low <= e.tokens_per_s_per_gpu <= e.tokens_per_s_per_gpu_high
    assert e.mfu_low <= e.mfu <= e.mfu_high
    # throughput and MFU take their low edge from the slow step time
    assert e.tokens_per_s_per_gpu_low == pytest.approx(e.tokens_per_s_per_gpu * e.step_time_s / e.step_time_s_high)
    assert e.mfu_high == pytest.approx(e.mfu * e.step_time_s / e.step_time_s_low)


@hs.composite
def questions(draw):
    heads = draw(hs.sampled_from([8, 16, 32]))
    hidden = heads * draw(hs.sampled_from([64, 128]))
    model = ModelSpec(name="random", num_layers=draw(hs.integers(2, 32)), hidden_size=hidden,
                      num_attention_heads=heads, num_kv_heads=draw(hs.sampled_from([d for d in (1, 4, 8) if heads % d == 0])),
                      ffn_hidden_size=4 * hidden, vocab_size=draw(hs.integers(1000, 64000)))
    num_gpus = 2 ** draw(hs.integers(0, 4))
    cluster = load_cluster(draw(hs.sampled_from(CLUSTERS)))
    train = TrainSpec(global_batch_size=num_gpus * draw(hs.sampled_from([1, 2, 4])),
                      seq_len=draw(hs.sampled_from([512, 2048])), precision="bf16" if "bf16" in cluster.gpu.peak_flop_per_s
                      else "fp32")
    return model, cluster, train, num_gpus, draw(hs.integers(0, 10**6))


ran = {"n": 0}


@SETTINGS
@given(questions())
def prop_band_contains_the_point_estimate(q):
    model, cluster, train, n, pick = q
    space = enumerate_space(model, train, n, {})
    valid, _ = check(Context(model, train, n, cluster), space)
    candidates = space.take(valid)
    assume(len(candidates) > 0)
    strategy = Strategy(**candidates.row(int(pick % len(candidates))))
    _contains(evaluate_one(model, cluster, train, strategy))
    ran["n"] += 1


def test_band_contains_the_point_estimate_for_random_valid_strategies():
    ran["n"] = 0
    prop_band_contains_the_point_estimate()
    assert ran["n"] >= 30, f"only {ran['n']} examples passed the filters"


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_every_plan_on_every_shipped_cluster_has_a_band_around_its_estimate(cluster):
    gpus = 2 if cluster == "local-cpu" else 16
    model = "llama3-8b" if cluster != "local-cpu" else ModelSpec(
        name="tiny", num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, vocab_size=1000)
    result = plan(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=4 * gpus,
                  seq_len=2048 if cluster != "local-cpu" else 256, top_k=5,
                  precision="bf16" if cluster != "local-cpu" else "fp32")
    assert result.plans
    for p in result.plans:
        _contains(p.estimate)
    overlap = overlaps_best([p.estimate.step_time_s_low for p in result.plans],
                            [p.estimate.step_time_s_high for p in result.plans])
    assert result.worth_a_real_run == [p.rank for p, o in zip(result.plans, overlap) if o]
    assert result.worth_a_real_run[0] == 1


def _relative_width(cluster: str) -> float:
    from planner import evaluate

    e = evaluate(model="llama3-8b", cluster=cluster, num_gpus=8, global_batch_size=32, seq_len=4096,
                 strategy={"tp": 2, "sequence_parallel": True})
    _contains(e)
    return e.step_time_s_high / e.step_time_s_low


@pytest.mark.parametrize("cluster", ["dgx-h200", "dgx-a100-40gb"])  # GPUs with no published run the planner predicts
def test_a_gpu_without_end_to_end_runs_has_a_wider_band_than_the_a100(cluster):
    gpu = load_cluster(cluster).gpu
    assert gpu.step_time_residuals is not None and not gpu.step_time_residuals.end_to_end
    assert "no end-to-end check on this GPU" in gpu.step_time_residuals.basis
    assert load_gpu("a100-80gb").step_time_residuals.end_to_end
    # spread of the band, high / low - 1: the widened band against the A100 measured one
    assert _relative_width(cluster) - 1 > 1.5 * (_relative_width("dgx-a100-80gb") - 1)


def test_a_gpu_without_residuals_gets_the_documented_estimate_band():
    doc = yaml.safe_load((PROFILES_DIR / "gpus" / "b200.yaml").read_text())
    bare = gpu_from_yaml(doc)
    assert bare.step_time_residuals is None
    fields = band_fields(1.0, 1000.0, 0.4, bare)
    assert "no residuals" in fields["band_basis"]
    # +-40 % on the error: the step time between 1/1.4 and 1/0.6 of the point estimate
    assert fields["step_time_s_low"] == pytest.approx(1 / 1.4) and fields["step_time_s_high"] == pytest.approx(1 / 0.6)


def test_the_fast_edge_never_passes_the_dense_peak():
    fast = StepTimeResiduals(end_to_end=True, n=10, error_low=-0.2, error_high=0.5, basis="x")
    gpu = load_gpu("b200").model_copy(update={"step_time_residuals": fast})  # a fast edge 1 / 1.5 of the point
    fields = band_fields(1.0, 1000.0, 0.95, gpu)
    assert fields["mfu_high"] <= 1.0 + 1e-12 and fields["step_time_s_low"] == pytest.approx(0.95)


def test_widening_never_narrows_and_respects_the_floor():
    for low, high in ((-0.3, 0.02), (-0.01, 0.25), (0.0, 0.0)):
        ref = StepTimeResiduals(end_to_end=True, n=10, error_low=low, error_high=high, basis="x")
        w = widened(ref, "ref")
        # widened on the ratio scale: (1 + e) ** factor - 1, so the fast edge never reaches -100 %
        assert w.error_low <= min((1 + low) ** WIDEN_FACTOR - 1, -WIDEN_FLOOR) + 1e-12 and w.error_low <= low
        assert w.error_low > -1
        assert w.error_high >= max((1 + high) ** WIDEN_FACTOR - 1, WIDEN_FLOOR) - 1e-12 and w.error_high >= high


def test_order_statistic_interval_reaches_its_coverage():
    """For i.i.d. errors the interval from n rows holds a new row with probability (n+1-2j)/(n+1)."""
    rng = np.random.default_rng(0)
    hits, trials, coverage = 0, 4000, None
    for _ in range(trials):
        xs = rng.normal(0.0, 0.05, 30)
        iv = interval(list(xs[:29]))
        coverage = iv.coverage
        hits += iv.error_low <= xs[29] <= iv.error_high
    assert coverage == pytest.approx(0.8)
    assert abs(hits / trials - coverage) < 0.03  # widened to contain 0 it can only cover more


def test_an_estimate_whose_band_misses_its_point_is_refused():
    e = evaluate_one_tiny()
    data = e.model_dump()
    data["step_time_s_low"] = e.step_time_s * 1.1
    with pytest.raises(ValueError, match="must contain step_time_s"):
        Estimate(**data)


def evaluate_one_tiny() -> Estimate:
    from planner import evaluate

    return evaluate(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=8, seq_len=2048,
                    strategy={"tp": 8, "sequence_parallel": True})


# ---- the shipped residuals are what the script computes ----------------------------------------
def _stored(gpu: str) -> dict:
    return yaml.safe_load((PROFILES_DIR / "calibration" / f"{gpu}.yaml").read_text())["step_time_residuals"]


def test_stored_residual_summary_matches_its_rows():
    """median, mean, max and the interval of a100-80gb's stored rows, recomputed with numpy."""
    doc = _stored("a100-80gb")
    errors = np.array([r["error"] for r in doc["rows"]])
    n = len(errors)
    assert doc["end_to_end"] and doc["n"] == n >= 29
    assert doc["median_abs"] == pytest.approx(np.median(np.abs(errors)), abs=1e-4)
    assert doc["mean_signed"] == pytest.approx(errors.mean(), abs=1e-4)
    assert doc["max_abs"] == pytest.approx(np.abs(errors).max(), abs=1e-4)
    j = int(0.1 * (n + 1))  # x_(j) .. x_(n+1-j) of n holds one more with probability (n + 1 - 2j) / (n + 1)
    s = np.sort(errors)
    assert doc["error_low"] == pytest.approx(min(s[j - 1], 0), abs=1e-4)
    assert doc["error_high"] == pytest.approx(max(s[len(s) - j], 0), abs=1e-4)
    assert doc["coverage"] == pytest.approx((n + 1 - 2 * j) / (n + 1), abs=1e-3)
    assert sum(int(t.rsplit("(", 1)[1].rstrip(")")) for t in doc["tables"]) == n


@pytest.fixture(scope="module")
def predicted():
    """Every end-to-end row predicted once (`benchmarks.residuals.predicted_rows`, about 15 s here), for the
    tests of this module that need them."""
    from benchmarks.residuals import calibration_files, predicted_rows

    return predicted_rows(calibration_files())


def test_shipped_residuals_are_what_benchmarks_residuals_recomputes(predicted):
    from benchmarks.residuals import calibration_files, residuals_by_gpu

    files = calibration_files()
    rows, _ = predicted
    fresh = residuals_by_gpu(rows, list(files))
    assert set(fresh) == set(files)
    for gpu in files:
        stored, now = _stored(gpu), fresh[gpu]
        assert stored["end_to_end"] == now.end_to_end and stored["n"] == now.n, gpu
        for key in ("error_low", "error_high", "median_abs", "mean_signed", "max_abs"):
            value = getattr(now, key)
            assert (value is None and key not in stored) or stored[key] == pytest.approx(value, abs=2e-4), (gpu, key)
        if now.end_to_end:
            by_row = {r["row"]: r["error"] for r in stored["rows"]}
            for r in rows:
                if r.gpu == gpu and r.error is not None:
                    assert by_row[f"{r.table}: {r.label}"] == pytest.approx(r.error, abs=2e-4)
    # the A100 rows are the four out-of-sample sets the accuracy report targets, never the fitted Table 4
    assert {t.split(" (")[0] for t in fresh["a100-80gb"].tables} == {
        "Korthikanti Table 5", "SC'21 Table 1", "SC'21 Table 2 PTD", "torchtitan FSDP2"}


def test_dense_and_moe_plans_take_their_own_kinds_band():
    """GB200's profile has enough dense and MoE rows for a sub-band each: each is the interval of
    that kind's stored rows alone, and plans of that kind get it; without a kind, the band of all."""
    gpu = load_gpu("gb200")
    doc = _stored("gb200")
    for kind, moe in (("dense", False), ("moe", True)):
        errors = [r["error"] for r in doc["rows"] if r["kind"] == kind]
        assert len(errors) >= MIN_KIND_ROWS
        expected = interval(errors)
        low, high, basis = errors_of(gpu, moe)
        assert (low, high) == pytest.approx((expected.error_low, expected.error_high), abs=2e-4)
        assert ("MoE runs" if moe else "dense runs") in basis
    r = gpu.step_time_residuals
    assert errors_of(gpu)[:2] == (r.error_low, r.error_high)
    # the MoE rows err further to the fast side than the dense ones on GB200
    assert errors_of(gpu, True)[0] < errors_of(gpu, False)[0]


def test_a_kind_with_too_few_rows_takes_the_band_of_all_rows():
    gpu = load_gpu("a100-80gb")  # no MoE row of its own: fewer than MIN_KIND_ROWS
    doc = _stored("a100-80gb")
    assert sum(r["kind"] == "moe" for r in doc["rows"]) < MIN_KIND_ROWS
    assert gpu.step_time_residuals.moe is None
    assert errors_of(gpu, True)[:2] == errors_of(gpu)[:2]


# ---- CLI -----------------------------------------------------------------------------------------
def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


GAP = ["--model", "llama3-8b", "--cluster", "dgx-a100-80gb", "--gpus", "16", "--global-batch-size", "64",
       "--seq-len", "4096", "--constraints", json.dumps({"tp": [1, 8], "pp": 1, "cp": 1, "zero_stage": 1,
       "micro_batch_size": 1, "recompute": "none", "sequence_parallel": False})]


def test_plan_table_shows_the_band_and_marks_overlap_with_the_best(capsys):
    code, out, err = run(capsys, "plan", *GAP, "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["worth_a_real_run"] == [1] and len(data["plans"]) == 2  # tp8 is far slower than tp1 here
    code, out, err = run(capsys, "plan", "--model", "llama3-8b", "--cluster", "dgx-a100-80gb", "--gpus", "16",
                         "--global-batch-size", "64", "--seq-len", "8192", "--top", "3", "--format", "json")
    tied = json.loads(out)
    assert tied["worth_a_real_run"] == [1, 2, 3]
    code, out, err = run(capsys, "plan", "--model", "llama3-8b", "--cluster", "dgx-a100-80gb", "--gpus", "16",
                         "--global-batch-size", "64", "--seq-len", "8192", "--top", "3", "--wide")
    assert code == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if "step (s)" in line)
    assert "step band (s)" in header and "MFU band %" in header and "~#1" in header
    rows = [line for line in lines if line.startswith("│")]
    for row, p in zip(rows, tied["plans"]):
        e = p["estimate"]
        assert f"{e['step_time_s_low']:.3f}-{e['step_time_s_high']:.3f}" in row
        assert f"{100 * e['mfu_low']:.1f}-{100 * e['mfu_high']:.1f}" in row
    assert " best " in rows[0] and " ~ " in rows[1] and " ~ " in rows[2]
    assert any(line.startswith("~ : step-time band overlaps plan 1's") for line in lines)
    assert any(line.startswith("band: ") and "end-to-end residuals of" in line for line in lines)
    code, out, _ = run(capsys, "plan", *GAP, "--wide")
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert " best " in rows[0] and " ~ " not in rows[1]


def test_evaluate_prints_the_band_and_its_basis(capsys):
    code, out, err = run(capsys, "evaluate", "--model", "llama3-8b", "--cluster", "dgx-h200", "--gpus", "8",
                         "--global-batch-size", "64", "--seq-len", "8192", "--tp", "2", "--sp")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("band: step "))
    assert "tokens/s/GPU" in line and "MFU" in line and "no end-to-end check on this GPU" in line
    code, out, _ = run(capsys, "evaluate", "--model", "llama3-8b", "--cluster", "dgx-h200", "--gpus", "8",
                       "--global-batch-size", "64", "--seq-len", "8192", "--tp", "2", "--sp", "--format", "json")
    e = json.loads(out)
    assert line.startswith(f"band: step {e['step_time_s_low']:.3f}-{e['step_time_s_high']:.3f} s")


def test_clusters_names_where_every_presets_numbers_come_from(capsys):
    code, out, err = run(capsys, "clusters", "--format", "json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["name"] for r in rows] == CLUSTERS
    for r in rows:
        where = r["provenance"]
        gpu = load_cluster(r["name"]).gpu
        for topic in TOPICS:
            assert where[topic] == "none" or where[topic].startswith(("public (", "measured ("))
        assert where["constants"].startswith(("fitted on ", "carried over from ", "measured by `meshplan profile`",
                                              "defaults (assumed)"))
        if "carried over" in gpu.calibration:  # nothing carried over goes unnamed
            assert where["constants"].startswith("carried over from a100-80gb (assumed)")
        band = gpu.step_time_residuals
        kind = "estimate" if band is None else ("end-to-end" if band.end_to_end else "widened")
        assert kind in where["error_band"] and where["error_band_basis"]
        # the EP-overlap share says whether it was fitted there, carried, or is the generic overlap efficiency
        assert r["ep_overlap"].endswith(("(fitted)", "(carried)", "(measured)", "(generic overlap)")), r
    by_name = {r["name"]: r["ep_overlap"] for r in rows}
    assert by_name["dgx-h100"] == "0.59 (fitted)" and by_name["gb200-nvl72"] == "0.59 (carried)"
    code, out, _ = run(capsys, "clusters")
    assert "where each GPU's numbers come from" in out
    for r in rows:
        assert r["gpu"] in out
    flat = " ".join(out.split())  # the table wraps its cells
    assert "end-to-end" in flat and "widened" in flat and "carried over from" in flat


def test_residuals_script_prints_every_gpu(capsys, monkeypatch, predicted):
    import benchmarks.residuals as residuals

    # the script as it runs, on the rows the fixture predicted with the same files
    monkeypatch.setattr(residuals, "predicted_rows", lambda files: predicted)
    assert residuals.main([]) == 0
    out = capsys.readouterr().out
    for gpu in ("a100-80gb", "a100-40gb", "h100-sxm", "h200", "b200", "gb200", "gb300"):
        assert f"\n{gpu}: " in out
    assert "left out SC'21 Table 2 ZeRO-3" in out and "wrote" not in out
    assert math.isfinite(load_gpu("h100-sxm").step_time_residuals.error_low)


def test_a_malformed_residuals_mapping_is_one_clear_error():
    from planner.errors import SpecError

    doc = yaml.safe_load((PROFILES_DIR / "gpus" / "b200.yaml").read_text())
    doc["step_time_residuals"] = {"end_to_end": True, "n": 3, "error_low": 0.1, "error_high": 0.2, "basis": "x"}
    with pytest.raises(SpecError, match=r"step_time_residuals: error_low: .*less than or equal to 0 \(got 0.1\)"):
        gpu_from_yaml(doc)
    doc["step_time_residuals"] = [0.1]
    with pytest.raises(SpecError, match="step_time_residuals must be a mapping"):
        gpu_from_yaml(doc)
