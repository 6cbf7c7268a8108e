"""Fit and check the share of the MoE token exchange that Megatron's EP overlap hides.

    python -m benchmarks.ep_overlap          # the fit, then every published overlapped row under it

`ClusterSpec.ep_comm_overlap` is the share of the dispatch and combine time that
`--overlap-moe-expert-parallel-comm` hides behind the other micro-batch's compute.
It is fitted on one published A/B, Megatron-Bridge's Qwen3-30B-A3B run on 16 H100s
(`benchmarks/data/mbridge_skills.json`: BF16, EP 16, HybridEP, the same run with the
overlap off and on): the value makes the predicted step-time ratio on/off equal the
measured one (20.9920 s / 24.7138 s), so the rest of the model's error on that shape
cancels out of the fit (least squares of that ratio's relative error,
planner.calibrate.fit_parameters). With the overlap on, the step time is linear in the
share (the exposed exchange is `exchange - share * min(exchange, compute)`), so the fit
is exact.

Every other published row that ran the overlap (Megatron-Bridge's Qwen3-235B on
H100, GPT-OSS on GB200, DeepSeek-V3 on B200, ...) is not fitted and is printed under
the shipped value: they are the check.
"""

from __future__ import annotations

import sys

import numpy as np

from benchmarks.calibration import base_cluster, with_parameters
from benchmarks.validation import PUBLIC_SETS, predict, public_runs
from planner.calibrate import FitParameter, fit_parameters

FIT_SET = "mbridge_skills"
OFF = "qwen3-30b-a3b EP overlap off dgx-h100 bf16 n16 s4096 tp1 pp1 cp1 vp1 ep16"
ON = "qwen3-30b-a3b EP overlap on dgx-h100 bf16 n16 s4096 tp1 pp1 cp1 vp1 ep16"
#: The (set, label) rows the fit uses: the accuracy report counts them as calibration rows.
FIT_ROWS = ((FIT_SET, OFF), (FIT_SET, ON))
PARAMETER = "ep_comm_overlap"


def _case(label: str):
    found = [c for c in public_runs(FIT_SET).cases if c.label == label]
    if len(found) != 1:
        raise SystemExit(f"{FIT_SET}: expected one row labelled {label!r}, found {len(found)}")
    return found[0]


def _step(case, share: float | None) -> float:
    cluster = base_cluster(case.cluster)
    if share is not None:
        cluster = with_parameters(cluster, {PARAMETER: share})
    p = predict(case, cluster)
    if p.predicted_step_s is None:
        raise SystemExit(f"{case.label}: no prediction ({p.note})")
    return p.predicted_step_s


def fit() -> tuple[float, float, float]:
    """(share, measured on/off ratio, predicted off step) of the A/B (module docstring): least squares
    (planner.calibrate.fit_parameters) of the relative error of the predicted on/off step ratio, bounded
    to [0, 1]."""
    off, on = _case(OFF), _case(ON)
    ratio = on.measured_step_s / off.measured_step_s
    off_s = _step(off, 0.0)

    def residual(values: dict[str, float]) -> np.ndarray:
        return np.array([_step(on, values[PARAMETER]) / (ratio * off_s) - 1])

    result = fit_parameters(residual, [FitParameter(name=PARAMETER, lower=0.0, upper=1.0)], loss="linear")
    return result.values[PARAMETER], ratio, off_s


def overlapped_rows():
    """(set, case) of every published row that ran the EP overlap."""
    for name in PUBLIC_SETS:
        for case in public_runs(name).cases:
            if case.constraints.get("overlap_moe_comm"):
                yield name, case


def main(argv: list[str]) -> int:
    share, ratio, off_s = fit()
    shipped = base_cluster("dgx-h100").ep_comm_overlap
    print(f"fit on {FIT_SET}, {OFF!r} and {ON!r}:")
    print(f"  measured step ratio on / off {ratio:.4f}; predicted off {off_s:.2f} s")
    print(f"  ep_comm_overlap = {share:.3f}   (shipped in profiles/clusters/dgx-h100.yaml: {shipped})")
    print("\nevery published overlapped row under the shipped profiles (error = predicted / measured - 1):")
    for name, case in overlapped_rows():
        p = predict(case)
        err = "no fit" if p.predicted_step_s is None else f"{p.predicted_step_s / case.measured_step_s - 1:+7.1%}"
        tag = "  [fit row]" if name == FIT_SET else ""
        print(f"  {name:18s} {case.label:80s} {err}{tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
