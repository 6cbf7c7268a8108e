"""Fit the A100's calibrated parameters leave-one-paper-out, print the result,
and write the shipped fit to profiles/calibration/.

    python -m benchmarks.calibrate          # both fits, LOPO table, write the files
    python -m benchmarks.calibrate --check  # both fits and the LOPO table only

Two fits, each on one paper's rows (benchmarks/calibration.py, `FITS`):

- korthikanti-table4 (shipped): gemm_efficiency, hbm_efficiency and
  backward_gemm_ratio on Korthikanti et al. 2022 Table 4, the forward and
  backward time of one 22B layer in five settings (10 numbers).
- sc21: gemm_efficiency on SC'21 Table 1 and Table 2's PTD rows (16 end-to-end
  runs), with hbm_efficiency held at 0.8 (assumed) and backward_gemm_ratio at
  the FLOP ratio 2, which step times cannot separate from the GEMM rate.

Each fit is then judged on every A100 table: the other paper's rows are held
out, the same paper's unfitted rows (Korthikanti Table 5) are not fitted but
share the cluster and software of the fitted ones. The shipped fit is written
to a100-80gb.yaml and a100-40gb.yaml (same silicon) with its residuals and the
LOPO table; the newer GPUs get it carried over, and their files say so.
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.calibration import A100_TABLES, BOUNDS, FITS, SHIPPED, SHIPPED_BECAUSE, Fit, fit, lopo, role
from planner.calibrate import calibration_document, write_calibration_profile
from profiles import PROFILES_DIR

CARRIED_OVER = ("h100-sxm", "h200", "b200", "gb200", "gb300")
METHOD = ("python -m benchmarks.calibrate (benchmarks/calibration.py): scipy least squares on the relative errors of "
          "the rows in fitted_on; kernel_overhead_us, link bandwidths and efficiencies and comm_overlap as the GPU and "
          "cluster profiles give them")


def print_fit(f: Fit) -> None:
    spec = f.spec
    print(f"\nfit {spec.key!r} on {spec.fitted_on}")
    for name in BOUNDS:
        if name in f.standard_errors:
            print(f"  {name:20s} {f.params[name]:.4f} +- {f.standard_errors[name]:.4f}  (fitted)")
        else:
            print(f"  {name:20s} {f.params[name]:.4f}  (held)")
    if spec.held:
        print(f"  held because {spec.held_because}")
    for table, rows in f.residuals.items():
        print(f"  {table}: " + ", ".join(f"{r.label} {r.error:+.1%}" for r in rows))


def print_lopo(fits: list[Fit], table: dict) -> None:
    print("\nLeave one paper out: every A100 table under each fit")
    print("  (role: fitted = the fit's own rows; same paper = not fitted, same cluster and software; "
          "held out = another source)")
    print(f"  {'':30s}" + "".join(f" | {f.spec.key + (' (shipped)' if f.spec.key == SHIPPED else ''):40s}"
                                  for f in fits))
    print(f"  {'table':30s}" + f" | {'role':10s} {'n':>3s} {'median':>7s} {'max':>7s} {'mean':>7s}    " * len(fits))
    for t in A100_TABLES:
        cells = []
        for f in fits:
            s = table[f.spec.key][t.name]
            cells.append(f" | {role(f.spec, t):10s} {s.n:3d} {s.median_abs:7.1%} {s.max_abs:7.1%} {s.mean:+7.1%}    ")
        print(f"  {t.name:30s}" + "".join(cells))
    print("  median, max: |relative error|; mean: signed (< 0: predicted faster than measured)")


def lopo_doc(fits: list[Fit], table: dict) -> dict:
    out = {}
    for f in fits:
        out[f.spec.key] = {
            "shipped": f.spec.key == SHIPPED,
            "label": f.spec.label,
            "fitted_on": f.spec.fitted_on,
            "parameters": {k: f.params[k] for k in BOUNDS},
            "fitted": list(f.spec.parameters),
            "tables": [{"table": t.name, "role": role(f.spec, t), "n": s.n,
                        "median_abs_error": round(s.median_abs, 5), "max_abs_error": round(s.max_abs, 5),
                        "mean_error": round(s.mean, 5)}
                       for t in A100_TABLES for s in [table[f.spec.key][t.name]]],
        }
    return out


def shipped_doc(f: Fit, lopo: dict, note: str = "") -> dict:
    return calibration_document(f.result, fit=f.spec.key, method=METHOD, fitted_on=f.spec.fitted_on + note,
                                order=tuple(BOUNDS), notes={"why_this_fit": SHIPPED_BECAUSE},
                                extra={"leave_one_paper_out": lopo})


def main(argv: list[str]) -> int:
    fits = [fit(spec) for spec in FITS.values()]
    for f in fits:
        print_fit(f)
    table = lopo(fits)
    print_lopo(fits, table)
    if "--check" in argv:
        return 0
    shipped = next(f for f in fits if f.spec.key == SHIPPED)
    lopo_table = lopo_doc(fits, table)
    directory = Path(PROFILES_DIR) / "calibration"
    for key, note in (("a100-80gb", ""), ("a100-40gb", "; applied to the A100-SXM4-40GB (same A100 silicon)")):
        path = directory / f"{key}.yaml"
        write_calibration_profile(path, shipped_doc(shipped, lopo_table, note), keep=KEPT, shipped=True)
        print(f"wrote {path}")
    # The newer GPUs' A100-fitted constants (gemm_efficiency and the others) are carried over and say
    # so; they time only what those GPUs' kernel tables do not cover. Their sustained_compute_fraction
    # (benchmarks.generations) and error band (benchmarks.residuals) are kept as those scripts wrote them.
    for key in CARRIED_OVER:
        path = directory / f"{key}.yaml"
        doc = {
            **{k: shipped.params[k] for k in BOUNDS},
            "fit": f"{SHIPPED} (carried over from a100-80gb)",
            "fitted_on": "nothing for this GPU: the a100-80gb fit carried over (assumed) for the parts its kernel "
                         "tables do not time. Replace with `meshplan profile` measurements.",
            "method": "python -m benchmarks.calibrate (carried over)",
        }
        write_calibration_profile(path, doc, keep=KEPT, shipped=True)
        print(f"wrote {path} (carried over)")
    return 0


#: Keys of a calibration file that other scripts write (benchmarks.generations, benchmarks.residuals): kept as they are.
KEPT = ("sustained_compute_fraction", "sustained_compute_fraction_fit", "step_time_residuals", "host_time_scale",
        "host_time_scale_fit")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
