"""NVFP4 training (precision nvfp4: Transformer Engine's NVFP4BlockScaling under Megatron): its GEMM rate against
Transformer Engine's pre-quantised B300 measurement, its quantisation bytes, the bf16 layers, the refusals, and an
NVFP4 Llama 3 plan on GB300 that is faster than MXFP8 but by less than the FP4 / FP8 peak ratio."""

import pytest

from benchmarks.te_gemm_profiling import layer_shapes, model_gemm_ms
from cost_models.elementwise import fp8_cast_bytes_per_element, fp8_cast_kernels, nvfp4_weight_cast_bytes_per_element
from cost_models.memory import fp8_weight_bytes_per_element
from planner.api import plan
from planner.errors import SpecError
from planner.specs.train import TrainSpec
from profiles import load_gpu

SHAPES = layer_shapes(4096, 16384, 15872)
ONE_LAYOUT = {"tp": 1, "pp": 1, "cp": 1, "micro_batch_size": 1, "zero_stage": 1}


@pytest.mark.parametrize("cluster", ["gb300-nvl72", "dgx-b300"])
def test_nvfp4_gemms_run_at_the_measured_b300_rate(cluster):
    """TE's GEMM profiling guide, pre-quantised, B300: the twelve GEMMs of one layer take 6.812 ms in per-tensor FP8
    and 3.764 ms in NVFP4; Blackwell Ultra's FP4 peak is three times its FP8 peak on both systems."""
    ratio = model_gemm_ms(cluster, SHAPES, "fp8", "tensorwise") / model_gemm_ms(cluster, SHAPES, "nvfp4", "nvfp4")
    assert ratio == pytest.approx(6.812 / 3.764, rel=0.02)  # kernel overheads aside


def test_nvfp4_on_blackwell_with_twice_the_fp8_peak_is_slower_relative_to_fp8():
    ratio = model_gemm_ms("gb200-nvl72", SHAPES, "fp8", "tensorwise") / model_gemm_ms("gb200-nvl72", SHAPES, "nvfp4")
    assert 1.0 < ratio < 6.812 / 3.764


def test_nvfp4_quantisation_bytes():
    # activations and gradients: three reads of bf16, FP4 row- and column-wise copies, an E4M3 scale per 16
    assert fp8_cast_bytes_per_element("nvfp4", False) == 3 * 2 + 2 * 0.5 + 2 / 16
    assert fp8_cast_kernels("nvfp4") == 3
    # weights: two reads, 16x16 blocks
    assert nvfp4_weight_cast_bytes_per_element() == 2 * 2 + 2 * (0.5 + 1 / 256)
    # the FP4 weight copies kept: row-wise and column-wise, 16x16-block scales
    assert fp8_weight_bytes_per_element("nvfp4", False) == 2 * (0.5 + 1 / 256)


def _step(precision, model="llama3.1-8b", **train):
    r = plan(model, "gb300-nvl72", 8, 64, 8192, precision=precision, top_k=1, constraints=ONE_LAYOUT, **train)
    return r.plans[0].estimate


def test_an_nvfp4_llama3_plan_on_gb300_plans():
    r = plan("llama3-70b", "gb300-nvl72", 64, 128, 8192, precision="nvfp4", top_k=1)
    assert r.plans and r.train.precision == "nvfp4"
    assert r.plans[0].estimate.fits and 0 < r.plans[0].estimate.mfu < 1  # MFU against the dense FP4 peak


def test_nvfp4_is_faster_than_mxfp8_but_not_by_the_peak_ratio():
    nvfp4, mxfp8 = _step("nvfp4"), _step("fp8", fp8_recipe="mxfp8")
    speedup = mxfp8.step_time_s / nvfp4.step_time_s
    gpu = load_gpu("gb300")
    assert 1 < speedup < gpu.peak("fp4") / gpu.peak("fp8") and speedup < 2


def test_bf16_layers_cost_between_nvfp4_and_bf16():
    plain, kept, bf16 = _step("nvfp4"), _step("nvfp4", fp4_bf16_layers_start=1, fp4_bf16_layers_end=4), _step("bf16")
    assert plain.step_time_s < kept.step_time_s < bf16.step_time_s


def test_nvfp4_is_refused_without_fp4_tensor_cores():
    with pytest.raises(SpecError, match="needs FP4 tensor cores") as err:
        plan("llama3.1-8b", "dgx-h100", 8, 64, 8192, precision="nvfp4")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("options,rule", [
    ({"precision": "nvfp4", "framework": "torchtitan"}, "framework"),
    ({"precision": "fp8", "fp4_bf16_layers_end": 2}, "need precision 'nvfp4'"),
])
def test_nvfp4_settings_are_checked(options, rule):
    with pytest.raises(SpecError, match=rule):
        TrainSpec(global_batch_size=8, seq_len=1024, **options)
