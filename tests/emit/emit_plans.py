"""Plans for the emitter tests: published configurations, hand-made edge cases, and a
sample of the search's own output. Every Estimate comes from the real cost model."""

from __future__ import annotations

import collections
from functools import lru_cache

from planner import evaluate, plan
from planner.api import make_inputs
from planner.specs import ModelSpec, Plan, Strategy


def make_plan(model: str, cluster: str, num_gpus: int, global_batch_size: int, seq_len: int,
              strategy: Strategy | dict, precision: str = "bf16", rank: int = 1, **train) -> Plan:
    """A Plan for one fixed strategy, scored by `evaluate` (fits or not)."""
    strategy = strategy if isinstance(strategy, Strategy) else Strategy(**strategy)
    strategy = strategy.resolve(num_gpus)
    m, c, t = make_inputs(model, cluster, num_gpus, global_batch_size, seq_len, precision, **train)
    est = evaluate(m, c, num_gpus, global_batch_size, seq_len, precision, strategy=strategy, **train)
    return Plan(rank=rank, strategy=strategy, estimate=est, model=m, cluster=c, train=t, num_gpus=num_gpus)


# ---- published plans (snapshots) --------------------------------------------------------
def gpt3_175b_sc21() -> Plan:
    """GPT-3 175B on 1024 A100-80GB: TP 8, PP 8, DP 16, global batch 1536, seq 2048, fp16, full recompute.

    Narayanan et al., SC'21, Sec. 5.1 ("On n=1024 A100 GPUs using batch size 1536, we achieve
    X=140 teraFLOP/s per GPU") with Table 1's TP 8 / PP 8 for models of this size; micro-batch 1
    and the plain 1F1B schedule are assumed (not given in the paper); 2021 Megatron had no
    distributed optimizer (zero_stage 0).
    """
    return make_plan("gpt3-175b", "dgx-a100-80gb", 1024, 1536, 2048, precision="fp16",
                     strategy=dict(tp=8, pp=8, micro_batch_size=1, recompute="full"))


def llama3_70b_nemo() -> Plan:
    """Llama-3-70B on 64 H100: TP 4, PP 4, CP 2, VPP 5, sequence parallel, distributed optimizer,
    micro-batch 1, global batch 128, seq 8192, bf16 (NVIDIA NeMo / Megatron-Bridge performance
    recipe for Llama 3 70B pre-training on 64 H100; also DESIGN.md's `evaluate` example)."""
    return make_plan("llama3-70b", "dgx-h100", 64, 128, 8192,
                     strategy=dict(tp=4, pp=4, cp=2, vpp=5, sequence_parallel=True, zero_stage=1,
                                   micro_batch_size=1))


def llama3_70b_gb200_activation_offload() -> Plan:
    """Llama-3-70B on 64 GB200: no tp, pp or cp, Megatron-FSDP (zero_stage 3), micro-batch 1, global batch
    128, seq 8192, bf16, the activations of 20 of the 80 layers offloaded to the host (Megatron-Bridge 0.3.1
    scripts/performance/configs/llama/llama3_workload_base_configs.py LLAMA3_70B_PRETRAIN_CONFIG_GB200_BF16_V1:
    use_megatron_fsdp, cpu_offloading_num_layers 20, parallel sizes and micro-batch at their defaults of 1;
    the llama3_70b_pretrain_config recipe's seq_length 8192)."""
    return make_plan("llama3-70b", "gb200-nvl72", 64, 128, 8192,
                     strategy=dict(zero_stage=3, micro_batch_size=1, offload_activation_layers=20))


PUBLISHED = {"gpt3-175b-1024xA100-tp8pp8": gpt3_175b_sc21, "llama3-70b-64xH100-tp4pp4cp2vpp5": llama3_70b_nemo,
             "llama3-70b-64xGB200-fsdp-act-offload20": llama3_70b_gb200_activation_offload}


# ---- MoE, latent-attention and windowed architectures (issue 8) -----------------------------
# Shapes from each model's Hugging Face config.json, built directly (not from presets).
DEEPSEEK_V3_LIKE = ModelSpec(
    name="deepseek-v3-like", num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
    gated_mlp=True, vocab_size=129280, tie_embeddings=False, max_position_embeddings=4096,
    num_experts=256, moe_top_k=8, moe_ffn_hidden_size=2048, num_shared_experts=1, moe_first_k_dense=3,
    num_mtp_layers=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    norm_epsilon=1e-6,
    source="deepseek-ai/DeepSeek-V3 config.json: rms_norm_eps 1e-6, hidden_size 7168, intermediate_size 18432, moe_intermediate_size "
           "2048, num_hidden_layers 61, first_k_dense_replace 3, n_routed_experts 256, num_experts_per_tok 8, "
           "n_shared_experts 1, q_lora_rank 1536, kv_lora_rank 512, qk_nope/rope_head_dim 128/64, v_head_dim 128, "
           "vocab_size 129280, num_nextn_predict_layers 1; the position table is cut to 4096 (pre-training length)")
MIXTRAL_LIKE = ModelSpec(
    name="mixtral-8x7b-like", num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
    ffn_hidden_size=14336, gated_mlp=True, vocab_size=32000, tie_embeddings=False, max_position_embeddings=32768,
    num_experts=8, moe_top_k=2,
    source="mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, intermediate_size 14336, 32 layers, 32 heads, "
           "8 KV heads, num_local_experts 8, num_experts_per_tok 2, vocab_size 32000")
GEMMA2_LIKE = ModelSpec(
    name="gemma2-9b-like", num_layers=42, hidden_size=3584, num_attention_heads=16, num_kv_heads=8, head_dim=256,
    ffn_hidden_size=14336, gated_mlp=True, vocab_size=256000, tie_embeddings=True, max_position_embeddings=8192,
    sliding_window=4096, global_attention_every=2, norm_epsilon=1e-6,
    source="google/gemma-2-9b config.json: rms_norm_eps 1e-6, hidden_size 3584, intermediate_size 14336, 42 layers, 16 heads, 8 KV "
           "heads, head_dim 256, vocab_size 256000, sliding_window 4096 on every other layer (layer 0 local)")

QWEN3_LIKE = ModelSpec(
    name="qwen3-8b-like", num_layers=36, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128,
    ffn_hidden_size=12288, gated_mlp=True, vocab_size=151936, tie_embeddings=False, max_position_embeddings=40960,
    rope_theta=1000000, qk_norm="per_head", norm_epsilon=1e-6,
    source="Qwen/Qwen3-8B config.json: rms_norm_eps 1e-6, hidden_size 4096, intermediate_size 12288, 36 layers, 32 heads, 8 KV heads, "
           "head_dim 128, vocab_size 151936, rope_theta 1000000, untied; Qwen3Attention's q_norm / k_norm are "
           "RMSNorms over each head's 128 features")


def deepseek_v3_like() -> Plan:
    """DeepSeek-V3-like on 256 H100: pp 8 (7 layers first, 6 last, 8 in between), ep 8, dp 32, ZeRO-1,
    global batch 1024 of 4096 tokens. A hand-made layout in the spirit of the DeepSeek-V3 report
    (Sec. 3.2: pipeline stages, expert parallelism over nodes, ZeRO-1 data parallelism, no tp),
    scaled to 256 GPUs."""
    return make_plan(DEEPSEEK_V3_LIKE, "dgx-h100", 256, 1024, 4096,
                     strategy=dict(pp=8, ep=8, zero_stage=1, num_layers_in_first_stage=7,
                                   num_layers_in_last_stage=6, recompute="full"))


def mixtral_like_etp() -> Plan:
    """Mixtral-8x7B-like on 64 H100: tp 4 with sequence parallelism, pp 2, ep 4 with etp 2 (experts
    on 8 of the 32 ranks of a stage), ZeRO-1."""
    return make_plan(MIXTRAL_LIKE, "dgx-h100", 64, 256, 4096,
                     strategy=dict(tp=4, pp=2, ep=4, etp=2, sequence_parallel=True, zero_stage=1))


def gemma2_like() -> Plan:
    """Gemma-2-9B-like on 16 H100: tp 2 with sequence parallelism, ZeRO-1, optimizer on the CPU."""
    return make_plan(GEMMA2_LIKE, "dgx-h100", 16, 64, 8192,
                     strategy=dict(tp=2, sequence_parallel=True, zero_stage=1, offload_optimizer=True))


def qwen3_like() -> Plan:
    """Qwen3-8B-like (per-head query/key norms) on 16 H100: tp 2 with sequence parallelism, ZeRO-1."""
    return make_plan(QWEN3_LIKE, "dgx-h100", 16, 64, 4096,
                     strategy=dict(tp=2, sequence_parallel=True, zero_stage=1))


ARCHITECTURES = {"deepseek-v3-like-256xH100-pp8ep8": deepseek_v3_like,
                 "mixtral-like-64xH100-tp4pp2ep4etp2": mixtral_like_etp,
                 "gemma2-like-16xH100-tp2-offload": gemma2_like,
                 "qwen3-like-16xH100-tp2": qwen3_like}


# ---- fine-tuning plans: the toolkits' two shardings -------------------------------------------------------
def llama3_8b_qlora_zero2() -> Plan:
    """Llama-3-8B QLoRA (rank 16, double quantisation, paged AdamW) on one DGX H100 under DeepSpeed ZeRO-2 with
    full recompute, global batch 64 of 4096 tokens: a hand-made layout for the fine-tuning toolkits."""
    return make_plan("llama3-8b", "dgx-h100", 8, 64, 4096, strategy=dict(zero_stage=2, recompute="full"),
                     finetune="qlora", paged_optimizer=True)


def llama31_70b_lora_fsdp2() -> Plan:
    """Llama-3.1-70B LoRA (rank 16 on the attention projections) on two DGX H100 under FSDP2 (framework
    torchtitan, zero_stage 3) with full recompute, global batch 64 of 4096 tokens: hand-made."""
    return make_plan("llama3.1-70b", "dgx-h100", 16, 64, 4096, strategy=dict(zero_stage=3, recompute="full"),
                     finetune="lora", framework="torchtitan",
                     lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


FINETUNE = {"llama3-8b-8xH100-qlora-zero2": llama3_8b_qlora_zero2,
            "llama3.1-70b-16xH100-lora-fsdp2": llama31_70b_lora_fsdp2}


# ---- the search's own output --------------------------------------------------------------
#: (question, extra constrained searches) covering every knob the search varies
QUESTIONS = [
    (dict(model="llama3-8b", cluster="dgx-h100", num_gpus=16, global_batch_size=64, seq_len=4096),
     [{"pp": [2, 4]}, {"zero_stage": 3, "tp": [2, 4]}, {"cp": [2, 4]},
      # the stage split (issue 7): explicit splits, with and without interleaving; embedding and loss as layers
      {"pp": 4, "stage_layers": [[7, 9, 10, 6], [6, 10, 12, 4]]}, {"pp": 4, "vpp": 2, "stage_layers": [[6, 10, 12, 4]]},
      {"pp": 2, "embedding_as_layer": True, "loss_as_layer": True}]),
    (dict(model="llama3-70b", cluster="dgx-h100", num_gpus=64, global_batch_size=128, seq_len=8192),
     [{"pp": [4, 8], "vpp": [2, 5]}, {"zero_stage": [2, 3], "pp": [2, 4]}, {"tp": 8, "recompute": "selective"},
      {"pp": 4, "vpp": 2, "stage_layers": [[18, 22, 24, 16]], "recompute": "full"}]),
    (dict(model="gpt3-175b", cluster="dgx-a100-80gb", num_gpus=1024, global_batch_size=1536, seq_len=2048,
          precision="fp16"),
     [{"tp": 8, "pp": 8}, {"pp": [16, 32], "recompute": "full"},
      {"tp": 8, "pp": 2, "vpp": 7, "embedding_as_layer": True, "loss_as_layer": True, "recompute": "full"}]),
    (dict(model="llama3.1-405b", cluster="dgx-h100", num_gpus=512, global_batch_size=256, seq_len=8192),
     [{"pp": [8, 16], "tp": 8}, {"pp": 2, "vpp": [2, 4], "tp": 8, "embedding_as_layer": True, "loss_as_layer": True}]),
    (dict(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=32, seq_len=8192, precision="fp8"),
     [{"pp": 2}, {"tp": [2, 4], "zero_stage": 0}]),
    (dict(model="gpt3-1.7b", cluster="dgx-a100-40gb", num_gpus=8, global_batch_size=64, seq_len=2048,
          attention_kernel="unfused", grad_precision="bf16"),
     [{"pp": [2, 4], "recompute": "selective"}, {"zero_stage": 3}]),
    # MoE (issue 8): expert parallelism with and without etp, offload, a windowed model
    (dict(model="mixtral-8x7b", cluster="dgx-h100", num_gpus=64, global_batch_size=128, seq_len=4096),
     [{"ep": [4, 8], "etp": 1, "pp": [1, 4]}, {"ep": 2, "etp": [2], "tp": 2}, {"zero_stage": 1, "offload_optimizer": True}]),
    (dict(model="gemma-2-27b", cluster="dgx-h100", num_gpus=16, global_batch_size=32, seq_len=8192), []),
    # nothing fits: the search returns the closest valid strategies instead
    (dict(model="llama3-70b", cluster="dgx-a100-40gb", num_gpus=8, global_batch_size=8, seq_len=4096), []),
]


def knob_key(p: Plan) -> tuple:
    s = p.strategy
    return (s.tp > 1, s.pp > 1, s.cp > 1, s.vpp > 1, s.zero_stage, s.recompute, s.recompute_num_layers is not None,
            s.sequence_parallel, s.num_layers_in_first_stage is not None, s.stage_layers is not None,
            s.embedding_as_layer, s.loss_as_layer, s.ep > 1, s.etp > 1, s.offload_optimizer,
            s.offload_activation_layers is not None, p.train.precision,
            p.train.attention_kernel, p.estimate.fits)


@lru_cache(maxsize=1)
def search_sample(per_key: int = 2, top_k: int = 400) -> tuple[Plan, ...]:
    """A few hundred plans from the search (`plans` and `closest`), at most `per_key` per knob combination."""
    groups: dict[tuple, list[Plan]] = collections.defaultdict(list)
    for question, constrained in QUESTIONS:
        for constraints in [{}] + constrained:
            result = plan(top_k=top_k, constraints=constraints, **question)
            for p in result.plans + result.closest:
                key = (question["model"],) + knob_key(p)
                if len(groups[key]) < per_key and p.strategy not in [q.strategy for q in groups[key]]:
                    groups[key].append(p)
    return tuple(p for key in sorted(groups, key=repr) for p in groups[key])
