"""Transformer Engine's published GEMM profiling (B300, H200 NVL) against the cost model's GEMM and FP8 cast
terms: kernel-level figures, no end-to-end run (benchmarks/data/te_gemm_profiling.json names the source).

    PYTHONPATH=. python -m benchmarks.te_gemm_profiling

For each GPU it prints the twelve GEMMs of one layer of the profiled model (hidden 4096, intermediate 16384,
15,872 tokens) as the model times them (BF16, per-tensor FP8, MXFP8) beside the measured pre-quantised times,
and per FP8 recipe the quantisation work of TE's autocast benchmark (each timed call casts its input and its
weight) as the model costs it (`ElementwiseModel.time_s` of `fp8_cast_bytes_per_element` and
`fp8_cast_kernels`) beside the measured autocast minus pre-quantised time.
"""

from __future__ import annotations

import json
from pathlib import Path

from cost_models.blocks import Gemm
from cost_models.compute import gemm_time
from cost_models.elementwise import elementwise_model, fp8_cast_bytes_per_element, fp8_cast_kernels
from profiles import load_cluster

DATA = Path(__file__).resolve().parent / "data" / "te_gemm_profiling.json"
MS = 1e3


def layer_shapes(hidden: int, intermediate: int, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of the twelve GEMMs benchmark_gemm.py times for one layer: Fprop of QKV, attention out,
    MLP up and down, then Dgrad (K and N swapped) and Wgrad (M moved to the contraction axis)."""
    fprop = [(tokens, hidden, 3 * hidden), (tokens, hidden, hidden), (tokens, hidden, intermediate),
             (tokens, intermediate, hidden)]
    return fprop + [(m, n, k) for m, k, n in fprop] + [(k, m, n) for m, k, n in fprop]


def model_gemm_ms(cluster: str, shapes, precision: str, recipe: str | None = None) -> float:
    gpu = load_cluster(cluster).gpu
    return sum(float(gemm_time(Gemm(2.0 * m * n * k, m, n, k), gpu, precision, recipe)) for m, k, n in shapes) * MS


def model_cast_ms(cluster: str, shapes, recipe: str) -> float:
    """The quantisation work of the autocast benchmark: every call casts its input (M x K) and weight (K x N)."""
    table = elementwise_model(load_cluster(cluster).gpu)
    elements = sum(m * k + k * n for m, k, n in shapes)
    kernels = 2 * len(shapes) * fp8_cast_kernels(recipe)
    return float(table.time_s(fp8_cast_bytes_per_element(recipe, table.fp8_transpose) * elements, kernels)) * MS


def rows() -> list[dict]:
    data = json.loads(DATA.read_text())
    shapes = layer_shapes(**{k: data["model"][k] for k in ("hidden", "intermediate", "tokens")})
    out = []
    for gpu, d in data["gpus"].items():
        cluster, pre, auto = d["cluster"], d["prequantized"], d["autocast"]
        for name, prec, recipe in (("bf16", "bf16", None), ("fp8_tensorwise", "fp8", "tensorwise"), ("mxfp8", "fp8", "mxfp8")):
            if name in pre:
                out.append(dict(gpu=gpu, what=f"GEMMs {name}", model=model_gemm_ms(cluster, shapes, prec, recipe),
                                measured=pre[name]))
        for recipe, measured in auto.items():
            base = pre["mxfp8" if recipe == "mxfp8" else "fp8_tensorwise"]
            out.append(dict(gpu=gpu, what=f"casts {recipe}", model=model_cast_ms(cluster, shapes, recipe),
                            measured=measured - base))
    return out


def main() -> None:
    print("Transformer Engine GEMM profiling (docs/examples/gemm_profiling, d0067d0da): one layer, ms")
    print(f"{'GPU':6s} {'term':24s} {'model':>8s} {'measured':>9s} {'error':>7s}")
    for r in rows():
        print(f"{r['gpu']:6s} {r['what']:24s} {r['model']:8.3f} {r['measured']:9.3f} {r['model'] / r['measured'] - 1:+7.1%}")
    print("H200 rows were measured on an H200 NVL (600 W) and are modelled on the dgx-h200 preset (700 W SXM): "
          "compare their ratios, not their absolute times.")


if __name__ == "__main__":
    main()
