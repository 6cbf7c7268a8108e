"""Every number in profiles/ names its source or says it is an estimate (issue 7, part 3).

A number is covered by
- a `<field>_source` (or the same without the unit, `kernel_overhead_source`) in
  its mapping or an enclosing one;
- a cluster's `topology.source` for the numbers of its `topology:` mapping;
- the file's `source:` for the fields a datasheet or model card gives
  (`DATASHEET`), or for every field of a profile `meshplan profile` measured;
- in calibration files, `fitted_on:` for the calibrated fields; the other
  numbers there are the fit's own report (`REPORT_KEYS`), which `method:` names.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from planner.errors import SpecError
from profiles import CALIBRATED_FIELDS, PROFILES_DIR, gpu_from_yaml, load_cluster, source_keys

#: Fields whose values come from the datasheet (GPUs, clusters) or the model card that `source:` names.
DATASHEET = {
    "gpus": {"memory_gib", "peak_tflops", "hbm_bw_gb_per_s"},
    "clusters": {"gpus_per_node", "nvlink_domain_size", "max_gpus", "bw_gb_per_s"},
}
#: Calibration-file blocks that report the fit (residuals, its uncertainty, held-out errors).
REPORT_KEYS = {"standard_errors", "residuals", "leave_one_paper_out", "step_time_residuals", "sustained_compute_fraction_fit",
               "host_time_scale_fit"}
MEASURED = "measured by `meshplan profile`"


def _numbers(node, path=()):
    """(path, enclosing mappings) of every numeric leaf."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from ((p, [node, *m]) for p, m in _numbers(value, (*path, key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _numbers(value, (*path, i))
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path, []


def unsourced(kind: str, doc: dict) -> list[str]:
    """The dotted paths of the numbers in one profile file that name no source."""
    source = str(doc.get("source") or "").strip()
    missing = []
    for path, mappings in _numbers(doc):
        top = path[0]
        field = next(p for p in reversed(path) if isinstance(p, str))
        if any(doc.get(k) for k in source_keys(field)) or any(m.get(k) for m in mappings for k in source_keys(field)):
            continue
        if kind == "models" and source:
            continue
        if kind == "clusters" and top == "topology" and str(doc["topology"].get("source") or "").strip():
            continue  # the fabric's structure (unit sizes, oversubscription) as its `topology.source` publishes it
        if kind in DATASHEET and source and (top in DATASHEET[kind] or field in DATASHEET[kind]):
            continue
        if kind in ("gpus", "clusters") and source.startswith(MEASURED):
            continue
        if kind == "calibration" and (top in REPORT_KEYS and doc.get("method")
                                      or top in CALIBRATED_FIELDS and str(doc.get("fitted_on") or "").strip()):
            continue
        missing.append(".".join(str(p) for p in path))
    return missing


FILES = sorted((kind, path) for kind in ("gpus", "clusters", "models", "calibration")
               for path in (PROFILES_DIR / kind).glob("*.yaml"))


@pytest.mark.parametrize("kind,path", FILES, ids=[f"{k}/{p.stem}" for k, p in FILES])
def test_every_number_names_its_source(kind: str, path: Path):
    doc = yaml.safe_load(path.read_text())
    assert unsourced(kind, doc) == []
    for key, value in doc.items():
        if key.endswith("_source"):
            assert isinstance(value, str) and value.strip(), key


def test_an_unsourced_number_is_found():
    gpu = {"name": "x", "memory_gib": 80, "peak_tflops": {"bf16": 1}, "hbm_bw_gb_per_s": 1, "source": "datasheet",
           "kernel_overhead_us": 5, "framework_reserve_gib": 2, "framework_reserve_source": "estimate"}
    assert unsourced("gpus", gpu) == ["kernel_overhead_us"]
    assert unsourced("gpus", gpu | {"kernel_overhead_source": "estimate"}) == []
    cluster = {"gpu": "a100-80gb", "gpus_per_node": 8, "comm_overlap": 1.0, "source": "datasheet",
               "intra_node": {"name": "nvlink", "bw_gb_per_s": 300, "latency_us": 3, "efficiency": 0.8}}
    assert unsourced("clusters", cluster) == ["comm_overlap", "intra_node.latency_us", "intra_node.efficiency"]
    covered = cluster | {"comm_overlap_source": "estimate", "latency_source": "estimate",
                         "intra_node": cluster["intra_node"] | {"efficiency_source": "nccl-tests"}}
    assert unsourced("clusters", covered) == []
    assert unsourced("calibration", {"gemm_efficiency": 0.6, "residuals": [{"error": 0.1}]}) == [
        "gemm_efficiency", "residuals.0.error"]


def test_loaders_accept_and_drop_source_keys():
    gpu = {"name": "x", "memory_gib": 80, "peak_tflops": {"bf16": 100}, "hbm_bw_gb_per_s": 1000,
           "kernel_overhead_us": 4, "kernel_overhead_source": "estimate", "hbm_bw_source": "datasheet"}
    assert gpu_from_yaml(gpu).kernel_overhead_s == pytest.approx(4e-6)
    with pytest.raises(SpecError, match="kernel_overhead_source"):
        gpu_from_yaml(gpu | {"kernel_overhead_source": ""})
    with pytest.raises(SpecError, match="unknown field.*warp_source"):
        gpu_from_yaml(gpu | {"warp_source": "x"})
    tier = {"name": "t", "bw_gb_per_s": 10, "latency_us": 5, "latency_source": "estimate"}
    cluster = load_cluster({"gpu": "a100-80gb", "gpus_per_node": 8, "intra_node": tier, "inter_node": tier,
                            "comm_overlap": 0.5, "comm_overlap_source": "measured", "efficiency_source": "assumed"})
    assert cluster.comm_overlap == 0.5


def test_every_shipped_kernel_table_loads_with_its_source():
    """Kernel tables (profiles/kernels/<topic>/<set>.yaml) are refused by the loader without a
    source or a known kind; every shipped one loads, and names the GPU it was measured on."""
    from profiles.tables import TOPICS, kernel_table

    root = PROFILES_DIR / "kernels"
    found = sorted(root.glob("*/*.yaml"))
    assert found, "no kernel tables shipped"
    for path in found:
        topic, name = path.parent.name, path.stem
        assert topic in TOPICS, path
        table = kernel_table(topic, name)
        assert table is not None and str(table["source"]).strip() and str(table.get("gpu", "")).strip(), path
