"""Every physical number of a GPU or cluster has a range: a value far outside it (1e-300 GB/s, 1e300),
NaN or infinity in a profile YAML is refused with one line and exit 2, before any time or table is
computed from it (a 1e-300 GB/s link gave a 290-digit step time)."""

from __future__ import annotations

import annotated_types as at
import pytest
import yaml

from planner.cli import main
from planner.specs.hardware import ClusterSpec, GpuSpec, HostSpec, LinkTier, StepTimeResiduals
from profiles import PROFILES_DIR

SPECS = (GpuSpec, LinkTier, HostSpec, ClusterSpec, StepTimeResiduals)


def _numeric(annotation) -> bool:
    text = str(annotation)
    return ("float" in text or "int" in text) and "dict" not in text


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.__name__)
def test_every_number_of_the_hardware_specs_has_both_bounds(spec):
    unbounded = []
    for name, field in spec.model_fields.items():
        if not _numeric(field.annotation):
            continue
        low = any(isinstance(m, (at.Ge, at.Gt)) for m in field.metadata)
        high = any(isinstance(m, (at.Le, at.Lt)) for m in field.metadata)
        if not (low and high):
            unbounded.append(name)
    assert unbounded == []
    assert spec.model_config.get("allow_inf_nan") is False  # NaN and infinity refused whatever the bounds


#: Every number the shipped cluster profile states, by its path in the cluster YAML (the GPU inline).
FIELDS = [
    "inter_node.bw_gb_per_s", "intra_node.bw_gb_per_s", "inter_node.latency_us", "intra_node.efficiency",
    "inter_node.efficiency", "gpus_per_node", "comm_overlap", "comm_compute_slowdown", "tp_comm_overlap",
    "ep_comm_overlap", "moe_load_imbalance", "host.memory_gib", "host.memory_bw_gb_per_s", "host.memory_efficiency",
    "host.gpus_per_host_link", "gpu.memory_gib", "gpu.peak_tflops.bf16", "gpu.hbm_bw_gb_per_s",
    "gpu.kernel_overhead_us", "gpu.host_link_gb_per_s",
]
BAD = [1e-300, 1e300, -1.0, float("nan"), float("inf"), float("-inf")]


def _cluster_doc() -> dict:
    doc = yaml.safe_load((PROFILES_DIR / "clusters" / "dgx-h100.yaml").read_text())
    doc["gpu"] = yaml.safe_load((PROFILES_DIR / "gpus" / "h100-sxm.yaml").read_text())
    return doc


def _set(doc: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for key in parents:
        doc = doc[key]
    assert last in doc, path  # the shipped profile states it: the test changes a real number
    doc[last] = value


#: Fields whose range starts at 0 (a latency, a share of the communication hidden): 1e-300 is a valid value.
ZERO_ALLOWED = {"inter_node.latency_us", "gpu.kernel_overhead_us", "comm_overlap", "comm_compute_slowdown",
                "tp_comm_overlap", "ep_comm_overlap"}
CASES = [(path, value) for path in FIELDS for value in BAD if not (value == 1e-300 and path in ZERO_ALLOWED)]


@pytest.mark.parametrize("path,value", CASES, ids=[f"{p}={v!r}" for p, v in CASES])
def test_a_hardware_number_out_of_range_is_one_line_and_exit_2(tmp_path, capsys, path, value):
    doc = _cluster_doc()
    _set(doc, path, value)
    file = tmp_path / "cluster.yaml"
    file.write_text(yaml.safe_dump(doc))  # .nan / .inf / -.inf for the non-finite values
    code = main(["plan", "-m", "llama3-8b", "-c", str(file), "-n", "16", "-b", "64", "-s", "4096", "--top", "1"])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.startswith("error: ") and out.err.count("\n") == 1, out.err
    assert path.split(".")[-1] in out.err  # the field is named


def test_the_shipped_cluster_document_plans(tmp_path, capsys):
    """The document the cases above change is a valid cluster as it stands."""
    file = tmp_path / "cluster.yaml"
    file.write_text(yaml.safe_dump(_cluster_doc()))
    assert main(["plan", "-m", "llama3-8b", "-c", str(file), "-n", "16", "-b", "64", "-s", "4096", "--top", "1"]) == 0


@pytest.mark.parametrize("field", ["error_high", "median_abs", "max_abs", "mean_signed"])
@pytest.mark.parametrize("value", [1e300, float("nan"), float("inf")], ids=repr)
def test_step_time_residual_statistics_are_bounded(field, value):
    base = dict(end_to_end=True, n=5, error_low=-0.1, error_high=0.1, basis="test")
    StepTimeResiduals(**base)
    with pytest.raises(ValueError, match=field):
        StepTimeResiduals(**base | {field: value})
