"""The emitter interface and registry: contract, duplicates, unknown names, the per-backend functions (issue 3)."""

from __future__ import annotations

import json

import pytest
from emit_plans import PUBLISHED, make_plan

from planner.emit import (
    EmitOptions,
    Emitter,
    NotExpressibleError,
    Registry,
    backends,
    bridge_overrides,
    ds_config,
    emit,
    emit_data,
    first_expressible,
    get_emitter,
    megatron_args,
    plugin_spec,
    to_toml,
)
from planner.emit.base import shell_array
from planner.errors import SpecError

EXPECTED = ["megatron", "megatron-bridge", "deepspeed", "megatron-deepspeed", "colossalai", "torchtitan", "maxtext",
            "torchrun", "slurm", "axolotl", "llamafactory"]


def test_registered_backends():
    assert backends() == EXPECTED
    for name in EXPECTED:
        emitter = get_emitter(name)
        assert isinstance(emitter, Emitter) and emitter.name == name
        assert emitter.syntax in ("shell", "json", "toml", "python", "yaml")


def test_unknown_backend_lists_close_matches():
    with pytest.raises(SpecError, match=r"unknown emit backend 'megatorn'; close matches: megatron"):
        get_emitter("megatorn")


def test_registry_refuses_duplicates_and_non_emitters():
    reg = Registry()
    reg.register(get_emitter("megatron"))
    with pytest.raises(ValueError, match="already registered"):
        reg.register(get_emitter("megatron"))
    with pytest.raises(TypeError, match="does not implement the Emitter protocol"):
        reg.register(object())


def test_not_expressible_is_a_spec_error_naming_the_framework():
    exc = NotExpressibleError("DeepSpeed", "vpp (2) > 1")
    assert isinstance(exc, SpecError) and str(exc) == "not expressible in DeepSpeed: vpp (2) > 1"


@pytest.mark.parametrize("backend", EXPECTED)
def test_output_is_deterministic_serialisable_and_leaves_the_plan_alone(backend):
    if backend in ("axolotl", "llamafactory"):  # the fine-tuning toolkits: a QLoRA fine-tune, data parallel
        plan = make_plan("llama3-70b", "dgx-h100", 64, 128, 8192, strategy=dict(zero_stage=3, recompute="full"),
                         finetune="qlora")
    else:
        plan = make_plan("llama3-70b", "dgx-h100", 64, 128, 8192, strategy=dict(tp=8, pp=2, zero_stage=1))
    before = plan.model_dump()
    first, second = emit(plan, backend), emit(plan, backend)
    assert first == second and first.endswith("\n")
    data = emit_data(plan, backend)
    assert json.loads(json.dumps(data)) == data
    assert plan.model_dump() == before


def test_backend_functions_match_the_emitters():
    plan = PUBLISHED["gpt3-175b-1024xA100-tp8pp8"]()
    assert megatron_args(plan) == emit_data(plan, "megatron")["args"]
    with pytest.raises(NotExpressibleError, match="Megatron-Bridge: grad_precision 'fp32' with precision 'fp16'"):
        bridge_overrides(plan)
    assert ds_config(plan) == emit_data(plan, "deepspeed")["config"]
    assert plugin_spec(plan) == emit_data(plan, "colossalai")
    with pytest.raises(NotExpressibleError, match="torchtitan: precision 'fp16'"):
        to_toml(plan)
    llama = PUBLISHED["llama3-70b-64xH100-tp4pp4cp2vpp5"]()
    assert to_toml(llama) == emit(llama, "torchtitan")
    assert bridge_overrides(llama) == emit_data(llama, "megatron-bridge")["overrides"]


def test_backend_functions_survive_a_json_round_trip():
    plan = PUBLISHED["llama3-70b-64xH100-tp4pp4cp2vpp5"]()
    again = type(plan).model_validate(json.loads(plan.model_dump_json()))
    assert megatron_args(again) == megatron_args(plan)


def test_emit_options_are_validated():
    with pytest.raises(ValueError):
        EmitOptions(job_name="bad name; rm -rf /")
    with pytest.raises(ValueError):
        EmitOptions(launch_for="jax")


def test_shell_array_quotes_and_groups_values():
    assert shell_array("A", ["--x", "1", "--flag", "--name", "a b", "--neg", "-1"]) == (
        "A=(\n  --x 1\n  --flag\n  --name 'a b'\n  --neg -1\n)\n")


def test_first_expressible_skips_refused_plans_and_says_why():
    refused_plan = make_plan("llama3-8b", "dgx-h100", 16, 64, 4096, strategy=dict(cp=2), rank=1)
    ok_plan = make_plan("llama3-8b", "dgx-h100", 16, 64, 4096, strategy=dict(tp=2, zero_stage=1), rank=2)
    best, refused = first_expressible([refused_plan, ok_plan], "deepspeed")
    assert best is ok_plan and [p for p, _ in refused] == [refused_plan]
    with pytest.raises(NotExpressibleError, match=r"DeepSpeed: none of the 1 plans: cp > 1: 1$"):
        first_expressible([refused_plan], "deepspeed")
