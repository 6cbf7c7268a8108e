"""Published measurements as typed cases, for calibration, accuracy tests and benchmarks.

The papers' tables live in `benchmarks/data/published/` (its README names every
source), the public runs in `benchmarks/data/`; each JSON row names its source. This module
only reads them and states, for each case, the strategy and settings the paper
used, so the cost model can be asked the same question.

Conventions (see benchmarks/data/published/README.md):
- SC'21 Table 1/2 report hardware TFLOP/s with Eq. 3, F = 96·B·s·l·h²·(1 + s/6h + V/16lh),
  which counts the recompute forward; we compare step times, step = F / (N · X).
- Korthikanti Table 5 reports iteration times directly.
- Both used A100-SXM4-80GB on Selene (DGX A100, 8x HDR 200 Gb/s per node),
  fp16/bf16 mixed precision, unfused attention (scores stored), dropout on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from planner.calibrate import MeasuredRun, predict_run
from planner.errors import SpecError
from planner.rules import eager_problem
from planner.specs import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED_DIR = ROOT / "benchmarks" / "data" / "published"


def _load(name: str) -> dict[str, Any]:
    """One of the papers' tables in benchmarks/data/published/ (SC'21, Korthikanti, ZeRO)."""
    return json.loads((PUBLISHED_DIR / name).read_text())


def gpt_model(name: str, heads: int, hidden: int, layers: int, vocab: int = 51200, seq: int = 2048) -> ModelSpec:
    """The GPT shape used by SC'21 and Korthikanti: learned positions, LayerNorm, biases, 4h MLP, dropout."""
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     ffn_hidden_size=4 * hidden, vocab_size=vocab, tie_embeddings=True, position_embedding="learned",
                     max_position_embeddings=seq, norm="layernorm", linear_bias=True, dropout=True,
                     source="Narayanan et al. SC'21 / Korthikanti et al. 2022")


@dataclass(frozen=True)
class StepCase:
    """One published end-to-end measurement: a model, a job, and how long a step took."""

    label: str
    table: str
    model: ModelSpec
    num_gpus: int
    global_batch_size: int
    seq_len: int
    constraints: dict[str, Any]  # the strategy fields the paper fixed; the rest are searched
    measured_step_s: float
    train_options: dict[str, Any] = field(default_factory=dict)
    cluster: str = "dgx-a100-80gb"


@dataclass(frozen=True)
class LayerCase:
    """Korthikanti Table 4: one layer's forward and backward time."""

    label: str
    model: ModelSpec
    micro_batch_size: int
    tp: int
    seq_len: int
    sequence_parallel: bool
    recompute: str
    forward_s: float
    backward_s: float


MEGATRON_2021 = {"precision": "fp16", "grad_precision": "fp16", "attention_kernel": "unfused"}
MEGATRON_2022 = {"precision": "bf16", "grad_precision": "fp32", "attention_kernel": "unfused"}
#: The 2021-22 Megatron-LM of these papers exchanged pipeline activations with blocking point-to-point
#: transfers (SC'21 Sec. 4.1 scatter/gather: the transfers are on the critical path); the overlapped
#: interleaved schedule (overlap_p2p_comm) came with megatron-core later.
BLOCKING_P2P = {"overlap_p2p_comm": False}


def sc21_flop_per_step(B: int, s: int, L: int, h: int, V: int) -> float:
    """SC'21 Eq. 3 (counts the recompute forward)."""
    return 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))


def sc21_table1() -> list[StepCase]:
    data = _load("megatron_sc21_table1.json")
    cases = []
    for r in data["table1_weak_scaling"]:
        h, L, a, V, s = r["hidden_size"], r["num_layers"], r["attention_heads"], r["vocab_size"], r["seq_length"]
        B, n = r["global_batch_size"], r["num_gpus"]
        step = sc21_flop_per_step(B, s, L, h, V) / (n * r["achieved_tflops_per_gpu"] * 1e12)
        cases.append(StepCase(
            label=f"{r['model_params_billion']}B tp{r['tp']} pp{r['pp']} n{n}", table="SC'21 Table 1",
            model=gpt_model(f"gpt-{r['model_params_billion']}b", a, h, L, V, s), num_gpus=n, global_batch_size=B,
            seq_len=s, measured_step_s=step, train_options=MEGATRON_2021,
            constraints={"tp": r["tp"], "pp": r["pp"], "dp": r["dp_derived"], "cp": 1, "recompute": "full",
                         "recompute_num_layers": None, "zero_stage": 0, "sequence_parallel": False,
                         "overlap_grad_reduce": False} | BLOCKING_P2P,
        ))
    return cases


def sc21_table2() -> list[StepCase]:
    data = _load("megatron_sc21_table1.json")
    shapes = {174.6: (96, 12288, 96), 529.6: (128, 20480, 105)}
    cases = []
    for r in data["table2_zero3_vs_ptd"]:
        a, h, L = shapes[r["model_params_billion"]]
        B, n, s, V = r["global_batch_size"], r["num_gpus"], r["seq_length"], 51200
        step = sc21_flop_per_step(B, s, L, h, V) / (n * r["achieved_tflops_per_gpu"] * 1e12)
        zero3 = r["zero_stage"] == 3
        cons = {"tp": r["tp"], "pp": r["pp"], "dp": r["dp_derived"], "cp": 1, "micro_batch_size": r["micro_batch_size"],
                "recompute": "full", "recompute_num_layers": None, "zero_stage": r["zero_stage"],
                "sequence_parallel": False, "overlap_grad_reduce": zero3} | BLOCKING_P2P
        cases.append(StepCase(
            label=f"{r['model_params_billion']}B {'ZeRO-3' if zero3 else 'PTD'} n{n} mbs{r['micro_batch_size']}",
            table="SC'21 Table 2", model=gpt_model(f"gpt-{r['model_params_billion']}b", a, h, L, V, s), num_gpus=n,
            global_batch_size=B, seq_len=s, measured_step_s=step, train_options=MEGATRON_2021, constraints=cons,
        ))
    return cases


def korthikanti_table5() -> list[StepCase]:
    data = _load("korthikanti2022.json")
    cases = []
    for r in data["table5_end_to_end"]:
        model = gpt_model(r["model"], r["attention_heads"], r["hidden_size"], r["num_layers"], r["vocab_size"], r["seq_length"])
        base = {"tp": r["tp"], "pp": r["pp"], "dp": r["dp"], "cp": 1, "vpp": r["vp"] or 1,
                "micro_batch_size": r["micro_batch_size"], "zero_stage": 0, "recompute_num_layers": None,
                "overlap_grad_reduce": False} | BLOCKING_P2P
        for kind, sp, rc, key in (("full recompute", False, "full", "iteration_time_s_full_recompute_no_sp"),
                                  ("SP + selective", True, "selective", "iteration_time_s_present_work_sp_plus_selective")):
            cases.append(StepCase(
                label=f"{r['model']} {kind}", table="Korthikanti Table 5", model=model, num_gpus=r["num_gpus"],
                global_batch_size=r["global_batch_size"], seq_len=r["seq_length"], measured_step_s=r[key],
                train_options=MEGATRON_2022, constraints=base | {"sequence_parallel": sp, "recompute": rc},
            ))
    return cases


def korthikanti_table4() -> list[LayerCase]:
    data = _load("korthikanti2022.json")
    cfg = next(c for c in data["table3_model_configs"] if c["model"] == "22B")
    model = gpt_model("gpt-22b", cfg["attention_heads"], cfg["hidden_size"], cfg["num_layers"], cfg["vocab_size"],
                      cfg["seq_length"])
    return [
        LayerCase(label=r["experiment"], model=model, micro_batch_size=cfg["micro_batch_size"], tp=cfg["tp"],
                  seq_len=cfg["seq_length"], sequence_parallel=r["sequence_parallel"], recompute=r["recompute"],
                  forward_s=r["forward_ms"] / 1e3, backward_s=r["backward_ms"] / 1e3)
        for r in data["table4_per_layer_time_22B"]
    ]


def torchtitan_fsdp2() -> list[StepCase]:
    """torchtitan's FSDP2 runs on 64 A100-80GB (benchmarks/data/torchtitan_fsdp2_a100.json).

    'selective layer' checkpointing (every second layer) is full recompute of half
    the layers; 'selective op' is torchtitan's own op-level policy, meshplan's
    selective recompute under framework torchtitan (every row runs on it).
    """
    data = json.loads((ROOT / "benchmarks" / "data" / "torchtitan_fsdp2_a100.json").read_text())
    from profiles import load_model

    cases = []
    for r in data["rows"]:
        ac = r["activation_checkpointing"]
        model = load_model(r["model"])
        n, b, s = 64, r["local_batch_size"], r["seq_len"]
        recompute = (ACTIVATION_CHECKPOINTING
                     | {"selective layer": {"recompute": "full", "recompute_num_layers": model.num_layers // 2}})[ac]
        cases.append(StepCase(
            label=f"{r['model']} mbs{b} AC {ac}", table="torchtitan FSDP2", model=model, num_gpus=n,
            global_batch_size=b * n, seq_len=s, measured_step_s=b * s / r["tokens_per_s_per_gpu"],
            train_options={"precision": "bf16", "grad_precision": "fp32", "attention_kernel": "flash",
                           "framework": "torchtitan"},
            constraints={"dp": n, "tp": 1, "pp": 1, "cp": 1, "zero_stage": 3, "micro_batch_size": b,
                         "sequence_parallel": False} | recompute,
        ))
    return cases


#: The published-run files in benchmarks/data/ read by `public_runs`: file stem -> (table name, defaults for
#: fields the file's rows leave out). Every other JSON file there has a schema of its own (`OTHER_DATA_FILES`).
#: Megatron-Bridge's FP8 mixed-precision recipes (delayed, current/tensorwise and MXFP8 scaling) set
#: fp8_param_gather = True (megatron-bridge 0.3.1, megatron/bridge/training/mixed_precision.py:
#: bf16_with_fp8_delayed_scaling_mixed, bf16_with_fp8_current_scaling_mixed, bf16_with_mxfp8_mixed); the
#: block-scaled (subchannel) recipe sets it False. Applied to the fp8 rows of the Bridge tables.
#: Its performance scripts reduce gradients in BF16: `grad_reduce_in_fp32: false` in every pretrain override of the
#: first ones (NVIDIA-NeMo/Megatron-Bridge@568b3a3e, 2025-08-28, scripts/performance/llm/configs/*_pretrain_overrides.yaml)
#: and `cfg.ddp.grad_reduce_in_fp32 = False` in `_benchmark_common` since (src/megatron/bridge/perf_recipes/_common.py
#: at 067f987d), so Megatron's main-gradient buffers are BF16 (grad_precision bf16), not the FP32 of its default.
#: Its performance runs compute the loss with Transformer Engine's cross-entropy: `cross_entropy_fusion_impl: "te"` in every
#: model yaml of the first scripts (v0.1.0rc4 scripts/performance/configs/*/*_llm_pretrain.yaml), then
#: `recipe.model.cross_entropy_fusion_impl = "te"` for every recipe (v0.2.0 scripts/performance/utils/helpers.py, v0.3.0 ..
#: v0.5.0 scripts/performance/utils/overrides.py) and `_benchmark_common(cfg, cross_entropy_impl="te")` at 067f987d
#: (src/megatron/bridge/perf_recipes/_common.py), with cross_entropy_loss_fusion on (GPTModelProvider's default).
#: And they run HybridEP on 32 SMs: `recipe.model.moe_hybridep_num_sms = 32` wherever the backend is hybridep (v0.2.0
#: scripts/performance/utils/helpers.py, v0.3.0 .. v0.5.0 scripts/performance/utils/overrides.py; `_benchmark_common` at
#: 067f987d), against megatron-core's default 16; applied to the rows whose dispatcher is hybridep.
BRIDGE = {"fp8_param_gather": True, "grad_precision": "bf16", "cross_entropy_fusion_impl": "te",
          "moe_hybridep_num_sms": 32}
PUBLIC_SETS: dict[str, tuple[str, dict[str, Any]]] = {
    # NeMo's interleaved pipelines overlap their transfers, as Strategy.overlap_p2p_comm defaults: the NeMo Framework
    # Launcher's llama2_70b training config (tp 4, pp 4, vp 20, this table's layout) sets overlap_p2p_comm: true,
    # batch_p2p_comm: false (launcher_scripts/conf/training/llama/llama2_70b.yaml, NVIDIA/NeMo-Framework-Launcher@0446d2c0)
    "nemo_h100_fp8": ("NeMo DGX-H100 FP8", {"cluster": "dgx-h100", "precision": "fp8"}),
    "mbridge_25_09": ("Megatron-Bridge 25.09", BRIDGE),
    "mbridge_25_11": ("Megatron-Bridge 25.11", BRIDGE),
    "mbridge_26_02": ("Megatron-Bridge 26.02", BRIDGE),
    "mbridge_26_02_01": ("Megatron-Bridge 26.02.01", BRIDGE),
    "mbridge_26_04": ("Megatron-Bridge 26.04", BRIDGE),
    "mbridge_26_04_01": ("Megatron-Bridge 26.04.01", BRIDGE),
    "mbridge_26_06": ("Megatron-Bridge 26.06", BRIDGE),
    "mbridge_26_06_01": ("Megatron-Bridge 26.06.01", BRIDGE),
    # Megatron-Bridge's own measured A/B runs (its performance skill cards), run with its performance recipes
    "mbridge_skills": ("Megatron-Bridge skill cards (H100)", BRIDGE),
    # torchtitan runs on its own schedule, reductions and op-level selective recompute, and computes the loss with
    # PyTorch's cross_entropy over fp32 logits, not Megatron's fused kernel (framework torchtitan: its profile's
    # cross_entropy_fusion false, profiles/frameworks/torchtitan.yaml). Its attention
    # is PyTorch's SDPA, whose backend list had FlashAttention-2 first on Hopper then: cuDNN was made opt-in after
    # torch 2.5 (pytorch/pytorch#138522; #142132 measured the default at 329 TFLOP/s against cuDNN's 631 on
    # torch 2.6.0.dev20241204) and torchtitan put cuDNN first on sm100 only (pytorch/torchtitan#1196, 2025-05).
    "torchtitan_h100": ("torchtitan H100 (2024-12)", {"framework": "torchtitan", "attention_kernel": "flash2"}),
    "torchtitan_h200": ("torchtitan H200 (2025-06)", {"framework": "torchtitan", "attention_kernel": "flash2"}),
    # LLM Foundry trains with Composer on PyTorch FSDP1 (FULL_SHARD / SHARD_GRAD_OP), which meshplan has no framework
    # for: costed as torchtitan (PyTorch FSDP2), the closest, whose per-micro-batch reduce-scatter and re-gather
    # Composer shares; FSDP1's flat-parameter copies and rate limiting are not modelled. Its loss is flash-attn's
    # fused cross-entropy (MPT's default loss_fn 'fused_crossentropy'): the file's source block says where from. Its
    # attention is each row's `attn_impl` (ATTN_IMPL): flash-attn 2 (the large-scale table's 'flash' rows) or the Triton
    # FlashAttention kernel of flash-attn 1.x's era (attn_impl 'triton'), timed as FlashAttention v1 (attention_kernel
    # flash1), which it matches within 10 % on A100 at MPT's head dim 128 with the causal mask
    # (profiles/kernels/attention/h100-sxm.yaml, flash1 section). No run compiled, but the rows keep torch_compile
    # true: MPT's eager element-wise operators (LayerNorm and GELU, one ATen kernel each; no rotary) move what the
    # fused kernels move, and torch_compile false costs torchtitan's eager Llama operators (RMSNorm, rotary).
    "llmfoundry_h100": ("LLM Foundry H100 (MPT)", {"cross_entropy_fusion": True, "framework": "torchtitan",
                                                    "attention_kernel": "flash2"}),
}
#: A row's `attn_impl` (LLM Foundry's attn_config.attn_impl, as the row's table ran it) -> attention_kernel.
ATTN_IMPL = {"flash2": "flash2", "triton": "flash1"}
OTHER_DATA_FILES = {"published_layouts", "torchtitan_fsdp2_a100", "zero3_runs", "peak_memory", "te_gemm_profiling",
                    "finetune_memory"}

#: GPU preset -> the generation accuracy is reported by (H200 is the H100's GH100 die with faster HBM).
#: The TPUs and B300 have no published run in the accuracy set yet (their names group none).
GENERATIONS = {"a100-40gb": "A100", "a100-80gb": "A100", "h100-sxm": "H100-H200", "h200": "H100-H200",
               "b200": "B200", "b300": "B300", "gb200": "GB200", "gb300": "GB300", "tpu-v4": "TPU v4", "tpu-v5p": "TPU v5p",
               "tpu-v5e": "TPU v5e"}
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
GRAD_PRECISIONS = ("bf16", "fp16", "fp32")  # what TrainSpec.grad_precision accepts
CROSS_ENTROPY_IMPLS = ("native", "te")  # what TrainSpec.cross_entropy_fusion_impl accepts
ACTIVATION_CHECKPOINTING = {"no": {"recompute": "none"},
                            "full": {"recompute": "full", "recompute_num_layers": None},
                            # torchtitan's op-level policy: its selective recompute (framework torchtitan)
                            "selective op": {"recompute": "selective"}}


def generation(cluster: str) -> str:
    """The GPU generation of a cluster preset ('dgx-h200' -> 'H100-H200'); 'other' for GPUs not listed."""
    from profiles import PROFILES_DIR

    import yaml

    doc = yaml.safe_load((PROFILES_DIR / "clusters" / f"{cluster}.yaml").read_text())
    return GENERATIONS.get(str(doc.get("gpu", "")), "other")


@dataclass(frozen=True)
class Refusal:
    """A published row that is kept but not predicted, and why (never dropped silently)."""

    label: str
    cluster: str
    measured_step_s: float
    reason: str
    moe: bool = False  # a mixture-of-experts model (kept in the MoE summaries when refused)


@dataclass(frozen=True)
class PublicSet:
    """One published-run file: its source, the rows turned into cases, and the rows refused."""

    name: str
    table: str
    source: dict[str, Any]
    cases: list[StepCase]
    refused: list[Refusal]


def public_set_path(name: str) -> Path:
    return ROOT / "benchmarks" / "data" / f"{name}.json"


def public_runs(name: str) -> PublicSet:
    """Read benchmarks/data/<name>.json (a `PUBLIC_SETS` entry) into StepCases.

    Each row gives the model preset, the cluster preset, #GPUs, global and micro
    batch, sequence length, the degrees (tp, pp, cp, vp, ep), precision and the
    measured tokens/s/GPU, and optionally `fsdp` (> 0: ZeRO-3 over the data
    parallel ranks; 0: DDP with or without the distributed optimizer, searched),
    `ga` (gradient accumulation steps, checked against GBS / (MBS·DP)), `zero_stage` (2: PyTorch FSDP's
    SHARD_GRAD_OP; it may not contradict `fsdp`),
    `local_batch_size` (torchtitan: sequences per data parallel rank),
    `activation_checkpointing`, `pp_schedule`, `model_overrides`, `variant`, `moe_dispatcher`
    (alltoall, deepep, hybridep), `overlap_moe_comm` (Megatron's --overlap-moe-expert-parallel-comm),
    `compile` (torchtitan's torch.compile: torch_compile), `attention_kernel` (flash, flash2, flash1;
    default flash) or `attn_impl` (LLM Foundry's, read through `ATTN_IMPL`), `stage_layers` (decoder
    layers per virtual stage in schedule order, pp·vp counts: the recipe's
    --pipeline-model-parallel-layout, e.g. Megatron-Bridge's DeepSeek-V3 layouts) and
    `recompute_modules` (the recipe's --recompute-modules: selective recompute of those modules; an
    empty list: no recomputation) and `grad_precision` (the gradient buffers and their reduction: fp32
    unless the row or its set's defaults say otherwise). A row with `recipe_disagrees` (why: the
    printed layout against the recipe the release ran) is refused with that reason, and so is a row with
    `unmodelled` (what the release's recipe ran that meshplan has no model of, e.g. a fused kernel).
    The file's top-level `moe_load_imbalance` applies to rows of MoE models.
    Fields a row does not state are searched (recomputation, etp, ZeRO 0/1, and
    micro-batch size where no row field fixes it); optimizer offload is off. A
    row whose fields disagree or ask for something meshplan does not model is
    refused with the reason.
    """
    if name not in PUBLIC_SETS:
        raise SpecError(f"public run set {name!r} is not one of {sorted(PUBLIC_SETS)}")
    table, defaults = PUBLIC_SETS[name]
    data = json.loads(public_set_path(name).read_text())
    cases, refused = [], []
    for r in data["rows"]:
        row = defaults | r
        outcome = _public_case(row, table, data.get("moe_load_imbalance"), legacy="cluster" not in r)
        (refused if isinstance(outcome, Refusal) else cases).append(outcome)
    return PublicSet(name, table, data["source"], cases, refused)


def _public_label(r: dict[str, Any], legacy: bool) -> str:
    deg = f"tp{r['tp']} pp{r['pp']} cp{r['cp']} vp{r.get('vp') or '?'}"
    if legacy:  # the label nemo_h100_fp8 has always given
        return f"{r['model']} n{r['num_gpus']} {deg}"
    model = f"{r['model']} {r['variant']}" if r.get("variant") else r["model"]
    recipe = r.get("fp8_recipe", "")
    prec = recipe if r["precision"] == "fp8" and 0 < len(recipe) <= 8 else r["precision"]
    extra = "".join(f" {k}{r[k]}" for k in ("ep", "fsdp") if r.get(k, 0) > 1)
    extra += f" zero{r['zero_stage']}" if "zero_stage" in r else ""
    ac = f" AC {r['activation_checkpointing']}" if "activation_checkpointing" in r else ""
    sched = " interleaved" if r.get("pp_schedule", "").startswith("Interleaved") else ""
    asynctp = " asyncTP" if r.get("async_tp") else ""
    compiled = " compile" if r.get("compile") else ""
    return (f"{model} {r['cluster']} {prec} n{r['num_gpus']} s{r['seq_len']} {deg}{extra}{ac}{sched}{asynctp}{compiled}"
            .replace(" vp?", ""))


#: The published FP8 recipe names -> TrainSpec.fp8_recipe. Where the table does not name the recipe, a row's
#: `fp8_recipe_preset` (the recipe its release's performance preset runs, read at the release's tag and
#: named in the set's source) gives it; a recipe neither states keeps the default (delayed).
FP8_RECIPES = {"FP8-CS": "tensorwise", "FP8-MX": "mxfp8", "MXFP8": "mxfp8",
               "torchao float8 tensorwise dynamic": "tensorwise",
               # Composer's amp_fp8: Transformer Engine's DelayedScaling (HYBRID, amax history 16, max)
               "TE DelayedScaling HYBRID": "delayed"}


def _is_moe(name: str) -> bool:
    """Whether the model preset `name` is a mixture of experts (False for a name that is no preset)."""
    from profiles import load_model

    try:
        return load_model(name).num_experts > 0
    except SpecError:
        return False


def _public_case(r: dict[str, Any], table: str, moe_load_imbalance: float | None, legacy: bool):
    from profiles import load_model

    n, B, s, tp, pp, cp = r["num_gpus"], r["global_batch_size"], r["seq_len"], r["tp"], r["pp"], r["cp"]
    label = _public_label(r, legacy)
    step_s = B * s / (n * r["tokens_per_s_per_gpu"])

    def refuse(reason: str) -> Refusal:
        return Refusal(label, r["cluster"], step_s, reason, _is_moe(r["model"]))

    if r.get("recipe_disagrees"):  # the printed layout contradicts the recipe the release ran (the row says how)
        return refuse(f"the table's layout disagrees with its recipe: {r['recipe_disagrees']}")
    if r.get("unmodelled"):  # the release's recipe ran kernels meshplan has no model of (the row says which)
        return refuse(f"not modelled: {r['unmodelled']}")
    if n % (tp * pp * cp):
        return refuse(f"tp*pp*cp ({tp * pp * cp}) does not divide num_gpus ({n})")
    dp = n // (tp * pp * cp)
    if "ga" in r and B != r["micro_batch_size"] * dp * r["ga"]:
        return refuse(f"published GA ({r['ga']}) disagrees with GBS / (MBS*DP) = {B} / ({r['micro_batch_size']}*{dp})")
    if "local_batch_size" in r and B != r["local_batch_size"] * dp:
        return refuse(f"global batch ({B}) is not local batch ({r['local_batch_size']}) x dp ({dp})")
    if r.get("fsdp", 0) not in (0, dp):
        return refuse(f"fsdp ({r['fsdp']}) is neither 0 nor the data parallel degree ({dp})")
    if "zero_stage" in r and (r["zero_stage"] not in (0, 1, 2, 3) or (r.get("fsdp", 0) > 0) != (r["zero_stage"] == 3)):
        return refuse(f"zero_stage ({r['zero_stage']}) must be 0-3 and is 3 exactly when fsdp ({r.get('fsdp', 0)}) > 0")
    if r["precision"] not in PRECISIONS:
        return refuse(f"precision {r['precision']!r} has no meshplan setting")
    ac = r.get("activation_checkpointing")
    if ac is not None and ac not in ACTIVATION_CHECKPOINTING:
        return refuse(f"activation checkpointing {ac!r} is not modelled")
    if ac is not None and "recompute_modules" in r:
        return refuse("activation_checkpointing and recompute_modules both say what is recomputed")
    if ac == "selective op" and r.get("framework") != "torchtitan":
        return refuse("activation checkpointing 'selective op' is torchtitan's policy: the row needs framework torchtitan")

    model = load_model(r["model"])
    if r.get("model_overrides"):
        model = ModelSpec.model_validate(model.model_dump() | r["model_overrides"])
    cons: dict[str, Any] = {"tp": tp, "pp": pp, "cp": cp}
    if r.get("pp_schedule", "").startswith("Interleaved"):
        cons["vpp"] = list(range(2, model.num_layers // pp + 1))  # stages per rank not published: searched
    elif r.get("vp") is not None or "pp_schedule" in r:
        cons["vpp"] = r.get("vp") or 1
    if "stage_layers" in r:
        cons["stage_layers"] = list(r["stage_layers"])
    if "recompute_modules" in r:  # the recipe's --recompute-modules: selective recompute of those, [] none
        modules = list(r["recompute_modules"])
        cons |= {"recompute": "selective", "recompute_modules": modules} if modules else {"recompute": "none"}
    if "micro_batch_size" in r:
        cons["micro_batch_size"] = r["micro_batch_size"]
    elif "local_batch_size" in r and pp == 1:
        cons["micro_batch_size"] = r["local_batch_size"]  # no pipeline: the local batch is one micro-batch
    cons["sequence_parallel"] = tp > 1
    cons["zero_stage"] = r.get("zero_stage", 3 if r.get("fsdp", 0) > 0 else [0, 1])
    cons["offload_optimizer"] = False  # no published row offloads the optimizer
    if "ep" in r:
        cons["ep"] = r["ep"]
    if ac is not None:
        cons |= ACTIVATION_CHECKPOINTING[ac]
    if "attn_impl" in r and r["attn_impl"] not in ATTN_IMPL:
        return refuse(f"attn_impl {r['attn_impl']!r} is not one of {sorted(ATTN_IMPL)}")
    kernel = ATTN_IMPL[r["attn_impl"]] if "attn_impl" in r else r.get("attention_kernel", "flash")
    if r.get("grad_precision", "fp32") not in GRAD_PRECISIONS:
        return refuse(f"grad_precision {r['grad_precision']!r} is not one of {sorted(GRAD_PRECISIONS)}")
    train: dict[str, Any] = {"precision": r["precision"], "grad_precision": r.get("grad_precision", "fp32"),
                             "attention_kernel": kernel}
    if r["precision"] == "fp8":
        published = r.get("fp8_recipe")
        recipe = published if published in FP8_RECIPES else r.get("fp8_recipe_preset")
        if recipe is not None and recipe not in FP8_RECIPES:
            return refuse(f"fp8_recipe_preset {recipe!r} is not one of {sorted(FP8_RECIPES)}")
        if recipe is not None:
            train["fp8_recipe"] = FP8_RECIPES[recipe]
    if "cross_entropy_fusion" in r:
        train["cross_entropy_fusion"] = bool(r["cross_entropy_fusion"])
    if "cross_entropy_fusion_impl" in r:
        if r["cross_entropy_fusion_impl"] not in CROSS_ENTROPY_IMPLS:
            return refuse(f"cross_entropy_fusion_impl {r['cross_entropy_fusion_impl']!r} is not one of "
                          f"{sorted(CROSS_ENTROPY_IMPLS)}")
        train["cross_entropy_fusion_impl"] = r["cross_entropy_fusion_impl"]
    if "framework" in r:
        train["framework"] = r["framework"]
    if "compile" in r:  # torch.compile on or off (torchtitan's [compile])
        train["torch_compile"] = bool(r["compile"])
        problem = eager_problem(SimpleNamespace(**({"framework": "megatron"} | train)), model)
        if problem:
            return refuse(problem)
    if r.get("fp8_param_gather") and r["precision"] == "fp8" and train.get("fp8_recipe") != "blockwise":
        train["fp8_param_gather"] = True
    if "moe_dispatcher" in r:
        train["moe_dispatcher"] = r["moe_dispatcher"]
    if r.get("moe_dispatcher") == "hybridep" and "moe_hybridep_num_sms" in r:
        train["moe_flex_num_sms"] = int(r["moe_hybridep_num_sms"])
    if r.get("overlap_moe_comm"):
        cons["overlap_moe_comm"] = True
    if moe_load_imbalance is not None and model.num_experts > 0:
        train["moe_load_imbalance"] = moe_load_imbalance
    return StepCase(label=label, table=table, model=model, num_gpus=n, global_batch_size=B, seq_len=s,
                    cluster=r["cluster"], measured_step_s=step_s, train_options=train, constraints=cons)


def nemo_h100_fp8() -> list[StepCase]:
    """NeMo 24.07's FP8 pre-training runs on DGX-H100 (benchmarks/data/nemo_h100_fp8.json).

    The table gives the parallel layout but not SP, the optimizer sharding or
    recomputation: SP is assumed with tp > 1, the rest is searched.
    """
    return public_runs("nemo_h100_fp8").cases


@dataclass(frozen=True)
class ZeroCase:
    label: str
    params: float
    dp: int
    zero_stage: int
    memory_gb: float  # the paper's GB = 1e9 bytes, model states only


def zero_table1() -> list[ZeroCase]:
    data = _load("zero_table1.json")
    return [ZeroCase(label=f"{r['model_params']} Nd={r['dp_degree']} {r['zero_label']}", params=r["params"],
                     dp=r["dp_degree"], zero_stage=r["zero_stage"], memory_gb=r["model_state_memory_per_device_GB"])
            for r in data["table1"]]


@dataclass(frozen=True)
class Prediction:
    case: StepCase
    predicted_step_s: float | None  # None: no strategy under the paper's constraints fits
    strategy: str
    note: str = ""

    @property
    def error(self) -> float | None:
        if self.predicted_step_s is None:
            return None
        return self.predicted_step_s / self.case.measured_step_s - 1


def measured_run(case: StepCase, set_name: str | None = None) -> MeasuredRun:
    """The case as the package's typed measured run (planner.calibrate.MeasuredRun)."""
    train = dict(case.train_options)
    precision = train.pop("precision", "bf16")
    return MeasuredRun(label=case.label, source=case.table, set_name=set_name, model=case.model, cluster=case.cluster,
                       num_gpus=case.num_gpus, global_batch_size=case.global_batch_size, seq_len=case.seq_len,
                       precision=precision, strategy=dict(case.constraints), train_options=train,
                       measured_step_s=float(case.measured_step_s))


def predict(case: StepCase, cluster=None) -> Prediction:
    """Plan the case under the paper's constraints; the fastest plan that fits the GPU (no safety
    margin: the run was made) is the prediction (planner.calibrate.predict_run).

    Fields the paper did not report (SC'21 Table 1: micro-batch size and
    interleaving) are searched, as the authors tuned them. `cluster` overrides
    the case's cluster preset (calibration tries candidate efficiencies).
    """
    p = predict_run(measured_run(case), cluster)
    return Prediction(case, p.step_s, p.strategy, p.note)
