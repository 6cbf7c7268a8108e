"""Hybrid Mamba-Transformer stacks (Nemotron-H, Nemotron 3): the layer pattern and its refusals, the Hugging Face
reader, parameter counts against the published totals, the Mamba-2 block's costs, plan() and the CLI, and the
emitters (Megatron-LM writes pretrain_mamba.py's flags; the others refuse).

Fixtures: tests/fixtures/hf/nemotron-h-56b.json, nemotron-3-nano-30b-a3b.json and nemotron-h-8b.json (their
`_source` names the published config.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cost_models.blocks import Mamba, Micro, model_blocks
from cost_models.params import num_active_params, num_params
from planner.api import plan
from planner.cli import main
from planner.emit import EmitOptions, NotExpressibleError, get_emitter
from planner.emit.megatron import parse_args, settings
from planner.errors import SpecError
from planner.specs.hf import read_hf_config
from planner.specs.model import ModelSpec
from profiles import load_model

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NANO = FIXTURES / "nemotron-3-nano-30b-a3b.json"
H56 = FIXTURES / "nemotron-h-56b.json"
SMALL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, vocab_size=1000,
             gated_mlp=False, mamba_num_heads=8, mamba_head_dim=64, mamba_state_dim=16, mamba_num_groups=2)


# ---- the pattern ---------------------------------------------------------------------------------------------
def test_pattern_symbols_are_megatron_cores():
    m = ModelSpec(**SMALL, hybrid_override_pattern="M*-M")
    assert m.is_hybrid and m.layer_symbols() == "M*-M" and m.mamba_inner == 512
    b = model_blocks(m)
    assert b.pattern == (0, 1, 2, 0) and len(b.kinds) == 3
    assert [type(k.blocks[1]).__name__ for k in b.kinds] == ["Mamba", "Attention", "DenseMLP"]


def test_unknown_symbol_is_refused_naming_it_its_position_and_the_allowed_ones():
    with pytest.raises(SpecError) as err:
        ModelSpec(**SMALL, hybrid_override_pattern="M*X-")
    text = str(err.value)
    assert "'X'" in text and "position 2" in text and "M (Mamba-2)" in text and "E (MoE)" in text
    assert "\n" not in text


def test_pattern_length_must_be_num_layers():
    with pytest.raises(SpecError, match="has 3 symbols but num_layers is 4"):
        ModelSpec(**SMALL, hybrid_override_pattern="M*-")


@pytest.mark.parametrize("extra,match", [
    (dict(hybrid_override_pattern="M*E-"), "E \\(MoE\\) layers but num_experts is 0"),
    (dict(hybrid_override_pattern="M*--", num_experts=4, moe_top_k=2), "no E \\(MoE\\) layer"),
    (dict(hybrid_override_pattern="M*--", mamba_num_groups=3), "must divide the Mamba heads"),
    (dict(hybrid_override_pattern="M*--", sliding_window=128), "sliding_window cannot be combined"),
    (dict(hybrid_override_pattern=None), "hybrid_override_pattern is not set"),
])
def test_inconsistent_hybrid_fields_are_refused(extra, match):
    with pytest.raises(SpecError, match=match):
        ModelSpec(**(SMALL | extra))


def test_moe_layers_are_the_patterns_e():
    m = ModelSpec(**SMALL | dict(hybrid_override_pattern="ME*E", num_experts=4, moe_top_k=2))
    assert m.moe_layer_mask() == (False, True, False, True)


# ---- the Hugging Face reader and the published totals -------------------------------------------------------
def test_nemotron_h_56b_reads_and_counts_56b():
    m = read_hf_config(H56)
    assert (m.num_layers, m.mamba_heads, m.mamba_head_dim, m.mamba_state_dim, m.mamba_num_groups) == (
        118, 256, 64, 256, 8)
    assert m.position_embedding == "none" and m.mlp_activation == "squared_relu" and not m.gated_mlp
    pattern = m.hybrid_override_pattern
    assert (pattern.count("M"), pattern.count("*"), pattern.count("-")) == (54, 10, 54)
    # Nemotron-H paper (arXiv 2504.03624): 56B parameters; the count is 56.32B (untied 131072-row vocabulary)
    assert num_params(m) == pytest.approx(56.3e9, rel=0.01)
    assert num_params(m) == num_params(load_model("nemotron-h-56b"))


def test_nemotron_h_8b_counts_8b():
    assert num_params(read_hf_config(FIXTURES / "nemotron-h-8b.json")) == pytest.approx(8.1e9, rel=0.01)


def test_nemotron_3_nano_reads_its_experts_and_counts_31_6b_total_3_6b_active():
    m = read_hf_config(NANO)
    assert (m.num_experts, m.moe_top_k, m.expert_ffn, m.num_shared_experts, m.shared_expert_ffn) == (
        128, 6, 1856, 1, 3712)
    assert sum(m.moe_layer_mask()) == 23 and m.moe_router_num_groups == 0
    # model card: 31.6B total, 3.2B active (3.6B including embeddings)
    assert num_params(m) == pytest.approx(31.6e9, rel=0.01)
    assert num_active_params(m) == pytest.approx(3.6e9, rel=0.02)


@pytest.mark.parametrize("extra,match", [
    ({"moe_latent_size": 1024}, "moe_latent_size"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"mlp_hidden_act": "swish"}, "mlp_hidden_act"),
    ({"hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEMX"}, "'X' at position 51"),
])
def test_nemotron_h_fields_that_are_not_modelled_are_refused(extra, match):
    with pytest.raises(SpecError, match=match):
        read_hf_config(json.loads(NANO.read_text()) | extra)


# ---- the Mamba-2 block ----------------------------------------------------------------------------------------
def micro(tp=1, cp=1, seq=8192):
    return Micro(seq, np.array([1]), np.array([tp]), np.array([cp]), np.array([tp > 1]), "bf16", "flash")


MAMBA_56B = Mamba(8192, 256, 64, 256, 8, 4, 128)


def test_mamba_parameters_follow_megatron_cores_mixer():
    # in_proj h x (2d + 2GN + H), conv (d + 2GN) x (w + 1), A_log, D, dt_bias, gated norm d, out_proj d x h
    d, g, h, heads = 16384, 8 * 256, 8192, 256
    assert MAMBA_56B.params() == h * (2 * d + 2 * g + heads) + (d + 2 * g) * 5 + 3 * heads + d + d * h


def test_mamba_work_splits_over_tp_and_the_scan_grows_with_the_chunk():
    one, eight = micro(1), micro(8)
    assert float(MAMBA_56B.core(eight).flop[0]) == pytest.approx(float(MAMBA_56B.core(one).flop[0]) / 8)
    assert sum(float(g.flop[0]) for g in MAMBA_56B.gemms(eight)) * 8 == pytest.approx(
        sum(float(g.flop[0]) for g in MAMBA_56B.gemms(one)))
    bigger = Mamba(8192, 256, 64, 256, 8, 4, 256)
    assert float(bigger.scan_flop(one)[0]) > float(MAMBA_56B.scan_flop(one)[0])


def test_mamba_cp_is_an_all_to_all_and_no_ring():
    c = MAMBA_56B.comm(micro(tp=2, cp=2))
    assert float(np.asarray(c.cp_a2a_bytes)[0]) > 0 and not np.any(c.cp_hop_bytes) and c.tp_exchanges == 1
    assert float(np.asarray(MAMBA_56B.comm(micro(tp=2, cp=1)).cp_a2a_bytes)[0]) == 0.0


def test_mamba_keeps_no_scores_for_selective_recompute():
    a = MAMBA_56B.activations(micro(8))
    assert float(np.asarray(a.scores)) == 0.0 and float(np.asarray(a.split)[0]) > 0


# ---- planning -------------------------------------------------------------------------------------------------
def test_plan_on_the_preset_fits_on_64_h100s():
    result = plan("nemotron-h-56b", "dgx-h100", num_gpus=64, global_batch_size=256, seq_len=8192, top_k=3)
    assert result.plans and all(p.estimate.fits for p in result.plans)
    for p in result.plans:
        s = p.strategy
        assert s.vpp == 1 and 256 % s.tp == 0 and 8 % s.tp == 0  # megatron-core's MambaStack and MambaMixer


def test_cp_plans_are_costed_with_the_all_to_all():
    result = plan("nemotron-h-56b", "dgx-h100", num_gpus=64, global_batch_size=256, seq_len=8192, top_k=1,
                  constraints={"cp": 2, "tp": 4})
    est = result.plans[0].estimate
    assert est.fits and est.time_s["cp_comm"] > 0


def test_non_megatron_framework_is_refused_for_a_hybrid_model():
    result = plan("nemotron-h-56b", "dgx-h100", num_gpus=64, global_batch_size=256, seq_len=8192, top_k=1,
                  framework="torchtitan")
    assert not result.plans
    assert [r.rule for r in result.rejections] == ["hybrid_framework"]
    assert "only Megatron-LM runs" in result.rejections[0].example


def test_cli_plans_a_nemotron_config_json(capsys):
    code = main(["plan", "--model", str(NANO), "--cluster", "dgx-h100", "--gpus", "64", "--global-batch-size",
                 "512", "--seq-len", "8192", "--top", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "nemotron" in out.lower()


def test_cli_refuses_an_unknown_symbol_in_one_line(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(json.loads(H56.read_text()) | {"hybrid_override_pattern": "M-Q" + "M-" * 57 + "M"}))
    code = main(["plan", "--model", str(bad), "--cluster", "dgx-h100", "--gpus", "64", "--global-batch-size",
                 "256", "--seq-len", "8192"])
    out, err = capsys.readouterr()
    assert code == 2 and "'Q' at position 2" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + out


# ---- emitters -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def best():
    return plan(str(H56), "dgx-h100", num_gpus=64, global_batch_size=256, seq_len=8192, top_k=1).plans[0]


def test_megatron_emits_pretrain_mamba_flags(best):
    args = settings(best)
    assert args["is_hybrid_model"] and args["hybrid_override_pattern"] == best.model.hybrid_override_pattern
    assert (args["mamba_num_heads"], args["mamba_head_dim"], args["mamba_state_dim"], args["mamba_num_groups"]) == (
        256, 64, 256, 8)
    assert args["squared_relu"] and args["position_embedding_type"] == "none" and "moe_layer_freq" not in args
    text = get_emitter("megatron").render(best, EmitOptions())
    assert "pretrain_mamba.py" in text and "--hybrid-override-pattern" in text
    round_trip = parse_args(text.split("MEGATRON_ARGS=(")[1].split(")")[0].split())
    assert round_trip["mamba_state_dim"] == 256


def test_megatron_flags_build_megatron_cores_config(best):
    pytest.importorskip("megatron.core")
    sys.path.insert(0, str(Path(__file__).parent / "emit"))  # the emit tests' helpers
    from emit_checks import megatron_configs
    from planner.emit.megatron import megatron_args

    tc = megatron_configs(megatron_args(best))["transformer"]
    assert tc.is_hybrid_model and (tc.mamba_num_heads, tc.mamba_head_dim, tc.mamba_state_dim,
                                   tc.mamba_num_groups) == (256, 64, 256, 8)
    assert tc.activation_func.__name__ == "squared_relu" and not tc.gated_linear_unit


@pytest.mark.parametrize("name", ["torchtitan", "deepspeed", "megatron-deepspeed", "colossalai", "maxtext",
                                  "megatron-bridge"])
def test_other_emitters_refuse_a_hybrid_model(best, name):
    with pytest.raises(NotExpressibleError, match="hybrid"):
        get_emitter(name).render(best, EmitOptions())
