"""A tiny model and training settings shared by the executor tests."""

from __future__ import annotations

from planner.specs import ModelSpec, TrainSpec

TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=128, gated_mlp=True, vocab_size=256, tie_embeddings=True,
                 source="executor tests")
TRAIN = TrainSpec(global_batch_size=8, seq_len=32, precision="fp32")
TINY_MOE = ModelSpec(name="tiny-moe", num_layers=3, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                     ffn_hidden_size=128, gated_mlp=True, vocab_size=256, tie_embeddings=True, num_experts=4,
                     moe_top_k=2, moe_ffn_hidden_size=64, num_shared_experts=1, moe_first_k_dense=1,
                     source="executor tests: layer 0 dense, layers 1-2 MoE (4 experts, top-2, one shared expert)")
