"""Fused-attention kernel tables (profiles/kernels/attention) and the attention-core times built on them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from cost_models.attention_kernels import BACKWARD_FLOP_RATIO, attention_table, flash_core_times
from cost_models.blocks import Attention, LatentAttention, Micro, model_blocks
from cost_models.compute import UNQUANTISED, layer_times
from planner.errors import SpecError
from profiles import PROFILES_DIR, load_gpu, load_model

TABLES = sorted((PROFILES_DIR / "kernels" / "attention").glob("*.yaml"))
SETS = [p.stem for p in TABLES]


def micro(seq_len=8192, cp=1, tp=1, precision="bf16", kernel="flash", n=1) -> Micro:
    one = np.ones(n, dtype=int)
    return Micro(seq_len, one, tp * one, cp * one, np.zeros(n, dtype=bool), precision, kernel)


def llama3_8b_attention() -> Attention:
    return model_blocks(load_model("llama3-8b")).kinds[0].attention()


def test_every_shipped_set_loads_and_names_a_gpu_preset():
    assert "h100-sxm" in SETS
    for name in SETS:
        assert attention_table(name) is not None
        assert load_gpu(name).kernel_tables == name  # each file is found under its GPU's default set name


@pytest.mark.parametrize("name", SETS)
def test_every_rate_is_positive_and_below_the_dense_peak(name: str):
    """The tables' TFLOP/s credit causal FLOPs halved, so even a causal rate may not pass the dense 16-bit peak."""
    table, peak = attention_table(name), load_gpu(name).peak("bf16")
    for key, grid in table.rates_flop_per_s.items():
        assert np.all(grid > 0) and np.all(grid < peak), (name, key)


def test_the_table_is_parsed_once_per_set():
    assert attention_table("h100-sxm") is attention_table("h100-sxm")


def test_h200_reuses_the_h100_measurements():
    h100, h200 = attention_table("h100-sxm"), attention_table("h200")
    for key in h100.rates_flop_per_s:
        np.testing.assert_array_equal(h100.rates_flop_per_s[key], h200.rates_flop_per_s[key])


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_causal_is_credited_half_its_flops_at_long_sequences(name: str, direction: str):
    """The tables credit a causal call half the FLOPs (the FA convention): a causal kernel skips the masked half of
    the scores, so at 16k its time is about half the unmasked kernel's. H100 (FA3 paper): 50-60 % (the rest is the
    diagonal blocks and the scheduling). Blackwell (NVIDIA's cuDNN 9.22 rows): 48-54 %, the unmasked latent-attention
    backward being a few percent slower per FLOP than the causal one (GB200: 1088 against 1134 TFLOP/s). A table whose
    causal rates counted the full score matrix would give about 25 %."""
    table = attention_table(name)
    for d in table.head_dims[(direction, True)]:
        causal_s = 0.5 / table.rate(direction, True, d, 16384)
        full_s = 1.0 / table.rate(direction, False, d, 16384)
        assert 0.45 <= causal_s / full_s <= 0.6, (d, causal_s / full_s)


@pytest.mark.parametrize("name", SETS)
def test_interpolation_keeps_the_data_monotone_where_it_is(name: str):
    """Where a measured curve never falls with sequence length, the interpolated one never does either; where it
    does (cuDNN forward, head dim 128, unmasked: 617 at 2k, 595 at 16k) the interpolation stays within the data."""
    table, seq = attention_table(name), np.geomspace(256, 65536, 97)
    monotone = 0
    for key, grid in table.rates_flop_per_s.items():
        for d, row in zip(table.head_dims[key], grid):
            rates = table.rate(key[0], key[1], d, seq)
            assert row.min() <= rates.min() and rates.max() <= row.max()
            if np.all(np.diff(row) >= 0):
                monotone += 1
                assert np.all(np.diff(rates) >= 0), (key, d)
    assert monotone > 0


def test_outside_the_measured_range_is_clamped():
    table = attention_table("h100-sxm")
    np.testing.assert_allclose(table.rate("fwd", True, 128, np.array([256, 65536])),
                               [315e12, 539e12])  # 512 and 16k points of Figure 5d
    np.testing.assert_allclose(table.rate("fwd", True, 32, 4096), table.rate("fwd", True, 64, 4096))
    # the backward has no head dim 256 curve: larger head dims take 128's
    np.testing.assert_allclose(table.rate("bwd", False, 256, 4096), table.rate("bwd", False, 128, 4096))


def test_llama3_8b_core_on_h100():
    """Llama-3-8B (32 heads of d=128, GQA 8 KV heads), s=8192, b=1, tp=1, one layer on an H100:
    forward 1.049 ms, backward 3.019 ms (the fitted-efficiency roofline gave 1.714 and 3.133 ms).
    Forward: 4·8192²·4096 = 1.100 TFLOP in the model's count, half of it credited, at the causal cuDNN rate
    529 TFLOP/s (FA3 paper Fig. 5d, 8k), plus two 5 µs kernel overheads. Backward: 2.5× the credited FLOP at
    518 × 529/600 = 456.7 TFLOP/s (unmasked backward, Fig. 6, times the forward's causal ratio)."""
    gpu, att, x = load_gpu("h100-sxm"), llama3_8b_attention(), micro()
    flop = 4 * 8192 * 8192 * 4096
    fwd, bwd = flash_core_times(att, x, gpu)
    np.testing.assert_allclose(fwd, flop / 2 / 529e12 + 2 * gpu.kernel_overhead_s, rtol=1e-9)
    np.testing.assert_allclose(bwd, BACKWARD_FLOP_RATIO * flop / 2 / (518e12 * 529 / 600) + 2 * gpu.kernel_overhead_s,
                               rtol=1e-9)
    assert round(float(fwd[0]) * 1e3, 3) == 1.049 and round(float(bwd[0]) * 1e3, 3) == 3.019


def test_gb200_reproduces_nvidias_cudnn_kernel_times():
    """NVIDIA's cuDNN 9.22 rows on GB200 (cudnn-frontend benchmark/sdpa_benchmark_training, llama3.1_20260424_100750.csv):
    batch 2, 64 query / 8 KV heads of 128, 16k tokens, causal: forward 5.150 ms, backward 16.554 ms (non-deterministic).
    The table gives them back from the model's FLOPs (4·2·16384²·8192, half credited) plus two kernel overheads."""
    gpu = load_gpu("gb200")
    att = Attention(8192, 64, 8192, 1024, 0, True, False)
    one = np.ones(1, dtype=int)
    x = Micro(16384, 2 * one, one, one, np.zeros(1, dtype=bool), "bf16", "flash")
    fwd, bwd = flash_core_times(att, x, gpu)
    overhead = 2 * gpu.kernel_overhead_s
    np.testing.assert_allclose(fwd - overhead, 5.150e-3, rtol=1e-3)
    np.testing.assert_allclose(bwd - overhead, 16.554e-3, rtol=1e-3)


def test_b200_is_gb200_at_b200s_dense_peak_and_near_its_own_measurements():
    """No complete B200 measurement exists: the B200 table is GB200's times the dense BF16 peak ratio (2250 / 2500).
    It stays within 15 % of the B200 cuDNN 9.13.1 rows NVIDIA published (causal, head dim 128, 16k and 32k)."""
    b200, gb200 = attention_table("b200"), attention_table("gb200")
    ratio = load_gpu("b200").peak("bf16") / load_gpu("gb200").peak("bf16")
    assert ratio == pytest.approx(0.9)
    for key, grid in b200.rates_flop_per_s.items():
        np.testing.assert_array_equal(b200.head_dims[key], gb200.head_dims[key])
        np.testing.assert_allclose(grid, ratio * gb200.rates_flop_per_s[key], atol=0.5e12)
    measured = {"fwd": [1332e12, 1419e12], "bwd": [1075e12, 1109e12]}  # sdpa_bf16_benchmark_results_NVIDIA_B200.csv
    for direction, rates in measured.items():
        np.testing.assert_allclose(rates, b200.rate(direction, True, 128, np.array([16384, 32768])), rtol=0.15)


def test_context_parallel_mixes_one_causal_call_with_unmasked_ones():
    gpu, att = load_gpu("h100-sxm"), llama3_8b_attention()
    table = attention_table("h100-sxm")
    x = micro(cp=4)
    credited = att.core(x).flop / 2
    expect = credited / 4 / table.rate("fwd", True, 128, 2048) + credited * 3 / 4 / table.rate("fwd", False, 128, 2048)
    np.testing.assert_allclose(flash_core_times(att, x, gpu)[0], expect + 2 * gpu.kernel_overhead_s, rtol=1e-12)


def test_windowed_layer_runs_at_the_window_length():
    gpu, table = load_gpu("h100-sxm"), attention_table("h100-sxm")
    att = Attention(4096, 32, 4096, 1024, 0, True, False, window=4096)
    x = micro(seq_len=32768)
    credited = att.core(x).flop * (1 - 4096 / (2 * 32768))
    np.testing.assert_allclose(flash_core_times(att, x, gpu)[0],
                               credited / table.rate("fwd", False, 128, 4096) + 2 * gpu.kernel_overhead_s, rtol=1e-12)


def test_mla_looks_up_the_mean_of_its_qk_and_v_head_dims():
    """DeepSeek-V3 MLA: d_qk = 128 + 64 = 192, d_v = 128, looked up at 160, between the 128 and 256 curves."""
    gpu, table = load_gpu("h100-sxm"), attention_table("h100-sxm")
    att = LatentAttention(7168, 128, 1536, 512, 128, 64, 128)
    x = micro(seq_len=4096)
    rate = table.rate("fwd", True, 160, 4096)
    r128, r256 = table.rate("fwd", True, 128, 4096), table.rate("fwd", True, 256, 4096)  # 518 and 483 TFLOP/s
    np.testing.assert_allclose(rate, r128 + (r256 - r128) * (160 - 128) / (256 - 128))
    np.testing.assert_allclose(flash_core_times(att, x, gpu)[0],
                               att.core(x).flop / 2 / rate + 2 * gpu.kernel_overhead_s, rtol=1e-12)


def test_fp8_training_keeps_the_core_in_bf16():
    gpu, att = load_gpu("h100-sxm"), llama3_8b_attention()
    np.testing.assert_array_equal(flash_core_times(att, micro(precision="fp8"), gpu)[0],
                                  flash_core_times(att, micro(precision="bf16"), gpu)[0])


def _roofline_layer(blocks, x, gpu):
    """The attention-core terms as costed before the tables: fitted GEMM efficiency, backward_gemm_ratio × forward."""
    layer = blocks.kinds[0]
    core = layer.attention().core(x)
    hbm = gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency
    return (np.maximum(core.flop / (gpu.peak(UNQUANTISED[x.precision]) * gpu.gemm_efficiency), core.bytes / hbm)
            + core.num_kernels * gpu.kernel_overhead_s)


@pytest.mark.parametrize("gpu_name,kernel", [("a100-80gb", "flash"), ("h100-sxm", "unfused"), ("h100-sxm-none", "flash")])
def test_without_a_table_the_core_is_costed_as_before(gpu_name: str, kernel: str, tmp_path, monkeypatch):
    """A GPU without an attention table, or the unfused core, keeps the fitted-efficiency roofline exactly: the
    layer's forward holds the roofline core time and its backward backward_gemm_ratio times it."""
    gpu = load_gpu(gpu_name.removesuffix("-none"))
    if gpu_name.endswith("-none"):
        gpu = gpu.model_copy(update={"kernel_tables": None})
    blocks, x = model_blocks(load_model("llama3-8b")), micro(seq_len=4096, cp=2, tp=2, kernel=kernel, n=3)
    assert flash_core_times(blocks.kinds[0].attention(), x, gpu) is None
    core_s = _roofline_layer(blocks, x, gpu)
    lt = layer_times(blocks, x, gpu)
    softmax = blocks.kinds[0].attention().core(x)
    softmax_s = softmax.softmax_bytes / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency) \
        + softmax.softmax_kernels * gpu.kernel_overhead_s
    np.testing.assert_allclose(lt.attn_core_fwd_s[0], core_s + softmax_s, rtol=1e-15)
    # the backward's core term is backward_gemm_ratio × the forward's, as before the tables
    # a table set holding only the H100 attention table, so that nothing but the core changes
    only = tmp_path / "kernels" / "attention"
    only.mkdir(parents=True)
    (only / "attn-only.yaml").write_text((PROFILES_DIR / "kernels" / "attention" / "h100-sxm.yaml").read_text())
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    with_table = gpu.model_copy(update={"kernel_tables": "attn-only"}) if kernel == "flash" else None
    if with_table is not None:
        flash_fwd, flash_bwd = flash_core_times(blocks.kinds[0].attention(), x, with_table)
        lt_table = layer_times(blocks, x, with_table)
        np.testing.assert_allclose(lt_table.fwd_s[0] - lt.fwd_s[0], flash_fwd - core_s, rtol=1e-9)
        np.testing.assert_allclose(lt_table.bwd_s[0] - lt.bwd_s[0], flash_bwd - gpu.backward_gemm_ratio * core_s,
                                   rtol=1e-9)


def _write_table(root: Path, body: dict) -> None:
    folder = root / "kernels" / "attention"
    folder.mkdir(parents=True)
    (folder / "broken.yaml").write_text(yaml.safe_dump(body))


@pytest.mark.parametrize("change,message", [
    ({"seq_lens": [512]}, "seq_lens must be at least two"),
    ({"curves": [{"direction": "fwd", "causal": True, "head_dim": 64, "tflops": [1, 2], "source": "x"}]},
     "needs forward curves"),
    ({"curves": [{"direction": "fwd", "causal": True, "head_dim": 64, "tflops": [1, -2], "source": "x"}]},
     "tflops must be 2 positive numbers"),
    ({"curves": [{"direction": "sideways", "causal": True, "head_dim": 64, "tflops": [1, 2], "source": "x"}]},
     "direction must be fwd or bwd"),
    ({"curves": [{"direction": "fwd", "causal": True, "head_dim": 64, "tflops": [1, 2]}]}, "names its source"),
    ({"same_as": "no-such-set"}, "same_as 'no-such-set' has no attention table"),
])
def test_a_bad_table_is_refused_naming_the_rule(tmp_path, monkeypatch, change, message):
    body = {"kind": "public", "gpu": "x", "source": "test", "seq_lens": [512, 1024], "curves": []} | change
    _write_table(tmp_path, body)
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    attention_table.cache_clear()
    try:
        with pytest.raises(SpecError, match=message):
            attention_table("broken")
    finally:
        attention_table.cache_clear()
