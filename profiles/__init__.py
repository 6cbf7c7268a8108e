"""Hardware, cluster, model and calibration data, and their loaders.

Layout: `gpus/*.yaml`, `clusters/*.yaml`, `models/*.yaml` (one file each, each
with a `source:`), `calibration/<gpu>.yaml` (the fitted GPU parameters
`CALIBRATED_FIELDS`, written by planner.calibrate; `fitted_on:` names the rows they
were fitted on and `fit:` the fit, e.g. one of benchmarks/calibration.py's; the A100 files hold
gemm_efficiency, hbm_efficiency and backward_gemm_ratio fitted on Korthikanti
et al. 2022 Table 4 alone, the newer GPUs' files that fit carried over). Extra directories with the same layout can be added
with the environment variable `MESHPLAN_PROFILES` (os.pathsep-separated); they
take precedence over the user's own directory (`user_profiles_dir`, where `meshplan
profile` writes), which takes precedence over the shipped files (`profiles.files.search_dirs`).

`kernels/<topic>/<set>.yaml` and `frameworks/*.yaml` are the cost model's tables: `load_gpu` and
`load_cluster` attach them to the GPU as typed objects (`profiles.bundle`, `GpuSpec.tables`), and
`resolve_gpu` / `resolve_cluster` do so for a spec built by hand; the cost model reads no file.

YAML carries vendor units in key names (`memory_gib`, `peak_tflops`,
`hbm_bw_gb_per_s`, `bw_gb_per_s`, `latency_us`); loading converts to SI.

Every number names where it comes from: the file's `source:` (datasheet or
model card), a `<field>_source:` beside it or in an enclosing mapping (with or
without the unit: `kernel_overhead_source` for `kernel_overhead_us`; an
estimate says so there), or, in calibration files, `fitted_on:`.

A user calibration file (`profiles.calibration_file`: `load_calibration`, `apply_calibration`) holds
parameters fitted on one's own runs, in the same shape; `planner.plan(calibration=...)` and the
CLI's `--calibration FILE` apply it to the cluster before planning. The loaders
accept and drop the `_source` keys of known fields; tests/test_profile_sources.py
checks that every shipped number is covered.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from planner.errors import (
    SpecError,
    SpecValidationError,
    format_validation_error,
    short_repr,
    unknown_name_message,
)
from planner.specs import ClusterSpec, GpuSpec, HostSpec, LinkTier, ModelSpec
from planner.specs.topology import TopologySpec
from planner.specs.hardware import (BOARD_POWER_W_RANGE, BW_BYTES_PER_S_RANGE, FLOP_PER_S_RANGE,
                                     HOST_TIME_SCALE_RANGE, LATENCY_S_RANGE,
                                     MEMORY_BYTES_RANGE, StepTimeResiduals)
from planner.specs.hf import read_hf_config
from profiles.bundle import resolve_cluster, resolve_gpu
from profiles.topology import with_fabric
from profiles.calibration_file import (
    USER_CALIBRATION_KEYS,
    Calibration,
    apply_calibration,
    load_calibration,
    with_parameters,
)
from profiles.files import PROFILES_DIR, read_yaml, search_dirs, user_profiles_dir

__all__ = ["PROFILES_DIR", "USER_CALIBRATION_KEYS", "Calibration", "apply_calibration", "load_calibration",
           "read_yaml", "resolve_cluster", "resolve_gpu", "search_dirs", "user_profiles_dir", "with_parameters"]

GIB = 2**30
GB = 1e9
TERA = 1e12
MICRO = 1e-6


def _names(kind: str) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in reversed(search_dirs()):
        for path in sorted((d / kind).glob("*.yaml")):
            found[path.stem] = path
    return found


def list_presets(kind: str) -> list[str]:
    """Preset names of `kind` ('models', 'clusters', 'gpus')."""
    return sorted(_names(kind))


#: The longest preset name or file path accepted (Linux's PATH_MAX), and the longest part of a path between
#: separators (NAME_MAX, bytes as the file system encodes them): longer ones are refused before any lookup.
MAX_REF_CHARS = 4096
MAX_NAME_BYTES = 255
#: A preset name `meshplan profile --name` may write: letters, digits, '.', '_' and '-', a letter or digit first.
PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_ref(what: str, ref: str) -> None:
    """Refuse a preset name or file path (`what`: 'cluster', 'model', 'GPU') that no file system lookup
    could serve: a control character (NUL among them), a character the file system cannot encode, more
    than MAX_REF_CHARS characters or a part longer than MAX_NAME_BYTES; checked before the file system
    is asked (which raised OSError or ValueError on them)."""
    rule = (f"a preset name or file path has no control characters, at most {MAX_REF_CHARS} characters and "
            f"at most {MAX_NAME_BYTES} bytes between separators")
    bad = next((c for c in ref if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise SpecError(f"{what} {short_repr(ref)} holds the control character {bad!r}; {rule}")
    try:
        parts = [p.encode(sys.getfilesystemencoding(), "surrogateescape") for p in ref.split(os.sep)]
    except UnicodeEncodeError:
        raise SpecError(f"{what} {short_repr(ref)} holds a character the file system cannot encode; {rule}") from None
    if len(ref) > MAX_REF_CHARS:
        raise SpecError(f"{what} {short_repr(ref)} is {len(ref)} characters long; {rule}")
    if max(len(p) for p in parts) > MAX_NAME_BYTES:
        raise SpecError(f"{what} {short_repr(ref)} has a part of {max(len(p) for p in parts)} bytes; {rule}")


def check_preset_name(what: str, name: str) -> None:
    """Refuse a name that cannot be written as a preset `<name>.yaml` (`PRESET_NAME`, at most
    MAX_NAME_BYTES less the suffix)."""
    longest = MAX_NAME_BYTES - len(".yaml")
    if not PRESET_NAME.fullmatch(name) or len(name) > longest:
        raise SpecError(f"{what} {short_repr(name)} must be a preset name: letters, digits, '.', '_' and '-', a "
                        f"letter or digit first, at most {longest} characters")


def _is_file_ref(ref: str) -> bool:
    """A reference names a file (not a preset) when it has a file suffix or a folder in it."""
    return Path(ref).suffix in {".yaml", ".yml", ".json"} or os.sep in ref


def _resolve(kind: str, ref: str) -> Path:
    check_ref(kind[:-1], ref)
    candidate = Path(ref)
    if _is_file_ref(ref):
        if not candidate.exists():
            raise SpecError(f"{kind[:-1]} file {ref!r} does not exist")
        return candidate
    names = _names(kind)
    if ref not in names:
        raise SpecError(unknown_name_message(f"{kind[:-1]} preset", ref, list(names)))
    return names[ref]


def _validated(cls: type, data: dict[str, Any], what: str):
    try:
        return cls(**data)
    except SpecValidationError as exc:
        raise SpecError(f"invalid {what}: {exc.problems}") from None
    except ValidationError as exc:
        raise SpecError(f"invalid {what}: {format_validation_error(exc)}") from None
    except TypeError as exc:
        raise SpecError(f"invalid {what}: {exc}") from None


UNIT_SUFFIXES = ("_gib", "_gb_per_s", "_us", "_w")


def source_keys(field: str) -> tuple[str, ...]:
    """The keys that may carry `field`'s source: `<field>_source`, and the same without
    its unit (`kernel_overhead_us` -> `kernel_overhead_us_source`, `kernel_overhead_source`)."""
    stem = next((field.removesuffix(u) for u in UNIT_SUFFIXES if field.endswith(u)), field)
    return tuple(dict.fromkeys((f"{field}_source", f"{stem}_source")))


def _pop_sources(data: dict[str, Any], fields, what: str) -> None:
    """Drop the `_source` keys of `fields` from `data` (they document, the specs do not keep them)."""
    for key in [k for f in fields for k in source_keys(f) if k in data]:
        if not isinstance(data[key], str) or not data[key].strip():
            raise SpecError(f"{what}: {key} must be a non-empty text naming where the value comes from")
        del data[key]


def _num(value: Any, key: str, what: str) -> float:
    """A finite number from a profile file: not a boolean, a text or NaN/infinity (YAML's `.inf`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"{what}: {key} must be a finite number (got {short_repr(value)})")
    return float(value)


def _si(value: Any, key: str, what: str, scale: float, bounds: tuple[float, float]) -> float:
    """A profile file's number in the unit its key names, converted to SI (times `scale`) and checked
    against its physical range `bounds` (SI, planner.specs.hardware), which a refusal states in the
    file's unit."""
    x = _num(value, key, what) * scale
    low, high = bounds
    if not low <= x <= high:
        raise SpecError(f"{what}: {key} must be between {low / scale:g} and {high / scale:g} (got {short_repr(value)})")
    return x


def _mapping(value: Any, key: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not value:
        raise SpecError(f"{what}: {key} must be a non-empty mapping (got {short_repr(value)})")
    return value


# ---- GPUs ------------------------------------------------------------------
#: The numeric keys of a GPU YAML file.
GPU_YAML_FIELDS = ("memory_gib", "peak_tflops", "hbm_bw_gb_per_s", "framework_reserve_gib", "gemm_efficiency",
                   "hbm_efficiency", "backward_gemm_ratio", "kernel_overhead_us", "grouped_gemm_efficiency",
                   "host_link_gb_per_s", "kernel_tables", "sustained_compute_fraction", "host_time_scale",
                   "board_power_w")


def gpu_from_yaml(data: dict[str, Any], what: str = "GPU profile") -> GpuSpec:
    """Convert a GPU YAML mapping (vendor units) to a GpuSpec (SI units)."""
    data = dict(data)
    try:
        fields: dict[str, Any] = {
            "name": data.pop("name"),
            "memory_bytes": _si(data.pop("memory_gib"), "memory_gib", what, GIB, MEMORY_BYTES_RANGE),
            "peak_flop_per_s": {str(k): _si(v, f"peak_tflops.{k}", what, TERA, FLOP_PER_S_RANGE)
                                for k, v in _mapping(data.pop("peak_tflops"), "peak_tflops", what).items()},
            "hbm_bw_bytes_per_s": _si(data.pop("hbm_bw_gb_per_s"), "hbm_bw_gb_per_s", what, GB, BW_BYTES_PER_S_RANGE),
        }
    except KeyError as exc:
        raise SpecError(f"{what} lacks required field {exc.args[0]!r}") from None
    except SpecError:  # already names the field and its rule
        raise
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{what} has a non-numeric value: {exc}") from None
    if "board_power_w" in data:  # kept with its source: the energy figures cite it
        fields.update(_board_power(data, what))
    _pop_sources(data, GPU_YAML_FIELDS, what)
    fields["framework_reserve_bytes"] = _si(data.pop("framework_reserve_gib", 0.0), "framework_reserve_gib", what, GIB,
                                            (0.0, MEMORY_BYTES_RANGE[1]))
    calib = data.pop("calibration", None)
    for key, conv in (("gemm_efficiency", 1.0), ("hbm_efficiency", 1.0), ("backward_gemm_ratio", 1.0),
                      ("grouped_gemm_efficiency", 1.0), ("sustained_compute_fraction", 1.0)):
        if key in data:
            fields[key] = _num(data.pop(key), key, what) * conv
    if "kernel_overhead_us" in data:
        fields["kernel_overhead_s"] = _si(data.pop("kernel_overhead_us"), "kernel_overhead_us", what, MICRO,
                                          LATENCY_S_RANGE)
    if "host_time_scale" in data:
        fields["host_time_scale"] = _si(data.pop("host_time_scale"), "host_time_scale", what, 1.0, HOST_TIME_SCALE_RANGE)
    if "host_link_gb_per_s" in data:
        fields["host_link_bw_bytes_per_s"] = _si(data.pop("host_link_gb_per_s"), "host_link_gb_per_s", what, GB,
                                                 BW_BYTES_PER_S_RANGE)
    if data.get("kernel_tables") is not None:
        fields["kernel_tables"] = str(data.pop("kernel_tables"))
    data.pop("kernel_tables", None)
    fields["source"] = str(data.pop("source", ""))
    residuals = data.pop("step_time_residuals", None)
    if residuals is not None:
        fields["step_time_residuals"] = _residuals(residuals, what)
    if calib:
        fields["calibration"] = str(calib)
    if data:
        raise SpecError(f"{what} has unknown field(s): {', '.join(sorted(data))}")
    return _validated(GpuSpec, fields, what)


def _board_power(data: dict[str, Any], what: str) -> dict[str, Any]:
    """`board_power_w` (watts, or null where no figure is published) and its `board_power_source`, which the
    spec keeps (an energy estimate names it); the source is required, null or not."""
    value = data.pop("board_power_w")
    source = data.pop("board_power_source", None)
    if not isinstance(source, str) or not source.strip():
        raise SpecError(f"{what}: board_power_source must be a non-empty text naming where board_power_w comes "
                        "from (or why it is null)")
    power = None if value is None else _si(value, "board_power_w", what, 1.0, BOARD_POWER_W_RANGE)
    return {"board_power_w": power, "board_power_source": source.strip()}


def load_gpu(ref: str | GpuSpec) -> GpuSpec:
    """A GPU by preset name (e.g. 'h100-sxm') or YAML path, with its calibration applied and its tables
    resolved (`resolve_gpu`)."""
    if isinstance(ref, GpuSpec):
        return resolve_gpu(ref)
    path = _resolve("gpus", ref)
    data = read_yaml(path, "GPU profile")
    calib = _calibration_for(path.stem)
    if calib:
        data.update(calib)
    data.setdefault("kernel_tables", path.stem)
    return resolve_gpu(gpu_from_yaml(data, f"GPU profile {path.name}"))


#: GPU fields a calibration file may set.
CALIBRATED_FIELDS = ("gemm_efficiency", "hbm_efficiency", "backward_gemm_ratio", "kernel_overhead_us",
                     "sustained_compute_fraction", "host_time_scale")


def _calibration_for(gpu_key: str) -> dict[str, Any]:
    """The calibrated fields of GPU preset `gpu_key`, its `calibration` note, and its
    `step_time_residuals` (the error band's basis; `residuals:` there is the fit's own, in-sample)."""
    for d in search_dirs():
        path = d / "calibration" / f"{gpu_key}.yaml"
        if path.exists():
            calib = read_yaml(path, "calibration")
            fitted_on = calib.pop("fitted_on", "")
            calib.pop("method", None)
            calib.pop("residuals", None)
            out = {k: calib[k] for k in CALIBRATED_FIELDS if k in calib}
            if calib.get("step_time_residuals") is not None:
                out["step_time_residuals"] = calib["step_time_residuals"]
            out["calibration"] = f"{path.name}: fitted on {fitted_on}" if fitted_on else path.name
            sustained = calib.get("sustained_compute_fraction_fit")
            if isinstance(sustained, dict) and "sustained_compute_fraction" in out:
                rows = len(sustained.get("residuals") or [])
                out["calibration"] += (f"; sustained_compute_fraction fitted on {rows} end-to-end rows "
                                       "(benchmarks.generations)")
            host = calib.get("host_time_scale_fit")
            if isinstance(host, dict) and "host_time_scale" in out:
                rows = len(host.get("residuals") or [])
                out["calibration"] += (f"; host_time_scale fitted on {rows} end-to-end rows "
                                       "(benchmarks.generations)")
            return out
    return {}


def _residuals(data: Any, what: str) -> StepTimeResiduals:
    """A `step_time_residuals:` mapping (see StepTimeResiduals; its `method:` and per-row `rows:` document
    the numbers, and are dropped)."""
    if not isinstance(data, dict):
        raise SpecError(f"{what}: step_time_residuals must be a mapping (end_to_end, n, error_low, error_high, "
                        f"basis, ...), not {type(data).__name__}")
    data = {k: v for k, v in data.items() if k not in ("method", "rows")}
    return _validated(StepTimeResiduals, data, f"{what} step_time_residuals")


# ---- clusters --------------------------------------------------------------
#: The numeric keys of a link tier and of a cluster YAML file (a cluster-level
#: `latency_source` or `efficiency_source` covers both tiers).
TIER_YAML_FIELDS = ("bw_gb_per_s", "latency_us", "efficiency", "gather_scatter_efficiency")
CLUSTER_SCALARS = ("gpus_per_node", "nvlink_domain_size", "segment_nodes", "max_gpus", "comm_overlap",
                   "comm_compute_slowdown", "tp_comm_overlap", "ep_comm_overlap", "moe_load_imbalance")
CLUSTER_YAML_FIELDS = (*CLUSTER_SCALARS, *TIER_YAML_FIELDS)
HOST_YAML_FIELDS = ("memory_gib", "memory_bw_gb_per_s", "memory_efficiency", "gpus_per_host_link")


def _host(data: Any, what: str) -> HostSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{what} must be a mapping with memory_gib, memory_bw_gb_per_s")
    data = dict(data)
    _pop_sources(data, HOST_YAML_FIELDS, what)
    try:
        fields: dict[str, Any] = {
            "memory_bytes": _si(data.pop("memory_gib"), "memory_gib", what, GIB, MEMORY_BYTES_RANGE),
            "memory_bw_bytes_per_s": _si(data.pop("memory_bw_gb_per_s"), "memory_bw_gb_per_s", what, GB,
                                         BW_BYTES_PER_S_RANGE)}
    except KeyError as exc:
        raise SpecError(f"{what} lacks required field {exc.args[0]!r}") from None
    except SpecError:  # already names the field and its rule
        raise
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{what} has a non-numeric value: {exc}") from None
    for key in ("memory_efficiency", "gpus_per_host_link"):
        if key in data:
            fields[key] = data.pop(key)
    if data:
        raise SpecError(f"{what} has unknown field(s): {', '.join(sorted(data))}")
    return _validated(HostSpec, fields, what)


def _tier(data: Any, what: str) -> LinkTier:
    if not isinstance(data, dict):
        raise SpecError(f"{what} must be a mapping with name, bw_gb_per_s, latency_us")
    data = dict(data)
    _pop_sources(data, TIER_YAML_FIELDS, what)
    try:
        fields = {
            "name": data.pop("name"),
            "bw_bytes_per_s": _si(data.pop("bw_gb_per_s"), "bw_gb_per_s", what, GB, BW_BYTES_PER_S_RANGE),
            "latency_s": _si(data.pop("latency_us"), "latency_us", what, MICRO, LATENCY_S_RANGE),
        }
    except KeyError as exc:
        raise SpecError(f"{what} lacks required field {exc.args[0]!r}") from None
    except SpecError:  # already names the field and its rule
        raise
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{what} has a non-numeric value: {exc}") from None
    for key in ("efficiency", "gather_scatter_efficiency"):
        if key in data:
            fields[key] = data.pop(key)
    if data:
        raise SpecError(f"{what} has unknown field(s): {', '.join(sorted(data))}")
    return _validated(LinkTier, fields, what)


def cluster_from_yaml(data: dict[str, Any], what: str = "cluster", base: Path | None = None) -> ClusterSpec:
    """A cluster from its YAML mapping. `gpu:` is a preset name, a mapping or a GPU file's path; a relative path
    is read from `base` (the cluster file's folder, as a topology's `graph_file` is), or from the working
    directory for a mapping given without a file."""
    data = dict(data)
    gpu = data.pop("gpu", None)
    if gpu is None:
        raise SpecError(f"{what} lacks required field 'gpu' (a GPU preset name or mapping)")
    if isinstance(gpu, str) and base is not None and _is_file_ref(gpu) and not Path(gpu).expanduser().is_absolute():
        gpu = str(Path(base) / gpu)
    gpu_spec = gpu_from_yaml(gpu, f"{what}.gpu") if isinstance(gpu, dict) else load_gpu(str(gpu))
    _pop_sources(data, CLUSTER_YAML_FIELDS, what)
    fields = {
        "name": data.pop("name", what),
        "gpu": gpu_spec,
        "intra_node": _tier(data.pop("intra_node", None), f"{what}.intra_node"),
        "inter_node": _tier(data.pop("inter_node", None), f"{what}.inter_node"),
    }
    for key in (*CLUSTER_SCALARS, "source"):
        if key in data:
            fields[key] = data.pop(key)
    if "host" in data:
        fields["host"] = _host(data.pop("host"), f"{what}.host")
    if "topology" in data:
        fields["topology"] = _topology(data.pop("topology"), f"{what}.topology")
    if data:
        raise SpecError(f"{what} has unknown field(s): {', '.join(sorted(data))}")
    return _validated(ClusterSpec, fields, what)


#: The numeric keys of a fabric level in a cluster YAML file's `topology.levels`.
LEVEL_YAML_FIELDS = ("unit_gpus", "oversubscription", "latency_us")


def _topology(data: Any, what: str) -> TopologySpec:
    """A cluster file's `topology:` mapping (planner.specs.topology.TopologySpec; level latencies in µs)."""
    data = dict(_mapping(data, "topology", what))
    levels = []
    raw = data.pop("levels", [])
    if not isinstance(raw, list):
        raise SpecError(f"{what}.levels must be a list of mappings (name, unit_gpus, oversubscription)")
    for i, level in enumerate(raw):
        level = dict(_mapping(level, f"levels[{i}]", what))
        _pop_sources(level, LEVEL_YAML_FIELDS, f"{what}.levels[{i}]")
        if "latency_us" in level:
            level["latency_s"] = _si(level.pop("latency_us"), "latency_us", f"{what}.levels[{i}]", MICRO,
                                     LATENCY_S_RANGE)
        levels.append(level)
    if levels:
        data["levels"] = levels
    return _validated(TopologySpec, data, what)


def load_cluster(ref: str | Path | ClusterSpec | dict) -> ClusterSpec:
    """A cluster by preset name ('dgx-h100'), YAML path, mapping or ClusterSpec, its GPU's tables resolved
    (`resolve_cluster`: a ClusterSpec that already carries them keeps them)."""
    if isinstance(ref, ClusterSpec):
        return resolve_cluster(ref)
    if isinstance(ref, dict):
        return resolve_cluster(cluster_from_yaml(ref, "cluster"))
    path = _resolve("clusters", str(ref))
    cluster = cluster_from_yaml(read_yaml(path, "cluster"), f"cluster {path.stem}", base=path.parent)
    return resolve_cluster(with_fabric(cluster, base=path.parent))


# ---- models ----------------------------------------------------------------
def load_model(ref: str | Path | ModelSpec | dict) -> ModelSpec:
    """A model by preset name, ModelSpec, mapping, YAML path, or HF config.json path/dict."""
    if isinstance(ref, ModelSpec):
        return ref
    if isinstance(ref, dict):
        if "model_type" in ref or "num_hidden_layers" in ref or "n_layer" in ref:
            return read_hf_config(ref)
        return _validated(ModelSpec, ref, "model")
    text = str(ref)
    check_ref("model", text)
    if text.endswith(".json"):
        return read_hf_config(text)
    path = _resolve("models", text)
    return _validated(ModelSpec, read_yaml(path, "model"), f"model {path.stem}")
