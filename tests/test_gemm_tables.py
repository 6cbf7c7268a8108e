"""GEMM efficiency by shape from measured tables (profiles.gemm, cost_models.compute)."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.blocks import Gemm
from cost_models.compute import gemm_backward_time, gemm_time
from planner.errors import SpecError
from profiles import PROFILES_DIR, load_gpu
from profiles.bundle import load_tables
from profiles.gemm import monotone

TABLE_GPUS = ["h100-sxm", "h200", "b200", "gb200", "gb300"]


def table_rows(name):
    doc = yaml.safe_load((PROFILES_DIR / "kernels" / "gemm" / f"{name}.yaml").read_text())
    return doc


@pytest.mark.parametrize("name", ["h100-sxm", "b200"])
def test_grid_points_come_back_within_the_smoothing(name):
    """At the measured b = 1 shapes the lookup returns the measured efficiency, up to the monotone
    smoothing (which moves noisy points by a few per cent of peak)."""
    doc = table_rows(name)
    table = load_tables(name).gemm
    rows = np.asarray(doc["rows"], dtype=float)
    rows = rows[rows[:, 0] == 1]
    got = table.efficiency(rows[:, 1], rows[:, 2], rows[:, 3], "bf16")
    want = rows[:, 4] / doc["peak_tflops"]["bf16"]
    assert np.median(np.abs(got - want)) < 0.01
    assert np.max(np.abs(got - want)) < 0.12


@pytest.mark.parametrize("name", TABLE_GPUS)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_never_above_peak_and_saturates(name, precision):
    table = load_tables(name).gemm
    sizes = 2.0 ** np.arange(4, 17)
    m, n, k = np.meshgrid(sizes, sizes, sizes, indexing="ij")
    eff = table.efficiency(m, n, k, precision)
    assert np.all(eff > 0) and np.all(eff <= 1.0)
    assert float(table.efficiency(16384, 16384, 16384, precision)) > 0.6


@settings(max_examples=60, deadline=None)
@given(tokens=st.sampled_from([512, 1024, 2048, 4096, 8192, 16384, 32768]),
       h_small=st.integers(2, 64), extra=st.integers(1, 64), ratio=st.sampled_from([1, 3, 4]),
       name=st.sampled_from(TABLE_GPUS), precision=st.sampled_from(["bf16", "fp8"]))
def test_smaller_hidden_size_never_more_efficient(tokens, h_small, extra, ratio, name, precision):
    """At the same token count a smaller hidden size (multiples of the 128-wide tile) never gets a
    higher GEMM efficiency, for the QKV-like (h, h), MLP-up (h, ratio·h) and MLP-down shapes."""
    table = load_tables(name).gemm
    small, big = 128 * h_small, 128 * (h_small + extra)
    for shape in (lambda h: (tokens, h, h), lambda h: (tokens, ratio * h, h), lambda h: (tokens, h, ratio * h)):
        assert table.efficiency(*shape(small), precision) <= table.efficiency(*shape(big), precision) + 1e-12


def test_monotone_envelope_is_monotone_and_keeps_monotone_data():
    rng = np.random.default_rng(0)
    grid = rng.uniform(0.1, 0.9, (5, 4, 3))
    mono = monotone(grid)
    for axis in range(3):
        assert np.all(np.diff(mono, axis=axis) >= -1e-12)
    already = np.cumsum(np.cumsum(np.cumsum(np.ones((3, 3, 3)), 0), 1), 2)
    assert np.allclose(monotone(already), already)


def test_h100_fp8_column_is_derived_not_the_implausible_one():
    """The OpenXLA sm_90 FP8 entries exceed the H100 dense FP8 peak, so the file carries no fp8
    column; FP8 is derived from BF16 and the measured K curve, and stays at or below the BF16
    fraction of peak (FP8 kernels reach a smaller share of their doubled peak)."""
    doc = table_rows("h100-sxm")
    assert "fp8" not in doc["columns"] and "fp8_from_bf16" in doc
    t = load_tables("h100-sxm").gemm
    shapes = np.array([(4096, 4096, 256), (8192, 8192, 4096), (16384, 4096, 8192)], dtype=float).T
    assert np.all(t.efficiency(*shapes, "fp8") <= t.efficiency(*shapes, "bf16") + 1e-12)


def test_small_gemms_slower_than_large_per_flop():
    gpu = load_gpu("h100-sxm")
    small = Gemm(2 * 2048 * 512 * 512, 2048, 512, 512)
    large = Gemm(2 * 8192 * 8192 * 8192, 8192, 8192, 8192)
    rate = lambda g: g.flop / float(gemm_time(g, gpu, "bf16"))
    assert rate(small) < 0.5 * rate(large)
    assert rate(large) < gpu.peak("bf16")


def test_backward_uses_both_gradient_shapes_on_table_gpus_and_the_ratio_elsewhere():
    g = Gemm(2 * 8192 * 1024 * 8192, 8192, 1024, 8192)
    h100, a100 = load_gpu("h100-sxm"), load_gpu("a100-80gb")
    assert np.isclose(gemm_backward_time(g, a100, "bf16"), a100.backward_gemm_ratio * gemm_time(g, a100, "bf16"))
    dgrad = Gemm(g.flop, 8192, 8192, 1024)  # (m×n)·(n×k): a short reduction over 1024
    wgrad = Gemm(g.flop, 8192, 1024, 8192)
    want = gemm_time(dgrad, h100, "bf16") + gemm_time(wgrad, h100, "bf16")
    assert np.isclose(gemm_backward_time(g, h100, "bf16"), want)


def test_gpus_without_table_use_their_constant():
    assert load_gpu("a100-80gb").tables.gemm is None
    assert load_tables(None).gemm is None


def test_alias_must_name_a_measured_table(tmp_path, monkeypatch):
    from profiles.tables import kernel_table

    root = tmp_path / "kernels" / "gemm"
    root.mkdir(parents=True)
    (root / "x.yaml").write_text("kind: public\ngpu: X\nsame_as: nowhere\nsource: test\n")
    (root / "y.yaml").write_text("kind: public\ngpu: Y\nsource: ''\n")
    (root / "z.yaml").write_text("kind: guessed\ngpu: Z\nsource: test\n")
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    with pytest.raises(SpecError, match="same_as 'nowhere' has no gemm table"):
        kernel_table("gemm", "x")
    with pytest.raises(SpecError, match="has no source"):
        kernel_table("gemm", "y")
    with pytest.raises(SpecError, match="kind must be one of"):
        kernel_table("gemm", "z")
    with pytest.raises(SpecError, match="unknown kernel-table topic"):
        kernel_table("gemms", "x")
