"""A calibration result as a calibration profile (`profiles/calibration/<gpu>.yaml`), written atomically.

Two shapes exist, both read by `profiles.load_gpu` (`profiles._calibration_for`):

- the GPU's main fit (`calibration_document`): each value at the top level, then `fit:` (the fit's
  name), `fitted_on:` (the rows), `method:`, optional notes, `standard_errors:` and `residuals:`
  (one `{row, error}` per fitted number, in-sample), then any extra keys;
- one parameter fitted on its own rows (`parameter_document`): `<parameter>:` and
  `<parameter>_fit: {fitted_on, method, residuals}` (as `sustained_compute_fraction` and
  `host_time_scale` are).

Only GPU fields a calibration file may set (`profiles.CALIBRATED_FIELDS`) can be written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from planner.calibrate.fit import CalibrationResult, Residual
from planner.errors import SpecError
from planner.specs.files import load_path, write_whole
from profiles import CALIBRATED_FIELDS, PROFILES_DIR

#: Decimals of a written error or standard error.
ERROR_DECIMALS = 4
#: yaml.safe_dump's line width in the shipped calibration files.
YAML_WIDTH = 120


def _check_writable(names) -> None:
    bad = [n for n in names if n not in CALIBRATED_FIELDS]
    if bad:
        raise SpecError(f"parameters: a calibration profile holds only {', '.join(CALIBRATED_FIELDS)} "
                        f"(got {', '.join(map(repr, bad))})")


def residual_rows(residuals: Sequence[Residual]) -> list[dict[str, Any]]:
    return [{"row": r.row, "error": round(r.error, ERROR_DECIMALS)} for r in residuals]


def fitted_on_text(result: CalibrationResult) -> str:
    """The rows a fit used, each as `<source>: <label>`."""
    return "; ".join(f"{r.source}: {r.row}" if r.source else r.row for r in result.residuals)


def calibration_document(result: CalibrationResult, fit: str, method: str, fitted_on: str | None = None,
                         order: Sequence[str] | None = None, notes: dict[str, Any] | None = None,
                         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The main-fit mapping of a calibration file. `order`: which values to write and in what
    order (default: fitted, then fixed); `notes` go after `method:`, `extra` at the end."""
    names = list(order) if order is not None else [*result.fitted, *(k for k in result.values if k not in result.fitted)]
    _check_writable(names)
    missing = [n for n in names if n not in result.values]
    if missing:
        raise SpecError(f"order: {', '.join(map(repr, missing))} is neither fitted nor fixed in the result")
    return {
        **{k: result.values[k] for k in names},
        "fit": fit,
        "fitted_on": fitted_on if fitted_on is not None else fitted_on_text(result),
        "method": method,
        **(notes or {}),
        "standard_errors": {k: None if v is None else round(v, ERROR_DECIMALS)
                            for k, v in result.standard_errors.items()},
        "residuals": residual_rows(result.residuals),
        **(extra or {}),
    }


def parameter_document(result: CalibrationResult, method: str, fitted_on: str | None = None) -> dict[str, Any]:
    """`<parameter>:` and `<parameter>_fit:` of the one parameter `result` fitted."""
    if len(result.fitted) != 1:
        raise SpecError(f"result.fitted: a parameter block holds one fitted parameter (got {list(result.fitted)})")
    name = result.fitted[0]
    _check_writable([name])
    return {name: result.values[name], f"{name}_fit": {
        "fitted_on": fitted_on if fitted_on is not None else fitted_on_text(result),
        "method": method,
        "residuals": residual_rows(result.residuals),
    }}


def write_calibration_profile(path: str | Path, document: dict[str, Any], keep: Sequence[str] | None = None,
                              *, shipped: bool = False) -> Path:
    """Write `document` to the calibration file `path` (only there: a temporary file in the same folder,
    then os.replace; a symbolic link at `path` is refused rather than followed or replaced). The
    present file is read by the bounded reader (`planner.specs.files.load_path`). A file among
    meshplan's shipped profiles (`profiles.PROFILES_DIR`) is written only with `shipped=True`: the
    benchmarks that refit the shipped calibration pass it; a user's fit goes to their own profiles.

    keep None: merge into the file's present mapping (its keys keep their places, `document`'s
    replace or follow them). keep given: `document`, then those keys of the present file as they are."""
    path = Path(path)
    if path.suffix != ".yaml":
        raise SpecError(f"path: a calibration profile is a .yaml file named after its GPU preset (got {str(path)!r})")
    if not path.parent.is_dir():
        raise SpecError(f"path: folder {str(path.parent)!r} does not exist")
    if path.is_symlink():
        raise SpecError(f"path: {str(path)!r} is a symbolic link; a calibration profile is written only as a "
                        "regular file")
    if not shipped and path.parent.resolve().is_relative_to(PROFILES_DIR):
        raise SpecError(f"path: {str(path)!r} is one of meshplan's shipped profiles; write your calibration to "
                        "your own profiles folder (shipped=True is for refitting the shipped files)")
    present: dict[str, Any] = {}
    if path.exists():
        present = load_path(path, "calibration profile") or {}
        if not isinstance(present, dict):
            raise SpecError(f"path: {str(path)!r} holds no mapping (got {type(present).__name__})")
    doc = present | document if keep is None else document | {k: present[k] for k in keep if k in present}
    text = yaml.safe_dump(doc, sort_keys=False, width=YAML_WIDTH)
    write_whole(path, text)
    return path
