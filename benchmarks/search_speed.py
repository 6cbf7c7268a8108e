"""Search speed: plan Llama-3.1-405B on 16,384 H100s over the full knob space.

    python benchmarks/search_speed.py [--repeat 5]

Prints candidates enumerated and scored, seconds and candidates per second
(best of the repeats; the first run includes imports and warm-up). Run it with
one BLAS/numpy thread to measure one core: OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from planner import plan  # noqa: E402

QUESTION = dict(model="llama3.1-405b", cluster="dgx-h100", num_gpus=16384, global_batch_size=2048, seq_len=8192)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        result = plan(**QUESTION, top_k=10)
        runs.append((time.perf_counter() - t0, result))
    wall, result = min(runs, key=lambda r: r[0])
    st = result.stats
    print(f"question: {QUESTION}")
    print(f"candidates enumerated:        {st.num_candidates:>10,}")
    print(f"candidates scored (valid):    {st.num_valid:>10,}")
    print(f"candidates that fit:          {st.num_feasible:>10,}")
    print(f"search time (inside plan):    {st.search_time_s:10.3f} s")
    print(f"plan() wall time, best of {args.repeat}:  {wall:10.3f} s")
    print(f"candidates scored per second: {st.num_valid / st.search_time_s:>10,.0f}")
    print(f"candidates enumerated per s:  {st.num_candidates / st.search_time_s:>10,.0f}")
    best = result.plans[0]
    print(f"best: {best.strategy.short()}  step {best.estimate.step_time_s:.2f} s, MFU {100 * best.estimate.mfu:.1f} %")


if __name__ == "__main__":
    main()
