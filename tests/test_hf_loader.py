"""The Hugging Face config.json loader (issue 8, part 6): each family's MoE / MLA / window
fields, family defaults, refusals, naming, and the CLI on real configs.

Fixtures under tests/fixtures/hf/ hold the published config.json fields of each model;
`_source` names the file they come from.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from cost_models.params import expert_params, num_active_params, num_params
from planner.cli import main
from planner.errors import SpecError
from planner.specs.hf import ConfigWarning, parse_bool, read_hf_config
from planner.specs.model import ModelSpec
from profiles import load_model

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def fixture(name: str) -> Path:
    return FIXTURES / f"{name}.json"


def raw(name: str) -> dict:
    return json.loads(fixture(name).read_text())


def read(config, **kw) -> ModelSpec:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # a known family reads without assumptions
        return read_hf_config(config, **kw)


def test_every_fixture_names_its_source():
    for path in FIXTURES.glob("*.json"):
        assert json.loads(path.read_text())["_source"].startswith("https://huggingface.co/"), path.name


# ---- families ------------------------------------------------------------------------------
def test_mixtral_reads_its_experts():
    m = read(fixture("mixtral-8x7b"))
    assert (m.num_experts, m.moe_top_k, m.expert_ffn, m.num_shared_experts) == (8, 2, 14336, 0)
    assert all(m.moe_layer_mask()) and m.sliding_window is None and not m.tie_embeddings


def test_deepseek_v3_reads_mla_moe_and_mtp():
    m = read(fixture("deepseek-v3"))
    assert m.is_mla and m.num_kv_heads is None
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (m.num_experts, m.moe_top_k, m.expert_ffn, m.ffn_hidden_size) == (256, 8, 2048, 18432)
    assert (m.num_shared_experts, m.shared_expert_ffn, m.num_mtp_layers) == (1, 2048, 1)
    assert m.moe_layer_mask() == (False,) * 3 + (True,) * 58


def test_kimi_k2_reads_as_deepseek_v3_with_its_own_settings():
    m = read(fixture("kimi-k2"))
    assert m.is_mla and m.num_kv_heads is None and m.num_attention_heads == 64
    assert (m.num_experts, m.moe_top_k, m.expert_ffn, m.num_shared_experts) == (384, 8, 2048, 1)
    assert m.moe_layer_mask() == (False,) + (True,) * 60
    assert (m.moe_router_num_groups, m.num_mtp_layers, m.rope_theta, m.vocab_size) == (0, 0, 50000, 163840)


def test_kimi_k2_is_deepseek_v3_under_another_name():
    as_v3 = read({**raw("kimi-k2"), "model_type": "deepseek_v3"})
    assert read(fixture("kimi-k2")).model_dump(exclude={"name", "source"}) == as_v3.model_dump(
        exclude={"name", "source"})


def test_kimi_k2_refuses_a_field_deepseek_v3_lacks():
    with pytest.raises(SpecError, match="index_topk"):
        read({**raw("kimi-k2"), "index_topk": 2048})


def test_deepseek_v32_sparse_attention_is_refused():
    cfg = {**raw("deepseek-v3"), "model_type": "deepseek_v32", "index_head_dim": 128, "index_n_heads": 64,
           "index_topk": 2048}
    with pytest.raises(SpecError, match="DeepSeek Sparse Attention"):
        read(cfg)


def test_deepseek_v2_lite_has_a_full_query_projection():
    m = read(fixture("deepseek-v2-lite"))  # "q_lora_rank": null
    assert m.q_lora_rank is None and m.kv_lora_rank == 512
    assert (m.num_experts, m.moe_top_k, m.num_shared_experts, m.moe_first_k_dense) == (64, 6, 2, 1)


def test_deepseek_moe_layer_freq_follows_the_modelling_code():
    # DeepseekV3DecoderLayer: MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0
    cfg = {**raw("deepseek-v2-lite"), "num_hidden_layers": 8, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    assert read(cfg).moe_layer_mask() == (False, False, True, False, True, False, True, False)


def test_qwen3_moe_reads_experts_without_a_shared_one():
    m = read(fixture("qwen3-30b-a3b"))
    assert (m.num_experts, m.moe_top_k, m.expert_ffn, m.head_size) == (128, 8, 768, 128)
    assert m.num_shared_experts == 0 and not m.qkv_bias and all(m.moe_layer_mask())


def test_qwen2_moe_has_one_shared_expert_and_qkv_bias():
    m = read(fixture("qwen1.5-moe-a2.7b"))
    assert (m.num_experts, m.moe_top_k, m.expert_ffn) == (60, 4, 1408)
    assert (m.num_shared_experts, m.shared_expert_ffn, m.qkv_bias) == (1, 5632, True)


def test_qwen_moe_sparse_step_and_mlp_only_layers():
    # Qwen2MoeDecoderLayer: MoE when (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    base = {**raw("qwen3-30b-a3b"), "num_hidden_layers": 6}
    assert read({**base, "decoder_sparse_step": 2}).moe_layer_mask() == (False, True) * 3
    only = read({**base, "decoder_sparse_step": 1, "mlp_only_layers": [0, 4]})
    assert only.moe_layer_mask() == (False, True, True, True, False, True)


def test_gpt_oss_reads_biases_sinks_and_layer_types():
    m = read(fixture("gpt-oss-120b"))
    assert (m.num_experts, m.moe_top_k, m.expert_ffn) == (128, 4, 2880)
    assert m.moe_router_bias and m.moe_expert_bias and m.attention_sinks and m.linear_bias
    assert m.sliding_window == 128
    assert m.local_attention_mask() == (True, False) * 18  # layer_types: sliding first
    assert m.rope_scaling == "yarn"


@pytest.mark.parametrize("name,scaling", [("gpt-oss-20b", "yarn"), ("deepseek-v3", "yarn"),
                                          ("deepseek-v2-lite", "yarn"), ("llama-3.1-8b", "none"),
                                          ("mistral-7b", "none")])
def test_rope_scaling_reads_yarn_and_nothing_else(name, scaling):
    """YaRN (rope_scaling's rope_type, or the older `type`) is read; llama3 and linear scaling change only
    the frequencies and read as none, as a config without rope_scaling does."""
    assert read(fixture(name)).rope_scaling == scaling


def test_rope_scaling_in_rope_parameters_and_without_rotary_embeddings():
    base = raw("llama-3.1-8b")
    del base["rope_scaling"]
    assert read({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}).rope_scaling == "yarn"
    assert read({**base, "rope_scaling": None}).rope_scaling == "none"
    assert read({**base, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}).rope_scaling == "none"
    from planner.specs import ModelSpec

    with pytest.raises(SpecError, match="rope_scaling 'yarn' scales rotary embeddings, but position_embedding is 'learned'"):
        ModelSpec(name="x", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100,
                  position_embedding="learned", rope_scaling="yarn")


def test_gpt_oss_top_k_spellings_must_agree():
    cfg = {**raw("gpt-oss-20b"), "experts_per_token": 2}
    with pytest.raises(SpecError, match=r"experts_per_token \(2\) and num_experts_per_tok \(4\) disagree"):
        read(cfg)
    del cfg["num_experts_per_tok"]
    assert read(cfg).moe_top_k == 2


def test_gemma2_is_tied_by_default_and_alternates_starting_local():
    cfg = raw("gemma-2-27b")
    assert "tie_word_embeddings" not in cfg  # the published file leaves it to Gemma2Config (True)
    m = read(cfg)
    assert m.tie_embeddings and m.head_size == 128 and m.sliding_window == 4096
    assert m.local_attention_mask()[:4] == (True, False, True, False)


def test_gemma3_reads_the_nested_text_config_and_its_defaults():
    with pytest.warns(ConfigWarning, match="only the text decoder"):
        m = read_hf_config(fixture("gemma-3-27b"))
    assert (m.num_layers, m.hidden_size, m.head_size, m.vocab_size) == (62, 5376, 128, 262208)
    assert m.tie_embeddings and m.sliding_window == 1024
    assert [i for i, local in enumerate(m.local_attention_mask()) if not local][:3] == [5, 11, 17]


def test_gemma3_layer_types_fill_the_global_layers():
    text = {**raw("gemma-3-27b")["text_config"], "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]}
    assert read(text).local_attention_mask() == (True, False, True, True)


def test_mistral_v01_windows_every_layer():
    m = read(fixture("mistral-7b"))
    assert m.sliding_window == 4096 and all(m.local_attention_mask())


def test_qwen2_window_only_when_switched_on_and_above_max_window_layers():
    cfg = raw("qwen2.5-72b")
    m = read(cfg)
    assert m.qkv_bias and m.sliding_window is None  # use_sliding_window: false
    on = read({**cfg, "num_hidden_layers": 4, "use_sliding_window": True, "max_window_layers": 2,
               "sliding_window": 4096})
    assert on.local_attention_mask() == (False, False, True, True)  # Qwen2Attention: layer_idx >= max_window_layers


def test_phi3_and_llama_read_head_dim_tie_and_window():
    phi = read(fixture("phi-3-mini-4k"))
    assert phi.sliding_window == 2047 and phi.kv_heads == 32 and not phi.tie_embeddings
    small = read(fixture("llama-3.2-1b"))
    assert small.tie_embeddings and small.head_size == 64 and small.sliding_window is None


def test_starcoder2_is_layernorm_biased_plain_gelu():
    m = read(fixture("starcoder2-15b"))
    assert (m.gated_mlp, m.norm, m.linear_bias, m.dropout) == (False, "layernorm", True, True)
    assert m.tie_embeddings  # no tie_word_embeddings in the file: PretrainedConfig's True
    assert m.sliding_window == 4096 and m.kv_heads == 4
    h, f, kv, L, V = 6144, 24576, 4 * 128, 40, 49152
    attention = 2 * h * h + 2 * h * kv + (h + 2 * kv + h)
    mlp = 2 * h * f + f + h
    assert num_params(m) == L * (attention + mlp + 2 * 2 * h) + V * h + 2 * h


def test_llama4_scout_reads_moe_shared_expert_and_chunked_attention():
    with pytest.warns(ConfigWarning, match="only the text decoder"):
        m = read_hf_config(fixture("llama-4-scout"))
    assert (m.num_experts, m.moe_top_k, m.expert_ffn, m.ffn_hidden_size) == (16, 1, 8192, 16384)
    assert (m.num_shared_experts, m.shared_expert_ffn) == (1, 8192) and all(m.moe_layer_mask())
    assert m.sliding_window == 8192  # attention_chunk_size, approximated as a window
    assert [i for i, local in enumerate(m.local_attention_mask()) if not local][:3] == [3, 7, 11]  # NoPE layers


def test_llama4_interleaved_moe_layers():
    text = {**raw("llama-4-scout")["text_config"], "num_hidden_layers": 4, "interleave_moe_layer_step": 2,
            "num_local_experts": 128, "no_rope_layers": [1, 1, 1, 0]}
    del text["moe_layers"]
    m = read({"model_type": "llama4", "text_config": text})
    assert m.moe_layer_mask() == (False, True, False, True)  # Maverick-style: every 2nd layer


# ---- defaults and typed fields --------------------------------------------------------------
@pytest.mark.parametrize("model_type,tied", [("llama", False), ("mistral", False), ("qwen2", False),
                                              ("gemma", True), ("gemma2", True), ("starcoder2", True),
                                              ("phi3", False), ("olmo", False), ("olmo2", False)])
def test_missing_tie_word_embeddings_takes_the_family_default(model_type, tied):
    cfg = {k: v for k, v in raw("llama-3.1-8b").items() if k != "tie_word_embeddings"}
    assert read({**cfg, "model_type": model_type}).tie_embeddings is tied


@pytest.mark.parametrize("text,tied", [("false", False), ("False", False), ("true", True), (True, True)])
def test_tie_word_embeddings_strings(text, tied):
    assert read({**raw("llama-3.1-8b"), "tie_word_embeddings": text}).tie_embeddings is tied


def test_tie_word_embeddings_other_strings_are_refused():
    with pytest.raises(SpecError, match=r"tie_word_embeddings must be true or false \(got 'no'\)"):
        read({**raw("llama-3.1-8b"), "tie_word_embeddings": "no"})
    with pytest.raises(SpecError, match="attention_bias must be true or false"):
        parse_bool(1, "attention_bias")


def test_llama_biases():
    base = raw("llama-3.1-8b")
    assert read({**base, "attention_bias": True}).qkv_bias
    assert read({**base, "mlp_bias": True}).linear_bias


def test_non_integer_field_is_one_line_naming_it():
    with pytest.raises(SpecError, match=r"hidden_size must be an integer >= 1 \(got '4096'\)") as err:
        read({**raw("llama-3.1-8b"), "hidden_size": "4096"})
    assert "\n" not in str(err.value)


def test_layer_types_other_than_sliding_or_full_are_refused():
    cfg = {**raw("gpt-oss-20b"), "layer_types": ["linear_attention", "full_attention"] * 12}
    with pytest.raises(SpecError, match="layer_types has linear_attention layers"):
        read(cfg)


def test_a_config_the_model_rules_reject_is_one_spec_error_line():
    with pytest.raises(SpecError, match=r"moe_top_k \(64\) must be between 1 and num_experts \(32\)") as err:
        read({**raw("gpt-oss-20b"), "num_experts_per_tok": 64, "experts_per_token": 64})
    assert "\n" not in str(err.value)


def test_layer_types_of_the_wrong_length_is_refused():
    with pytest.raises(SpecError, match="layer_types must be a list of one entry per layer"):
        read({**raw("gpt-oss-20b"), "layer_types": ["sliding_attention"]})


# ---- refusals and warnings --------------------------------------------------------------------
def test_unknown_family_with_standard_fields_is_dense_with_a_warning():
    with pytest.warns(ConfigWarning, match="model_type 'granite' is not a known family"):
        m = read_hf_config(fixture("granite-3.0-8b"))
    assert not m.is_moe and m.tie_embeddings
    assert num_params(m) / 1e9 == pytest.approx(8.17, rel=0.001)


def test_unknown_family_without_standard_fields_is_refused():
    with pytest.raises(SpecError, match="'t5' is not supported and lacks the standard decoder field"):
        read_hf_config({"model_type": "t5", "d_model": 512})


@pytest.mark.parametrize("config,fields", [
    ("dbrx-base", "ffn_config.moe_num_experts"),  # nested MoE fields (DBRX)
    ({**raw("llama-3.1-8b"), "num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts, num_experts_per_tok"),
    ({**raw("granite-3.0-8b"), "model_type": "granitemoe", "num_local_experts": 40}, "num_local_experts"),
    ({**raw("qwen3-30b-a3b"), "shared_expert_intermediate_size": 4096}, "shared_expert_intermediate_size"),
])
def test_moe_fields_the_reader_does_not_map_are_refused(config, fields):
    with pytest.raises(SpecError, match="mixture-of-experts field") as err:
        read_hf_config(fixture(config) if isinstance(config, str) else config)
    assert fields in str(err.value) and "\n" not in str(err.value)


def test_training_only_router_fields_do_not_refuse_a_dense_model():
    assert not read({**raw("llama-3.1-8b"), "router_aux_loss_coef": 0.01, "output_router_logits": False}).is_moe


@pytest.mark.parametrize("config,match", [
    ({**raw("nemotron-h-8b"), "model_type": "bamba"}, "model_type 'bamba'"),
    ({**raw("mistral-7b"), "model_type": "jamba"}, "model_type 'jamba'"),
    ({**raw("llama-3.1-8b"), "model_type": "falcon_h1_like", "mamba_d_state": 256}, "mamba_d_state"),
])
def test_hybrid_state_space_configs_are_refused(config, match):
    with pytest.raises(SpecError, match="hybrid state-space") as err:
        read_hf_config(fixture(config) if isinstance(config, str) else config)
    assert match in str(err.value)


def test_per_layer_nas_config_is_refused_not_a_type_error():
    with pytest.raises(SpecError, match="per-layer block_configs"):
        read_hf_config(fixture("nemotron-51b"))


# ---- naming ------------------------------------------------------------------------------------
def test_a_path_is_named_after_name_or_path_else_its_folder(tmp_path):
    assert read(fixture("phi-3-mini-4k")).name == "Phi-3-mini-4k-instruct"
    folder = tmp_path / "my-llama"
    folder.mkdir()
    shutil.copy(fixture("llama-3.1-8b"), folder / "config.json")
    assert read(folder / "config.json").name == "my-llama"
    assert read(folder / "config.json", name="given").name == "given"
    assert read({**raw("llama-3.1-8b"), "_name_or_path": "org/model"}).name == "org/model"
    shutil.copy(fixture("llama-3.1-8b"), folder / "llama-copy.json")  # not config.json: the file names it
    assert read(folder / "llama-copy.json").name == "llama-copy"


# ---- norm epsilon --------------------------------------------------------------------------------
@pytest.mark.parametrize("name,eps", [("qwen3-30b-a3b", 1e-6), ("deepseek-v3", 1e-6), ("llama-3.1-8b", 1e-5),
                                      ("starcoder2-15b", 1e-5), ("gemma-2-27b", 1e-6)])
def test_norm_epsilon_is_read_under_each_familys_key(name, eps):
    assert read(fixture(name)).norm_epsilon == eps


QWEN2 = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
         "num_key_value_heads": 2, "intermediate_size": 2816, "vocab_size": 151936}


@pytest.mark.parametrize("config,eps", [
    (QWEN2, 1e-6),  # Qwen2Config's default
    (QWEN2 | {"rms_norm_eps": 1e-5}, 1e-5),
    (QWEN2 | {"model_type": "mixtral"}, 1e-5),  # MixtralConfig's default
    ({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100, "layer_norm_epsilon": 1e-6},
     1e-6),
    ({"model_type": "gpt_neox", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
      "intermediate_size": 256, "vocab_size": 100, "layer_norm_eps": 1e-6}, 1e-6),
    ({"model_type": "gpt_neox", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
      "intermediate_size": 256, "vocab_size": 100}, 1e-5),
])
def test_norm_epsilon_family_defaults_and_other_spellings(config, eps):
    assert read(config).norm_epsilon == eps


@pytest.mark.parametrize("extra,match", [({"rms_norm_eps": 0}, "rms_norm_eps must be a positive number"),
                                         ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number"),
                                         ({"rms_norm_eps": 1e-6, "layer_norm_eps": 1e-5}, "disagree")])
def test_a_bad_or_contradictory_norm_epsilon_is_refused_naming_it(extra, match):
    with pytest.raises(SpecError, match=match):
        read(QWEN2 | extra)


# ---- dense totals and presets -------------------------------------------------------------------
@pytest.mark.parametrize("name,billions", [
    ("llama-3.1-8b", 8.03),  # meta-llama/Llama-3.1-8B safetensors metadata
    ("qwen2.5-72b", 72.7),  # Qwen/Qwen2.5-72B model card
    ("phi-3-mini-4k", 3.82),  # microsoft/Phi-3-mini-4k-instruct safetensors metadata
    ("mistral-7b", 7.24),  # mistralai/Mistral-7B-v0.1 safetensors metadata
])
def test_dense_configs_match_published_totals(name, billions):
    assert num_params(read(fixture(name))) / 1e9 == pytest.approx(billions, rel=0.001)


@pytest.mark.parametrize("preset,config", [
    ("mixtral-8x7b", "mixtral-8x7b"), ("mixtral-8x22b", "mixtral-8x22b"), ("deepseek-v2-lite", "deepseek-v2-lite"),
    ("deepseek-v3", "deepseek-v3"), ("kimi-k2", "kimi-k2"), ("qwen3-30b-a3b", "qwen3-30b-a3b"), ("qwen3-235b-a22b", "qwen3-235b-a22b"),
    ("gpt-oss-20b", "gpt-oss-20b"), ("gpt-oss-120b", "gpt-oss-120b"), ("mistral-7b", "mistral-7b"),
    ("gemma-2-27b", "gemma-2-27b"), ("qwen2.5-72b", "qwen2.5-72b"), ("llama3.1-8b", "llama-3.1-8b"),
    ("llama3.2-1b", "llama-3.2-1b"),
])
def test_presets_are_their_config_json(preset, config):
    p, c = load_model(preset), read(fixture(config))
    counts = (num_params, num_active_params, expert_params)
    assert [f(p) for f in counts] == [f(c) for f in counts]
    assert (p.moe_layer_mask(), p.local_attention_mask()) == (c.moe_layer_mask(), c.local_attention_mask())
    assert p.sliding_window == c.sliding_window and p.max_position_embeddings == c.max_position_embeddings
    assert p.norm_epsilon == c.norm_epsilon


# ---- CLI ---------------------------------------------------------------------------------------
PLAN = ["--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size", "16", "--seq-len", "2048", "--top", "1"]


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_models_lists_the_new_presets(capsys):
    code, out, _ = run(capsys, "models", "--format", "json")
    names = {m["name"] for m in json.loads(out)}
    assert code == 0 and {"mixtral-8x7b", "deepseek-v3", "gpt-oss-120b", "gemma-2-27b", "llama3.2-3b"} <= names


def test_cli_plans_a_dense_config_json(capsys):
    code, out, err = run(capsys, "plan", "--model", str(fixture("mistral-7b")), *PLAN)
    assert code == 0, err
    assert "7.2B params" in out


def test_cli_prints_a_config_warning_once(capsys):
    code, _, err = run(capsys, "plan", "--model", str(fixture("granite-3.0-8b")), *PLAN)
    assert code == 0
    assert err.count("warning: Hugging Face config model_type 'granite'") == 1


@pytest.mark.parametrize("config,message", [("nemotron-51b", "block_configs"), ("dbrx-base", "mixture-of-experts")])
def test_cli_refused_config_exits_2_with_one_line(capsys, config, message):
    code, out, err = run(capsys, "plan", "--model", str(fixture(config)), *PLAN)
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + out


# ---- fields the reader does not understand -------------------------------------------------------
HARMLESS = {"architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
            "use_cache": True, "bos_token_id": 151643, "eos_token_id": 151643, "initializer_range": 0.02,
            "hidden_act": "silu", "rope_scaling": None, "use_sliding_window": False, "sliding_window": 131072,
            "max_window_layers": 28, "tie_word_embeddings": False, "attention_dropout": 0.0}


def test_the_usual_harmless_fields_are_accepted():
    assert read(QWEN2 | HARMLESS) == read(QWEN2)


@pytest.mark.parametrize("extra,named", [
    ({"attention_chunk_size": 8192}, "attention_chunk_size"),  # Llama 4's chunked attention, not read for qwen2
    ({"parallel_attn": True, "num_kv_groups": 2}, "num_kv_groups, parallel_attn"),
])
def test_a_field_the_reader_does_not_understand_is_refused_naming_it(extra, named):
    with pytest.raises(SpecError, match=f"has field\\(s\\) {named} that this reader does not understand"):
        read(QWEN2 | extra)


def test_an_unknown_field_of_a_nested_text_config_is_named_with_its_path():
    config = raw("gemma-3-27b")
    config["text_config"] = config["text_config"] | {"altup_num_inputs": 4}
    with pytest.raises(SpecError, match=r"text_config\.altup_num_inputs"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)  # the vision tower is not planned
        read_hf_config(config)


def test_an_unknown_field_refuses_an_unknown_family_too():
    config = QWEN2 | {"model_type": "newfamily", "mamba_free_field": 1}
    with pytest.raises(SpecError, match="mamba_free_field"):
        read_hf_config(config)


def test_cli_refuses_an_unknown_field_in_one_line(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2 | {"parallel_attn": True}))
    code, out, err = run(capsys, "plan", "--model", str(path), *PLAN)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "parallel_attn" in err, err
