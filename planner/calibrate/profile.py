"""A calibration result as a calibration profile (`profiles/calibration/<gpu>.yaml`), written atomically.

Two shapes exist, both read by `profiles.load_gpu` (`profiles._calibration_for`):

- the GPU's main fit (`calibration_document`): each value at the top level, then `fit:` (the fit's
  name), `fitted_on:` (the rows), `method:`, optional notes, `standard_errors:` and `residuals:`
  (one `{row, error}` per fitted number, in-sample), then any extra keys;
- one parameter fitted on its own rows (`parameter_document`): `<parameter>:` and
  `<parameter>_fit: {fitted_on, method, residuals}` (as `sustained_compute_fraction` and
  `host_time_scale` are).

Only GPU fields a calibration file may set (`profiles.CALIBRATED_FIELDS`) can be written there.

A user calibration file (`user_calibration_document`, `write_calibration_profile(kind="user")`,
read by `profiles.load_calibration`) has the main fit's shape with the parameters a tuner fits on
one's own runs, cluster ones included, in the units their keys name (`profiles.USER_CALIBRATION_KEYS`),
and optionally the `gpu:` and `cluster:` they were measured on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from planner.calibrate.fit import CalibrationResult, Residual
from planner.errors import SpecError, short_repr
from planner.specs.files import load_path, write_whole
from profiles import CALIBRATED_FIELDS, PROFILES_DIR, USER_CALIBRATION_KEYS, load_calibration
from profiles.calibration_file import FILE_KEY, IGNORED_KEYS, UNIT_SCALE, calibration_from_mapping

#: Which calibration file a document is: a GPU's (`profiles/calibration/<gpu>.yaml`) or a user's (`--calibration`).
ProfileKind = Literal["gpu", "user"]
#: The parameter names, in file units and in SI, that only a user calibration file holds.
USER_ONLY_KEYS = tuple(dict.fromkeys(k for k in (*USER_CALIBRATION_KEYS, *FILE_KEY) if k not in CALIBRATED_FIELDS))

#: Decimals of a written error or standard error.
ERROR_DECIMALS = 4
#: yaml.safe_dump's line width in the shipped calibration files.
YAML_WIDTH = 120
#: Decimals of a value or standard error written to a user calibration file, in its file unit (a fit rounds
#: to fewer: `planner.calibrate.fit.DEFAULT_DECIMALS`).
VALUE_DECIMALS = 6


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


def user_calibration_document(values_si: Mapping[str, float], fit: str, method: str, fitted_on: str,
                              standard_errors: Mapping[str, float | None] | None = None,
                              residuals: Sequence[Residual | Mapping[str, Any]] = (), gpu: str | None = None,
                              cluster: str | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The mapping of a user calibration file: `values_si` (parameter names as `apply_parameters` takes them,
    SI) under their file keys and units, then `gpu:`, `cluster:`, `fit:`, `fitted_on:`, `method:`,
    `standard_errors:` (SI, converted likewise), `residuals:` (Residual or `{row, error}`) and `extra`
    (only keys the loader ignores: `trials:`, `study:`). The document is checked as the loader checks a file."""
    bad = [n for n in values_si if n not in FILE_KEY]
    if bad:
        raise SpecError(f"values_si: a user calibration holds only {', '.join(FILE_KEY)} "
                        f"(got {', '.join(map(repr, bad))})")
    for what, numbers in (("values_si", values_si), ("standard_errors", standard_errors or {})):
        for name, value in numbers.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise SpecError(f"{what}: {name} must be a number (got {short_repr(value)})")
    extra = dict(extra or {})
    clash = [k for k in extra if k not in IGNORED_KEYS]
    if clash:
        raise SpecError(f"extra: a user calibration's extra keys are {', '.join(IGNORED_KEYS)}, which the loader "
                        f"ignores (got {', '.join(map(repr, clash))})")
    errors = dict(standard_errors or {})
    stray = [n for n in errors if n not in values_si]
    if stray:
        raise SpecError(f"standard_errors: {', '.join(map(repr, stray))} is not among the values")

    def file_unit(name: str, value: float) -> float:
        return round(value / UNIT_SCALE[name], VALUE_DECIMALS)

    rows = [dict(r) if isinstance(r, Mapping) else {"row": r.row, "error": round(r.error, ERROR_DECIMALS)}
            for r in residuals]
    document = {
        **{FILE_KEY[n]: file_unit(n, float(values_si[n])) for n in FILE_KEY if n in values_si},
        **({"gpu": gpu} if gpu is not None else {}),
        **({"cluster": cluster} if cluster is not None else {}),
        "fit": fit,
        "fitted_on": fitted_on,
        "method": method,
        "standard_errors": {FILE_KEY[n]: None if v is None else file_unit(n, float(v)) for n, v in errors.items()},
        "residuals": rows,
        **extra,
    }
    load_calibration(document)  # every rule the loader applies, before anything is written
    return document


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
                              *, shipped: bool = False, kind: ProfileKind = "gpu") -> Path:
    """Write `document` to the calibration file `path` (only there: a temporary file in the same folder,
    then os.replace; a symbolic link at `path` is refused rather than followed or replaced). The
    present file is read by the bounded reader (`planner.specs.files.load_path`). A file among
    meshplan's shipped profiles (`profiles.PROFILES_DIR`) is written only with `shipped=True`: the
    benchmarks that refit the shipped calibration pass it; a user's fit goes to their own profiles.

    kind "gpu": a GPU's calibration profile (`profiles/calibration/<gpu>.yaml`); a value only a user
    calibration holds (`USER_ONLY_KEYS`: cluster parameters, values in SI names) is refused. keep None:
    merge into the file's present mapping (its keys keep their places, `document`'s replace or follow
    them). keep given: `document`, then those keys of the present file as they are.

    kind "user": a user calibration file (`user_calibration_document`), any name ending in .yaml; the
    file is `document` whole (a present file's values would otherwise outlive the fit that replaced
    them), then the keys `keep` names of the present file; the result is checked as
    `profiles.load_calibration` reads it before it is written."""
    if kind not in ("gpu", "user"):
        raise SpecError(f"kind must be 'gpu' or 'user' (got {kind!r})")
    path = Path(path)
    if path.suffix != ".yaml":
        named = "named after its GPU preset" if kind == "gpu" else "(user calibration)"
        raise SpecError(f"path: a calibration profile is a .yaml file {named} (got {str(path)!r})")
    if not path.parent.is_dir():
        raise SpecError(f"path: folder {str(path.parent)!r} does not exist")
    if path.is_symlink():
        raise SpecError(f"path: {str(path)!r} is a symbolic link; a calibration profile is written only as a "
                        "regular file")
    if not shipped and path.parent.resolve().is_relative_to(PROFILES_DIR):
        raise SpecError(f"path: {str(path)!r} is one of meshplan's shipped profiles; write your calibration to "
                        "your own profiles folder (shipped=True is for refitting the shipped files)")
    if kind == "gpu":
        stray = [k for k in document if k in USER_ONLY_KEYS]
        if stray:
            raise SpecError(f"document: a GPU's calibration profile holds only {', '.join(CALIBRATED_FIELDS)} as "
                            f"values (got {', '.join(map(repr, stray))}; write those to a user calibration, "
                            "kind='user')")
    present: dict[str, Any] = {}
    if path.exists():
        present = load_path(path, "calibration profile") or {}
        if not isinstance(present, dict):
            raise SpecError(f"path: {str(path)!r} holds no mapping (got {type(present).__name__})")
    if kind == "user":
        keep = () if keep is None else keep
    doc = present | document if keep is None else document | {k: present[k] for k in keep if k in present}
    if kind == "user":
        calibration_from_mapping(doc, f"calibration {path}", str(path))
    text = yaml.safe_dump(doc, sort_keys=False, width=YAML_WIDTH)
    write_whole(path, text)
    return path
