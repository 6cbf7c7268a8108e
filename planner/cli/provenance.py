"""Where a GPU's numbers come from, for `meshplan clusters`: per kernel-table topic, for the
calibrated constants, and for the error band. Nothing carried over from another GPU goes unnamed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from planner.error_band import errors_of
from planner.specs.hardware import GpuSpec

#: A GPU profile whose `source:` starts so was written by `meshplan profile` (executors/profiler.py).
MEASURED = "measured by `meshplan profile`"


def kernel_provenance(gpu: GpuSpec) -> dict[str, str]:
    """Per kernel-table topic: 'measured (<gpu>)', 'public (<gpu>)' (the GPU the table was measured
    on), or 'none' (the cost model then uses the calibrated constants for that part). A measured
    table some of whose fields `meshplan profile` carries from a shipped one (its `carried_from:`)
    says so: 'measured (<gpu>; some fields carried from <set>)'."""
    from profiles.tables import kernel_table, provenance

    out = provenance(gpu.kernel_tables)
    for topic, where in out.items():
        carried = (kernel_table(topic, gpu.kernel_tables) or {}).get("carried_from") if where != "none" else None
        if carried:
            out[topic] = f"{where[:-1]}; some fields carried from {Path(carried).stem})"
    return out


def constants_provenance(gpu: GpuSpec) -> str:
    """Where the calibrated constants (gemm/hbm efficiency, backward ratio, kernel overhead) come from: a user
    calibration file applied to the cluster (`--calibration`) is named first."""
    text = gpu.calibration
    if gpu.source.startswith(MEASURED):
        return f"{MEASURED} (micro-benchmarks on this machine)"
    if not text:
        return "defaults (assumed): no calibration file"
    user = re.match(r"(?P<file>[^:]+): fitted on (?P<what>.*?); user calibration of (?P<keys>[^;]+)", text)
    if user:  # profiles.apply_calibration's note: the user's file first, the profile's constants after it
        return f"user calibration {user['file']} ({user['keys']}): fitted on {user['what']}"
    fitted = re.findall(r"; ((?:sustained_compute_fraction|host_time_scale) fitted on \d+ end-to-end rows)", text)
    tail = "".join(f"; {f}" for f in fitted)
    if "carried over" in text:
        m = re.search(r"the (\S+) fit carried over|carried over from (\S+)", text)
        origin = next((g for g in m.groups() if g), None) if m else None
        return (f"carried over from {origin} (assumed)" if origin else "carried over (assumed): " + text) + tail
    m = re.match(r"(?P<file>[\w.-]+\.yaml): fitted on (?P<what>[^:]+)", text)
    if not m:
        return text
    applied = re.search(r"applied to ([^;]+)$", text)
    return f"fitted on {m['what'].strip()} ({m['file']})" + (f"; applied to {applied[1].strip()}" if applied else "")


def band_provenance(gpu: GpuSpec) -> str:
    """The error band in one cell: its edges as step-time errors and what it rests on."""
    low, high, basis = errors_of(gpu)
    r = gpu.step_time_residuals
    what = "estimate" if r is None else (f"end-to-end n={r.n}" if r.end_to_end else "widened")
    return f"{low:+.0%}..{high:+.0%} {what}"


def gpu_provenance(gpu: GpuSpec) -> dict[str, Any]:
    """One row of `meshplan clusters`' provenance table (and its JSON)."""
    low, high, basis = errors_of(gpu)
    return {"gpu": gpu.name, "kernel_set": gpu.kernel_tables or "-", **kernel_provenance(gpu),
            "constants": constants_provenance(gpu), "error_band": band_provenance(gpu),
            "error_band_basis": basis, "calibration": gpu.calibration or "-"}
