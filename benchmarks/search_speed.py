"""Search speed over the full knob space, three questions:

- dense: Llama-3.1-405B on 16,384 H100s, global batch 2,048, sequence 8,192;
- fabric: the same on llama3-h100-24k, Meta's published cluster (racks, 3,072-GPU pods, 1:7 above), where
  the placement of every group is priced over three fabric levels and both rank orders are searched;
- moe: DeepSeek-V3 on 2,048 H100s, global batch 4,096, sequence 4,096 (target: the whole space,
  the recipes' settings included, in at most 2 s on one core; Llama-3.1-405B in at most 1 s).

    python benchmarks/search_speed.py [--repeat 5] [--case dense|fabric|moe|all]

Every knob is free (tp, pp, vpp, uneven splits, cp, ep, etp, zero, micro-batch,
recompute, optimizer and activation offload, and the training settings planner.knobs chooses:
gradient precision, FP8 parameter gather, the MoE dispatcher, the all-to-all overlap, CUDA graphs).
Prints candidates enumerated and scored, seconds and candidates per second (best of the repeats;
the first run includes imports and warm-up). Run it with one BLAS/numpy thread to measure one core: OMP_NUM_THREADS=1
(set below unless the environment sets it); pin it to one core with `taskset -c 0`.

To compare two builds, alternate them and fix glibc's malloc thresholds
(`MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824`): with the default
dynamic threshold, whether each candidate-sized array is a fresh mmap (page faults on every
touch) depends on the heap's history since start-up, and moves the figures by up to a quarter
between builds whose call counts are identical.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from planner import ModelSpec, plan  # noqa: E402
from profiles import list_presets  # noqa: E402

DENSE = dict(model="llama3.1-405b", cluster="dgx-h100", num_gpus=16384, global_batch_size=2048, seq_len=8192)
FABRIC = DENSE | {"cluster": "llama3-h100-24k"}
MOE = dict(cluster="dgx-h100", num_gpus=2048, global_batch_size=4096, seq_len=4096)

# DeepSeek-V3 as published: deepseek-ai/DeepSeek-V3 config.json (num_hidden_layers 61, hidden_size 7168,
# intermediate_size 18432, moe_intermediate_size 2048, n_routed_experts 256, num_experts_per_tok 8,
# n_shared_experts 1, first_k_dense_replace 3, moe_layer_freq 1, num_attention_heads 128, q_lora_rank 1536,
# kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, vocab_size 129280,
# tie_word_embeddings false, num_nextn_predict_layers 1); used while profiles/models has no preset.
DEEPSEEK_V3 = ModelSpec(
    name="deepseek-v3", num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
    gated_mlp=True, vocab_size=129280, tie_embeddings=False, position_embedding="rope", norm="rmsnorm",
    num_experts=256, moe_top_k=8, moe_ffn_hidden_size=2048, num_shared_experts=1, moe_first_k_dense=3,
    moe_layer_freq=1, num_mtp_layers=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128,
    source="deepseek-ai/DeepSeek-V3 config.json; DeepSeek-V3 technical report (arXiv:2412.19437) Sec. 4.2",
)


def moe_question() -> tuple[dict, str]:
    """The DeepSeek-V3 question and where its model comes from (the preset when profiles has one)."""
    if "deepseek-v3" in list_presets("models"):
        return MOE | {"model": "deepseek-v3"}, "preset profiles/models/deepseek-v3.yaml"
    return MOE | {"model": DEEPSEEK_V3}, "inline ModelSpec in benchmarks/search_speed.py (no deepseek-v3 preset)"


def run(name: str, question: dict, repeat: int, origin: str = "") -> None:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = plan(**question, top_k=10)
        runs.append((time.perf_counter() - t0, result))
    wall, result = min(runs, key=lambda r: r[0])
    st = result.stats
    shown = {k: (v.name if isinstance(v, ModelSpec) else v) for k, v in question.items()}
    print(f"[{name}] question: {shown}" + (f"\n[{name}] model: {origin}" if origin else ""))
    print(f"candidates enumerated:        {st.num_candidates:>10,}")
    print(f"candidates scored (valid):    {st.num_valid:>10,}")
    print(f"candidates that fit:          {st.num_feasible:>10,}")
    print(f"search time (inside plan):    {st.search_time_s:10.3f} s")
    print(f"plan() wall time, best of {repeat}:  {wall:10.3f} s")
    print(f"candidates scored per second: {st.num_valid / st.search_time_s:>10,.0f}")
    print(f"candidates enumerated per s:  {st.num_candidates / st.search_time_s:>10,.0f}")
    if result.plans:
        best = result.plans[0]
        print(f"best: {best.strategy.short()}  step {best.estimate.step_time_s:.2f} s, "
              f"MFU {100 * best.estimate.mfu:.1f} %")
    else:
        print("best: nothing fits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--case", choices=("dense", "fabric", "moe", "all"), default="all")
    args = parser.parse_args()
    if args.case in ("dense", "all"):
        run("dense", DENSE, args.repeat)
    if args.case in ("fabric", "all"):
        run("fabric", FABRIC, args.repeat)
    if args.case in ("moe", "all"):
        question, origin = moe_question()
        run("moe", question, args.repeat, origin)


if __name__ == "__main__":
    main()
