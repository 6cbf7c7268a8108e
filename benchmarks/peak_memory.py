"""Predicted peak memory next to published and locally measured peaks.

    python -m benchmarks.peak_memory [DATA.json]

Published rows (`benchmarks/data/peak_memory.json`, or DATA.json in its format,
torchtitan's H100 benchmark): the published figure is the caching allocator's peak
reservation, so the prediction compared with it is meshplan's peak minus the terms
outside the allocator (`cost_models.memory.OUTSIDE_ALLOCATOR_TERMS`: CUDA context,
NCCL buffers, flat reserve). The runs are torchtitan's, so they are costed as
framework torchtitan (profiles/frameworks/torchtitan.yaml: FSDP2's fp32 shards, its
op-level selective recompute, torchao float8 without cached FP8 weights) with
PyTorch's unfused cross entropy (torchtitan components/loss.py), as
`benchmarks.validation` costs torchtitan's throughput sets. The published numbers are
reported, never fitted.

CPU rows (`meshplan validate` on this machine's `local-cpu` profile, recorded in
the same file with the date and command): the measurement counts live tensors
over the parity steps (plain SGD, no optimizer state) and one warm-up step whose
Adam states are created in `step()`, after the activations are freed. The
prediction compared with it is therefore the larger of the activation peak
without optimizer states and the optimizer-step peak (params + grads + states),
both from the same estimate; the estimate's own peak (states and activations
together, as in steady training) is printed beside it.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from cost_models.memory import OUTSIDE_ALLOCATOR_TERMS, RUNTIME_TERMS
from planner import evaluate
from planner.calibrate import run_settings
from profiles import load_cluster

DATA = Path(__file__).resolve().parent / "data" / "peak_memory.json"
GIB, MIB = 2**30, 2**20
#: the published runs' GPU is an H100 with 96 GB HBM2e; its memory tables are the H100's
PUBLISHED_CLUSTER = "dgx-h100"
#: a published row must not be under-predicted by more than this (relative to the measurement)
MAX_UNDER = 0.05
#: how the published runs trained (the data file's source: pytorch/torchtitan): the framework, which brings its loss
PUBLISHED_OPTIONS = {"framework": "torchtitan"}


def published_rows(data: dict) -> list[dict]:
    """Each published row with its prediction (GiB) and signed error."""
    cluster = load_cluster(PUBLISHED_CLUSTER)
    out = []
    for row in data["rows"]:
        gpus = row["num_gpus"]
        mbs, dp = row["strategy"]["micro_batch_size"], row["strategy"].get("dp", 1)
        est = evaluate(row["model"], cluster, gpus, mbs * dp, row["seq_len"], row["precision"], strategy=row["strategy"],
                       **run_settings(PUBLISHED_OPTIONS))
        reserved = est.peak_memory_bytes - sum(est.memory_bytes.get(t, 0.0) for t in OUTSIDE_ALLOCATOR_TERMS)
        pred = reserved / GIB
        out.append({**row, "predicted_gib": pred, "error": (pred - row["measured_gib"]) / row["measured_gib"],
                    "terms_gib": {k: v / GIB for k, v in est.memory_bytes.items() if v}})
    return out


def cpu_rows(data: dict) -> list[dict]:
    """Each recorded CPU validation row with the prediction for its measurement window (MiB)."""
    from benchmarks.validate_cpu import GLOBAL_BATCH, MODEL, NUM_RANKS, SEQ_LEN

    cpu = data["cpu_validate"]
    cluster = load_cluster("local-cpu")
    out = []
    for row in cpu["rows"]:
        est = evaluate(MODEL, cluster, NUM_RANKS, GLOBAL_BATCH, SEQ_LEN, "fp32", strategy=row["strategy"],
                       **run_settings({}))
        m = est.memory_bytes
        tensors = est.peak_memory_bytes - sum(m.get(t, 0.0) for t in RUNTIME_TERMS)
        step_peak = m["params"] + m["grads"] + m["optimizer"]
        window = max(tensors - m["optimizer"], step_peak)
        out.append({**row, "steady_mib": tensors / MIB, "window_mib": window / MIB,
                    "error": (window / MIB - row["measured_mib"]) / row["measured_mib"]})
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    data = json.loads((Path(argv[0]) if argv else DATA).read_text())
    rows = published_rows(data)
    print(f"published peak reservation ({data['source']['path']}, {PUBLISHED_CLUSTER} tables)")
    print(f"{'row':24s} {'model':13s} {'GPUs':>5s} {'pred (GiB)':>10s} {'meas (GiB)':>10s} {'err':>6s}  largest terms (GiB)")
    for r in rows:
        top = sorted(r["terms_gib"].items(), key=lambda kv: -kv[1])[:5]
        print(f"{r['table']:24s} {r['model']:13s} {r['num_gpus']:5d} {r['predicted_gib']:10.1f} {r['measured_gib']:10.1f} "
              f"{100 * r['error']:+5.0f}%  " + ", ".join(f"{k} {v:.1f}" for k, v in top))
    under = [r for r in rows if r["error"] < -MAX_UNDER]
    print(f"median |error| {100 * statistics.median(abs(r['error']) for r in rows):.1f}%; "
          f"under-predicted by more than {100 * MAX_UNDER:.0f}%: {', '.join(r['table'] for r in under) or 'none'}")
    cpu = cpu_rows(data)
    print(f"\nCPU validate ({data['cpu_validate']['date']}: {data['cpu_validate']['command']})")
    print(f"{'strategy':34s} {'window (MiB)':>12s} {'steady (MiB)':>12s} {'meas (MiB)':>10s} {'err':>6s}")
    for r in cpu:
        print(f"{r['label']:34s} {r['window_mib']:12.0f} {r['steady_mib']:12.0f} {r['measured_mib']:10.0f} {100 * r['error']:+5.0f}%")
    print(f"median |error| {100 * statistics.median(abs(r['error']) for r in cpu):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
