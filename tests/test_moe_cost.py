"""Mixture-of-experts, latent and windowed attention, per-stage layer kinds and optimizer
offload in the cost model, and the rules and CLI errors that guard them."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from cost_models.blocks import LatentAttention, model_blocks
from cost_models.params import expert_params, num_active_params, num_params
from cost_models.units import optimizer_state_bytes
from planner import evaluate
from planner.cli import main
from planner.errors import SpecError
from planner.specs import ModelSpec

#: Mixtral 8x7B's shape (mistralai/Mixtral-8x7B-v0.1 config.json), 8 layers instead of 32 to keep tests small.
MIXTRAL = dict(name="mixtral-8-layers", num_layers=8, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
               ffn_hidden_size=14336, gated_mlp=True, vocab_size=32000, tie_embeddings=False, num_experts=8,
               moe_top_k=2)
#: DeepSeek-V3's layer shapes (deepseek-ai/DeepSeek-V3 config.json) on 8 layers, the first 3 dense.
DEEPSEEK = dict(name="deepseek-8-layers", num_layers=8, hidden_size=7168, num_attention_heads=128,
                ffn_hidden_size=18432, gated_mlp=True, vocab_size=129280, tie_embeddings=False, num_experts=256,
                moe_top_k=8, moe_ffn_hidden_size=2048, num_shared_experts=1, moe_first_k_dense=3,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _eval(model, gpus=16, gbs=64, seq=4096, **strategy):
    return evaluate(ModelSpec(**model), "dgx-h100", gpus, gbs, seq, strategy=strategy)


def test_all_to_all_only_with_expert_parallelism():
    assert _eval(MIXTRAL, dp=16, zero_stage=1).time_s["ep_comm"] == 0
    e = _eval(MIXTRAL, dp=16, ep=8, zero_stage=1)
    assert e.valid and e.time_s["ep_comm"] > 0
    # across nodes (ep 16 spans two DGX) the all-to-all is slower than inside one
    wide = evaluate(ModelSpec(**(MIXTRAL | {"num_experts": 16})), "dgx-h100", 16, 64, 4096,
                    strategy=dict(dp=16, ep=16, zero_stage=1))
    narrow = evaluate(ModelSpec(**(MIXTRAL | {"num_experts": 16})), "dgx-h100", 16, 64, 4096,
                      strategy=dict(dp=16, ep=8, zero_stage=1))
    assert wide.time_s["ep_comm"] > narrow.time_s["ep_comm"]


def test_expert_states_are_sharded_by_ep_and_the_expert_data_parallel_group():
    model = ModelSpec(**MIXTRAL)
    experts = expert_params(model)
    dense = num_params(model) - experts
    for ep in (1, 2, 8):
        e = _eval(MIXTRAL, dp=16, ep=ep, zero_stage=1)
        edp = 16 // ep
        # ZeRO-1: optimizer states of dense weights over dp = 16, of expert weights (E/ep per rank) over edp.
        # (The padded vocabulary adds a little to the dense part.)
        expected = optimizer_state_bytes("adam", "bf16") * (dense / 16 + experts / ep / edp)
        assert e.memory_bytes["optimizer"] == pytest.approx(expected, rel=0.01)
        assert e.memory_bytes["params"] == pytest.approx(2 * (dense + experts / ep), rel=0.01)


def test_model_flops_count_the_active_experts_only():
    model = ModelSpec(**MIXTRAL)
    seq, gbs = 1024, 64
    e = _eval(MIXTRAL, dp=16, ep=8, zero_stage=1, gbs=gbs, seq=seq)
    tokens = gbs * seq
    step_flop = e.model_tflops_per_gpu * 1e12 * e.step_time_s * 16
    embedding = model.vocab_size * model.hidden_size  # a lookup, not a GEMM
    six_n_t = 6 * (num_active_params(model) - embedding) * tokens
    assert step_flop == pytest.approx(six_n_t, rel=0.08)  # the rest is attention's s² term and the router
    assert step_flop < 6 * num_params(model) * tokens / 2


def test_load_imbalance_slows_experts_and_dispatch():
    model = ModelSpec(**MIXTRAL)
    one = evaluate(model, "dgx-h100", 16, 64, 4096, strategy=dict(dp=16, ep=8, zero_stage=1), moe_load_imbalance=1.0)
    skew = evaluate(model, "dgx-h100", 16, 64, 4096, strategy=dict(dp=16, ep=8, zero_stage=1), moe_load_imbalance=1.5)
    assert skew.time_s["ep_comm"] == pytest.approx(1.5 * one.time_s["ep_comm"], rel=0.05)
    assert skew.time_s["compute"] > one.time_s["compute"]
    assert skew.model_tflops_per_gpu < one.model_tflops_per_gpu  # model FLOPs do not count the imbalance


def test_dense_and_moe_layers_are_counted_per_stage():
    # 8 layers, first 3 dense, pp 4: the first stage holds 2 dense layers, the binding stage is an MoE one.
    e = _eval(DEEPSEEK, gpus=64, gbs=64, dp=16, pp=4, ep=16, zero_stage=1, recompute="full")
    assert e.valid, e.reasons
    assert e.binding_pipeline_rank > 0
    counts = model_blocks(ModelSpec(**DEEPSEEK)).pattern
    assert counts == (0, 0, 0, 1, 1, 1, 1, 1)


def test_latent_attention_parameters_match_deepseek_v3():
    # DeepSeek-V3: q down 7168·1536 + norm, q up 1536·128·192, kv down 7168·576 + norm 512,
    # kv up 512·128·256, output 128·128·7168 = 187.1M per layer.
    mla = LatentAttention(7168, 128, 1536, 512, 128, 64, 128)
    expected = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert mla.params() == expected
    # down-projections and norms are replicated over TP, the rest split
    assert float(mla.params_per_rank(np.array(8))) == pytest.approx(
        7168 * 1536 + 1536 + 7168 * 576 + 512 + (1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168) / 8)


def test_sliding_window_cuts_attention_core_flops():
    base = dict(name="w", num_layers=4, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                ffn_hidden_size=14336, gated_mlp=True, vocab_size=32000)
    full = ModelSpec(**base)
    local = ModelSpec(**base, sliding_window=4096)
    half = ModelSpec(**base, sliding_window=4096, global_attention_every=2)
    seq = 32768
    flop = {m.name + str(m.sliding_window) + str(m.global_attention_every):
            evaluate(m, "dgx-h100", 8, 8, seq, strategy=dict(dp=8, recompute="full")).model_tflops_per_gpu
            for m in (full, local, half)}
    f, lo, h = flop.values()
    assert lo < h < f
    assert local.local_attention_mask() == (True,) * 4 and half.local_attention_mask() == (True, False, True, False)


def test_offload_moves_optimizer_states_to_the_host_and_prices_the_host_step():
    on = _eval(MIXTRAL, dp=16, ep=8, zero_stage=1, offload_optimizer=True)
    off = _eval(MIXTRAL, dp=16, ep=8, zero_stage=1)
    assert on.valid and on.memory_bytes["optimizer"] == 0 < off.memory_bytes["optimizer"]
    assert on.time_s["optimizer"] > 10 * off.time_s["optimizer"]  # host DRAM and PCIe, not HBM
    cpu = evaluate(ModelSpec(**MIXTRAL | {"hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 4,
                                          "num_kv_heads": 2}),
                   "local-cpu", 2, 2, 64, precision="fp32", strategy=dict(dp=2, zero_stage=1, offload_optimizer=True))
    assert not cpu.valid and any("offload_optimizer needs" in r for r in cpu.reasons)


@pytest.mark.parametrize("field,value,message", [
    ("moe_top_k", 9, "moe_top_k (9) must be between 1 and num_experts (8)"),
    ("sliding_window", -4, "sliding_window"),
    ("moe_dense_layers", [8], "moe_dense_layers [8] must be layer indices 0..7"),
])
def test_bad_model_fields_are_one_line_errors(field, value, message, tmp_path, capsys):
    with pytest.raises((SpecError, ValueError)):
        ModelSpec(**(MIXTRAL | {field: value}))
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(MIXTRAL | {field: value}))
    code = main(["plan", "--model", str(path), "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
                 "--seq-len", "4096"])
    out, err = capsys.readouterr()
    assert code == 2 and message in err and "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args,message", [
    (["-C", "ep=3"], "ep (3) must divide num_experts (8)"),
    (["-C", "ep=8", "-C", "etp=4", "-C", "tp=1", "-C", "cp=1"], "etp·ep (4·8 = 32) must divide the tp·cp·dp ranks"),
])
def test_bad_expert_constraints_exit_2(args, message, tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(MIXTRAL))
    code = main(["plan", "--model", str(path), "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
                 "--seq-len", "4096", "-C", "pp=1", *args])
    out, err = capsys.readouterr()
    assert code == 2 and message in err and "Traceback" not in err + out


def test_explain_shows_the_all_to_all(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(MIXTRAL))
    code = main(["explain", "--model", str(path), "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
                 "--seq-len", "4096", "--ep", "8", "--zero", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "ep_comm (MoE token all-to-all" in out
    code = main(["evaluate", "--model", str(path), "--cluster", "dgx-h100", "--gpus", "16", "--global-batch-size", "64",
                 "--seq-len", "4096", "--ep", "3"])
    out, err = capsys.readouterr()
    assert code == 2 and "invalid strategy: ep (3) must divide num_experts (8)" in err


def test_recompute_modules_trade_activation_memory_for_time():
    base = dict(dp=16, pp=4, ep=16, zero_stage=1, recompute="selective")
    plain = _eval(DEEPSEEK, gpus=64, **base)
    deepseek = _eval(DEEPSEEK, gpus=64, **base, recompute_modules=["layernorm", "mla_up_proj", "moe_act"])
    whole_moe = _eval(DEEPSEEK, gpus=64, **base, recompute_modules=["moe"])
    assert deepseek.memory_bytes["activations"] < plain.memory_bytes["activations"]
    assert whole_moe.memory_bytes["activations"] < deepseek.memory_bytes["activations"]
    # repeating the MoE block repeats its GEMMs and its dispatch: far more than the attention core
    assert whole_moe.time_s["recompute"] > 3 * plain.time_s["recompute"]
    dense = evaluate("llama3-8b", "dgx-h100", 8, 8, 4096,
                     strategy=dict(dp=8, recompute="selective", recompute_modules=["moe_act"]))
    assert not dense.valid and any("moe_act / shared_experts / moe an MoE model" in r for r in dense.reasons)


def test_search_offloads_only_when_nothing_fits_without_it():
    from planner import plan

    one = plan("llama3-8b", "dgx-h100", 1, 8, 4096, top_k=3)  # 8B x 16 bytes of state > 80 GiB
    assert one.plans and all(p.strategy.offload_optimizer and p.strategy.zero_stage >= 1 for p in one.plans)
    assert one.plans[0].estimate.memory_bytes["optimizer"] == 0
    eight = plan("llama3-8b", "dgx-h100", 8, 64, 4096, top_k=3)  # fits on HBM: offload would only add time
    assert not any(p.strategy.offload_optimizer for p in eight.plans)
    cpu = plan("llama3-8b", "local-cpu", 2, 2, 512, precision="fp32", top_k=1)  # no host profile: refused
    assert not any(p.strategy.offload_optimizer for p in cpu.plans + cpu.closest)


def test_recompute_modules_constraint_values_are_checked():
    from planner.space import normalise_constraints

    cons = normalise_constraints({"recompute_modules": ["layernorm", "moe_act"]})
    assert cons["recompute"] == ["selective"] and len(cons["recompute_modules"]) == 1
    assert len(normalise_constraints({"recompute_modules": [["layernorm"], ["moe"]]})["recompute_modules"]) == 2
    with pytest.raises(SpecError, match="recompute_modules=\\['attention'\\] must be a list of core_attn"):
        normalise_constraints({"recompute_modules": ["attention"]})


def test_overlapping_the_all_to_all_with_another_micro_batch():
    base = dict(dp=16, pp=2, vpp=2, ep=8, zero_stage=1)
    plain = _eval(MIXTRAL, gpus=32, **base)
    over = _eval(MIXTRAL, gpus=32, **base, overlap_moe_comm=True)
    assert over.valid and 0 <= over.time_s["ep_comm"] < plain.time_s["ep_comm"]
    assert over.time_s["compute"] == plain.time_s["compute"]
    bad = _eval(MIXTRAL, gpus=32, dp=16, pp=2, ep=8, zero_stage=1, overlap_moe_comm=True)  # pp 2 without vpp
    assert not bad.valid and any("overlap_moe_comm" in r for r in bad.reasons)


def test_grouped_gemm_runs_four_experts_at_a_time_on_table_gpus():
    """Transformer Engine's grouped linear issues one GEMM per local expert over four streams: on
    a GPU with a GEMM table, 16 experts of 512 rows take four times as long as 4 such experts
    (the same shape, four at a time), and longer than one 8,192-row GEMM of the same FLOPs."""
    from cost_models.blocks import Gemm
    from cost_models.compute import GROUPED_GEMM_STREAMS, gemm_time
    from profiles import load_cluster

    gpu = load_cluster("dgx-h100").gpu
    m, n, k = 512, 1536, 2048

    def grouped(count):
        return float(gemm_time(Gemm(2 * m * n * k * count, m, n, k, count=count, grouped=True), gpu, "bf16"))

    assert GROUPED_GEMM_STREAMS == 4
    overhead = gpu.kernel_overhead_s
    assert grouped(16) - overhead == pytest.approx(4 * (grouped(4) - overhead), rel=1e-6)
    one_tall = float(gemm_time(Gemm(2 * 16 * m * n * k, 16 * m, n, k), gpu, "bf16"))
    assert grouped(16) > one_tall


def test_host_setup_per_local_expert_slows_fine_grained_moe():
    """The host's per-expert set-up of a grouped MLP (Transformer Engine) is a floor under the
    layer: with more local experts per rank (smaller ep) a host-bound MoE layer takes longer."""
    from cost_models.elementwise import elementwise_model
    from profiles import load_cluster

    table = elementwise_model(load_cluster("dgx-h100").gpu)
    assert table.host_per_expert_fwd_s > 0 and table.host_per_expert_bwd_s > table.host_per_expert_fwd_s
    tiny = np.array(1e-6)
    few = table.host_floor(tiny, tiny, np.array(10), 2)
    many = table.host_floor(tiny, tiny, np.array(10), 64)
    assert many[0] - few[0] == pytest.approx(62 * table.host_per_expert_fwd_s)
    assert many[1] - few[1] == pytest.approx(62 * table.host_per_expert_bwd_s)


@pytest.mark.parametrize("experts,m,measured", [
    pytest.param(8, 4096, 627.903, marks=pytest.mark.xfail(strict=True, reason=(
        "-16.9 %: the H100 end-to-end fit's sustained fraction fell from 0.8138 to 0.7479 when the table's FP8 "
        "column took cuBLAS's measured FP8 / BF16 ratio (fp8_from_bf16.level); -9.6 % before Transformer Engine's "
        "cross-entropy, -10.8 % after it: outside 10 %, not resolved"))),
    (16, 2048, 553.945)])
def test_grouped_gemm_rate_matches_transformer_engines_published_multi_stream_benchmark(experts, m, measured):
    """Transformer Engine PR 2045 (NVIDIA/TransformerEngine, 2025-08; yaox12's table for TE 2.7, CUDA 12.9, H100):
    `general_grouped_gemm` over multi-stream cuBLAS runs (g, m, n, k) = (8, 4096, 768, 2048) at 627.9 TFLOP/s and
    (16, 2048, 768, 2048) at 553.9 BF16. The model (the measured per-shape table, GROUPED_GEMM_STREAMS experts
    sharing the waves, the fitted sustained fraction) should land within 10 %: the second does (-9.8 %), the first
    (-16.9 %) does not and is marked as a known failure; one expert at a time would be 21-30 % slow."""
    from cost_models.blocks import Gemm
    from cost_models.compute import gemm_time
    from profiles import load_gpu

    n, k = 768, 2048
    flop = 2.0 * experts * m * n * k
    rate = flop / float(np.ravel(gemm_time(Gemm(flop, m, n, k, True, experts, True), load_gpu("h100-sxm"), "bf16"))[0])
    assert rate / 1e12 == pytest.approx(measured, rel=0.10)


def test_megatrons_expert_output_bias_is_a_per_expert_pass_over_the_routed_tokens():
    """gpt-oss's experts have biases; Megatron-core adds fc2's outside the GEMM, one local expert at a
    time (TEGroupedMLP._apply_bias): 6 activation-type values per routed element, which other
    frameworks' code (and bias-free experts) do not pay."""
    from cost_models.blocks import Micro, MoE
    from profiles import load_model

    def x(framework):
        return Micro(4096, np.array([4]), np.array([1]), np.ones(1), np.zeros(1, bool), "bf16", "flash",
                     ep=np.array([8]), etp=np.array([1]), framework=framework)

    biased, plain = MoE(2880, 128, 4, 2880, True, 0, 0, True, True), MoE(2880, 128, 4, 2880, True, 0, 0, False, True)
    extra = biased.elementwise(x("megatron")).bytes - plain.elementwise(x("megatron")).bytes
    assert extra[0] == pytest.approx(6 * 2 * 4 * 4096 * 4 * 2880)  # 6 bf16 values x routed tokens x hidden
    assert biased.expert_output_bias(x("megatron")).num_kernels[0] == 2 * 16 + 1
    assert biased.expert_output_bias(x("torchtitan")).num_kernels == 0
    kw = dict(strategy=dict(ep=8, pp=1, micro_batch_size=4, zero_stage=1))
    with_bias = evaluate("gpt-oss-120b", "dgx-b200", 64, 1280, 4096, **kw)
    without = evaluate(load_model("gpt-oss-120b").model_copy(update={"moe_expert_bias": False}),
                       "dgx-b200", 64, 1280, 4096, **kw)
    assert with_bias.time_s["compute"] > without.time_s["compute"]


def test_alltoall_dispatcher_sorts_by_local_expert_where_the_flex_dispatcher_does_not():
    """Megatron's alltoall dispatcher sorts the received tokens by local expert and back (two more
    passes over the routed tokens); DeepEP's dispatch delivers them per expert. With one expert per
    rank there is nothing to sort."""
    from cost_models.blocks import Micro
    from profiles import load_model

    moe = model_blocks(load_model("qwen3-30b-a3b")).kinds[0].moe()

    def ew(dispatcher, ep):
        x = Micro(4096, np.array([2]), np.array([1]), np.ones(1), np.zeros(1, bool), "bf16", "flash",
                  ep=np.array([ep]), etp=np.array([1]), moe_dispatcher=dispatcher)
        return moe.elementwise(x).bytes[0]

    routed = 2 * 4096 * 8
    assert ew("alltoall", 8) - ew("deepep", 8) == pytest.approx(2 * 2 * 2 * routed * 2048)
    assert ew("alltoall", 128) == pytest.approx(ew("deepep", 128))
