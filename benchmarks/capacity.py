"""Time to train published pre-training runs: predicted (best plan x goodput) against published.

    python -m benchmarks.capacity [RUNS.yaml]

Each row of `benchmarks/data/capacity_runs.yaml` (or RUNS.yaml in its format) gives a run's model and cluster
presets, GPU count, batch, sequence, token budget and published GPU-hours, with its sources. The prediction is
`planner.plan_capacity` at that one GPU count: the token budget over the best plan's tokens/s, divided by the
goodput (failures at the default rate, Llama 3's; checkpoints at the row's published storage bandwidth). The
error is predicted GPU-hours / published - 1 (< 0: the planner predicts a faster run). Nothing here is fitted:
the cost model's calibration is fixed, and a row that misses is reported as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from planner import plan_capacity
from planner.specs.files import load_path

DATA = Path(__file__).resolve().parent / "data" / "capacity_runs.yaml"
#: The error every row of the acceptance set is expected to stay within (tests/test_capacity_benchmark.py).
TOLERANCE = 0.20
DAY_S = 86_400.0


def load_runs(path: Path = DATA) -> list[dict[str, Any]]:
    """The rows of a runs file; each must name its `source`."""
    runs = load_path(path, "capacity runs")["runs"]
    for run in runs:
        if not str(run.get("source", "")).strip():
            raise ValueError(f"{path}: run {run.get('name')!r} names no source")
    return runs


def predict(run: dict[str, Any]) -> dict[str, Any]:
    """One run's prediction next to its published GPU-hours."""
    result = plan_capacity(model=run["model"], cluster=run["cluster"], gpus=int(run["num_gpus"]),
                           global_batch_size=int(run["global_batch_size"]), seq_len=int(run["seq_len"]),
                           tokens=float(run["tokens"]),
                           aggregate_write_bw_bytes_per_s=float(run["ckpt_bandwidth_gb_per_s"]) * 1e9,
                           ranking="fastest")
    row = result.rows[0]
    if row.plan is None:
        return {"name": run["name"], "error": None, "reason": row.reason}
    published = float(run["published_gpu_hours"])
    n = int(run["num_gpus"])
    return {"name": run["name"], "num_gpus": n, "layout": row.plan.strategy.short(), "mfu": row.mfu,
            "goodput": row.goodput.fraction, "ideal_days": row.time_to_train_s / DAY_S,
            "predicted_days": row.time_to_train_goodput_s / DAY_S, "published_days": published / n / 24,
            "predicted_gpu_hours": row.gpu_hours, "published_gpu_hours": published,
            "error": row.gpu_hours / published - 1}


def main(argv: list[str]) -> int:
    runs = load_runs(Path(argv[0]) if argv else DATA)
    print(f"{'run':32s} {'GPUs':>6s} {'MFU %':>6s} {'goodput %':>9s} {'days':>7s} {'published':>9s} "
          f"{'GPU-h (M)':>9s} {'published':>9s} {'error':>7s}")
    worst = 0.0
    for run in runs:
        p = predict(run)
        if p["error"] is None:
            print(f"{p['name']:32s} no plan: {p['reason']}")
            continue
        if run.get("acceptance"):
            worst = max(worst, abs(p["error"]))
        mark = "" if run.get("acceptance") else "  (GPU count and batch assumed)"
        print(f"{p['name']:32s} {p['num_gpus']:6d} {100 * p['mfu']:6.1f} {100 * p['goodput']:9.1f} "
              f"{p['predicted_days']:7.1f} {p['published_days']:9.1f} {p['predicted_gpu_hours'] / 1e6:9.2f} "
              f"{p['published_gpu_hours'] / 1e6:9.2f} {100 * p['error']:+6.1f}%{mark}")
    print("days: predicted wall time with goodput; published days = published GPU-hours / GPUs / 24")
    print(f"error: predicted / published GPU-hours - 1; largest |error| of the runs whose setup is published "
          f"{100 * worst:.1f}% (tolerance {100 * TOLERANCE:.0f}%); the assumed rows are reported, not judged")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
