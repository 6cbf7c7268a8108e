"""Specs, presets and loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cost_models.params import embedding_params, layer_params, num_params
from planner import ModelSpec, SpecError, Strategy
from planner.specs.hf import read_hf_config
from profiles import list_presets, load_cluster, load_gpu, load_model

ROOT = Path(__file__).resolve().parents[1]

# Published parameter counts (Hugging Face model cards / safetensors totals).
PUBLISHED_PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
}

# SC'21 Table 1 "Number of parameters (billion)" and GPT-3 175B.
SC21_PARAMS_B = {"gpt3-1.7b": 1.7, "gpt3-3.6b": 3.6, "gpt3-7.5b": 7.5, "gpt3-18b": 18.4, "gpt3-39b": 39.1,
                 "gpt3-76b": 76.1, "gpt3-145b": 145.6, "gpt3-310b": 310.1, "gpt3-530b": 529.6, "gpt3-1t": 1008.0,
                 "gpt3-175b": 174.6}


@pytest.mark.parametrize("name,count", PUBLISHED_PARAMS.items())
def test_llama_presets_match_published_counts_exactly(name, count):
    assert num_params(load_model(name)) == count


@pytest.mark.parametrize("name,billions", SC21_PARAMS_B.items())
def test_gpt3_presets_match_sc21_table1(name, billions):
    # SC'21 Eq. 2 plus the final LayerNorm; the table prints 1-4 significant digits.
    assert num_params(load_model(name)) / 1e9 == pytest.approx(billions, rel=0.03)


def test_gpt3_layer_params_follow_sc21_eq2():
    m = load_model("gpt3-175b")
    h = m.hidden_size
    assert layer_params(m) == 12 * h * h + 13 * h  # Eq. 2 per layer: 12h^2 (1 + 13/(12h))
    assert embedding_params(m) == (m.vocab_size + m.max_position_embeddings) * h


def test_every_preset_loads_and_names_a_source():
    for kind, loader in (("models", load_model), ("clusters", load_cluster), ("gpus", load_gpu)):
        names = list_presets(kind)
        assert names, kind
        for name in names:
            spec = loader(name)
            source = spec.source if hasattr(spec, "source") else ""
            assert source, f"{kind}/{name} has no source"


def test_required_presets_exist():
    assert {"dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72"} <= set(list_presets("clusters"))
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200", "gb200"} <= set(list_presets("gpus"))
    assert set(PUBLISHED_PARAMS) | set(SC21_PARAMS_B) <= set(list_presets("models"))


def test_units_are_converted_on_load():
    gpu = load_gpu("a100-80gb")
    assert gpu.memory_bytes == 80 * 2**30
    assert gpu.peak("bf16") == 312e12
    assert gpu.hbm_bw_bytes_per_s == 2039e9
    cluster = load_cluster("dgx-h100")
    assert cluster.inter_node.bw_bytes_per_s == 50e9
    assert cluster.intra_node.latency_s == pytest.approx(3e-6)


def test_unknown_preset_lists_close_matches():
    with pytest.raises(SpecError, match="llama3-8b"):
        load_model("llama3-7b")
    with pytest.raises(SpecError, match="dgx-h100"):
        load_cluster("dgx-h10")


def test_malformed_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpu: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_cluster(str(bad))


def test_cluster_yaml_with_unknown_field_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: c\ngpu: h100-sxm\ngpus_per_node: 8\nfoo: 1\n"
                    "intra_node: {name: nv, bw_gb_per_s: 450, latency_us: 3}\n"
                    "inter_node: {name: ib, bw_gb_per_s: 50, latency_us: 6}\n")
    with pytest.raises(SpecError, match="unknown field.*foo"):
        load_cluster(str(path))


def test_cluster_yaml_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: mine\ngpu: h100-sxm\ngpus_per_node: 4\n"
                    "intra_node: {name: nv, bw_gb_per_s: 450, latency_us: 3, efficiency: 0.7}\n"
                    "inter_node: {name: ib, bw_gb_per_s: 25, latency_us: 8}\n")
    c = load_cluster(str(path))
    assert c.gpus_per_node == 4 and c.intra_node.bus_bw_bytes_per_s == pytest.approx(0.7 * 450e9)


def test_model_rules_name_field_and_values():
    with pytest.raises(SpecError, match=r"num_kv_heads \(3\) must divide num_attention_heads \(8\)"):
        ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=8, num_kv_heads=3, ffn_hidden_size=128, vocab_size=10)


def test_strategy_rules():
    with pytest.raises(SpecError, match="sequence_parallel requires tp > 1"):
        Strategy(sequence_parallel=True)
    with pytest.raises(SpecError, match="vpp"):
        Strategy(vpp=2)
    with pytest.raises(SpecError, match="extra"):
        Strategy(tensor_parallel=2)
    with pytest.raises(SpecError, match=r"must equal the number of GPUs \(16\)"):
        Strategy(dp=2, tp=4).resolve(16)
    assert Strategy(tp=4, pp=2).resolve(64).dp == 8


HF_LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                "max_position_embeddings": 8192, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def test_from_hf_config_llama_matches_preset(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_LLAMA3_8B))
    assert num_params(read_hf_config(path)) == PUBLISHED_PARAMS["llama3-8b"]


def test_from_hf_config_families():
    mistral = read_hf_config({**HF_LLAMA3_8B, "model_type": "mistral", "vocab_size": 32000,
                                        "intermediate_size": 14336})
    assert num_params(mistral) == 7_241_732_096  # Mistral-7B-v0.1
    qwen2 = read_hf_config({"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                                      "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                                      "vocab_size": 152064, "tie_word_embeddings": False})
    assert num_params(qwen2) == 7_615_616_512  # Qwen2-7B (QKV biases)
    gpt2 = read_hf_config({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                                     "vocab_size": 50257, "n_positions": 1024})
    assert num_params(gpt2) == 124_439_808  # GPT-2 small
    neox = read_hf_config({"model_type": "gpt_neox", "hidden_size": 512, "intermediate_size": 2048,
                                     "num_hidden_layers": 6, "num_attention_heads": 8, "vocab_size": 50304})
    assert num_params(neox) == 70_426_624  # Pythia-70m


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(SpecError, match="not supported"):
        read_hf_config({"model_type": "t5"})
    with pytest.raises(SpecError, match="lacks field 'num_hidden_layers'"):
        read_hf_config({"model_type": "llama", "hidden_size": 8})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        read_hf_config(bad)


def test_every_spec_field_is_documented():
    import planner.specs as S

    for cls in (S.ModelSpec, S.GpuSpec, S.LinkTier, S.ClusterSpec, S.TrainSpec, S.Strategy, S.Estimate, S.Plan,
                S.PlanResult, S.SearchStats):
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"
        assert cls.model_config.get("frozen") and cls.model_config.get("extra") == "forbid", cls.__name__


def test_cluster_host_section_is_read_and_checked():
    from profiles import load_cluster

    host = load_cluster("dgx-h100").host
    assert host.memory_bytes == 2048 * 2**30 and host.memory_bw_bytes_per_s == pytest.approx(614.4e9)
    tier = {"name": "t", "bw_gb_per_s": 10, "latency_us": 5}
    base = {"gpu": "h100-sxm", "gpus_per_node": 8, "intra_node": tier, "inter_node": tier}
    with pytest.raises(SpecError, match="host lacks required field 'memory_bw_gb_per_s'"):
        load_cluster(base | {"host": {"memory_gib": 1024}})
    with pytest.raises(SpecError, match="unknown field"):
        load_cluster(base | {"host": {"memory_gib": 1024, "memory_bw_gb_per_s": 400, "cores": 64}})
    assert load_cluster(base).host is None and load_cluster(base).moe_load_imbalance == 1.0


def test_a_cluster_files_gpu_path_is_read_from_its_folder(tmp_path, monkeypatch):
    """A relative `gpu:` path in a cluster file is the file's neighbour, wherever meshplan runs (as a
    topology's graph_file is); a path that is not there is refused naming it."""
    from profiles import load_cluster

    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "accel.yaml").write_text((ROOT / "docs/examples/l40s.yaml").read_text())
    text = (ROOT / "docs/examples/l40s-cluster.yaml").read_text().replace("gpu: l40s.yaml", "gpu: accel.yaml")
    (folder / "cluster.yaml").write_text(text)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cluster = load_cluster(str(folder / "cluster.yaml"))
    assert cluster.gpu.name == load_cluster(str(ROOT / "docs/examples/l40s-cluster.yaml")).gpu.name
    (folder / "cluster.yaml").write_text(text.replace("gpu: accel.yaml", "gpu: missing.yaml"))
    with pytest.raises(SpecError, match="missing.yaml"):
        load_cluster(str(folder / "cluster.yaml"))
