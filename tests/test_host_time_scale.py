"""The x86 hosts' fitted factor on the element-wise tables' host-time figures (GpuSpec.host_time_scale)."""

import pytest

from benchmarks.generations import (HOST_BOUNDS, HOST_FIT, HOST_PARAMETER, PARAMETER, calibration_rows, cases_of,
                                    fit_generation)
from cost_models.blocks import model_blocks
from cost_models.compute import layer_times
from cost_models.elementwise import elementwise_model
from planner.errors import SpecError
from profiles import gpu_from_yaml, load_cluster, load_gpu, load_model
from cost_models.arrays import StrategyArrays
from planner.specs import Strategy, TrainSpec
from cost_models.step import micro_of


def test_scaling_changes_the_host_figures_only():
    table = elementwise_model(load_gpu("h100-sxm"))
    assert table.host_scaled(1.0) is table
    s = table.host_scaled(2.0)
    assert s.host_per_kernel_s == pytest.approx(2 * table.host_per_kernel_s)
    assert s.host_per_expert_fwd_s == pytest.approx(2 * table.host_per_expert_fwd_s)
    assert s.host_per_expert_bwd_s == pytest.approx(2 * table.host_per_expert_bwd_s)
    assert s.host_per_expert_gemm_s == pytest.approx(2 * table.host_per_expert_gemm_s)
    assert (s.bw_bytes_per_s, s.kernel_fixed_s, s.moe_host_ops) == (table.bw_bytes_per_s, table.kernel_fixed_s,
                                                                     table.moe_host_ops)


def test_only_the_x86_hosts_carry_a_fitted_scale():
    for name in HOST_FIT.gpus:
        gpu = load_gpu(name)
        assert HOST_BOUNDS[0] <= gpu.host_time_scale <= HOST_BOUNDS[1], name
        assert "host_time_scale fitted on 2 end-to-end rows" in gpu.calibration, name
    for name in ("gb200", "gb300", "a100-80gb"):  # Grace hosts (their own figures), and a GPU without tables
        assert load_gpu(name).host_time_scale == 1.0, name


def test_a_scale_below_one_is_refused_naming_the_field():
    with pytest.raises(SpecError, match="host_time_scale"):
        gpu_from_yaml({"name": "x", "memory_gib": 80, "peak_tflops": {"bf16": 1000}, "hbm_bw_gb_per_s": 3350,
                       "host_time_scale": 0.5})


def _layer_s(model_name: str, scale: float, mbs: int, seq_len: int = 4096, **degrees) -> float:
    """Forward + backward seconds of one layer on a DGX-B200 with its host at `scale`."""
    model = load_model(model_name)
    gpu = load_cluster("dgx-b200").gpu.model_copy(update={"host_time_scale": scale})
    st = StrategyArrays.from_strategies([Strategy(micro_batch_size=mbs, **degrees)])
    x = micro_of(TrainSpec(global_batch_size=8 * mbs, seq_len=seq_len), st)
    lt = layer_times(model_blocks(model), x, gpu)
    return float(lt.fwd_s[0, 0] + lt.bwd_s[0, 0])


def test_a_host_bound_moe_layer_slows_by_at_most_the_scale():
    """Qwen3-30B-A3B at micro-batch 1 with 16 local experts is host-bound on a DGX-B200: a slower host lengthens
    it, never by more than the factor (the GPU work does not grow)."""
    base = _layer_s("qwen3-30b-a3b", 1.0, 1, dp=8, ep=8)
    slow = _layer_s("qwen3-30b-a3b", 2.0, 1, dp=8, ep=8)
    assert base < slow <= 2.0 * base * (1 + 1e-9)


def test_a_gpu_bound_dense_layer_is_unchanged():
    assert _layer_s("llama3-70b", HOST_BOUNDS[1], 1, 8192, dp=8) == pytest.approx(_layer_s("llama3-70b", 1.0, 1, 8192, dp=8))


def test_the_shipped_scale_is_the_fit_of_its_named_rows():
    """benchmarks/generations.py reproduces the calibration files' value from the rows they name, and the accuracy
    report counts those rows as calibration rows (not in any generation's held-out figures)."""
    cases = cases_of(HOST_FIT)
    gpu = load_cluster(cases[0].cluster).gpu
    result = fit_generation(HOST_FIT, HOST_PARAMETER, HOST_BOUNDS, {PARAMETER: gpu.sustained_compute_fraction})
    assert gpu.host_time_scale == pytest.approx(result.values[HOST_PARAMETER], abs=0.01)
    assert [r.row for r in result.residuals] == [label for _, label in HOST_FIT.rows]
    assert all(abs(r.error) < 0.05 for r in result.residuals)
    assert set(HOST_FIT.rows) <= calibration_rows()
