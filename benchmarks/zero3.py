"""Predict the published ZeRO-3 / FSDP runs of benchmarks/data/zero3_runs.json and print the errors.

    python -m benchmarks.zero3          # every row, and the median / max / mean error per set
    python -m benchmarks.zero3 --fit    # also fit deepspeed.cross_node_nic_fraction on the `fit` rows

The DeepSpeed rows are predicted with `zero3_impl="deepspeed"`, the torchtitan rows with
`"fsdp2"`. The fit is least squares over the one parameter (planner.calibrate.fit_parameters)
of the relative errors of the rows marked `fit`; the `check` rows are not used by it, and the
accuracy report (benchmarks.accuracy) prints the `fit` rows as calibration rows (`FIT_ROWS`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import numpy as np

from benchmarks.calibration import RowError, Summary
from benchmarks.validation import MEGATRON_2021, ROOT, StepCase, gpt_model, predict, sc21_flop_per_step
from planner.calibrate import FitParameter, fit_parameters
from profiles.bundle import load_tables

DATA = ROOT / "benchmarks" / "data" / "zero3_runs.json"
#: SC'21's GPT shapes (layers, hidden, heads), Table 2.
SC21_SHAPES = {174.6: (96, 12288, 96), 529.6: (105, 20480, 128)}
PARAMETER = "cross_node_nic_fraction"
#: The accuracy report's table of SC'21 Table 2's ZeRO-3 rows (benchmarks.calibration.sc21_zero3).
SC21_ZERO3_TABLE = "SC'21 Table 2 ZeRO-3"


def fit_rows() -> tuple[tuple[str, str], ...]:
    """The (table, label) of every SC'21 row marked `fit`, labelled as the accuracy report's SC'21 Table 2
    ZeRO-3 table labels them (benchmarks.validation.sc21_table2): it prints them as calibration rows."""
    return tuple((SC21_ZERO3_TABLE, f"{r['model_params_billion']}B ZeRO-3 n{r['num_gpus']} mbs{r['micro_batch_size']}")
                 for r in json.loads(DATA.read_text())["rows"] if r["set"] == "sc21_deepspeed" and r["role"] == "fit")


#: The rows `fit_fraction` fits on, as (table, label): the accuracy report counts them as calibration rows.
FIT_ROWS = fit_rows()
RECOMPUTE = {"no": {"recompute": "none"}, "full": {"recompute": "full", "recompute_num_layers": None}}


def cases() -> list[tuple[StepCase, str, str]]:
    """(case, set, role) of every row."""
    from profiles import load_model

    out = []
    for r in json.loads(DATA.read_text())["rows"]:
        n, B, s, b = r["num_gpus"], r["global_batch_size"], r["seq_len"], r["micro_batch_size"]
        cons = {"dp": n, "tp": 1, "pp": 1, "cp": 1, "zero_stage": 3, "micro_batch_size": b, "sequence_parallel": False}
        if r["set"] == "sc21_deepspeed":
            L, h, a = SC21_SHAPES[r["model_params_billion"]]
            model = gpt_model(f"gpt-{r['model_params_billion']}b", a, h, L, 51200, s)
            step = sc21_flop_per_step(B, s, L, h, 51200) / (n * r["achieved_tflops_per_gpu"] * 1e12)
            train = MEGATRON_2021
            cons |= RECOMPUTE["full"]
            label = f"SC'21 {r['model_params_billion']}B n{n} mbs{b}"
        else:
            model = load_model(r["model"])
            step = b * s / r["tokens_per_s_per_gpu"]
            train = {"precision": "bf16", "grad_precision": "fp32", "attention_kernel": "flash"}
            ac = r["activation_checkpointing"]
            cons |= RECOMPUTE.get(ac) or {"recompute": "full", "recompute_num_layers": model.num_layers // 2}
            label = f"torchtitan {r['model']} mbs{b} AC {ac}"
        case = StepCase(label=label, table=r["set"], model=model, num_gpus=n, global_batch_size=B, seq_len=s,
                        measured_step_s=step, train_options=train | {"zero3_impl": r["impl"]}, constraints=cons)
        out.append((case, r["set"], r["role"]))
    return out


def errors(rows) -> list[tuple[RowError, str, str]]:
    out = []
    for case, name, role in rows:
        p = predict(case)
        out.append((RowError(case.label, case.measured_step_s, p.predicted_step_s, p.strategy, p.note), name, role))
    return out


def fit_fraction(rows) -> float:
    """The cross-node NIC fraction, by least squares of the `fit` rows' relative errors
    (planner.calibrate.fit_parameters, plain quadratic loss), bounded to [0.05, 1], to 2 decimals.

    The fraction is a ZeRO-3 implementation's (profiles/frameworks/zero3.yaml), not a cluster
    field: each try replaces the parsed implementation for the duration of the fit."""
    impls = load_tables(None).zero3
    shipped = impls["deepspeed"]
    fit_rows = [r for r in rows if r[2] == "fit"]

    def residual(values: dict[str, float]) -> np.ndarray:
        impls["deepspeed"] = replace(shipped, cross_node_nic_fraction=values[PARAMETER])
        return np.array([e.error for e, _, _ in errors(fit_rows)])

    try:
        result = fit_parameters(residual, [FitParameter(name=PARAMETER, lower=0.05, upper=1.0)], loss="linear",
                                decimals=2)
    finally:
        impls["deepspeed"] = shipped
    return result.values[PARAMETER]


def main(argv: list[str]) -> int:
    rows = cases()
    if "--fit" in argv:
        f = fit_fraction(rows)
        print(f"fitted deepspeed.cross_node_nic_fraction = {f:.2f} (shipped "
              f"{load_tables(None).zero3['deepspeed'].cross_node_nic_fraction}) on the `fit` rows")
    results = errors(rows)
    print(f"  {'row':46s} {'role':5s} {'measured':>9s} {'predicted':>9s} {'error':>7s}  strategy")
    for e, _, role in results:
        if e.predicted_s is None:
            print(f"  {e.label:46s} {role:5s} {e.measured_s:8.2f}s {'no fit':>9s} {'':>7s}  {e.strategy} ({e.note})")
        else:
            print(f"  {e.label:46s} {role:5s} {e.measured_s:8.2f}s {e.predicted_s:8.2f}s {e.error:+7.1%}  {e.strategy}")
    for name in dict.fromkeys(n for _, n, _ in results):
        for role in ("fit", "check"):
            subset = [e for e, n, r in results if n == name and r == role]
            if subset:
                print(f"  {name:18s} {role:5s} {Summary.of(subset).line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
