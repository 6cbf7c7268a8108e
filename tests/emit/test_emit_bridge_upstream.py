"""Megatron-Bridge override lists run through Megatron-Bridge's own recipe, Hydra override and
`runtime_config_update` + `ConfigContainer.validate()` path (the `megatron-bridge` 0.3.1 package from the
package index, in the interpreter named by MESHPLAN_BRIDGE_PYTHON, which scripts/test.sh builds),
and the validated config means what the plan says. The lists are the emitter's for that release
(`bridge_version="0.3"`); 0.6.0, the default, cannot be installed here and is checked against its source's
field names instead (tests/emit/test_emit_bridge_fields.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from emit_plans import make_plan
from planner.emit.base import BRIDGE_VERSIONS, NotExpressibleError
from planner.emit.megatron_bridge import bridge_overrides

HERE = Path(__file__).parent
#: the release scripts/test.sh installs (megatron-bridge==0.3.1), by the emitter's name for it
BRIDGE_VERSION = "0.3"
FIXTURES = HERE.parent / "fixtures" / "hf"

# Megatron-Bridge 0.3.1 has no Mixtral recipe, and its Qwen3-MoE recipes read the CUDA device's
# properties while they are built (apply_flex_dispatcher_backend), so they cannot run on a CPU-only
# machine; DeepSeek-V2-Lite is the MoE recipe here.
#: recipe (module under megatron.bridge.recipes . function) -> (the Hugging Face id it loads, the
#: published config.json in tests/fixtures/hf, the meshplan preset of the same model)
RECIPES = {
    "llama31_8b": ("llama.llama3.llama31_8b_pretrain_config", "meta-llama/Meta-Llama-3.1-8B", "llama-3.1-8b.json",
                   "llama3.1-8b"),
    "llama32_1b": ("llama.llama3.llama32_1b_pretrain_config", "meta-llama/Llama-3.2-1B", "llama-3.2-1b.json",
                   "llama3.2-1b"),
    "deepseek_v2_lite": ("deepseek.deepseek_v2.deepseek_v2_lite_pretrain_config", "deepseek-ai/DeepSeek-V2-Lite",
                         "deepseek-v2-lite.json", "deepseek-v2-lite"),
}

# (recipe, num_gpus, global batch, seq, precision, strategy)
GRID = [
    ("llama31_8b", 8, 64, 8192, "bf16", dict(tp=1, pp=1, zero_stage=1, micro_batch_size=1)),
    ("llama31_8b", 16, 64, 4096, "bf16", dict(tp=2, pp=2, sequence_parallel=True, zero_stage=1, micro_batch_size=2)),
    ("llama31_8b", 32, 128, 8192, "bf16", dict(tp=2, pp=4, vpp=2, cp=2, sequence_parallel=True, zero_stage=1,
                                               recompute="selective")),
    ("llama31_8b", 16, 64, 8192, "bf16", dict(tp=2, pp=4, num_layers_in_first_stage=7, num_layers_in_last_stage=7,
                                              recompute="full", recompute_num_layers=2)),
    ("llama31_8b", 16, 64, 8192, "bf16", dict(pp=2, embedding_as_layer=True, loss_as_layer=True)),
    ("llama31_8b", 16, 64, 2048, "bf16", dict(tp=1, zero_stage=3, micro_batch_size=2)),
    ("llama31_8b", 16, 64, 2048, "bf16", dict(tp=2, zero_stage=2, sequence_parallel=True)),
    ("llama31_8b", 16, 64, 8192, "fp8", dict(tp=4, sequence_parallel=True, zero_stage=1)),
    ("llama31_8b", 8, 32, 8192, "bf16", dict(tp=1, zero_stage=0, recompute="full")),
    # activation offloading (Megatron's --cpu-offloading-num-layers): pp 1, no recompute, 20 of 32 layers
    ("llama31_8b", 8, 64, 8192, "bf16", dict(tp=2, sequence_parallel=True, zero_stage=1,
                                             offload_activation_layers=20)),
    ("llama32_1b", 8, 64, 4096, "bf16", dict(tp=2, pp=2, zero_stage=1, micro_batch_size=4)),
    ("deepseek_v2_lite", 16, 128, 4096, "bf16", dict(ep=8, zero_stage=1)),
    ("deepseek_v2_lite", 32, 256, 4096, "bf16", dict(tp=2, ep=4, etp=2, sequence_parallel=True, cp=2, zero_stage=1)),
    ("deepseek_v2_lite", 16, 128, 4096, "bf16", dict(pp=2, ep=4, tp=2, sequence_parallel=True, zero_stage=1,
                                                     num_layers_in_first_stage=13, recompute="full")),
]


def bridge_python() -> str | None:
    python = os.environ.get("MESHPLAN_BRIDGE_PYTHON")
    if not python or not Path(python).exists():
        return None
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('megatron-bridge'))"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return None
    installed = probe.stdout.strip()
    assert installed == BRIDGE_VERSIONS[BRIDGE_VERSION], (
        f"{python} has megatron-bridge {installed}; these lists are written for {BRIDGE_VERSIONS[BRIDGE_VERSION]}")
    return python


def seed_hf_cache(home: Path) -> None:
    """An offline Hugging Face cache holding each recipe's config.json (architecture fields as published)."""
    revision = "0" * 40
    for _, hf_id, fixture, _ in RECIPES.values():
        config = {k: v for k, v in json.loads((FIXTURES / fixture).read_text()).items() if not k.startswith("_")}
        repo = home / "hub" / ("models--" + hf_id.replace("/", "--"))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        (repo / "snapshots" / revision).mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / revision / "config.json").write_text(json.dumps(config))


def run_bridge(python: str, hf_home: Path, cases: list[dict]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    proc = subprocess.run([python, str(HERE / "bridge_check.py")],
                          input=json.dumps({"hf_home": str(hf_home), "cases": cases}),
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def grid_plans():
    plans = []
    for key, num_gpus, gbs, seq, precision, strategy in GRID:
        fp8 = {"fp8_param_gather": True} if precision == "fp8" else {}  # what the delayed FP8 recipe sets
        plans.append((key, make_plan(RECIPES[key][3], "dgx-h100", num_gpus, gbs, seq, precision=precision,
                                     strategy=strategy, **fp8)))
    return plans


@pytest.fixture(scope="module")
def bridge_results(tmp_path_factory):
    python = bridge_python()
    if python is None:
        pytest.skip("megatron-bridge is not importable: set MESHPLAN_BRIDGE_PYTHON to the interpreter "
                    "scripts/test.sh builds (build/bridge-venv/bin/python)")
    hf_home = tmp_path_factory.mktemp("hf")
    seed_hf_cache(hf_home)
    plans, cases, refused = [], [], []
    for key, plan in grid_plans():
        try:
            overrides = bridge_overrides(plan, BRIDGE_VERSION)
        except NotExpressibleError as exc:
            refused.append((key, plan, exc))
            continue
        plans.append((key, plan))
        cases.append({"recipe": RECIPES[key][0], "world_size": plan.num_gpus, "overrides": overrides})
    return plans, run_bridge(python, hf_home, cases), refused


def expected(plan) -> dict:
    """What the validated Megatron-Bridge config must hold for this plan."""
    s, t, m = plan.strategy, plan.train, plan.model
    moe = bool(m.num_experts)
    out = {
        "model.tensor_model_parallel_size": s.tp, "model.pipeline_model_parallel_size": s.pp,
        "model.virtual_pipeline_model_parallel_size": s.vpp if s.vpp > 1 else None,
        "model.context_parallel_size": s.cp,
        "model.expert_model_parallel_size": s.ep if moe else 1,
        "model.sequence_parallel": s.sequence_parallel,
        "model.seq_length": t.seq_len, "dataset.sequence_length": t.seq_len,
        "train.micro_batch_size": s.micro_batch_size, "train.global_batch_size": t.global_batch_size,
        "data_parallel_size": plan.num_gpus // (s.tp * s.pp * s.cp),
        "model.num_layers": m.num_layers,
        "model.recompute_granularity": {"none": None, "selective": "selective", "full": "full"}[s.recompute],
        "model.bf16": t.precision in ("bf16", "fp8"), "model.fp16": t.precision == "fp16",
        "ddp.grad_reduce_in_fp32": t.grad_precision == "fp32",
        "ddp.fp8_param_gather": t.fp8_param_gather,
        "ddp.use_distributed_optimizer": s.zero_stage >= 1,
        "ddp.use_megatron_fsdp": s.zero_stage >= 2,
        "ddp.data_parallel_sharding_strategy": {0: "no_shard", 1: "no_shard", 2: "optim_grads",
                                                3: "optim_grads_params"}[s.zero_stage],
        "model.account_for_embedding_in_pipeline_split": bool(s.embedding_as_layer),
        "model.account_for_loss_in_pipeline_split": bool(s.loss_as_layer),
        # activation offloading: the activations (never the weights) of the first N layers
        "model.cpu_offloading": bool(s.offload_activation_layers),
        "model.cpu_offloading_num_layers": s.offload_activation_layers or 0,
        "model.cpu_offloading_activations": True, "model.cpu_offloading_weights": False,
    }
    if moe:
        out["model.expert_tensor_parallel_size"] = s.etp
    if s.recompute == "full":
        # every layer recomputed (uniform, 1 per chunk), or the first n of each stage (block)
        out["model.recompute_method"] = "block" if s.recompute_num_layers else "uniform"
        out["model.recompute_num_layers"] = s.recompute_num_layers or 1
    else:
        out["model.recompute_method"] = None
    if t.precision == "fp8":
        out["model.fp8"] = "hybrid"
    else:
        out["model.fp8"] = None
    first, last = s.num_layers_in_first_stage, s.num_layers_in_last_stage
    if first is not None:
        out["model.num_layers_in_first_pipeline_stage"] = first
    if last is not None:
        out["model.num_layers_in_last_pipeline_stage"] = last
    return out


def test_grid_covers_each_kind_of_plan():
    kinds = {(RECIPES[k][3], p.train.precision, p.strategy.zero_stage >= 2, p.strategy.num_layers_in_first_stage
              is not None, p.strategy.ep > 1) for k, p in grid_plans()}
    assert any(fp8 == "fp8" for _, fp8, *_ in kinds)
    assert any(fsdp for _, _, fsdp, *_ in kinds)
    assert any(uneven for *_, uneven, _ in kinds)
    assert {"deepseek-v2-lite"} <= {model for model, _, _, _, ep in kinds if ep}
    assert any(p.strategy.offload_activation_layers for _, p in grid_plans())


def test_every_override_list_validates_and_means_the_plan(bridge_results):
    plans, results, refused = bridge_results
    assert not refused, [f"{key}: {exc}" for key, _, exc in refused]
    assert len(results) == len(plans) == len(GRID)
    failures = []
    for (key, plan), result in zip(plans, results):
        label = f"{key} {plan.strategy.describe() if hasattr(plan.strategy, 'describe') else plan.strategy}"
        if not result["ok"]:
            failures.append(f"{label}: {result['stage']}: {result['error']}")
            continue
        got = result["config"]
        for field, want in expected(plan).items():
            if got.get(field) != want:
                failures.append(f"{label}: {field} = {got.get(field)!r}, plan says {want!r}")
        if got["comm_overlap"] is not None:  # the recipe's overlap settings would rewrite the plan's
            failures.append(f"{label}: the recipe's comm_overlap is left in place: {got['comm_overlap']}")
    assert not failures, "\n".join(failures)
