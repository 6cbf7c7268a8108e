"""Golden memory numbers: ZeRO Table 1, Korthikanti Table 2, Megatron's distributed optimizer.

Sources: Rajbhandari et al. 2020 (ZeRO) Table 1; Korthikanti et al. 2022 Table 2 and
Eqs. 1-6; Megatron-LM docs/dist_optimizer (formulas.json). Model-state and
per-layer formulas must match exactly; ZeRO Table 1 to its printed rounding.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

from cost_models.blocks import Micro, model_blocks
from cost_models.layout import ParallelLayout
from cost_models.memory import layer_activation_bytes, model_state_bytes
from benchmarks.validation import zero_table1
from planner.specs import ModelSpec


def _states(params, stage, nd, grad="fp16", precision="fp16"):
    out = model_state_bytes(np.array(params), np.array(stage), np.array(nd), np.array(False), precision, grad, "adam")
    return float(sum(out.values()))


def _unit(value: float) -> float:
    text = repr(float(value)).rstrip("0").rstrip(".")
    return 10.0 ** -(len(text.split(".")[1]) if "." in text else 0)


def test_zero_table1_to_printed_rounding():
    rows = zero_table1()
    assert len(rows) == 54
    for row in rows:
        predicted_gb = _states(row.params, row.zero_stage, row.dp) / 1e9
        assert abs(predicted_gb - row.memory_gb) < _unit(row.memory_gb), row.label


@pytest.mark.parametrize("nd", [1, 4, 16, 64, 1024])
def test_zero_formulas(nd):
    psi = 7.5e9
    assert _states(psi, 1, nd) == pytest.approx(4 * psi + 12 * psi / nd)  # P_os
    assert _states(psi, 2, nd) == pytest.approx(2 * psi + 14 * psi / nd)  # P_os+g
    assert _states(psi, 3, nd) == pytest.approx(16 * psi / nd)  # P_os+g+p


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_megatron_distributed_optimizer_bytes_per_param(d):
    # bf16 params, fp32 grads: 18 without, 6 + 12/d with the distributed optimizer.
    assert _states(1.0, 0, d, grad="fp32", precision="bf16") == pytest.approx(18)
    assert _states(1.0, 1, d, grad="fp32", precision="bf16") == pytest.approx(6 + 12 / d)


GPT175 = ModelSpec(name="gpt3-175b", num_layers=96, hidden_size=12288, num_attention_heads=96,
                   ffn_hidden_size=4 * 12288, vocab_size=51200, position_embedding="learned", norm="layernorm",
                   linear_bias=True, dropout=True)
UNFUSED = NS(seq_len=2048, precision="bf16", attention_kernel="unfused")


def layer_activation_bytes_of(model, train, b, t, c, sp, rc):
    """One layer's stored activations for one micro-batch (Korthikanti's s, b, t, SP, recompute)."""
    x = Micro(train.seq_len, np.array(b), np.array(t), np.array(c), np.array(sp), train.precision,
              train.attention_kernel)
    return layer_activation_bytes(model_blocks(model), x, rc)


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("b", [1, 4])
def test_korthikanti_table2_per_layer(t, b):
    s, h, a = 2048, 12288, 96
    act = lambda sp, rc: float(layer_activation_bytes_of(GPT175, UNFUSED, b, t, 1, sp, rc))  # noqa: E731
    sbh = s * b * h
    assert act(False, 0) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)  # Eq. 2
    assert act(False, 1) == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)  # TP + selective
    assert act(False, 2) == pytest.approx(2 * sbh, rel=1e-12)  # full recompute
    if t > 1:
        assert act(True, 0) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)), rel=1e-12)  # Eq. 4
        assert act(True, 1) == pytest.approx(sbh * 34 / t, rel=1e-12)  # TP + SP + selective


def test_eq1_without_parallelism():
    s, b, h, a = 2048, 1, 12288, 96
    assert float(layer_activation_bytes_of(GPT175, UNFUSED, b, 1, 1, False, 0)) == pytest.approx(s * b * h * (34 + 5 * a * s / h))


def test_selective_recompute_saves_70_percent_for_gpt3():
    # Korthikanti Sec. 5: selective recompute saves 70% of activation memory for GPT-3 (5as/h = 80).
    full = float(layer_activation_bytes_of(GPT175, UNFUSED, 1, 8, 1, True, 0))
    sel = float(layer_activation_bytes_of(GPT175, UNFUSED, 1, 8, 1, True, 1))
    assert 1 - sel / full == pytest.approx(0.70, abs=0.005)


@pytest.mark.parametrize("p,v", [(4, 1), (8, 1), (8, 3), (16, 2)])
def test_first_stage_holds_korthikanti_interleaving_factor(p, v):
    # Eq. 5 and Sec. 4.2.3: the first stage holds L layers' worth of activations, times
    # (1 + (p-1)/(p·v)) with interleaving.
    L, m = 96, 64
    one = np.array([1])
    lay = ParallelLayout(num_layers=L, tp=one, cp=one, dp=one, pp=np.array([p]), vpp=np.array([v]), ep=one, etp=one,
                         first=0 * one, last=0 * one, embedding_as_layer=np.array([False]),
                         loss_as_layer=np.array([False]))
    held = lay.inflight_chunks(lay.rows.rank, np.array([m])) * lay.rows.chunk_layers
    expected = L * (1 + (p - 1) / (p * v)) if v > 1 else L
    assert float(held[0, 0]) == pytest.approx(expected)
    assert float(held[-1, 0]) <= float(held[0, 0])  # last stage holds the least


def test_flash_attention_stores_no_scores():
    flash = NS(seq_len=8192, precision="bf16", attention_kernel="flash")
    unfused = NS(seq_len=8192, precision="bf16", attention_kernel="unfused")
    assert float(layer_activation_bytes_of(GPT175, flash, 1, 8, 1, True, 0)) < float(
        layer_activation_bytes_of(GPT175, unfused, 1, 8, 1, True, 0)) / 5
