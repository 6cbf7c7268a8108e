"""The transformer the executor builds from a ModelSpec (single process, imports torch)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from executor_fixtures import TINY, TRAIN  # noqa: E402

from cost_models.params import num_params
from executors.memory import peak_live_bytes  # noqa: E402
from executors.model import apply_rope, build_model, rope_tables  # noqa: E402
from executors.parity import PARITY_LOSS_DECREASE  # noqa: E402
from executors.results import RunConfig  # noqa: E402
from executors.runner import reference  # noqa: E402
from planner.specs import ModelSpec, Strategy  # noqa: E402

GPT_LIKE = ModelSpec(name="gpt-like", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                     vocab_size=300, tie_embeddings=True, position_embedding="learned", max_position_embeddings=64,
                     norm="layernorm", linear_bias=True)
QWEN_LIKE = ModelSpec(name="qwen-like", num_layers=2, hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                      ffn_hidden_size=96, gated_mlp=True, vocab_size=300, tie_embeddings=False, qkv_bias=True)

QWEN3_LIKE = QWEN_LIKE.model_copy(update={"name": "qwen3-like", "qkv_bias": False, "qk_norm": "per_head"})
OLMO2_LIKE = QWEN_LIKE.model_copy(update={"name": "olmo2-like", "qkv_bias": False, "qk_norm": "full"})


@pytest.mark.parametrize("spec", [TINY, GPT_LIKE, QWEN_LIKE, QWEN3_LIKE, OLMO2_LIKE], ids=lambda s: s.name)
def test_parameter_count_matches_the_spec(spec):
    model = build_model(spec, seq_len=32, seed=0)
    assert sum(p.numel() for p in model.parameters()) == num_params(spec)


@pytest.mark.parametrize("spec", [QWEN3_LIKE, OLMO2_LIKE], ids=lambda s: s.name)
def test_query_key_norms_normalise_what_the_spec_says(spec):
    """Per head: each head's query has unit RMS (weights 1 at initialisation); whole width: only the heads
    together do."""
    model = build_model(spec, seq_len=32, seed=0)
    att = model.layers["0"].attn
    seen = {}
    att.q_norm.register_forward_hook(lambda mod, args, out: seen.setdefault("q", out.detach()))
    model(torch.randint(0, spec.vocab_size, (2, 16)))
    q = seen["q"].reshape(2, 16, spec.num_attention_heads, spec.head_size).float()
    per_head_rms = q.pow(2).mean(-1).sqrt()
    whole_rms = q.pow(2).mean((-1, -2)).sqrt()
    assert torch.allclose(whole_rms, torch.ones_like(whole_rms), atol=1e-3)
    assert torch.allclose(per_head_rms, torch.ones_like(per_head_rms), atol=1e-3) == (spec.qk_norm == "per_head")


def test_same_seed_same_weights_and_causal_output():
    a, b = build_model(TINY, 32, seed=3), build_model(TINY, 32, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    x = torch.randint(0, TINY.vocab_size, (2, 16))
    y = a(x)
    assert y.shape == (2, 16, TINY.vocab_size)
    x2 = x.clone()
    x2[:, 8:] = 0  # the future does not change the past
    assert torch.allclose(a(x2)[:, :8], y[:, :8], atol=1e-5)


def test_rope_rotation_keeps_norms():
    cos, sin = rope_tables(8, 16, None)
    q = torch.randn(1, 2, 8, 16)
    assert torch.allclose(apply_rope(q, cos, sin).norm(dim=-1), q.norm(dim=-1), atol=1e-5)


def test_reference_is_deterministic_and_its_sgd_step_decreases_the_loss_by_the_set_fraction():
    cfg = RunConfig(label="ref", model=TINY, train=TRAIN, strategy=Strategy(dp=1), num_gpus=1, parity_steps=2)
    first, second = reference(cfg), reference(cfg)
    assert first == second
    losses = first.losses
    assert losses[0] == pytest.approx(math.log(TINY.vocab_size), rel=0.02)
    # same batch, one plain-SGD step sized for a first-order decrease of PARITY_LOSS_DECREASE of the loss
    assert (losses[0] - losses[1]) / losses[0] == pytest.approx(PARITY_LOSS_DECREASE, rel=0.2)


def test_peak_live_bytes_counts_from_the_window_start():
    events = [(0, 100), (1, 50), (2, -100), (3, 30), (4, -80)]
    assert peak_live_bytes(events, after_ns=0) == 150
    assert peak_live_bytes(events, after_ns=2) == 80  # live bytes before the marker still count
