"""Plans for the emitter tests: published configurations, hand-made edge cases, and a
sample of the search's own output. Every Estimate comes from the real cost model."""

from __future__ import annotations

import collections
from functools import lru_cache

from planner import evaluate, plan
from planner.api import make_inputs
from planner.specs import Plan, Strategy


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


PUBLISHED = {"gpt3-175b-1024xA100-tp8pp8": gpt3_175b_sc21, "llama3-70b-64xH100-tp4pp4cp2vpp5": llama3_70b_nemo}


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
    # nothing fits: the search returns the closest valid strategies instead
    (dict(model="llama3-70b", cluster="dgx-a100-40gb", num_gpus=8, global_batch_size=8, seq_len=4096), []),
]


def knob_key(p: Plan) -> tuple:
    s = p.strategy
    return (s.tp > 1, s.pp > 1, s.cp > 1, s.vpp > 1, s.zero_stage, s.recompute, s.recompute_num_layers is not None,
            s.sequence_parallel, s.num_layers_in_first_stage is not None, s.stage_layers is not None,
            s.embedding_as_layer, s.loss_as_layer, p.train.precision, p.train.attention_kernel, p.estimate.fits)


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
