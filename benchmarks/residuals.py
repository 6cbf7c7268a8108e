"""The error band's basis: step-time residuals on published end-to-end runs, per GPU calibration file.

    python -m benchmarks.residuals           # predict the rows, print each GPU's residuals and band
    python -m benchmarks.residuals --write   # also write them to profiles/calibration/<gpu>.yaml

Run it after `python -m benchmarks.calibrate` (which rewrites the calibration files without this
key). Each calibration file gets `step_time_residuals:` (planner.specs.hardware.StepTimeResiduals,
read by profiles.load_gpu; planner.error_band turns it into every Estimate's band):

- a GPU with published end-to-end runs that its shipped fit did not use (`END_TO_END`, predicted as
  `python -m benchmarks.accuracy` predicts them): the signed errors predicted / measured - 1 of
  those rows, their order-statistic prediction interval (planner.error_band.interval), summary and
  the rows themselves (`end_to_end: true`);
- a GPU without such runs: the interval of every GPU that has them, pooled, widened by
  planner.error_band.widened (`end_to_end: false`, and `basis` says so).

Rows the shipped fit was fitted on (the fit named by the file's `fit:` key, benchmarks.calibration
FITS) are in-sample and never used. `LEFT_OUT` names the end-to-end sets that are not used, and why.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from benchmarks.calibration import A100_TABLES, FITS
from benchmarks.generations import calibration_rows
from benchmarks.validation import PUBLIC_SETS, nemo_h100_fp8, predict, public_runs
from planner.calibrate import write_calibration_profile
from planner.error_band import MIN_KIND_ROWS, summarise, widened
from planner.specs.hardware import StepTimeResiduals
from profiles import PROFILES_DIR, load_cluster, load_gpu, load_model

METHOD = ("python -m benchmarks.residuals --write: signed step-time errors (predicted / measured - 1) of published "
          "end-to-end runs no fit used, predicted as python -m benchmarks.accuracy does; band = order-statistic "
          "prediction interval (planner.error_band)")


@dataclass(frozen=True)
class EndToEnd:
    """A published set of end-to-end step times."""

    name: str
    rows: Callable[[], list]  # StepCase loader (benchmarks.validation)


#: Every published end-to-end step-time set the accuracy report predicts, but those in LEFT_OUT.
def _held_out_cases(name: str) -> Callable[[], list]:
    """A published set's cases less the rows a generation fit used (benchmarks.generations)."""
    def rows() -> list:
        fitted = calibration_rows()
        return [c for c in public_runs(name).cases if (name, c.label) not in fitted]
    return rows


#: End-to-end sets the band does not use.
LEFT_OUT = {
    "SC'21 Table 2 ZeRO-3": "DeepSpeed's ZeRO-3 of 2021, priced through a cross-node rate fitted on two of the "
                            "set's own four rows (benchmarks.zero3): its errors say how well that fit carries, "
                            "not what the model claims to cover",
    "torchtitan H100 (2024-12)": "measured on Grand Teton H100s (500 W, 96 GB HBM2e), not the 700 W DGX H100 the "
                                 "dgx-h100 preset describes: its errors are another machine's, not this GPU's band "
                                 "(the accuracy report still shows them, with and without)",
    "LLM Foundry H100 (MPT)": "Composer on PyTorch FSDP1 with 2023-24 kernels (Triton FlashAttention, torch 2.0/2.1), "
                              "costed as framework torchtitan, the closest meshplan has: its errors are an approximated "
                              "framework's, not this GPU's band (the accuracy report shows them)",
}

END_TO_END = tuple(e for e in tuple(EndToEnd(t.name, t.rows) for t in A100_TABLES if t.kind == "step") + (
    EndToEnd("NeMo DGX-H100 FP8", nemo_h100_fp8),
) + tuple(EndToEnd(table, _held_out_cases(name)) for name, (table, _) in PUBLIC_SETS.items()
          if name != "nemo_h100_fp8") if e.name not in LEFT_OUT)
#: GPUs that share a compute die and its calibration with another (the A100 40 GB and 80 GB; the H200
#: and H100: same GH100 die and clocks, more and faster HBM): without runs of their own, their band is
#: the twin's as it is (at least the floor), rather than every GPU's pooled and widened.
SAME_SILICON = {"a100-40gb": "a100-80gb", "h200": "h100-sxm"}



@dataclass(frozen=True)
class Row:
    gpu: str  # calibration file stem
    table: str
    label: str
    error: float | None  # None: no strategy under the paper's constraints fits
    moe: bool = False  # a mixture-of-experts model


def calibration_files(directory: Path = PROFILES_DIR / "calibration") -> dict[str, Path]:
    return {p.stem: p for p in sorted(directory.glob("*.yaml"))}


def fitted_tables(calibration: dict) -> set[str]:
    """Names of the tables the file's shipped fit was fitted on (in-sample rows)."""
    spec = FITS.get(str(calibration.get("fit", "")))
    return {t.name for t in spec.tables} if spec else set()


def predicted_rows(files: dict[str, Path]) -> tuple[list[Row], list[str]]:
    """Every end-to-end row, predicted and assigned to the GPU preset of its cluster; and notes on
    the rows that were skipped (in-sample or on a GPU without a calibration file)."""
    by_name = {load_gpu(key).name: key for key in files}
    docs = {key: yaml.safe_load(path.read_text()) or {} for key, path in files.items()}
    rows, notes = [], []
    for table in END_TO_END:
        for case in table.rows():
            gpu = by_name.get(load_cluster(case.cluster).gpu.name)
            if gpu is None:
                notes.append(f"{table.name}: {case.label}: GPU of {case.cluster} has no calibration file")
                continue
            if table.name in fitted_tables(docs[gpu]):
                notes.append(f"{table.name}: {case.label}: fitted on by {gpu}'s fit (in-sample), not used")
                continue
            model = load_model(case.model) if isinstance(case.model, str) else case.model
            rows.append(Row(gpu, table.name, case.label, predict(case).error, model.num_experts > 0))
    return rows, notes


def residuals_by_gpu(rows: list[Row], gpus: list[str]) -> dict[str, StepTimeResiduals]:
    """Each GPU's StepTimeResiduals: its own rows where it has any, else the pooled rows widened."""
    own: dict[str, list[Row]] = {}
    for r in rows:
        if r.error is not None:
            own.setdefault(r.gpu, []).append(r)
    # a GPU with fewer rows than a band needs (MIN_KIND_ROWS) is banded as one without runs of its own
    own = {gpu: rs for gpu, rs in own.items() if len(rs) >= MIN_KIND_ROWS}
    out = {gpu: _with_kinds(_summary(rs), rs) for gpu, rs in own.items()}
    for gpu, twin in SAME_SILICON.items():  # the twin's own runs, widened (no run on this GPU itself)
        if gpu in gpus and gpu not in out and twin in own:
            name = f"{twin} (same compute die)"
            kinds = {k: widened(getattr(out[twin], k), name, factor=1.0) for k in ("dense", "moe")
                     if getattr(out[twin], k) is not None}
            out[gpu] = widened(out[twin], name, factor=1.0).model_copy(update=kinds)
    pooled = [r for rs in own.values() for r in rs]
    if pooled:
        reference = _summary(pooled)
        name = ", ".join(sorted(own))
        for gpu in gpus:
            if gpu not in out:
                out[gpu] = widened(reference, name)
    return out


def _with_kinds(res: StepTimeResiduals, rows: list[Row]) -> StepTimeResiduals:
    """`res` with a `dense` and a `moe` sub-band, each from `rows` of that kind where the kind has
    at least MIN_KIND_ROWS of them (planner.error_band: a kind with fewer takes the band of all)."""
    kinds = {}
    for kind, moe in (("dense", False), ("moe", True)):
        picked = [r for r in rows if r.moe == moe]
        if len(picked) >= MIN_KIND_ROWS:
            kinds[kind] = _summary(picked, f", {kind} models only")
    return res.model_copy(update=kinds)


def _summary(rows: list[Row], which: str = "") -> StepTimeResiduals:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.table] = counts.get(r.table, 0) + 1
    tables = [f"{name} ({n})" for name, n in counts.items()]
    basis = "end-to-end runs no fit used" + which + ": " + ", ".join(tables)
    return summarise([r.error for r in rows], tables, basis)


def document(res: StepTimeResiduals, rows: list[Row]) -> dict:
    """The `step_time_residuals:` mapping written into a calibration file."""
    doc = {"method": METHOD, **res.model_dump(exclude_none=True)}
    if res.end_to_end:
        doc["rows"] = [{"row": f"{r.table}: {r.label}", "kind": "moe" if r.moe else "dense",
                        "error": round(r.error, 4)} for r in rows if r.error is not None]
    return doc


def main(argv: list[str]) -> int:
    files = calibration_files()
    rows, notes = predicted_rows(files)
    result = residuals_by_gpu(rows, list(files))
    for note in notes:
        print(f"skipped {note}")
    for name, why in LEFT_OUT.items():
        print(f"left out {name}: {why}")
    for gpu in files:
        res = result.get(gpu)
        own = [r for r in rows if r.gpu == gpu]
        print(f"\n{gpu}: " + ("no end-to-end rows" if not own else f"{len(own)} end-to-end rows"))
        for r in own:
            err = "no fit" if r.error is None else f"{r.error:+7.1%}"
            print(f"  {r.table + ': ' + r.label:60s} {err}")
        if res is None:
            print("  no residuals (no GPU has end-to-end rows)")
            continue
        stats = "" if not res.end_to_end else (f"median |err| {res.median_abs:.1%}, max |err| {res.max_abs:.1%}, "
                                              f"mean {res.mean_signed:+.1%}; ")
        cover = f", coverage {res.coverage:.0%}" if res.coverage else ""
        print(f"  {stats}band: error {res.error_low:+.1%} .. {res.error_high:+.1%}{cover}")
        print(f"  step time in [{1 / (1 + res.error_high):.3f}, {1 / (1 + res.error_low):.3f}] x predicted; {res.basis}")
        for kind in ("dense", "moe"):
            sub = getattr(res, kind)
            if sub is not None:
                print(f"  {kind} plans: band error {sub.error_low:+.1%} .. {sub.error_high:+.1%} (n={sub.n})")
    if "--write" in argv:
        for gpu, path in files.items():
            if gpu not in result:
                continue
            rs = [r for r in rows if r.gpu == gpu]
            write_calibration_profile(path, {"step_time_residuals": document(result[gpu], rs)}, shipped=True)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
