"""A user calibration file: physical parameters fitted on one's own runs, applied to a cluster when planning.

The file has the shape of a shipped calibration profile's main fit (`profiles/calibration/<gpu>.yaml`,
written by `planner.calibrate.user_calibration_document` and `write_calibration_profile(kind="user")`):

    sustained_compute_fraction: 0.71      # the values, in the units their keys name (USER_CALIBRATION_KEYS)
    intra_node_bw_gb_per_s: 310.5
    gpu: h100-sxm                         # optional: the GPU preset (or GpuSpec.name) it was measured on
    cluster: dgx-h100                     # optional: the cluster (ClusterSpec.name) it was measured on
    fit: my-tune                          # optional: the fit's name
    fitted_on: 12 trial runs of llama3-8b on 8 GPUs, 2025-06-02   # required: what the values come from
    method: bounded least squares of log step-time errors          # optional
    standard_errors: {sustained_compute_fraction: 0.004}          # optional, in the values' units
    residuals: [{row: trial 3, error: -0.012}]                    # optional, one per fitted run
    trials: [...]                         # optional, ignored: the runs the fit used, as the tuner keeps them
    study: {...}                          # optional, ignored: the tuner's search state

Every value is checked against its physical range (in the file's unit), a key that is neither a value nor
one of the keys above is refused by name, and the file is read by the bounded reader (`profiles.files`).
`apply_calibration` sets the values on a cluster: GPU fields on its GPU, `comm_overlap`, `tp_comm_overlap`
and `ep_comm_overlap` on the cluster, the two bandwidths on its link tiers. A `gpu:` that is not the
cluster's GPU is refused; so is a `cluster:` naming another cluster where the file sets cluster values
(overlaps, bandwidths), which describe the network it was measured on. GPU values alone carry to any
cluster of that GPU.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import Field

from planner.errors import InputWarning, SpecError, short_repr
from planner.specs import ClusterSpec, GpuSpec
from planner.specs.base import Spec
from planner.specs.hardware import (BW_BYTES_PER_S_RANGE, EFFICIENCY_RANGE, HOST_TIME_SCALE_RANGE, LATENCY_S_RANGE,
                                    MEMORY_BYTES_RANGE)
from profiles.files import find_file, parsed_yaml, read_yaml

#: Units the file's keys name, in SI.
GIB = 2**30
GB = 1e9
MICRO = 1e-6
#: backward_gemm_ratio's range (above 0, at most 4: GpuSpec's bounds).
BACKWARD_GEMM_RATIO_RANGE = (0.0, 4.0)
#: A share of something that runs concurrently or is hidden: 0 to 1, both allowed.
SHARE_RANGE = (0.0, 1.0)


class UserKey(NamedTuple):
    """One value key of a user calibration file: the parameter it sets (SI, as `planner.calibrate.apply_parameters`
    names it), the factor from the file's unit to SI, the SI range, and whether the range's lower end is
    excluded (a rate or ratio must be above 0)."""

    name: str
    scale: float
    bounds: tuple[float, float]
    positive: bool = False


#: The value keys of a user calibration file, in the order a written file lists them.
USER_CALIBRATION_KEYS: dict[str, UserKey] = {
    "sustained_compute_fraction": UserKey("sustained_compute_fraction", 1.0, EFFICIENCY_RANGE),
    "host_time_scale": UserKey("host_time_scale", 1.0, HOST_TIME_SCALE_RANGE),
    "gemm_efficiency": UserKey("gemm_efficiency", 1.0, EFFICIENCY_RANGE),
    "hbm_efficiency": UserKey("hbm_efficiency", 1.0, EFFICIENCY_RANGE),
    "backward_gemm_ratio": UserKey("backward_gemm_ratio", 1.0, BACKWARD_GEMM_RATIO_RANGE, positive=True),
    "kernel_overhead_us": UserKey("kernel_overhead_s", MICRO, LATENCY_S_RANGE),
    "framework_reserve_gib": UserKey("framework_reserve_bytes", GIB, (0.0, MEMORY_BYTES_RANGE[1])),
    "comm_overlap": UserKey("comm_overlap", 1.0, SHARE_RANGE),
    "tp_comm_overlap": UserKey("tp_comm_overlap", 1.0, SHARE_RANGE),
    "ep_comm_overlap": UserKey("ep_comm_overlap", 1.0, SHARE_RANGE),
    "intra_node_bw_gb_per_s": UserKey("intra_node_bw_bytes_per_s", GB, BW_BYTES_PER_S_RANGE, positive=True),
    "inter_node_bw_gb_per_s": UserKey("inter_node_bw_bytes_per_s", GB, BW_BYTES_PER_S_RANGE, positive=True),
}
#: The file key of each SI parameter name.
FILE_KEY = {k.name: key for key, k in USER_CALIBRATION_KEYS.items()}
#: The factor from each SI parameter's file unit to SI (1 for dimensionless parameters): a fit rounds a
#: value in its file unit (`planner.calibrate.fit_parameters`), so microseconds keep their decimals.
UNIT_SCALE = {k.name: k.scale for k in USER_CALIBRATION_KEYS.values()}
#: The flat parameter names of the link tiers' bandwidths: (ClusterSpec field of the tier, LinkTier field).
TIER_PARAMETERS = {"intra_node_bw_bytes_per_s": ("intra_node", "bw_bytes_per_s"),
                   "inter_node_bw_bytes_per_s": ("inter_node", "bw_bytes_per_s")}
#: Parameters of the cluster (its fields or its tiers'), not of the GPU: a file setting them describes one network.
CLUSTER_PARAMETERS = ("comm_overlap", "tp_comm_overlap", "ep_comm_overlap", *TIER_PARAMETERS)
#: A name that can be a GPU preset (looked up as `gpus/<name>.yaml`): no separator, no control character.
_PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,250}")
#: Texts a file may hold beside the values; `fitted_on` is required.
TEXT_KEYS = ("gpu", "cluster", "fit", "fitted_on", "method")
#: Keys the loader accepts and ignores: what a tuner keeps in the file for itself (its trial runs, its search).
IGNORED_KEYS = ("trials", "study")


def _si_field(key: str, description: str) -> Any:
    k = USER_CALIBRATION_KEYS[key]
    low, high = k.bounds
    return Field(None, **({"gt": low} if k.positive else {"ge": low}), le=high,
                 description=f"{description} (SI; file key {key})")


class Calibration(Spec):
    """A user calibration in SI units (`load_calibration`): each value None where the file does not set it."""

    sustained_compute_fraction: float | None = _si_field("sustained_compute_fraction", "GpuSpec field")
    host_time_scale: float | None = _si_field("host_time_scale", "GpuSpec field")
    gemm_efficiency: float | None = _si_field("gemm_efficiency", "GpuSpec field")
    hbm_efficiency: float | None = _si_field("hbm_efficiency", "GpuSpec field")
    backward_gemm_ratio: float | None = _si_field("backward_gemm_ratio", "GpuSpec field")
    kernel_overhead_s: float | None = _si_field("kernel_overhead_us", "GpuSpec field, seconds")
    framework_reserve_bytes: float | None = _si_field("framework_reserve_gib", "GpuSpec field, bytes")
    comm_overlap: float | None = _si_field("comm_overlap", "ClusterSpec field")
    tp_comm_overlap: float | None = _si_field("tp_comm_overlap", "ClusterSpec field")
    ep_comm_overlap: float | None = _si_field("ep_comm_overlap", "ClusterSpec field")
    intra_node_bw_bytes_per_s: float | None = _si_field("intra_node_bw_gb_per_s",
                                                        "the intra_node tier's bandwidth, bytes/s")
    inter_node_bw_bytes_per_s: float | None = _si_field("inter_node_bw_gb_per_s",
                                                        "the inter_node tier's bandwidth, bytes/s")
    gpu: str | None = Field(None, min_length=1, description="GPU preset or GpuSpec.name the values were measured "
                            "on; None: any GPU.")
    cluster: str | None = Field(None, min_length=1, description="ClusterSpec.name the values were measured on; "
                                "None: any cluster.")
    fit: str = Field("", description="The fit's name.")
    fitted_on: str = Field(min_length=1, description="What the values were fitted on (runs, dates).")
    method: str = Field("", description="How they were fitted.")
    source: str = Field("", description="The file they were read from, as given; empty for a mapping.")

    @property
    def values(self) -> dict[str, float]:
        """The values the file sets, by parameter name (SI)."""
        return {k.name: getattr(self, k.name) for k in USER_CALIBRATION_KEYS.values()
                if getattr(self, k.name) is not None}

    @property
    def label(self) -> str:
        """The file's name (without its folder), or `calibration mapping` for one given as data."""
        return Path(self.source).name if self.source else "calibration mapping"

    def summary(self) -> str:
        """One line: the file, what it was fitted on, and each value in the file's units."""
        shown = ", ".join(f"{FILE_KEY[n]} {v / UNIT_SCALE[n]:.6g}" for n, v in self.values.items())
        fit = f", fit {self.fit}" if self.fit else ""
        return f"{self.label} ({shown}{fit}; fitted on {self.fitted_on})"


def load_calibration(ref: str | Path | dict[str, Any] | Calibration) -> Calibration:
    """A user calibration from a YAML (or JSON) file, a mapping of the file's keys, or a Calibration (returned
    as it is). Every problem is a one-line SpecError naming the file, the key and the rule."""
    if isinstance(ref, Calibration):
        return ref
    if isinstance(ref, dict):
        return calibration_from_mapping(ref, "calibration")
    if not isinstance(ref, (str, Path)):
        raise SpecError(f"calibration must be a file path, a mapping or a Calibration (got {type(ref).__name__})")
    text = str(ref)
    return calibration_from_mapping(read_yaml(Path(text), "calibration"), f"calibration {text}", text)


def _value(value: Any, key: str, what: str) -> float:
    """The SI value of file key `key`, checked against its range (stated in the file's unit)."""
    k = USER_CALIBRATION_KEYS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"{what}: {key} must be a finite number (got {short_repr(value)})")
    low, high = k.bounds
    if k.positive and value <= 0:
        raise SpecError(f"{what}: {key} must be > 0 (got {short_repr(value)})")
    x = float(value) * k.scale
    if not low <= x <= high:
        rule = (f"above 0 and at most {high / k.scale:g}" if k.positive and low == 0
                else f"between {low / k.scale:g} and {high / k.scale:g}")
        raise SpecError(f"{what}: {key} must be {rule} (got {short_repr(value)})")
    return x


def _check_notes(data: dict[str, Any], what: str) -> None:
    """The texts, `standard_errors:` and `residuals:` beside the values: documentation, checked for shape."""
    for key in TEXT_KEYS:
        if key in data and (not isinstance(data[key], str) or not data[key].strip()):
            raise SpecError(f"{what}: {key} must be a non-empty text (got {short_repr(data[key])})")
    if "fitted_on" not in data:
        raise SpecError(f"{what}: fitted_on is required: a text naming the runs the values were fitted on")
    errors = data.get("standard_errors")
    if errors is not None:
        if not isinstance(errors, dict):
            raise SpecError(f"{what}: standard_errors must be a mapping of value key -> standard error in its unit "
                            f"(got {short_repr(errors)})")
        for key, err in errors.items():
            if key not in USER_CALIBRATION_KEYS:
                raise SpecError(f"{what}: standard_errors.{key} names no value key "
                                f"({', '.join(USER_CALIBRATION_KEYS)})")
            if err is not None and (isinstance(err, bool) or not isinstance(err, (int, float))
                                    or not math.isfinite(err) or err < 0):
                raise SpecError(f"{what}: standard_errors.{key} must be a finite number >= 0 or null (not identified) "
                                f"(got {short_repr(err)})")
    rows = data.get("residuals")
    if rows is not None:
        if not isinstance(rows, list):
            raise SpecError(f"{what}: residuals must be a list of {{row, error}} (got {short_repr(rows)})")
        for i, row in enumerate(rows):
            err = row.get("error") if isinstance(row, dict) else None
            if (not isinstance(row, dict) or not isinstance(row.get("row"), str) or isinstance(err, bool)
                    or not isinstance(err, (int, float)) or not math.isfinite(err)):
                raise SpecError(f"{what}: residuals[{i}] must be a mapping with a text row and a finite number "
                                f"error (got {short_repr(row)})")


def calibration_from_mapping(data: Any, what: str = "calibration", source: str = "") -> Calibration:
    """A Calibration from the file's mapping (`what` names it in messages, `source` is the path text)."""
    if not isinstance(data, dict):
        raise SpecError(f"{what} must be a mapping of calibration keys (got {type(data).__name__})")
    known = (*USER_CALIBRATION_KEYS, *TEXT_KEYS, "standard_errors", "residuals", *IGNORED_KEYS)
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise SpecError(f"{what} has unknown key(s) {', '.join(unknown)}: a calibration file holds values "
                        f"({', '.join(USER_CALIBRATION_KEYS)}) and {', '.join(known[len(USER_CALIBRATION_KEYS):])}")
    si = {k.name: _value(data[key], key, what) for key, k in USER_CALIBRATION_KEYS.items() if key in data}
    if not si:
        raise SpecError(f"{what} sets no value: give at least one of {', '.join(USER_CALIBRATION_KEYS)}")
    _check_notes(data, what)
    try:
        return Calibration(**si, **{k: data[k] for k in TEXT_KEYS if k in data}, source=source)
    except SpecError as exc:  # the checks above state every rule; this names the file if one was missed
        raise SpecError(f"{what}: {exc}") from None


def with_parameters(cluster: ClusterSpec, values: dict[str, float]) -> ClusterSpec:
    """`cluster` with each named parameter set: a GpuSpec field on its GPU, a tier bandwidth
    (`TIER_PARAMETERS`) on that tier, any other name as a ClusterSpec field. Values are set as given
    (no range check: `apply_calibration` and a fit's bounds check them); the GPU keeps its tables."""
    gpu_update = {k: float(v) for k, v in values.items() if k in GpuSpec.model_fields}
    tiers: dict[str, dict[str, float]] = {}
    for name, value in values.items():
        if name in TIER_PARAMETERS:
            tier, field = TIER_PARAMETERS[name]
            tiers.setdefault(tier, {})[field] = float(value)
    update: dict[str, Any] = {k: float(v) for k, v in values.items()
                              if k not in gpu_update and k not in TIER_PARAMETERS}
    update |= {tier: getattr(cluster, tier).model_copy(update=fields) for tier, fields in tiers.items()}
    new_inter = tiers.get("inter_node", {}).get("bw_bytes_per_s")
    if new_inter is not None and cluster.fabric is not None:
        # The fabric's levels were derived from links at the scale-out tier's rate (or a graph file's): a
        # fitted rate scales every level's egress alike, oversubscription kept.
        ratio = new_inter / cluster.inter_node.bw_bytes_per_s
        levels = [lv.model_copy(update={"egress_bytes_per_s": lv.egress_bytes_per_s * ratio})
                  for lv in cluster.fabric.levels]
        update["fabric"] = cluster.fabric.model_copy(update={"levels": levels})
    return cluster.model_copy(update=update | {"gpu": cluster.gpu.model_copy(update=gpu_update)})


def same_gpu(ref: str, gpu: GpuSpec) -> bool:
    """Whether `ref` (a calibration's `gpu:`) names `gpu`: its GpuSpec.name (any case), the preset it was loaded
    from (its `kernel_tables` set is named after it), or a GPU preset whose file has that name."""
    if ref.casefold() in (gpu.name.casefold(), (gpu.kernel_tables or "").casefold()):
        return True
    if not _PRESET_NAME.fullmatch(ref):
        return False
    path = find_file("gpus", ref)
    return path is not None and parsed_yaml(path, "GPU profile").get("name") == gpu.name


def apply_calibration(cluster: ClusterSpec, calibration: str | Path | dict[str, Any] | Calibration) -> ClusterSpec:
    """`cluster` with the calibration's values set (`with_parameters`) and its GPU's `calibration` text naming
    the file first (`<file>: fitted on ...; user calibration of <keys>; other constants: <the profile's>`).

    Refused (SpecError, one line naming both): a `gpu:` that is not the cluster's GPU (`same_gpu`), a
    `cluster:` that is not this cluster's name where the file sets cluster values (`CLUSTER_PARAMETERS`),
    a framework_reserve_gib not below the GPU's memory. An `intra_node_bw_gb_per_s` on a GPU whose collectives
    are timed from a measured table (`cost_models.collectives`), where it prices only pipeline transfers,
    gives an InputWarning saying so."""
    calib = load_calibration(calibration)
    what = f"calibration {calib.source}" if calib.source else "calibration"
    gpu = cluster.gpu
    if calib.gpu is not None and not same_gpu(calib.gpu, gpu):
        preset = f", preset {gpu.kernel_tables}" if gpu.kernel_tables else ""
        raise SpecError(f"{what}: gpu {short_repr(calib.gpu)} is not the GPU of cluster {short_repr(cluster.name)} "
                        f"({gpu.name}{preset}); a calibration applies to the GPU it was measured on")
    values = calib.values
    network = [FILE_KEY[n] for n in values if n in CLUSTER_PARAMETERS]
    if calib.cluster is not None and network and calib.cluster != cluster.name:
        raise SpecError(f"{what}: cluster {short_repr(calib.cluster)} is not {short_repr(cluster.name)}, and its "
                        f"network values ({', '.join(network)}) describe the cluster they were measured on")
    reserve = values.get("framework_reserve_bytes", gpu.framework_reserve_bytes)
    if reserve >= gpu.memory_bytes:
        raise SpecError(f"{what}: framework_reserve_gib ({reserve / GIB:g}) must be less than GPU {gpu.name}'s "
                        f"memory ({gpu.memory_bytes / GIB:g} GiB)")
    if "intra_node_bw_bytes_per_s" in values and gpu.has_tables and gpu.tables.collectives is not None:
        warnings.warn(f"{what}: intra_node_bw_gb_per_s prices only pipeline transfers on GPU {gpu.name}, whose "
                      "collectives inside an NVLink domain are timed from its measured collectives table "
                      f"(profiles/kernels/collectives/{gpu.kernel_tables}.yaml)", InputWarning, stacklevel=2)
    out = with_parameters(cluster, values)
    note = (f"{calib.label}: fitted on {calib.fitted_on}; user calibration of {', '.join(FILE_KEY[n] for n in values)}"
            + (f"; other constants: {gpu.calibration}" if gpu.calibration else ""))
    return out.model_copy(update={"gpu": out.gpu.model_copy(update={"calibration": note})})
