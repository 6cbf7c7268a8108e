"""Predict every published row in ../shared/validation and print the errors.

    python -m benchmarks.accuracy

Compares step times (SC'21 hardware TFLOP/s are turned into step times with
their Eq. 3, so FLOP conventions cancel), and ZeRO Table 1 model-state memory.
The A100 efficiencies were fitted on Korthikanti Table 4 only
(profiles/calibration/a100-80gb.yaml); every row below is held out.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np

from cost_models.memory import model_state_bytes
from benchmarks.validation import (
    korthikanti_table5,
    nemo_h100_fp8,
    predict,
    sc21_table1,
    sc21_table2,
    torchtitan_fsdp2,
    zero_table1,
)

TARGETS = {"SC'21 Table 1": (0.07, 0.15), "Korthikanti Table 5": (0.07, 0.15)}


def step_tables() -> dict[str, list]:
    return {"SC'21 Table 1": [predict(c) for c in sc21_table1()],
            "Korthikanti Table 5": [predict(c) for c in korthikanti_table5()],
            "SC'21 Table 2": [predict(c) for c in sc21_table2()],
            "torchtitan FSDP2 (64 A100)": [predict(c) for c in torchtitan_fsdp2()],
            "NeMo DGX-H100 FP8 (H100 efficiencies carried over from the A100)": [predict(c) for c in nemo_h100_fp8()]}


def zero_rows() -> list[tuple[str, float, float, float]]:
    """(label, predicted GB, printed GB, one unit of the printed last digit)."""
    rows = []
    for c in zero_table1():
        states = model_state_bytes(np.array(c.params), np.array(c.zero_stage), np.array(c.dp), np.array(False),
                                   "fp16", "fp16", "adam")
        rows.append((c.label, float(sum(states.values())) / 1e9, c.memory_gb, printed_unit(c.memory_gb)))
    return rows


def printed_unit(value: float) -> float:
    """One unit of the last digit the paper printed: 0.12 -> 0.01, 31.4 -> 0.1, 513 -> 1."""
    text = repr(float(value)).rstrip("0").rstrip(".")
    return 10.0 ** -(len(text.split(".")[1]) if "." in text else 0)


def summary(errors: list[float]) -> tuple[float, float]:
    abs_err = [abs(e) for e in errors]
    return statistics.median(abs_err), max(abs_err)


def main() -> int:
    ok = True
    for table, preds in step_tables().items():
        print(f"\n{table}")
        print(f"  {'row':34s} {'measured':>10s} {'predicted':>10s} {'error':>8s}  strategy")
        errors = []
        for p in preds:
            if p.predicted_step_s is None:
                print(f"  {p.case.label:34s} {p.case.measured_step_s:9.2f}s {'no fit':>10s} {'':>8s}  {p.strategy}  ({p.note})")
                continue
            errors.append(p.error)
            fitted = "  (calibration row)" if p.case.table == "SC'21 Table 2" and "PTD" in p.case.label else ""
            print(f"  {p.case.label:34s} {p.case.measured_step_s:9.2f}s {p.predicted_step_s:9.2f}s {p.error:+8.1%}  "
                  f"{p.strategy}{fitted}")
        if errors:
            med, worst = summary(errors)
            line = f"  median |error| {med:.1%}, max |error| {worst:.1%} over {len(errors)} of {len(preds)} rows"
            if table in TARGETS:
                target_med, target_max = TARGETS[table]
                met = med <= target_med and worst <= target_max and len(errors) == len(preds)
                ok &= met
                line += f"  (target median <= {target_med:.0%}, max <= {target_max:.0%}: {'met' if met else 'NOT met'})"
            print(line)
    print("\nZeRO Table 1 (model-state memory per GPU, GB = 1e9 bytes; the paper prints 2-4 significant digits)")
    print(f"  {'row':34s} {'printed':>10s} {'predicted':>10s} {'error':>8s}  within the printed digit")
    errs, within = [], []
    for label, pred, meas, unit in zero_rows():
        err = pred / meas - 1
        errs.append(err)
        within.append(abs(pred - meas) < unit)
        print(f"  {label:34s} {meas:10.2f} {pred:10.4f} {err:+8.2%}  {'yes' if within[-1] else 'NO'}")
    med, worst = summary(errs)
    big = [abs(e) for (_, _, meas, unit), e in zip(zero_rows(), errs) if unit * 100 <= meas]
    met = all(within)
    ok &= met
    print(f"  median |error| {med:.2%}, max |error| {worst:.2%} over {len(errs)} rows; "
          f"max {max(big):.2%} where the printed digit resolves 1%; {sum(within)} of {len(within)} rows within one "
          f"unit of the printed digit (target: reproduced to rounding: {'met' if met else 'NOT met'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
