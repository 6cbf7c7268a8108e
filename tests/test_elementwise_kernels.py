"""Element-wise kernel tables: size curve, host floor, bandwidth bound, FP8 recipes, cross-entropy fusion,
and GPUs without a table keeping their calibrated constants."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models.arrays import StrategyArrays
from cost_models.blocks import model_blocks
from cost_models.compute import head_times, layer_times
from cost_models.elementwise import elementwise_model, fp8_cast_bytes_per_element, fp8_cast_launches
from cost_models.step import evaluate_arrays, micro_of
from planner import Strategy, evaluate
from planner.errors import SpecError
from planner.specs import TrainSpec
from profiles import load_cluster, load_model

TABLE_GPUS = ("h100-sxm", "h200", "b200", "gb200", "gb300")


def _gpu(name):
    from profiles import load_gpu

    return load_gpu(name)


@pytest.mark.parametrize("name", TABLE_GPUS)
def test_small_tensors_move_fewer_bytes_per_second(name):
    model = elementwise_model(_gpu(name))
    sizes = np.array([1e5, 1e6, 1e7, 1e8, 1e9])
    rate = sizes / model.time_s(sizes, 1)
    assert np.all(np.diff(rate) > 0)
    assert rate[0] < 0.1 * rate[-1]


@pytest.mark.parametrize("name", TABLE_GPUS)
def test_no_elementwise_kernel_beats_hbm_peak(name):
    gpu = _gpu(name)
    model = elementwise_model(gpu)
    sizes = np.logspace(3, 11, 20)
    assert np.all(sizes / model.time_s(sizes, 1) <= gpu.hbm_bw_bytes_per_s)
    assert model.optimizer_bw_bytes_per_s <= gpu.hbm_bw_bytes_per_s


#: A small Llama-shaped model (hidden 512, 8 heads): a few microseconds of GPU work per kernel at short sequences.
TINY = {"name": "tiny-llama", "num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_kv_heads": 8,
        "head_dim": 64, "ffn_hidden_size": 1536, "gated_mlp": True, "vocab_size": 32000, "tie_embeddings": True,
        "position_embedding": "rope", "max_position_embeddings": 4096, "norm": "rmsnorm", "linear_bias": False,
        "dropout": False}


def _layer(model_name, cluster, seq_len, mbs, precision="bf16", **train):
    model = load_model(model_name)
    st = StrategyArrays.from_strategies([Strategy(tp=1, dp=1, micro_batch_size=mbs)])
    t = TrainSpec(global_batch_size=8, seq_len=seq_len, precision=precision, **train)
    x = micro_of(t, st)
    return layer_times(model_blocks(model), x, load_cluster(cluster).gpu), model, x


def test_host_floor_binds_for_a_tiny_model_only():
    gpu = load_cluster("dgx-h100").gpu
    table = elementwise_model(gpu).host_scaled(gpu.host_time_scale)  # the host figures the layer is floored by
    tiny, model, x = _layer(TINY, "dgx-h100", 512, 1)
    layer = model_blocks(model).kinds[0]
    kernels = len(layer.gemms(x)) + layer.attention().core(x).num_kernels + layer.elementwise(x).num_kernels
    host_fwd = kernels * table.host_per_kernel_s
    # the layer never runs faster than the host issues its kernels, and for a tiny layer the host's issue
    # time is most of it (the GPU work of its GEMMs, timed from the measured table, is about as long)
    assert tiny.fwd_s[0, 0] >= host_fwd * (1 - 1e-9) and host_fwd > 0.5 * tiny.fwd_s[0, 0]
    assert tiny.bwd_s[0, 0] >= table.backward_kernels_per_forward * host_fwd * (1 - 1e-9)
    big, _, _ = _layer("llama3-70b", "dgx-h100", 8192, 1)
    host = 40 * table.host_per_kernel_s  # generous kernel count of a layer
    assert big.fwd_s[0, 0] > 10 * host


def test_fp8_overhead_present_and_bounded():
    bf16, _, _ = _layer("llama3-8b", "dgx-h100", 8192, 1, "bf16")
    fp8, _, _ = _layer("llama3-8b", "dgx-h100", 8192, 1, "fp8")
    tensorwise, _, _ = _layer("llama3-8b", "dgx-h100", 8192, 1, "fp8", fp8_recipe="tensorwise")
    # FP8 GEMMs are faster, but the casts are real work: more than half the bf16 layer, less than all of it
    assert 0.5 * bf16.fwd_s[0, 0] < fp8.fwd_s[0, 0] < bf16.fwd_s[0, 0]
    assert fp8.fwd_s[0, 0] < tensorwise.fwd_s[0, 0] < 1.2 * fp8.fwd_s[0, 0]  # current scaling adds an amax pass


def test_fp8_cast_bytes_by_recipe_and_generation():
    assert fp8_cast_bytes_per_element("delayed", True) > fp8_cast_bytes_per_element("delayed", False)
    assert fp8_cast_bytes_per_element("mxfp8", False) == pytest.approx(2 + 2 + 2 / 32)
    assert fp8_cast_bytes_per_element("blockwise", True) == pytest.approx(2 + 2 + 2 * 4 / 128)


def test_mxfp8_refused_on_h100_with_a_clear_message():
    with pytest.raises(SpecError, match=r"fp8_recipe 'mxfp8' is not supported on H100.*Blackwell"):
        evaluate(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=8, seq_len=4096,
                 precision="fp8", fp8_recipe="mxfp8", strategy=Strategy(tp=1))


def test_mxfp8_runs_on_b200():
    est = evaluate(model="llama3-8b", cluster="dgx-b200", num_gpus=8, global_batch_size=8, seq_len=4096,
                   precision="fp8", fp8_recipe="mxfp8", strategy=Strategy(tp=1, zero_stage=1))
    assert est.step_time_s > 0


def test_unfused_cross_entropy_is_slower():
    gpu = load_cluster("dgx-h100").gpu
    model = load_model("llama3-8b")
    st = StrategyArrays.from_strategies([Strategy(tp=1, dp=1)])
    times = {}
    for fused in (True, False):
        x = micro_of(TrainSpec(global_batch_size=8, seq_len=8192, cross_entropy_fusion=fused), st)
        times[fused] = head_times(model_blocks(model).head, x, gpu)
    assert times[False][0][0] > times[True][0][0]
    assert times[False][1][0] >= times[True][1][0]


def test_optimizer_step_and_fp8_weight_casts():
    kw = dict(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=8, seq_len=4096,
              strategy=Strategy(tp=1, zero_stage=1))
    bf16 = evaluate(precision="bf16", **kw).time_s["optimizer"]
    fp8 = evaluate(precision="fp8", **kw).time_s["optimizer"]
    # Adam over 1/8 of 8B parameters at 38 bytes each and about 2.7 TB/s: ~14 ms; FP8 adds the weight casts
    assert 0.005 < bf16 < 0.05
    assert fp8 > bf16


@pytest.mark.parametrize("cluster", ["dgx-a100-80gb", "dgx-a100-40gb"])
def test_gpus_without_a_table_are_unchanged(cluster, monkeypatch):
    """No elementwise table: the calibrated constants, and the new TrainSpec fields change nothing."""
    gpu = load_cluster(cluster).gpu
    assert elementwise_model(gpu) is None
    model, c = load_model("gpt3-1.7b"), load_cluster(cluster)
    st = StrategyArrays.from_strategies([Strategy(tp=2, dp=4, micro_batch_size=2)])
    a = evaluate_arrays(model, c, TrainSpec(global_batch_size=64, seq_len=2048), st)
    b = evaluate_arrays(model, c, TrainSpec(global_batch_size=64, seq_len=2048, cross_entropy_fusion=False), st)
    assert a.step_time_s[0] == b.step_time_s[0]
    # and the table path is really what changes H100 numbers: dropping it restores the constants' formula
    h100 = load_cluster("dgx-h100")
    with_table = evaluate_arrays(model, h100, TrainSpec(global_batch_size=64, seq_len=2048), st).step_time_s[0]
    bare = load_cluster(h100.model_copy(update={"gpu": h100.gpu.model_copy(update={"kernel_tables": None})}))
    without = evaluate_arrays(model, bare, TrainSpec(global_batch_size=64, seq_len=2048), st).step_time_s[0]
    assert with_table != without


def test_grace_hosts_issue_work_at_the_measured_ratio_to_x86_hosts():
    """Transformer Engine issue 2053: one PyTorch Linear forward costs 37.08 us of host time on Grace (GB200) and
    13.48 us on a DGX H100's Xeon; Grace-hosted tables issue kernels that much slower, and the x86 tables take the
    per-expert set-up measured on Grace (TE issue 2897) divided by the same ratio."""
    ratio = 37.08 / 13.48
    x86, grace = (elementwise_model(_gpu(g)) for g in ("h100-sxm", "gb200"))
    assert grace.host_per_kernel_s / x86.host_per_kernel_s == pytest.approx(ratio, rel=0.01)
    assert elementwise_model(_gpu("gb300")).host_per_kernel_s == grace.host_per_kernel_s
    for gpu in ("h100-sxm", "h200", "b200"):
        table = elementwise_model(_gpu(gpu))
        assert grace.host_per_expert_fwd_s / table.host_per_expert_fwd_s == pytest.approx(ratio, rel=0.02)
        assert grace.host_per_expert_bwd_s / table.host_per_expert_bwd_s == pytest.approx(ratio, rel=0.02)
        assert grace.host_per_expert_gemm_s / table.host_per_expert_gemm_s == pytest.approx(ratio, rel=0.02)


def test_grouped_gemm_inputs_are_quantised_per_expert_except_under_delayed_scaling():
    """Transformer Engine's split_quantize fuses the experts' casts into one launch only for FP8 delayed scaling
    (multi_tensor_quantize_impl, cast.cpp at v2.9); MXFP8, current and block scaling launch one per expert. The
    launches cost GPU time each; the host issues them in one call, after the dispatcher's wait."""
    from cost_models.blocks import Gemm
    from cost_models.elementwise import EXPERT_KERNELS, fp8_cast_launches, fp8_cast_kernels

    dense = Gemm(1.0, 4096, 2048, 2048)
    experts = Gemm(1.0, 256, 1536, 2048, count=16, grouped=True)
    for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        per = fp8_cast_kernels(recipe)
        n = int(fp8_cast_launches([dense, experts], recipe))
        assert n == per * (2 if recipe == "delayed" else 17), recipe
        assert int(fp8_cast_launches([dense, experts], recipe, grouped=True)) == n - per
        # the host makes one quantize call per GEMM: a grouped GEMM's casts come from one C++ loop (their
        # per-expert host time is in host_per_expert_*, measured with the quantizers' set-up), and current
        # scaling's amax, scale and cast kernels are launched inside the one call
        assert int(fp8_cast_launches([dense, experts], recipe, host=True)) == 2
    table = elementwise_model(_gpu("b200"))
    tiny = np.array(1e-9)
    base = table.moe_host_floor(tiny, tiny, np.array(60), 16, tiny / 2)
    moved = table.moe_host_floor(tiny, tiny, np.array(60), 16, tiny / 2, expert_kernels=EXPERT_KERNELS + 16)
    assert float(moved[0]) == pytest.approx(float(base[0]))  # the same kernels, issued after the wait instead
    gpu_before, gpu_after = np.array(5e-3), np.array(1e-6)  # the part before the wait hides its host time
    early = table.moe_host_floor(gpu_before + gpu_after, tiny, np.array(60), 16, gpu_after)
    late = table.moe_host_floor(gpu_before + gpu_after, tiny, np.array(60), 16, gpu_after,
                                expert_kernels=EXPERT_KERNELS + 16)
    assert float(late[0]) > float(early[0])


def test_per_expert_casts_cost_gpu_time_but_one_host_call():
    from cost_models.blocks import Elementwise, Gemm, Micro

    table = elementwise_model(_gpu("b200"))
    ew = Elementwise(np.array(1e6), 4)
    x = Micro(4096, np.array([1]), np.array([1]), np.array([1]), np.array([False]), "fp8", "flash",
              np.array([8]), np.array([1]), 1.0, True, "mxfp8", "alltoall")
    few = table.layer_s(ew, [Gemm(1.0, 256, 1536, 2048, count=2, grouped=True)], x, 1.5)
    many = table.layer_s(ew, [Gemm(1.0, 32, 1536, 2048, count=16, grouped=True)], x, 1.5)  # same bytes
    assert float(many[0] - few[0]) == pytest.approx(14 * table.kernel_fixed_s)
    assert float(many[2]) == float(few[2])


def test_mxfp8_swizzles_its_scales_before_every_gemm():
    """Transformer Engine rearranges both operands' MXFP8 block scales before each GEMM (gemm.cpp at v2.9):
    two launches per forward GEMM (a grouped GEMM's experts in one), twice as many in the backward; the
    per-tensor recipes have no block scales to swizzle."""
    from cost_models.blocks import Gemm

    table = elementwise_model(load_cluster("dgx-b200").gpu)
    gemms = [Gemm(1.0, 4096, 4096, 4096), Gemm(1.0, 256, 1536, 2048, count=16, grouped=True)]
    mx = table.fp8_casts(gemms, "mxfp8")
    tw = table.fp8_casts(gemms, "tensorwise")
    casts_mx, casts_tw = int(fp8_cast_launches(gemms, "mxfp8")), int(fp8_cast_launches(gemms, "tensorwise"))
    assert (int(mx[2]), int(mx[3])) == (casts_mx + 4, casts_mx + 8)
    assert (int(tw[2]), int(tw[3])) == (casts_tw, casts_tw)


def test_current_scaling_casts_launch_four_kernels_from_one_host_call():
    """Per-tensor current scaling (Megatron's --fp8-recipe tensorwise) zeroes the amax, reduces it, turns it into
    a scale and casts: four kernels (Float8CurrentScalingQuantizer::quantize_impl, quantizer.cpp at Transformer
    Engine v2.9) against delayed scaling's one fused cast, all launched inside one quantize call."""
    from cost_models.blocks import Elementwise, Gemm, Micro
    from cost_models.elementwise import fp8_cast_bytes_per_element, fp8_cast_kernels

    assert fp8_cast_kernels("tensorwise") == 4 and fp8_cast_kernels("delayed") == 1
    table = elementwise_model(load_cluster("dgx-h100").gpu)
    ew = Elementwise(np.array(1e6), 4)
    gemm = Gemm(1.0, 4096, 2048, 2048)

    def micro(recipe):
        return Micro(4096, np.array([1]), np.array([1]), np.array([1]), np.array([False]), "fp8", "flash",
                     np.array([1]), np.array([1]), 1.0, True, recipe, "alltoall")

    cs = table.layer_s(ew, [gemm], micro("tensorwise"), 1.5)
    ds = table.layer_s(ew, [gemm], micro("delayed"), 1.5)
    extra_bytes = (fp8_cast_bytes_per_element("tensorwise", True) - fp8_cast_bytes_per_element("delayed", True))
    expected = extra_bytes * 4096 * 2048 / table.bw_bytes_per_s + 3 * table.kernel_fixed_s
    assert float(cs[0] - ds[0]) == pytest.approx(expected, rel=1e-6)
    assert float(cs[2]) == float(ds[2])  # the host makes the same one call per cast
