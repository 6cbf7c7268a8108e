"""Fused-attention kernel tables (profiles/kernels/attention) and the attention-core times built on them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from cost_models.attention_kernels import BACKWARD_FLOP_RATIO, flash_core_times
from cost_models.blocks import Attention, LatentAttention, Micro, model_blocks
from cost_models.compute import UNQUANTISED, layer_times
from planner.errors import SpecError
from profiles import PROFILES_DIR, load_gpu, load_model, resolve_gpu
from profiles.bundle import load_tables

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
        assert load_tables(name).attention.get("flash") is not None
        assert load_gpu(name).kernel_tables == name  # each file is found under its GPU's default set name


@pytest.mark.parametrize("name", SETS)
def test_every_rate_is_positive_and_below_the_dense_peak(name: str):
    """The tables' TFLOP/s credit causal FLOPs halved, so even a causal rate may not pass the dense 16-bit peak."""
    table, peak = load_tables(name).attention.get("flash"), load_gpu(name).peak("bf16")
    for key, grid in table.rates_flop_per_s.items():
        assert np.all(grid > 0) and np.all(grid < peak), (name, key)


def test_the_table_is_parsed_once_per_set():
    assert load_tables("h100-sxm").attention.get("flash") is load_tables("h100-sxm").attention.get("flash")


def test_h200_reuses_the_h100_measurements():
    h100, h200 = load_tables("h100-sxm").attention.get("flash"), load_tables("h200").attention.get("flash")
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
    table = load_tables(name).attention.get("flash")
    for d in table.head_dims[(direction, True)]:
        causal_s = 0.5 / table.rate(direction, True, d, 16384)
        full_s = 1.0 / table.rate(direction, False, d, 16384)
        assert 0.45 <= causal_s / full_s <= 0.6, (d, causal_s / full_s)


@pytest.mark.parametrize("name", SETS)
def test_interpolation_keeps_the_data_monotone_where_it_is(name: str):
    """Where a measured curve never falls with sequence length, the interpolated one never does either; where it
    does (cuDNN forward, head dim 128, unmasked: 617 at 2k, 595 at 16k) the interpolation stays within the data."""
    table, seq = load_tables(name).attention.get("flash"), np.geomspace(256, 65536, 97)
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
    table = load_tables("h100-sxm").attention.get("flash")
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
    b200, gb200 = load_tables("b200").attention.get("flash"), load_tables("gb200").attention.get("flash")
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
    table = load_tables("h100-sxm").attention.get("flash")
    x = micro(cp=4)
    credited = att.core(x).flop / 2
    expect = credited / 4 / table.rate("fwd", True, 128, 2048) + credited * 3 / 4 / table.rate("fwd", False, 128, 2048)
    np.testing.assert_allclose(flash_core_times(att, x, gpu)[0], expect + 2 * gpu.kernel_overhead_s, rtol=1e-12)


def test_windowed_layer_runs_at_the_window_length():
    """A window of 4096 lies past the measured windows (128, 1024) and the dense length after them (2048): the band
    runs at the dense unmasked rate of a 4096-token call, as it did before the tables had window curves."""
    gpu, table = load_gpu("h100-sxm"), load_tables("h100-sxm").attention.get("flash")
    att = Attention(4096, 32, 4096, 1024, 0, True, False, window=4096)
    x = micro(seq_len=32768)
    credited = att.core(x).flop * (1 - 4096 / (2 * 32768))
    np.testing.assert_allclose(flash_core_times(att, x, gpu)[0],
                               credited / table.rate("fwd", False, 128, 4096) + 2 * gpu.kernel_overhead_s, rtol=1e-12)


def test_mla_looks_up_the_mean_of_its_qk_and_v_head_dims():
    """DeepSeek-V3 MLA: d_qk = 128 + 64 = 192, d_v = 128, looked up at 160, between the 128 and 256 curves."""
    gpu, table = load_gpu("h100-sxm"), load_tables("h100-sxm").attention.get("flash")
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
        gpu = resolve_gpu(gpu.model_copy(update={"kernel_tables": None}))
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
    with_table = resolve_gpu(gpu.model_copy(update={"kernel_tables": "attn-only"})) if kernel == "flash" else None
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
    with pytest.raises(SpecError, match=message):
        load_tables("broken").attention.get("flash")


# ---- sliding windows (window_curves) ----

def gpt_oss_window() -> Attention:
    """gpt-oss-120b's windowed layer: 64 query and 8 KV heads of 64, window 128."""
    att = model_blocks(load_model("gpt-oss-120b")).kinds[0].attention()
    assert att.window == 128 and att.q_width // att.num_heads == 64
    return att


def test_gb200_reproduces_nvidias_window_128_kernel_times():
    """NVIDIA's cuDNN 9.22 gpt-oss rows on GB200 (cudnn-frontend fb682ce761a2, results/gpt_oss/gb200/
    gpt_oss_20260424_100011.csv): batch 2, 128 query and 128 KV heads of 64, 8k tokens, causal window 128: forward
    0.414 ms, backward 0.911 ms (non-deterministic). The model's FLOPs (w keys for every query) times 1 - w/(2s) is
    NVIDIA's band; at the measured 165 and 187 TFLOP/s the table gives the kernel times back (the TFLOP/s are
    published rounded to 1, hence 0.5 %)."""
    gpu = load_gpu("gb200")
    att = Attention(8192, 128, 8192, 8192, 0, True, False, window=128)
    one = np.ones(1, dtype=int)
    x = Micro(8192, 2 * one, one, one, np.zeros(1, dtype=bool), "bf16", "flash")
    band = 2 * 128 * (128 * 129 // 2 + (8192 - 128) * 128)  # NVIDIA's flops(): score elements of the band
    np.testing.assert_allclose(att.core(x).flop * (1 - 128 / (2 * 8192)), 4 * 64 * band, rtol=1e-3)
    fwd, bwd = flash_core_times(att, x, gpu)
    overhead = 2 * gpu.kernel_overhead_s
    np.testing.assert_allclose(fwd - overhead, 0.414e-3, rtol=5e-3)
    np.testing.assert_allclose(bwd - overhead, 0.911e-3, rtol=5e-3)


@pytest.mark.parametrize("name,seq_len,fwd_tflops,bwd_tflops", [
    ("gb200", 4096, 161, 182), ("gb200", 16384, 167, 188), ("gb300", 8192, 172, 198),
    ("b200", 8192, 148, 168),  # GB200's x 0.9, derived
    ("h200", 8192, 95, 87),  # derived from H200's window 1024 and GB200's window ratio
])
def test_gpt_oss_window_layer_is_timed_at_the_window_curve(name, seq_len, fwd_tflops, bwd_tflops):
    """gpt-oss's window-128 layer runs at the table's window-128 rate at its sequence length, about an eighth of the
    dense unmasked rate the window length looked up before (GB200: 917 forward, the 2k rate); a global layer of the
    same model keeps its dense causal rate."""
    gpu, att, table = load_gpu(name), gpt_oss_window(), load_tables(name).attention.get("flash")
    x = micro(seq_len=seq_len)
    credited = att.core(x).flop * (1 - 128 / (2 * seq_len))
    fwd, bwd = flash_core_times(att, x, gpu)
    overhead = 2 * gpu.kernel_overhead_s
    np.testing.assert_allclose(fwd - overhead, credited / (fwd_tflops * 1e12), rtol=1e-9)
    np.testing.assert_allclose(bwd - overhead, BACKWARD_FLOP_RATIO * credited / (bwd_tflops * 1e12), rtol=1e-9)
    dense = table.rate("fwd", False, 64, 128)
    assert fwd_tflops * 1e12 < dense / 2  # the window costs more time per FLOP than the dense rule said


@pytest.mark.parametrize("name", SETS)
def test_window_rates_are_positive_and_below_the_dense_peak(name: str):
    table, peak = load_tables(name).attention.get("flash"), load_gpu(name).peak("bf16")
    seq = np.geomspace(512, 131072, 9)
    for direction in ("fwd", "bwd"):
        for d in (32, 64, 96, 128, 160, 256):
            for w in (16, 64, 128, 200, 512, 1024, 1500, 2048, 4096, 8192, 65536):
                rates = table.window_rate(direction, d, w, seq)
                assert np.all(rates > 0) and np.all(rates < peak), (direction, d, w)


@pytest.mark.parametrize("name", ["gb200", "gb300", "h100-sxm"])
def test_window_axis_runs_from_the_measured_windows_to_the_dense_rule(name: str):
    """Between window 128 and 1024 the rate lies between the two curves and never falls as the window widens; from the
    first dense length past 1024 (2048) on, the band runs at the dense unmasked rate of a call of w tokens."""
    table = load_tables(name).attention.get("flash")
    for direction in ("fwd", "bwd"):
        at = [float(table.window_rate(direction, 64, w, 8192)) for w in (128, 181, 256, 512, 1024, 1448, 2048)]
        assert all(b >= a for a, b in zip(at, at[1:])), (direction, at)
        for w in (2048, 4096, 8192):
            np.testing.assert_allclose(table.window_rate(direction, 64, w, 8192), table.rate(direction, False, 64, w))
        # another head dim keeps the measured band efficiency and takes its own dense rate
        np.testing.assert_allclose(table.window_rate(direction, 128, 1024, 8192) / table.rate(direction, False, 128, 1024),
                                   table.band_efficiency(direction, 64, 1024, 8192))


def test_h200_window_1024_is_nvidias_h200_measurement():
    """cudnn-frontend results/h200_919_only_cudnn/gpt_oss_20260227_034819.csv (cuDNN 9.19.1, gpt-oss's 64/8 heads of 64,
    window 1024): forward 349 and backward 300 TFLOP/s at 8k."""
    table = load_tables("h200").attention.get("flash")
    np.testing.assert_allclose(table.window_rate("fwd", 64, 1024, 8192), 349e12)
    np.testing.assert_allclose(table.window_rate("bwd", 64, 1024, 8192), 300e12)


def _table_set(root: Path, name: str, body: dict, monkeypatch) -> None:
    folder = root / "kernels" / "attention"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(body))
    monkeypatch.setenv("MESHPLAN_PROFILES", str(root))


@pytest.mark.parametrize("name", ["gb200", "h100-sxm"])
def test_a_table_without_window_curves_loads_and_keeps_the_dense_rule(name, tmp_path, monkeypatch):
    """The format before window curves: the same table without the key loads, a windowed layer then runs at the dense
    unmasked rate of the window length, and a global layer is timed exactly as with the window curves."""
    body = yaml.safe_load((PROFILES_DIR / "kernels" / "attention" / f"{name}.yaml").read_text())
    assert body.pop("window_curves")
    shipped = load_tables(name).attention.get("flash")
    gpu = load_gpu(name)
    blocks = model_blocks(load_model("gpt-oss-120b"))
    local, glob = (k.attention() for k in blocks.kinds)
    x = micro(seq_len=4096, cp=2, tp=2, n=3)
    with_curves = [flash_core_times(att, x, gpu) for att in (local, glob)]
    _table_set(tmp_path, "old", body, monkeypatch)
    old = load_tables("old").attention.get("flash")
    assert old.window_curves == {}
    for key, grid in shipped.rates_flop_per_s.items():
        np.testing.assert_array_equal(old.rates_flop_per_s[key], grid)
    np.testing.assert_array_equal(old.band_efficiency("fwd", 64, 128, np.array([2048, 8192])), [1.0, 1.0])
    gpu_old = resolve_gpu(gpu.model_copy(update={"kernel_tables": "old"}))
    for direction in (0, 1):  # global: unchanged to the last bit
        np.testing.assert_array_equal(flash_core_times(glob, x, gpu_old)[direction], with_curves[1][direction])
    fwd = flash_core_times(local, x, gpu_old)[0]
    core = local.core(x)
    floor = core.bytes / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency)  # the HBM floor may bind here
    expect = np.maximum(core.flop * (1 - 128 / (2 * 4096)) / old.rate("fwd", False, 64, 128), floor)
    np.testing.assert_allclose(fwd, expect + 2 * gpu.kernel_overhead_s, rtol=1e-12)
    assert np.all(fwd < with_curves[0][0])  # the dense rule was the fast one


GOOD_WINDOW = {"direction": "fwd", "causal": True, "head_dim": 64, "window": 128, "tflops": [100, 110], "source": "x"}


@pytest.mark.parametrize("change,message", [
    ({"window": 0}, r"window_curves\[0\]: window must be a whole number"),
    ({"window": 128.5}, r"window_curves\[0\]: window must be a whole number"),
    ({"window": 512}, r"window_curves\[0\]: window must be .* shorter than the shortest seq_len \(512\)"),
    ({"causal": False}, r"window_curves\[0\]: causal must be true"),
    ({"direction": "both"}, r"window_curves\[0\]: direction must be fwd or bwd"),
    ({"head_dim": -64}, r"window_curves\[0\]: head_dim must be a positive number"),
    ({"tflops": [100]}, r"window_curves\[0\]: tflops must be 2 positive numbers"),
    ({"tflops": [100, 0]}, r"window_curves\[0\]: tflops must be 2 positive numbers"),
    ({"seq_lens": [4096, 2048]}, r"window_curves\[0\]: seq_lens must be increasing"),
    ({"source": " "}, r"window_curves\[0\]: every curve names its source"),
    (None, r"window_curves\[1\]: a second curve for direction fwd, head_dim 64, window 128"),
    ("not a list", "window_curves must be a list"),
])
def test_a_bad_window_curve_is_refused_naming_the_field(tmp_path, monkeypatch, change, message):
    dense = [{"direction": d, "causal": c, "head_dim": 64, "tflops": [300, 400], "source": "x"}
             for d, c in (("fwd", False), ("fwd", True), ("bwd", False))]
    if change is None:
        windows = [GOOD_WINDOW, GOOD_WINDOW]
    elif isinstance(change, str):
        windows = change
    else:
        windows = [GOOD_WINDOW | change]
    body = {"kind": "public", "gpu": "x", "source": "test", "seq_lens": [512, 1024], "curves": dense,
            "window_curves": windows}
    _table_set(tmp_path, "broken", body, monkeypatch)
    with pytest.raises(SpecError, match=message):
        load_tables("broken").attention.get("flash")
    _table_set(tmp_path, "fine", body | {"window_curves": [GOOD_WINDOW]}, monkeypatch)
    assert load_tables("fine").attention.get("flash").window_curves["fwd"][0].window == 128


# ---- FlashAttention-2 (attention_kernel flash2) ----

def test_flash2_reads_the_fa3_papers_flashattention2_bars_on_h100():
    """The H100 table's flash2 section is FlashAttention-2 as the FA3 paper's Figure 5 measured it (forward) and
    the backward derived from the FA2 README's forward + backward figure; the H200 takes it with the rest."""
    for name in ("h100-sxm", "h200"):
        t = load_tables(name).attention.get("flash2")
        assert round(float(t.rate("fwd", True, 128, 8192)) / 1e12) == 333
        assert round(float(t.rate("fwd", False, 64, 512)) / 1e12) == 282
        # fwd + bwd of the README (causal, head dim 128, 16k: 328 TFLOP/s over 3.5x the forward FLOPs)
        fwd, bwd = float(t.rate("fwd", True, 128, 16384)), float(t.rate("bwd", True, 128, 16384))
        assert 3.5 / (1 / fwd + BACKWARD_FLOP_RATIO / bwd) / 1e12 == pytest.approx(328, abs=1)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash2_is_slower_than_the_cudnn_kernel_on_hopper_everywhere(direction, causal):
    fast, fa2 = load_tables("h100-sxm").attention.get("flash"), load_tables("h100-sxm").attention.get("flash2")
    for d in (64, 96, 128, 256):
        seq = np.array([512, 1024, 2048, 4096, 8192, 16384, 65536])
        assert np.all(fa2.rate(direction, causal, d, seq) < fast.rate(direction, causal, d, seq))


def test_flash2_core_is_slower_and_the_step_follows():
    """The same layer and micro-batch: the FlashAttention-2 core takes longer each way; only the core changes."""
    gpu, att = load_gpu("h100-sxm"), llama3_8b_attention()
    f_fwd, f_bwd = flash_core_times(att, micro(kernel="flash"), gpu)
    s_fwd, s_bwd = flash_core_times(att, micro(kernel="flash2"), gpu)
    assert s_fwd[0] > 1.4 * f_fwd[0] and s_bwd[0] > 1.4 * f_bwd[0]
    from planner.api import evaluate

    run = dict(model="llama3.1-8b", num_gpus=8, global_batch_size=16, seq_len=8192,
               strategy={"dp": 8, "zero_stage": 3, "micro_batch_size": 2, "recompute": "full"})
    h100 = {k: evaluate(cluster="dgx-h100", attention_kernel=k, **run) for k in ("flash", "flash2")}
    assert h100["flash2"].step_time_s > h100["flash"].step_time_s
    assert h100["flash2"].peak_memory_bytes == h100["flash"].peak_memory_bytes
    # the A100 has no attention table: its fitted roofline times any fused kernel (FlashAttention-2 is its kernel)
    a100 = {k: evaluate(cluster="dgx-a100-80gb", attention_kernel=k, **run) for k in ("flash", "flash2")}
    assert a100["flash2"].step_time_s == a100["flash"].step_time_s


@pytest.mark.parametrize("cluster,model,message", [
    ("dgx-b200", "llama3.1-8b", r"attention_kernel 'flash2' on B200.*no measurement of that kernel"),
    ("gb200-nvl72", "llama3.1-8b", r"profiles/kernels/attention/gb200.yaml"),
    ("dgx-h100", "gpt-oss-20b", r"sliding-window layers.*no window measurement"),
])
def test_flash2_without_a_measurement_is_refused(cluster, model, message):
    from planner.api import plan

    with pytest.raises(SpecError, match=message):
        plan(model=model, cluster=cluster, num_gpus=8, global_batch_size=64, seq_len=4096, attention_kernel="flash2")


def test_flash2_is_refused_on_the_cli_with_exit_2(capsys):
    from planner.cli import main

    code = main(["plan", "-m", "llama3.1-8b", "-c", "dgx-b200", "-n", "8", "-b", "64", "-s", "4096",
                 "--attention-kernel", "flash2"])
    out, err = capsys.readouterr()
    assert code == 2 and "attention_kernel 'flash2'" in err and "Traceback" not in out + err


# ---- FlashAttention v1 (attention_kernel flash1) ----

FA1_README = {(False, 64): [157, 159, 161, 161, 166, 168], (False, 128): [127, 127, 128, 131, 137, 139],
              (True, 64): [104, 123, 136, 138, 149, 156], (True, 128): [98, 109, 108, 126, 135, 137]}


@pytest.mark.parametrize("causal,head_dim", sorted(FA1_README))
def test_flash1_reproduces_the_fa2_readmes_flashattention_bars_forward_plus_backward(causal, head_dim):
    """Only forward + backward is published for FlashAttention v1 on H100 (the FA2 README figure): the table's two
    directions, whatever their split, give back those bars (3.5x the forward FLOPs over the sum of the times)."""
    t = load_tables("h100-sxm").attention.get("flash1")
    for seq, bar in zip([512, 1024, 2048, 4096, 8192, 16384], FA1_README[(causal, head_dim)]):
        fwd, bwd = float(t.rate("fwd", causal, head_dim, seq)), float(t.rate("bwd", causal, head_dim, seq))
        assert 3.5 / (1 / fwd + BACKWARD_FLOP_RATIO / bwd) / 1e12 == pytest.approx(bar, abs=1.5)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash1_is_slower_than_flash2_on_hopper_everywhere(direction, causal):
    fa2, fa1 = load_tables("h100-sxm").attention.get("flash2"), load_tables("h200").attention.get("flash1")
    seq = np.array([512, 1024, 2048, 4096, 8192, 16384, 65536])
    for d in (64, 96, 128, 256):
        assert np.all(fa1.rate(direction, causal, d, seq) < fa2.rate(direction, causal, d, seq))


def test_flash1_lengthens_the_step_and_megatron_cannot_run_it():
    from planner.api import evaluate, plan

    run = dict(model="mpt-7b", cluster="dgx-h100", num_gpus=8, global_batch_size=48, seq_len=2048)
    strategy = {"dp": 8, "zero_stage": 3, "micro_batch_size": 6}
    est = {k: evaluate(**run, strategy=strategy, attention_kernel=k, framework="torchtitan")
           for k in ("flash2", "flash1")}
    assert est["flash1"].step_time_s > est["flash2"].step_time_s
    assert est["flash1"].peak_memory_bytes == est["flash2"].peak_memory_bytes
    megatron = evaluate(**run, strategy=strategy, attention_kernel="flash1")
    assert not megatron.valid and any("attention_kernel flash1" in r for r in megatron.reasons)
    result = plan(**run, attention_kernel="flash1")
    assert not result.plans and result.stats.rejected.get("framework", 0) > 0


@pytest.mark.parametrize("cluster,message", [
    ("dgx-b200", r"attention_kernel 'flash1' on B200.*no measurement of that kernel"),
    ("dgx-a100-80gb", r"attention_kernel 'flash1' on A100.*no attention table.*roofline times flash and flash2 only"),
])
def test_flash1_is_refused_where_no_table_measures_it(cluster, message):
    """Blackwell's tables have no flash1 section; the A100 has no table, and its fitted roofline is
    FlashAttention-2's, which runs twice as fast as v1 there: both refuse rather than time it as another kernel."""
    from planner.api import plan

    with pytest.raises(SpecError, match=message):
        plan(model="llama3.1-8b", cluster=cluster, num_gpus=8, global_batch_size=64, seq_len=4096,
             attention_kernel="flash1", framework="torchtitan")
