"""NVFP4 plans emitted: Megatron-LM's --fp4-format e2m1 --fp4-recipe nvfp4 (and the bf16 first/last layers),
built into megatron-core 0.16's TransformerConfig; the emitters that cannot express it refuse."""

from __future__ import annotations

import pytest

from emit_checks import check_megatron, megatron_configs
from emit_plans import make_plan
from planner.emit import NotExpressibleError, emit, emit_data
from planner.emit.megatron import megatron_args

pytest.importorskip("megatron.core")

LLAMA_GB300 = ("llama3-70b", "gb300-nvl72", 64, 128, 8192)
STRATEGY = dict(tp=2, pp=4, vpp=5, sequence_parallel=True, zero_stage=1, micro_batch_size=1)


def test_an_nvfp4_llama3_plan_on_gb300_emits_megatrons_fp4_flags():
    plan = make_plan(*LLAMA_GB300, strategy=STRATEGY, precision="nvfp4")
    argv = megatron_args(plan)
    assert argv[argv.index("--fp4-format") + 1] == "e2m1" and argv[argv.index("--fp4-recipe") + 1] == "nvfp4"
    assert "--bf16" in argv and "--fp8-format" not in argv and "--first-last-layers-bf16" not in argv
    check_megatron(plan, argv)
    config = megatron_configs(argv)["transformer"]
    assert (config.fp4, config.fp4_recipe, config.fp8) == ("e2m1", "nvfp4", None)


def test_the_bf16_layers_reach_megatron_core():
    plan = make_plan(*LLAMA_GB300, strategy=STRATEGY, precision="nvfp4", fp4_bf16_layers_start=1,
                     fp4_bf16_layers_end=2)
    argv = megatron_args(plan)
    check_megatron(plan, argv)
    config = megatron_configs(argv)["transformer"]
    assert (config.first_last_layers_bf16, config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16) \
        == (True, 1, 2)


@pytest.mark.parametrize("framework", ["megatron-bridge", "deepspeed", "torchtitan", "colossalai", "maxtext"])
def test_emitters_without_nvfp4_refuse(framework):
    plan = make_plan("llama3.1-8b", "gb300-nvl72", 8, 64, 8192, strategy=dict(zero_stage=1, micro_batch_size=1),
                     precision="nvfp4")
    with pytest.raises(NotExpressibleError, match="nvfp4"):
        emit_data(plan, framework)


def test_the_megatron_emitter_writes_a_launchable_script():
    plan = make_plan("llama3.1-8b", "gb300-nvl72", 8, 64, 8192, strategy=dict(zero_stage=1, micro_batch_size=1),
                     precision="nvfp4")
    script = emit(plan, "megatron")
    assert "--fp4-format e2m1" in script and "--fp4-recipe nvfp4" in script
