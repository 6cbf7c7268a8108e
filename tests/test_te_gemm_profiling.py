"""The FP8 GEMM and cast terms against Transformer Engine's published GEMM profiling (B300 and H200 NVL,
benchmarks/data/te_gemm_profiling.json): kernel-level figures."""

import pytest

from benchmarks.te_gemm_profiling import layer_shapes, model_cast_ms, model_gemm_ms, rows
from planner.errors import SpecError
from profiles.bundle import load_tables
from profiles.gemm import _recipe_rates

SHAPES = layer_shapes(4096, 16384, 15872)


def test_mxfp8_gemms_run_at_the_measured_fraction_of_per_tensor_fp8():
    """TE's pre-quantised B300 profile: 6.812 ms per-tensor FP8 against 7.161 ms MXFP8 for the same twelve
    GEMMs; the Blackwell tables carry the ratio (b200.yaml recipe_rates), the Hopper ones have no MXFP8."""
    for cluster in ("dgx-b200", "gb200-nvl72", "gb300-nvl72"):
        per_tensor = model_gemm_ms(cluster, SHAPES, "fp8", "tensorwise")
        mx = model_gemm_ms(cluster, SHAPES, "fp8", "mxfp8")
        assert per_tensor / mx == pytest.approx(6.812 / 7.161, rel=0.01), cluster  # kernel overheads aside
        assert model_gemm_ms(cluster, SHAPES, "fp8", "delayed") == pytest.approx(per_tensor)
    assert load_tables("b200").gemm.recipe_rate("fp8", "blockwise") == load_tables("b200").gemm.recipe_rate("fp8", "mxfp8")
    assert load_tables("h100-sxm").gemm.recipe_rate("fp8", "mxfp8") == 1.0
    assert load_tables("b200").gemm.recipe_rate("bf16", "mxfp8") == 1.0  # unquantised GEMMs keep their rate


def test_cast_costs_order_the_recipes_as_measured():
    """Autocast minus pre-quantised time (the quantisation work of casting every call's input and weight):
    B300 delayed 0.99 < MXFP8 1.82 < current scaling 2.33 ms; H200 NVL delayed 2.19 < current 3.50 ms."""
    b300 = {r: model_cast_ms("gb300-nvl72", SHAPES, r) for r in ("delayed", "mxfp8", "tensorwise")}
    assert b300["delayed"] < b300["mxfp8"] < b300["tensorwise"]
    h200 = {r: model_cast_ms("dgx-h200", SHAPES, r) for r in ("delayed", "tensorwise")}
    assert h200["delayed"] < h200["tensorwise"]


def test_every_modelled_term_is_within_a_factor_of_one_and_a_half_of_the_measurement():
    for r in rows():
        assert 1 / 1.5 < r["model"] / r["measured"] < 1.5, r


@pytest.mark.parametrize("data,rule", [
    ({"recipe_rates": {"mxfp8": 0.95}}, "recipe_rates_source"),
    ({"recipe_rates": {"int8": 0.9}, "recipe_rates_source": "x"}, "not an FP8 recipe"),
    ({"recipe_rates": {"mxfp8": 0}, "recipe_rates_source": "x"}, "(0, 1]"),
    ({"recipe_rates": {"mxfp8": 1.2}, "recipe_rates_source": "x"}, "(0, 1]"),
    ({"recipe_rates": {"mxfp8": "fast"}, "recipe_rates_source": "x"}, "must be a number"),
])
def test_a_bad_recipe_rate_is_refused_naming_the_field(data, rule):
    with pytest.raises(SpecError, match="recipe_rates") as err:
        _recipe_rates(data, "GEMM table t")
    assert rule in str(err.value)


def test_the_h100_fp8_level_is_the_fit_of_the_measured_ratio():
    """profiles/kernels/gemm/h100-sxm.yaml's fp8_from_bf16.level reproduces cuBLAS's BF16 / FP8 time ratio of TE's
    twelve GEMMs on the H200 NVL (31.968 / 16.785 ms); the unscaled tilelang curve gives a smaller one."""
    from benchmarks.te_gemm_profiling import fit_h100_fp8_level

    level, target, shipped = fit_h100_fp8_level()
    assert target == pytest.approx(31.968 / 16.785)
    assert shipped == pytest.approx(level, abs=0.01)
    assert level > 1.0
    ratio = model_gemm_ms("dgx-h200", SHAPES, "bf16") / model_gemm_ms("dgx-h200", SHAPES, "fp8", "tensorwise")
    assert ratio == pytest.approx(target, rel=0.01)


@pytest.mark.parametrize("level,source,rule", [(3.0, "x", "[0.5, 2]"), ("high", "x", "[0.5, 2]"), (1.1, "", "level_source")])
def test_a_bad_fp8_level_is_refused_naming_the_field(level, source, rule):
    import copy

    from profiles.gemm import build_gemm_table
    from profiles.tables import kernel_table

    raw = copy.deepcopy(kernel_table("gemm", "h100-sxm"))
    raw["fp8_from_bf16"]["level"] = level
    raw["fp8_from_bf16"]["level_source"] = source
    with pytest.raises(SpecError, match="fp8_from_bf16.level") as err:
        build_gemm_table(raw, "GEMM table t")
    assert rule in str(err.value)


def test_the_source_is_exact():
    import json

    from benchmarks.te_gemm_profiling import DATA

    src = json.loads(DATA.read_text())["source"]
    assert src["repo"] == "NVIDIA/TransformerEngine" and len(src["commit"]) == 40
    assert src["path"].startswith("docs/examples/gemm_profiling/gemm_profiling.rst")
