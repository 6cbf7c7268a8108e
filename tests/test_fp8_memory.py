"""FP8 training's weight copies in memory (the `fp8_weights` term) and Megatron's --fp8-param-gather
(TrainSpec.fp8_param_gather): FP8 parameters in place of the 16-bit ones, gathered in FP8 under ZeRO."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models.arrays import StrategyArrays
from cost_models.collectives import comm_model_for
from cost_models.memory import (fp8_gather_bytes_per_element, fp8_param_bytes_per_element,
                                fp8_weight_bytes_per_element)
from cost_models.frameworks import cannot_run_masks
from cost_models.step import (MEMORY_TERMS, data_parallel_tail, per_layer_times,
                              setup)
from tests.framework_defaults import evaluate
from planner.api import make_inputs
from planner.cli import main
from planner.emit import NotExpressibleError, emit_data
from planner.errors import SpecError
from planner.specs import Plan, Strategy, TrainSpec
from profiles import load_model
from profiles.bundle import load_tables
from profiles.frameworks import FRAMEWORKS

LLAMA = dict(model="llama3-8b", num_gpus=16, global_batch_size=64, seq_len=4096)


def llama_quantised(tp: int = 1, layers: int = 32) -> float:
    """Weight elements of Llama 3 8B's transformer-layer linears on one rank, from its published shape:
    QKV h·(q + 2·kv), output h·q, gated MLP 3·h·f (no router, embedding or output layer)."""
    h, q, kv, f = 4096, 4096, 1024, 14336
    return layers * (h * (q + 2 * kv) + h * q + 3 * h * f) / tp


def _est(cluster="dgx-h100", precision="fp8", strategy=None, **train):
    s = strategy or Strategy(dp=8, tp=2, zero_stage=1)
    return evaluate(LLAMA["model"], cluster, LLAMA["num_gpus"], LLAMA["global_batch_size"], LLAMA["seq_len"],
                    precision, strategy=s, **train)


def test_the_term_is_registered():
    assert "fp8_weights" in MEMORY_TERMS
    assert "fp8_weights" in _est(precision="bf16").memory_bytes


def test_no_fp8_copies_without_fp8_training():
    assert _est(precision="bf16").memory_bytes["fp8_weights"] == 0


def test_hopper_per_tensor_keeps_an_fp8_copy_and_its_transpose():
    """2 bytes per quantised weight element on Hopper: the FP8 copy and its transpose (TN-only GEMMs)."""
    for recipe in ("delayed", "tensorwise"):
        e = _est(fp8_recipe=recipe)
        assert e.memory_bytes["fp8_weights"] == pytest.approx(2 * llama_quantised(tp=2), rel=1e-9)
    assert _est().memory_bytes["params"] == _est(precision="bf16").memory_bytes["params"]  # bf16 weights stay


def test_blackwell_per_tensor_keeps_one_copy_and_mxfp8_two_with_scales():
    one = _est("dgx-b200", fp8_recipe="delayed").memory_bytes["fp8_weights"]
    mx = _est("dgx-b200", fp8_recipe="mxfp8").memory_bytes["fp8_weights"]
    assert one == pytest.approx(llama_quantised(tp=2), rel=1e-9)
    assert mx == pytest.approx((2 + 2 / 32) * llama_quantised(tp=2), rel=1e-9)  # row- and column-wise, E8M0 per 32


def test_bytes_per_element_by_recipe_and_gpu():
    assert fp8_weight_bytes_per_element("delayed", True) == 2 and fp8_weight_bytes_per_element("delayed", False) == 1
    assert fp8_weight_bytes_per_element("blockwise", False) == pytest.approx(2 * (1 + 4 / 128**2))
    assert fp8_weight_bytes_per_element("mxfp8", False) == 2 + 2 / 32
    assert fp8_param_bytes_per_element("delayed", True) == 1 and fp8_param_bytes_per_element("mxfp8", False) == 2 + 2 / 32
    assert fp8_gather_bytes_per_element("tensorwise") == 1 and fp8_gather_bytes_per_element("mxfp8") == 2


def test_pipeline_stages_hold_their_own_layers():
    pp2 = _est(strategy=Strategy(dp=4, tp=2, pp=2, zero_stage=1))
    assert pp2.memory_bytes["fp8_weights"] == pytest.approx(2 * llama_quantised(tp=2, layers=16), rel=1e-9)


def test_moe_experts_are_split_over_ep_and_etp():
    """Mixtral 8x7B (no biases): every layer's routed experts, E/ep of 1/etp width, plus attention."""
    m = load_model("mixtral-8x7b")
    h, f, q, kv, L, E = m.hidden_size, m.ffn_hidden_size, 4096, 1024, m.num_layers, m.num_experts
    for ep, etp in ((2, 1), (4, 1), (2, 2)):
        s = Strategy(dp=8, tp=2, ep=ep, etp=etp, sequence_parallel=True, zero_stage=1)
        e = evaluate("mixtral-8x7b", "dgx-h100", 16, 64, 4096, "fp8", strategy=s)
        per_rank = L * ((h * (q + 2 * kv) + h * q) / 2 + E / ep * 3 * h * f / etp)
        assert e.memory_bytes["fp8_weights"] == pytest.approx(2 * per_rank, rel=1e-9), (ep, etp)


def test_only_a_framework_that_caches_keeps_the_copies():
    assert load_tables(None).framework("megatron").fp8_weight_cache
    assert not any(load_tables(None).framework(f).fp8_weight_cache for f in FRAMEWORKS if f != "megatron")
    titan = _est(strategy=Strategy(dp=8, tp=2, zero_stage=1), framework="torchtitan")
    assert titan.memory_bytes["fp8_weights"] == 0


# ---- --fp8-param-gather ---------------------------------------------------------------------------------
def test_fp8_param_gather_replaces_the_bf16_weights_by_fp8_ones():
    plain, gather = _est(), _est(fp8_param_gather=True)
    q = llama_quantised(tp=2)
    assert gather.memory_bytes["params"] == pytest.approx(plain.memory_bytes["params"] - q, rel=1e-9)  # 2 -> 1 byte
    assert gather.memory_bytes["fp8_weights"] == pytest.approx(q, rel=1e-9)  # the transpose; the FP8 data is a param
    for term in ("grads", "optimizer"):  # fp32 main grads and master weights stay
        assert gather.memory_bytes[term] == plain.memory_bytes[term]
    assert gather.peak_memory_bytes < plain.peak_memory_bytes


def test_fp8_param_gather_under_zero3_shards_the_fp8_weights_and_keeps_no_copies():
    s = Strategy(dp=16, zero_stage=3)
    plain, gather = _est(strategy=s), _est(strategy=s, fp8_param_gather=True)
    q = llama_quantised()
    assert plain.memory_bytes["fp8_weights"] == pytest.approx(2 * q, rel=1e-9)  # TE's cache of the gathered weights
    assert gather.memory_bytes["fp8_weights"] == 0
    assert gather.memory_bytes["params"] == pytest.approx(plain.memory_bytes["params"] - q / 16, rel=1e-9)


def test_blackwell_mxfp8_parameters_hold_both_copies():
    plain = _est("dgx-b200", fp8_recipe="mxfp8")
    gather = _est("dgx-b200", fp8_recipe="mxfp8", fp8_param_gather=True)
    q = llama_quantised(tp=2)
    assert gather.memory_bytes["fp8_weights"] == 0
    assert gather.memory_bytes["params"] == pytest.approx(plain.memory_bytes["params"] + (2 + 2 / 32 - 2) * q,
                                                          rel=1e-9)
    assert gather.peak_memory_bytes < plain.peak_memory_bytes


class _Recorder:
    """A comm model that records the bytes of every all-gather / reduce-scatter it times (the largest
    entry of each call: with pp = 1 every stage row holds the same)."""

    def __init__(self, inner):
        self.inner, self.sent = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def gather_scatter_s(self, nbytes, size, stride):
        self.sent.append(float(np.max(nbytes)))
        return self.inner.gather_scatter_s(nbytes, size, stride)


def _dp_bytes(strategy: Strategy, cluster="dgx-h100", **train) -> float:
    """All bytes the data parallel tail gathers and reduce-scatters (one call each, summed)."""
    model, c, t = make_inputs(LLAMA["model"], cluster, 16, 64, 4096, "fp8", **train)
    st = StrategyArrays.from_strategies([strategy.resolve(16)])
    s = setup(model, c, t, st, comm_model_for(c))
    pl = per_layer_times(model, t, c.gpu, s.comm, st, c.overlap_efficiency, s, c.tp_comm_overlap)
    s.comm = _Recorder(s.comm)
    data_parallel_tail(s, pl)
    return sum(s.comm.sent)


@pytest.mark.parametrize("zero", [1, 2])
def test_fp8_param_gather_halves_the_gathered_bytes_of_the_quantised_weights(zero):
    s = Strategy(dp=16, zero_stage=zero)
    saved = _dp_bytes(s) - _dp_bytes(s, fp8_param_gather=True)
    assert saved == pytest.approx(llama_quantised(), rel=1e-9)  # 1 byte fewer per element, gradients unchanged


def test_fp8_param_gather_shrinks_the_zero3_layer_gathers():
    s = Strategy(dp=16, zero_stage=3)
    saved = _dp_bytes(s) - _dp_bytes(s, fp8_param_gather=True)
    per_layer = llama_quantised(layers=1)
    # one gather per layer kind (every layer of Llama is one kind), and its FSDP2 copy-out is time, not bytes
    assert saved == pytest.approx(per_layer, rel=1e-9)


def test_mxfp8_param_gather_still_moves_two_bytes():
    """megatron-core all-gathers bf16 values for MXFP8 parameters (requantised on arrival)."""
    s = Strategy(dp=16, zero_stage=1)
    assert _dp_bytes(s, "dgx-b200", fp8_recipe="mxfp8") == _dp_bytes(s, "dgx-b200", fp8_recipe="mxfp8",
                                                                       fp8_param_gather=True)


# ---- the rules ------------------------------------------------------------------------------------------
def test_fp8_param_gather_needs_fp8_training():
    with pytest.raises(SpecError, match=r"fp8_param_gather needs precision 'fp8' \(precision is 'bf16'\)"):
        TrainSpec(global_batch_size=8, seq_len=128, fp8_param_gather=True)
    assert TrainSpec(global_batch_size=8, seq_len=128, precision="fp8", fp8_param_gather=True).fp8_param_gather


def test_the_cli_refuses_fp8_param_gather_without_fp8(capsys):
    args = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
            "--seq-len", "4096", "--fp8-param-gather"]
    for command in (["plan"], ["evaluate", "--zero", "1"], ["emit"]):
        code = main([*command, *args])
        err = capsys.readouterr().err
        assert code != 0 and "fp8_param_gather needs precision 'fp8'" in err, (command, err)


def test_megatron_refuses_fp8_param_gather_without_the_distributed_optimizer():
    est = _est(strategy=Strategy(dp=8, tp=2, zero_stage=0), fp8_param_gather=True)
    assert not est.valid and any("zero_stage >= 1" in r for r in est.reasons)
    assert _est(strategy=Strategy(dp=8, tp=2, zero_stage=1), fp8_param_gather=True).valid


def test_megatron_refuses_offload_with_fp8_parameters_of_another_recipe():
    s = Strategy(dp=8, tp=2, zero_stage=1, offload_optimizer=True)
    assert _est(strategy=s, fp8_param_gather=True).valid
    est = _est(strategy=s, fp8_param_gather=True, fp8_recipe="tensorwise")
    assert not est.valid and any("fp8_recipe delayed" in r for r in est.reasons)


@pytest.mark.parametrize("framework", ["torchtitan", "colossalai"])
def test_other_frameworks_cannot_run_fp8_param_gather_and_their_emitters_agree(framework):
    strategy = Strategy(dp=8, tp=2, zero_stage=1).resolve(16)
    model, cluster, train = make_inputs("llama3-8b", "dgx-h100", 16, 64, 4096, "fp8", fp8_param_gather=True)
    est = evaluate(model, cluster, 16, 64, 4096, "fp8", strategy=strategy, fp8_param_gather=True)
    plan = Plan(rank=1, strategy=strategy, estimate=est, model=model, cluster=cluster, train=train, num_gpus=16)
    st = StrategyArrays.from_strategies([plan.strategy])
    hits = [rule.reason for rule, hit in cannot_run_masks(load_tables(None).framework(framework), plan.model, plan.train, st)
            if hit[0]]
    assert any(r.startswith("fp8_param_gather") for r in hits)
    with pytest.raises(NotExpressibleError, match="fp8_param_gather; it is Megatron's --fp8-param-gather"):
        emit_data(plan, framework)


# ---- FP8 GEMM inputs kept for backward (Micro.gemm_input) ----

def _micro(precision="fp8", recipe="delayed", framework="megatron"):
    from cost_models.blocks import Micro

    one = np.ones(1, dtype=int)
    return Micro(8192, one, one, one, np.zeros(1, bool), precision, "flash", fp8_recipe=recipe, framework=framework)


@pytest.mark.parametrize("recipe,framework,byte", [("delayed", "megatron", 1.0), ("tensorwise", "megatron", 1.0),
                                                     ("mxfp8", "megatron", 1 + 1 / 32), ("blockwise", "megatron", 1 + 4 / 128),
                                                     ("tensorwise", "torchtitan", 2.0)])
def test_quantised_gemm_inputs_are_kept_in_fp8_under_transformer_engine(recipe, framework, byte):
    """Megatron's Transformer Engine modules keep the FP8 copy of each quantised GEMM's input (plus block
    scales); torchao's float8 linear keeps the 16-bit one. Q, K, V and the SwiGLU input stay 16-bit."""
    from cost_models.blocks import model_blocks

    layer = model_blocks(load_model("llama3-8b")).kinds[0]
    att, mlp = layer.attention(), next(b for b in layer.blocks if type(b).__name__ == "DenseMLP")
    x, bf16 = _micro(recipe=recipe, framework=framework), _micro(precision="bf16")
    assert x.gemm_input == pytest.approx(byte) and bf16.gemm_input == 2
    n, h, q, k, f = 8192, 4096, 4096, 1024, 14336
    a = att.activations(x)
    assert float(a.replicated[0]) == pytest.approx(n * byte * h)  # the QKV input
    assert float(a.split[0]) == pytest.approx(n * (2 * (q + k) + 2 * k + byte * q))  # Q, K, V 16-bit; proj input
    m = mlp.activations(x)
    assert float(m.replicated[0]) == pytest.approx(n * byte * h)
    assert float(m.split[0]) == pytest.approx(n * (2 * 2 + byte) * f)  # [gate, up] output 16-bit, fc2 input


def test_fp8_activations_are_smaller_only_where_transformer_engine_runs():
    run = dict(model="llama3-70b", cluster="dgx-h100", num_gpus=64, global_batch_size=128, seq_len=8192,
               strategy={"tp": 4, "pp": 4, "sequence_parallel": True, "zero_stage": 1, "micro_batch_size": 1})

    def activations(precision, framework="megatron"):
        return evaluate(precision=precision, framework=framework, **run).memory_bytes["activations"]

    assert activations("fp8") < 0.85 * activations("bf16")
    assert activations("fp8", "torchtitan") == pytest.approx(activations("bf16", "torchtitan"))


def test_fp8_param_gather_casts_only_the_optimizers_shard_each_step():
    """With FP8 parameters the optimizer quantises its master-weight shard (megatron-core quantize_param_shard):
    each rank casts 1/dp of the weights per step, so the step's cast time shrinks with dp and not at dp 1."""
    run = dict(model="llama3-70b", cluster="dgx-h100", num_gpus=64, global_batch_size=128, seq_len=8192,
               precision="fp8")

    def optimizer_s(strategy, gather):
        return evaluate(**run, strategy=strategy, fp8_param_gather=gather).time_s["optimizer"]

    dp4 = dict(tp=4, pp=4, sequence_parallel=True, zero_stage=1, micro_batch_size=1)
    dp1 = dict(tp=4, pp=16, sequence_parallel=True, zero_stage=1, micro_batch_size=1)
    full, shard = optimizer_s(dp4, False), optimizer_s(dp4, True)
    assert shard < full
    assert optimizer_s(dp1, True) == pytest.approx(optimizer_s(dp1, False))
