"""Contract: every registered emitter over a sample of the search's own output (issue 3 acceptance).

For each of a few hundred strategies the search returned (ranked plans and, where
nothing fits, the closest ones), across every knob it varies, every backend either
emits something its real library accepts, or refuses with "not expressible in
<framework>: <reason>" where the reason is one that framework documents. The
generic rules (tp divides the KV heads, pp·vpp divides the layers, ...) never
fire here: the search already enforces them.
"""

from __future__ import annotations

import collections
import json
import re

import pytest

from emit_checks import (check_bridge, check_colossalai, check_deepspeed, check_deepspeed_initialize, check_maxtext,
                         check_megatron, check_shell, check_torchtitan, maxtext_wheel)
from emit_plans import search_sample
from finetune_checks import check_axolotl, check_llamafactory
from planner.emit import EmitOptions, Emitter, NotExpressibleError, backends, get_emitter
from planner.emit import imposed_settings

pytest.importorskip("megatron.core")
pytest.importorskip("colossalai.booster.plugin")

#: the only refusals each framework may give for a strategy the search returns
ALLOWED_REFUSALS = {
    "megatron": [],
    "megatron-bridge": [r"grad_precision '\w+' with precision '\w+'; the \w+ mixed-precision recipe",
                        # the FP8 recipes set fp8_param_gather (and its scaling) over any override
                        r"fp8_param_gather (True|False) with fp8_recipe '\w+'; the \w+ mixed-precision recipe",
                        r"fp8_recipe 'tensorwise'; Megatron-Bridge's current-scaling recipe"],
    "deepspeed": [r"zero_stage 0 with bf16 and grad_precision 'fp32'", r"zero_stage [23] with pp", r"vpp \(\d+\) > 1", r"uneven pipeline stages", r"cp \(\d+\) > 1",
                  r"recompute_num_layers \(\d+\) with pp", r"precision 'fp8'",
                  r"(stage_layers \[[\d, ]+\]|embedding_as_layer|loss_as_layer)[\w ]* with pp \(\d+\) > 1",
                  # MoE (issue 8): expert parallelism lives in DeepSpeed-MoE model code
                  r"ep \(\d+\) > 1; DeepSpeed sets expert parallelism in model code", r"etp \(\d+\) > 1",
                  r"(MoE|latent attention|sliding-window attention)[\w ,-]* with tp \(\d+\) or pp",
                  # Megatron's activation offloading (--cpu-offloading-num-layers)
                  r"offload_activation_layers \(\d+\); DeepSpeed's only activation offload",
                  # Megatron's --recompute-modules (the search's module-recompute twins of MoE/MLA models)
                  r"recompute_modules \[[\w', ]+\]; DeepSpeed checkpoints whole layers"],
    "colossalai": [r"zero_stage 2 with pp", r"zero_stage 3 with pp", r"cp \(\d+\) > 1 with sequence_parallel",
                   r"recompute_num_layers \(\d+\) without pipeline", r"selective recompute with the unfused",
                   r"(stage_layers \[[\d, ]+\]|embedding_as_layer|loss_as_layer)[\w ]* with vpp \(\d+\) > 1",
                   r"uneven pipeline stages with vpp \(\d+\) > 1",
                   r"etp \(\d+\) must equal tp", r"zero_stage 3 with an MoE model", r"ep \(\d+\) must divide dp",
                   r"num_mtp_layers \(\d+\)", r"offload_activation_layers \(\d+\); Colossal-AI's plugins",
                   r"recompute_modules \[[\w', ]+\]; Colossal-AI checkpoints whole layers"],
    "torchtitan": [r"precision 'fp16'", r"recompute_num_layers \(\d+\) of \d+ layers per chunk",
                   r"recompute_num_layers \(\d+\) with pipeline chunks of \d+ to \d+ layers",
                   r"offload_optimizer; torchtitan", r"etp \(\d+\) with ep", r"num_mtp_layers \(\d+\)",
                   r"offload_activation_layers \(\d+\); torchtitan has no activation offloading",
                   r"recompute_modules \[[\w', ]+\]; torchtitan's selective checkpointing is per operator"],
    "maxtext": [r"zero_stage 2; MaxText shards", r"(cp|ep) \(\d+\)( and ep \(\d+\))? > 1 with zero_stage [01]",
                r"ep \(\d+\) with cp \(\d+\) > 1", r"etp \(\d+\) must equal tp", r"precision '(fp16|fp8)'",
                r"grad_precision 'fp16'", r"offload_optimizer; MaxText", r"offload_activation_layers \(\d+\); MaxText",
                r"recompute_num_layers \(\d+\); MaxText", r"recompute_modules \[[\w', ]+\]; MaxText",
                r"(stage_layers \[[\d, ]+\]|num_layers_in_first_stage|embedding_as_layer|loss_as_layer)[\w ,]* with pp",
                r"num_microbatches \(\d+\) must be a multiple of pp", r"overlap_moe_comm; MaxText",
                r"moe_dispatcher \w+; MaxText", r"fp8_param_gather; the emitted config",
                r"per_device_batch_size [\d/()·]+ is not exact", r"num_gpus \(\d+\) is not a whole number of slices",
                r"\w+ \(\d+\) at rank stride \d+ does not split", r"ep \(\d+\) does not divide"],
    "torchrun": [],
    "slurm": [],
}
# The settings the planner chooses for framework megatron where the input leaves them free (planner.knobs): Megatron's
# FP8 parameter gather and flex dispatcher, which the other frameworks do not run
ALLOWED_REFUSALS["torchtitan"].append(r"fp8_param_gather; it is Megatron's --fp8-param-gather")
ALLOWED_REFUSALS["colossalai"].append(r"fp8_param_gather; it is Megatron's --fp8-param-gather")
ALLOWED_REFUSALS["deepspeed"].append(r"moe_dispatcher (deepep|hybridep); DeepSpeed-MoE dispatches tokens")
ALLOWED_REFUSALS["colossalai"].append(r"moe_dispatcher (deepep|hybridep); Colossal-AI's MoE plugin dispatches tokens")
ALLOWED_REFUSALS["torchtitan"].append(r"moe_dispatcher (deepep|hybridep); the emitted job dispatches MoE tokens")
# a sample plan searched for Megatron-LM with ZeRO 0, given the FP8 parameter gather Megatron-Bridge's FP8 recipe
# imposes (its own search, `meshplan emit --backend megatron-bridge`, never returns one: the rules refuse it)
ALLOWED_REFUSALS["megatron-bridge"].append(r"fp8_param_gather with zero_stage 0; --fp8-param-gather needs")
for _backend in ("torchtitan", "colossalai", "deepspeed", "maxtext"):  # megatron-core's CUDA graphs
    ALLOWED_REFUSALS[_backend].append(r"cuda_graph_impl 'transformer_engine' \(scope \[[\w', ]*\]\); [\w-]+ is not "
                                      "emitted with megatron-core's CUDA graphs")
for _backend in ("torchtitan", "colossalai", "deepspeed"):  # Megatron's --overlap-moe-expert-parallel-comm
    ALLOWED_REFUSALS[_backend].append(r"overlap_moe_comm; [\w-]+ does not overlap the expert all-to-all")
# Megatron's --use-tp-pp-dp-mapping, which the search turns for framework megatron: the other meshes nest one way
for _backend in ("deepspeed", "colossalai", "torchtitan", "maxtext"):
    ALLOWED_REFUSALS[_backend].append(r"rank_order 'tp-cp-ep-pp-dp': [\w-]+ lays ranks out tp-cp-ep-dp-pp only")
ALLOWED_REFUSALS["megatron-deepspeed"] = ALLOWED_REFUSALS["deepspeed"]
#: the fine-tuning toolkits, given each searched strategy as a LoRA, QLoRA or full fine-tune (`as_finetune`)
FINETUNE_REFUSALS = [r"(tp|pp|cp|ep|etp|vpp) \(\d+\) > 1; [\w-]+ shards the Hugging Face model by data parallelism",
                     r"precision '(fp8|nvfp4)'; the Hugging Face Trainer", r"recompute '\w+' \(modules",
                     r"recompute_num_layers \(\d+\) of \d+ layers; gradient_checkpointing",
                     r"offload_activation_layers \(\d+\); [\w-]+ has no activation offloading",
                     r"fp8_param_gather; it is Megatron's", r"overlap_moe_comm; [\w-]+ runs the experts",
                     r"attention_kernel '(flash1|unfused)'", r"offload_optimizer with framework torchtitan",
                     r"model '[\w.-]+' has no Hugging Face id here", r".* \(its DeepSpeed config\)$",
                     r"cuda_graph_impl 'transformer_engine' \(scope \[[\w', ]*\]\); [\w-]+ is not emitted",
                     r"rank_order 'tp-cp-ep-pp-dp': [\w-]+ lays ranks out tp-cp-ep-dp-pp only"]
ALLOWED_REFUSALS["axolotl"] = FINETUNE_REFUSALS + [r"torch_compile with framework deepspeed; the plan is costed"]
ALLOWED_REFUSALS["llamafactory"] = FINETUNE_REFUSALS + [r"lora_layers \[[\d, ]+\]; LLaMA-Factory has no argument"]
FINETUNE_MODES = ("lora", "qlora", "full")
#: the searched plans' training settings a fine-tuning variant keeps
FINETUNE_KEPT = ("global_batch_size", "seq_len", "precision", "grad_precision", "attention_kernel")
LAUNCH_EVERY = 10  # bash -n one launch script in ten (a subprocess each)
_INITIALIZED: set[tuple] = set()  # deepspeed.initialize inputs already built into an engine and checked
FULL_PARSE_EVERY = 10  # torchtitan's full ConfigManager.parse_args for one in ten; its TOML conversion for all


@pytest.fixture(scope="module")
def sample():
    plans = search_sample(per_key=1)
    assert len(plans) >= 200
    return plans


def test_sample_covers_every_knob(sample):
    seen = collections.Counter()
    for p in sample:
        s = p.strategy
        seen.update(k for k, on in {
            "tp": s.tp > 1, "pp": s.pp > 1, "cp": s.cp > 1, "vpp": s.vpp > 1, "sp": s.sequence_parallel,
            "uneven": s.num_layers_in_first_stage is not None, "recompute_num_layers": s.recompute_num_layers,
            "stage_layers": s.stage_layers is not None, "stage_layers+vpp": s.stage_layers is not None and s.vpp > 1,
            "embedding_as_layer": s.embedding_as_layer, "loss_as_layer": s.loss_as_layer,
            "embedding_as_layer+vpp": s.embedding_as_layer and s.vpp > 1,
            f"zero{s.zero_stage}": True, f"recompute={s.recompute}": True, p.train.precision: True,
            "unfused": p.train.attention_kernel == "unfused", "does-not-fit": not p.estimate.fits,
            "act-offload": s.offload_activation_layers is not None,
            "rank_order": s.rank_order != "tp-cp-ep-dp-pp"}.items() if on)
    expected = {"tp", "pp", "cp", "vpp", "sp", "uneven", "recompute_num_layers", "zero0", "zero1", "zero2", "zero3",
                "stage_layers", "stage_layers+vpp", "embedding_as_layer", "loss_as_layer", "embedding_as_layer+vpp",
                "recompute=none", "recompute=selective", "recompute=full", "bf16", "fp16", "fp8", "unfused",
                "does-not-fit", "act-offload", "rank_order"}
    assert expected <= set(seen), expected - set(seen)


def test_every_backend_is_in_the_contract():
    assert set(backends()) == set(ALLOWED_REFUSALS)


@pytest.mark.parametrize("backend", sorted(ALLOWED_REFUSALS))
def test_backend_accepts_or_refuses_every_searched_strategy(backend, sample, deepspeed_comm, tmp_path):
    emitter = get_emitter(backend)
    assert isinstance(emitter, Emitter)
    if backend == "maxtext" and not maxtext_wheel().exists():
        pytest.skip(f"the MaxText wheel is not at {maxtext_wheel()} (scripts/test.sh downloads it)")
    options = EmitOptions()
    counts = collections.Counter()
    for i, plan in enumerate(sample):
        if backend in ("axolotl", "llamafactory"):
            plan = as_finetune(plan, i)
            if plan is None:
                counts["not a fine-tune (TrainSpec refuses it)"] += 1
                continue
        fixed = imposed_settings(backend, plan.train.precision, plan.train.fp8_recipe)  # as `meshplan emit` searches
        if fixed:
            plan = plan.model_copy(update={"train": plan.train.model_copy(update=fixed)})
        try:
            data = emitter.data(plan, options)
        except NotExpressibleError as exc:
            prefix = f"not expressible in {emitter.framework}: "
            assert str(exc).startswith(prefix), str(exc)
            assert any(re.match(r, exc.reason) for r in ALLOWED_REFUSALS[backend]), (plan.strategy.short(), str(exc))
            with pytest.raises(NotExpressibleError):
                emitter.render(plan, options)
            counts["refused: " + exc.reason.split(";")[0]] += 1
            continue
        text = emitter.render(plan, options)
        assert text.endswith("\n") and json.loads(json.dumps(data)) == data
        _check_with_real_library(backend, plan, data, text, tmp_path, i)
        counts["accepted"] += 1
    print(f"\n{backend}: {dict(counts)}")
    assert counts["accepted"] > 0


def as_finetune(plan, i):
    """The searched strategy as a LoRA, QLoRA or full fine-tune (by turns) costed for DeepSpeed or FSDP2 (by turns),
    with the searched batch, sequence, precisions and attention kernel (the Megatron-only settings a search for
    Megatron-LM chose are left out), checked by TrainSpec (None when it refuses them: a LoRA plan in fp8); its
    estimate is the pre-training one, which the emitters only quote."""
    from planner.errors import SpecError
    from planner.specs import TrainSpec

    mode = FINETUNE_MODES[i % 3]
    update = {"finetune": mode, "framework": ("deepspeed", "torchtitan")[i // 3 % 2], "model_code": "transformers",
              "torch_compile": False}  # the toolkits run Transformers' layers, eager
    try:
        kept = {k: getattr(plan.train, k) for k in FINETUNE_KEPT}
        train = TrainSpec.model_validate({**kept, **update})
    except (SpecError, ValueError):
        return None
    return plan.model_copy(update={"train": train})


def _check_with_real_library(backend, plan, data, text, tmp_path, i):
    if backend == "axolotl":
        check_axolotl(plan, data, tmp_path / f"axolotl-{i}")
    elif backend == "llamafactory":
        check_llamafactory(plan, data, tmp_path / f"llamafactory-{i}")
    elif backend == "megatron":
        check_megatron(plan, data["args"])
    elif backend == "megatron-bridge":
        check_bridge(plan, data["overrides"])
    elif backend in ("deepspeed", "megatron-deepspeed"):
        args = data["megatron_deepspeed_args"] if backend == "deepspeed" else data["args"]
        check_deepspeed(plan, data["config"], args)
        # deepspeed.initialize too (bf16 without offload: DeepSpeed's CPU accelerator has no fp16 engine,
        # and offload's DeepSpeedCPUAdam is built in its own slow test), once per distinct engine: the same
        # config at the same degrees builds the same engine, and what it is checked against (the plan's
        # batch, micro-batches, ZeRO stage and precisions) is in the key
        if backend == "deepspeed" and plan.train.precision == "bf16" and not plan.strategy.offload_optimizer:
            s, t = plan.strategy, plan.train
            key = (json.dumps(data["config"], sort_keys=True), s.dp, s.tp, s.pp, s.micro_batch_size, s.zero_stage,
                   t.global_batch_size, t.precision, t.grad_precision)
            if key not in _INITIALIZED:
                check_deepspeed_initialize(plan, data["config"])
                _INITIALIZED.add(key)
    elif backend == "colossalai":
        check_colossalai(plan, data)
    elif backend == "torchtitan":
        check_torchtitan(plan, text, tmp_path, full_parse=i % FULL_PARSE_EVERY == 0)
    elif backend == "maxtext":
        check_maxtext(plan, data, text)
    elif i % LAUNCH_EVERY == 0:
        check_shell(text, tmp_path)
