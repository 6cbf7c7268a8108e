"""Snapshots of every emitter's output for published plans (issue 3).

- GPT-3 175B on 1024 A100-80GB, TP 8 / PP 8 (Narayanan et al., SC'21)
- Llama-3-70B on 64 H100, TP 4 / PP 4 / CP 2 / VPP 5 (NVIDIA NeMo performance recipe)
- Llama-3-70B on 64 GB200, Megatron-FSDP with the activations of 20 layers offloaded to the host
  (Megatron-Bridge's GB200 BF16 performance preset): Megatron's and Megatron-Bridge's flags, the
  other frameworks' refusals
- Architectures of issue 8 (tests/emit/emit_plans.py ARCHITECTURES): a DeepSeek-V3-like MoE with
  latent attention and multi-token prediction on pp 8 / ep 8, a Mixtral-like MoE with etp 2 under
  tp 4, a Gemma-2-like windowed model with the optimizer offloaded to the CPU, and a Qwen3-like dense
  model with per-head query/key norms on tp 2
- Fine-tuning (tests/emit/emit_plans.py FINETUNE): Llama-3-8B QLoRA under DeepSpeed ZeRO-2 and Llama-3.1-70B LoRA
  under FSDP2: the Axolotl and LLaMA-Factory scripts, DeepSpeed's JSON, the other backends' refusals

The predicted step time, MFU and memory in each header come from the cost model and are
masked, so calibration changes do not churn the snapshots. Regenerate after an intended
change with MESHPLAN_UPDATE_SNAPSHOTS=1 and review the diff.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from emit_plans import ARCHITECTURES, FINETUNE, PUBLISHED

from cost_models.params import num_params
from planner.emit import NotExpressibleError, backends, emit, emit_data

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("MESHPLAN_UPDATE_SNAPSHOTS") == "1"
PLANS = PUBLISHED | ARCHITECTURES | FINETUNE
SUFFIX = {"shell": "sh", "json": "json", "toml": "toml", "python": "py.txt", "yaml": "yml"}  # snippets, not modules
ESTIMATE = re.compile(r"(predicted(?: \(as \w+ runs it, not \w+\))?) [^\n]*? GiB peak per GPU")


def _render(plan, backend: str) -> tuple[str, str]:
    from planner.emit import get_emitter

    emitter = get_emitter(backend)
    try:
        text = emit(plan, backend)
    except NotExpressibleError as exc:
        return "refused.txt", f"{exc}\n"
    return SUFFIX[emitter.syntax], ESTIMATE.sub(r"\1 <estimate>", text)


def _compare(path: Path, text: str) -> None:
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing snapshot {path}; run with MESHPLAN_UPDATE_SNAPSHOTS=1"
    assert text == path.read_text(), f"{path} changed; if intended, regenerate with MESHPLAN_UPDATE_SNAPSHOTS=1"


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("name", sorted(PLANS))
def test_snapshot(name, backend):
    suffix, text = _render(PLANS[name](), backend)
    _compare(SNAPSHOTS / name / f"{backend}.{suffix}", text)
    stale = [p for p in (SNAPSHOTS / name).glob(f"{backend}.*")
             if p.name not in (f"{backend}.{suffix}", f"{backend}.data.json")]
    assert not stale, f"stale snapshots {stale}: the backend now {'refuses' if suffix == 'refused.txt' else 'emits'}"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_colossalai_json_snapshot(name):
    plan = PLANS[name]()
    try:
        text = json.dumps(emit_data(plan, "colossalai"), indent=2) + "\n"
    except NotExpressibleError as exc:
        text = f"{exc}\n"
    _compare(SNAPSHOTS / name / "colossalai.data.json", text)


def test_published_plans_are_the_published_strategies():
    gpt3 = PUBLISHED["gpt3-175b-1024xA100-tp8pp8"]()
    assert (gpt3.strategy.dp, gpt3.strategy.tp, gpt3.strategy.pp, gpt3.num_gpus) == (16, 8, 8, 1024)
    assert gpt3.train.global_batch_size == 1536 and num_params(gpt3.model) / 1e9 == pytest.approx(174.6, abs=0.5)
    llama = PUBLISHED["llama3-70b-64xH100-tp4pp4cp2vpp5"]()
    s = llama.strategy
    assert (s.dp, s.tp, s.pp, s.cp, s.vpp, llama.num_gpus) == (2, 4, 4, 2, 5, 64)
