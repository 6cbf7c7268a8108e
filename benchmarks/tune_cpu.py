"""`meshplan tune` on this machine's CPU: does the calibration fed back from real trials make the
model's predictions better?

A real study (2 gloo ranks, the small GPT of benchmarks/validate_cpu.py, the measured `local-cpu`
profile) in a temporary SQLite file: the analytic top plans run first, the calibration is refitted
every `--calibrate-every` ok trials, and the candidates are re-ranked on it. Printed:

- every trial: its strategy, where it came from, predicted step time on the profile, predicted on
  the calibration in force when it ran (fitted on earlier trials only), measured, both errors,
  the spread of its timed steps and whether the host was busy;
- held out: over the trials that ran after a calibration, the median |step-time error| of their
  profile prediction and of their calibrated one (the calibration never saw them);
- in sample: the final fit's median |error| on all ok trials, before and after;
- the load average before and after, and the wall time.

    python benchmarks/tune_cpu.py [--trials 9] [--calibrate-every 3] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.validate_cpu import MODEL  # noqa: E402
from executors.tune import TuneOptions, tune  # noqa: E402
from executors.validate import ValidateOptions  # noqa: E402

NUM_RANKS = 2
GLOBAL_BATCH = 8
SEQ_LEN = 256


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=9, help="measured trials")
    parser.add_argument("--calibrate-every", type=int, default=3, help="refit after this many new ok trials")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trial")
    parser.add_argument("--top-k", type=int, default=3, help="analytic top plans run first")
    parser.add_argument("--cluster", default="local-cpu", help="cluster profile")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)

    def event(kind, data):
        if kind in ("trial_start", "calibrated", "skipped"):
            shown = {k: v for k, v in data.items() if k not in ("best",)}
            print(f"  {kind}: {shown}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshplan-tune-bench-") as tmp:
        options = TuneOptions(storage=f"sqlite:///{tmp}/tune.db", n_trials=args.trials, top_k=args.top_k,
                              calibrate_every=args.calibrate_every, sampler_seed=0,
                              calibration_out=Path(tmp) / "calibration.yaml",
                              run=ValidateOptions(device="cpu", timed_steps=args.steps, warmup_steps=1, timeout_s=600))
        report = tune(MODEL, args.cluster, NUM_RANKS, GLOBAL_BATCH, SEQ_LEN, precision="fp32", options=options,
                      on_event=event)
    wall = time.perf_counter() - start
    print(f"\n{MODEL.name}: {NUM_RANKS} ranks, batch {GLOBAL_BATCH} x {SEQ_LEN}, fp32, cluster {args.cluster}; "
          f"{report.measured} measured trials")
    head = (f"{'#':>3} {'strategy':34} {'origin':34} {'status':8} {'pred (s)':>9} {'pred cal':>9} {'meas (s)':>9} "
            f"{'err':>6} {'err cal':>7} {'spread':>6} busy")
    print(head)
    print("-" * len(head))
    for r in report.trials:
        if r.state == "PRUNED":
            continue
        spread = "-" if r.spread is None else f"{100 * r.spread:.0f}%"
        print(f"{r.number:>3} {r.label[:34]:34} {r.origin[:34]:34} {r.status[:8]:8} {_num(r.predicted_step_s):>9} "
              f"{_num(r.predicted_step_s_calibrated):>9} {_num(r.measured_step_s):>9} {_pct(r.error):>6} "
              f"{_pct(r.error_calibrated):>7} {spread:>6} {'yes' if r.busy else 'no'}")
    rr = report.reranked_errors
    if rr.get("n"):
        print(f"\nheld out (trials run after a calibration fitted on earlier ones, n={rr['n']:.0f}): median "
              f"|step-time error| {100 * rr['before']:.1f}% on the profile -> {100 * rr['after']:.1f}% calibrated")
    elif any(r.predicted_step_s_calibrated is not None for r in report.trials):
        print("\nheld out: no ok trial ran after a calibration (raise --trials)")
    else:
        print("\nheld out: no calibration was in force while trials ran (no fit paid for its parameters on the "
              "trials before; the profile was kept)")
    cal = report.calibration
    if cal is None:
        print("in sample: no parameter set lowers the profile's error on these trials enough to pay for itself "
              "(10 % a parameter): the profile is kept")
    else:
        print(f"in sample (final fit on {len(cal.after)} ok trials): median |step-time error| "
              f"{100 * cal.median_abs(cal.before):.1f}% -> {100 * cal.median_abs(cal.after):.1f}%; fitted "
              + ", ".join(f"{k} = {v:.4g}" for k, v in cal.values.items())
              + (f"; at the bound of its range: {', '.join(cal.at_bound)}" if cal.at_bound else "")
              + (f"; not identified: {', '.join(cal.not_identified)}" if cal.not_identified else ""))
    ok = [r for r in report.trials if r.status == "ok"]
    if ok:
        busy = sum(r.busy for r in ok)
        print(f"busy-host trials: {busy} of {len(ok)}; median spread of the timed steps "
              f"{100 * statistics.median(r.spread or 0 for r in ok):.0f}%")
    if report.best is not None:
        print(f"best measured: {report.best.label}: {report.best.tokens_per_s:,.0f} tokens/s (trial {report.best.number})")
    print(f"load average (1 min) before/after: {load_before:.2f}/{os.getloadavg()[0]:.2f}; wall time {wall:.0f} s; "
          f"stopped: {report.stopped}")
    if args.json:
        args.json.write_text(json.dumps(report.model_dump(mode="json"), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
