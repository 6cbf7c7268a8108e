"""The B300 GPU and the DGX-B300 cluster presets: they load with every kernel table, their numbers are those of
their sources (HGX B300 datasheet; B300's attention is GB300's at B300's dense peak) and plan() plans on them."""

import pytest
import yaml

from executors.profile_tables import shipped_set
from planner.api import plan
from profiles import PROFILES_DIR, list_presets, load_cluster, load_gpu
from profiles.bundle import load_tables, resolve_cluster
from profiles.tables import TOPICS


def test_b300_and_dgx_b300_are_presets():
    assert "b300" in list_presets("gpus") and "dgx-b300" in list_presets("clusters")


def test_b300_peaks_are_the_hgx_b300_datasheet_per_gpu():
    g = load_gpu("b300")
    peaks = {k: v / 1e12 for k, v in g.peak_flop_per_s.items()}
    assert (peaks["bf16"], peaks["fp8"], peaks["fp4"]) == (2250, 4500, 13500)
    assert g.memory_bytes / 2**30 == 268 and g.hbm_bw_bytes_per_s == 8e12


@pytest.mark.parametrize("gpu,fp4_over_fp8", [("b200", 2), ("gb200", 2), ("b300", 3), ("gb300", 3)])
def test_blackwell_fp4_peaks(gpu, fp4_over_fp8):
    g = load_gpu(gpu)
    assert g.peak("fp4") == pytest.approx(fp4_over_fp8 * g.peak("fp8"))


def test_every_topic_has_a_b300_table():
    tables = load_tables("b300")
    assert tables.gemm is not None and tables.elementwise is not None and tables.collectives is not None
    assert tables.memory is not None and tables.dispatch is not None and tables.attention
    assert all(load_tables(g) is not None for g in ("b200", "gb300")) and len(TOPICS) == 6


def test_b300_attention_is_gb300_scaled_to_the_b300_dense_peak():
    def curves(name):
        data = yaml.safe_load((PROFILES_DIR / "kernels" / "attention" / f"{name}.yaml").read_text())
        return {(c["direction"], c["causal"], c["head_dim"], c.get("window")): c["tflops"]
                for c in data["curves"] + data["window_curves"]}
    b300, gb300 = curves("b300"), curves("gb300")
    assert set(b300) == set(gb300)
    for key, tflops in gb300.items():
        assert b300[key] == [round(v * 2250 / 2500) for v in tflops], key
    assert load_tables("b300").attention


def test_dgx_b300_fabric_is_eight_gpu_nodes_in_512_gpu_units():
    c = resolve_cluster(load_cluster("dgx-b300"))
    assert c.gpu.name == load_gpu("b300").name and c.gpus_per_node == 8
    assert [lv.unit_gpus for lv in c.fabric.levels] == [8, 512]
    assert c.inter_node.bw_bytes_per_s == 100e9  # one ConnectX-8 800 Gb/s per GPU


def test_the_profile_command_maps_a_b300_to_its_set():
    assert shipped_set("NVIDIA B300 SXM6 AC") == "b300" and shipped_set("NVIDIA GB300") == "gb300"


@pytest.mark.parametrize("precision,options", [("bf16", {}), ("fp8", {"fp8_recipe": "mxfp8"})])
def test_plan_works_on_dgx_b300(precision, options):
    r = plan("llama3.1-8b", "dgx-b300", 16, 128, 8192, precision=precision, top_k=1, **options)
    assert r.plans and r.plans[0].estimate.step_time_s > 0
