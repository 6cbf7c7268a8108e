"""MaxText config and JAX mesh: every key checked against MaxText's own configs/base.yml, read from the released
wheel that scripts/test.sh downloads into build/maxtext (MaxText needs Python >= 3.12 and is not installed here);
the mapping of each degree, the ICI/DCN split, the batch, the refusals and the CLI."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from emit_checks import check_maxtext, maxtext_base_config, maxtext_wheel
from emit_plans import make_plan
from planner.emit import NotExpressibleError, emit, emit_data, get_emitter, jax_mesh
from planner.emit.maxtext import MAXTEXT_VERSION, ici_dcn_split

needs_wheel = pytest.mark.skipif(not maxtext_wheel().exists(), reason=(
    f"the MaxText {MAXTEXT_VERSION} wheel is not at {maxtext_wheel()}: scripts/test.sh downloads it "
    "(pip download --no-deps --python-version 3.12 --only-binary=:all: -d build/maxtext maxtext==VERSION)"))

V5P = ("llama3-8b", "tpu-v5p-128", 128, 256, 8192)
V5P_2 = ("llama3-8b", "tpu-v5p-2x128", 256, 512, 8192)
MIXTRAL = ("mixtral-8x7b", "tpu-v5p-128", 128, 256, 4096)

PLANS = {
    "fsdp": (V5P, dict(zero_stage=3)),
    "data-zero1": (V5P, dict(zero_stage=1, micro_batch_size=2)),
    "tp-sp-selective": (V5P, dict(tp=4, sequence_parallel=True, zero_stage=3, recompute="selective")),
    "cp-fsdp-full": (V5P, dict(cp=2, zero_stage=3, recompute="full")),
    "two-slices-fsdp": (V5P_2, dict(zero_stage=3)),
    "two-slices-tp-data": (V5P_2, dict(tp=4, sequence_parallel=True, zero_stage=0)),
    "pipeline-vpp": (V5P, dict(pp=4, vpp=2, zero_stage=3, micro_batch_size=1)),
    "moe-ep-pp": (MIXTRAL, dict(pp=2, ep=8, zero_stage=3, vpp=8)),
    "gpu-fsdp": (("llama3-8b", "dgx-h100", 16, 64, 4096), dict(zero_stage=3)),
}


def plan_of(name: str):
    question, strategy = PLANS[name]
    return make_plan(*question, strategy=strategy)


@needs_wheel
def test_the_wheel_is_the_version_the_emitter_names():
    base = maxtext_base_config()
    assert maxtext_wheel().name == f"maxtext-{MAXTEXT_VERSION}-py3-none-any.whl"
    assert "ici_fsdp_parallelism" in base and "mesh_axes" in base


@needs_wheel
@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_key_is_maxtexts(name):
    plan = plan_of(name)
    data = emit_data(plan, "maxtext")
    check_maxtext(plan, data, emit(plan, "maxtext"))


def test_zero3_shards_over_fsdp_the_others_over_data():
    fsdp = emit_data(plan_of("fsdp"), "maxtext")["config"]
    assert fsdp["ici_fsdp_parallelism"] == 128 and fsdp["ici_data_parallelism"] == 1
    assert not fsdp["shard_optimizer_over_data"]
    zero1 = emit_data(plan_of("data-zero1"), "maxtext")["config"]
    assert zero1["ici_data_parallelism"] == 128 and zero1["ici_fsdp_parallelism"] == 1
    assert zero1["shard_optimizer_over_data"] is True


def test_model_parallel_degrees_and_the_mesh():
    c = emit_data(plan_of("tp-sp-selective"), "maxtext")
    assert (c["config"]["ici_tensor_parallelism"], c["config"]["ici_fsdp_parallelism"]) == (4, 32)
    assert c["config"]["remat_policy"] == "minimal"
    assert c["mesh"] == {"axis_names": ["fsdp", "tensor"], "shape": [32, 4]}
    assert jax_mesh(plan_of("tp-sp-selective")) == {"fsdp": 32, "tensor": 4}
    cp = emit_data(plan_of("cp-fsdp-full"), "maxtext")["config"]
    assert (cp["ici_context_parallelism"], cp["remat_policy"]) == (2, "full")


def test_the_outermost_dimensions_cross_slices():
    fsdp = emit_data(plan_of("two-slices-fsdp"), "maxtext")["config"]
    assert (fsdp["num_slices"], fsdp["ici_fsdp_parallelism"], fsdp["dcn_fsdp_parallelism"]) == (2, 128, 2)
    tp = emit_data(plan_of("two-slices-tp-data"), "maxtext")["config"]
    assert (tp["ici_tensor_parallelism"], tp["dcn_tensor_parallelism"]) == (4, 1)
    assert (tp["ici_data_parallelism"], tp["dcn_data_parallelism"]) == (32, 2)
    assert ici_dcn_split(4, 64, 128) == (2, 2) and ici_dcn_split(2, 128, 128) == (1, 2)
    assert ici_dcn_split(4, 48, 128) is None  # the slice boundary (128) falls inside a step of 48 ranks


def test_the_batch_is_the_plans():
    for name in PLANS:
        plan = plan_of(name)
        c = emit_data(plan, "maxtext")["config"]
        # MaxText: global batch = per_device_batch_size x chips x gradient_accumulation_steps
        assert c["per_device_batch_size"] * plan.num_gpus * c["gradient_accumulation_steps"] == \
            plan.train.global_batch_size, name


def test_pipeline_and_experts():
    c = emit_data(plan_of("pipeline-vpp"), "maxtext")["config"]
    assert (c["ici_pipeline_parallelism"], c["num_layers_per_pipeline_stage"]) == (4, 4)  # 32 layers / (4 x 2)
    assert c["num_pipeline_microbatches"] % 4 == 0 and c["gradient_accumulation_steps"] == 1
    moe = emit_data(plan_of("moe-ep-pp"), "maxtext")["config"]
    assert (moe["ici_expert_parallelism"], moe["ici_fsdp_parallelism"], moe["ici_pipeline_parallelism"]) == (8, 8, 2)
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["decoder_block"]) == (8, 2, "mixtral")


def test_a_gpu_cluster_uses_its_nvlink_domains_as_slices():
    c = emit_data(plan_of("gpu-fsdp"), "maxtext")["config"]
    assert (c["hardware"], c["num_slices"], c["ici_fsdp_parallelism"], c["dcn_fsdp_parallelism"]) == ("gpu", 2, 8, 2)


@pytest.mark.parametrize("strategy,reason", [
    (dict(zero_stage=2), r"zero_stage 2; MaxText shards the optimizer states alone"),
    (dict(cp=2, zero_stage=1), r"^cp \(2\) > 1 with zero_stage 1; MaxText's logical axis rules shard"),
    (dict(zero_stage=3, recompute="full", recompute_num_layers=2), r"recompute_num_layers \(2\)"),
    (dict(zero_stage=3, overlap_grad_reduce=False), r"overlap_grad_reduce off"),
    (dict(zero_stage=3, recompute="selective", recompute_modules=["mlp"]), r"recompute_modules \['mlp'\]"),
])
def test_what_maxtext_cannot_express_is_refused_in_one_line(strategy, reason):
    plan = make_plan(*V5P, strategy=strategy)
    with pytest.raises(NotExpressibleError) as exc:
        emit(plan, "maxtext")
    assert str(exc.value).startswith("not expressible in MaxText: ") and "\n" not in str(exc.value)
    assert re.search(reason, exc.value.reason), exc.value.reason


def test_experts_must_be_sharded_over_the_tensor_axis():
    plan = make_plan(*MIXTRAL, strategy=dict(tp=2, etp=1, ep=4, zero_stage=3, sequence_parallel=True))
    with pytest.raises(NotExpressibleError, match=r"etp \(1\) must equal tp \(2\)"):
        emit(plan, "maxtext")


def test_the_text_names_the_version_the_mesh_and_the_costs():
    text = emit(plan_of("tp-sp-selective"), "maxtext")
    assert text.splitlines()[0].startswith("# MaxText plan 1: llama3-8b on 128x TPU-v5p")
    assert f"# MaxText {MAXTEXT_VERSION}: python3 -m maxtext.trainers.pre_train.train" in text
    assert "axis_names=('fsdp', 'tensor')" in text
    assert "costed as megatron runs it: the cost model has no MaxText profile" in text
    assert yaml.safe_load(text)["base_config"] == "base.yml"
    assert get_emitter("maxtext").runs == "torchtitan" and get_emitter("maxtext").syntax == "yaml"


def test_the_cli_emits_maxtext_for_a_tpu_preset():
    proc = subprocess.run([sys.executable, "-m", "planner", "emit", "--backend", "maxtext", "--model", "llama3-8b",
                           "--cluster", "tpu-v5p-128", "--gpus", "128", "--global-batch-size", "256", "--seq-len",
                           "8192", "--constraint", "zero_stage=3", "--best-expressible"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    assert config["hardware"] == "tpu" and config["ici_fsdp_parallelism"] * config["ici_tensor_parallelism"] * \
        config["ici_context_parallelism"] * config["ici_pipeline_parallelism"] * config["ici_data_parallelism"] == 128
    help_text = subprocess.run([sys.executable, "-m", "planner", "emit", "--help"], capture_output=True, text=True,
                               timeout=120).stdout
    assert "maxtext" in help_text
