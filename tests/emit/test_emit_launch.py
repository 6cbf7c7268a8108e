"""torchrun and Slurm launch scripts: bash parses them, node counts and environment are the plan's (issue 3)."""

from __future__ import annotations

import json
import re
import shutil
import tomllib

import pytest

from emit_checks import check_shell
from emit_plans import PUBLISHED, make_plan
from planner.emit import EmitOptions, NotExpressibleError, emit, emit_data
from planner.emit.megatron import megatron_args

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
LLAMA70 = PUBLISHED["llama3-70b-64xH100-tp4pp4cp2vpp5"]


@needs_bash
@pytest.mark.parametrize("backend", ["torchrun", "slurm"])
@pytest.mark.parametrize("target", ["megatron", "deepspeed", "colossalai", "torchtitan"])
def test_scripts_parse_for_every_launch_target(backend, target, tmp_path):
    plan = make_plan("llama3-70b", "dgx-h100", 64, 128, 8192, strategy=dict(tp=8, pp=2, zero_stage=1))
    options = EmitOptions(launch_for=target)
    script = emit(plan, backend, options)
    check_shell(script, tmp_path)
    data = emit_data(plan, backend, options)
    assert (data["num_nodes"], data["nproc_per_node"]) == (8, 8)
    for path, text in data["files"].items():
        assert f"cat > {path} <<'MESHPLAN_EOF'\n{text}MESHPLAN_EOF\n" in script
        if path.endswith(".json"):
            json.loads(text)
        else:
            tomllib.loads(text)


def test_torchrun_multi_node_command_and_environment():
    plan = LLAMA70()
    script = emit(plan, "torchrun")
    assert "torchrun --nnodes 8 --nproc-per-node 8 --node-rank \"$NODE_RANK\"" in script
    assert ': "${MASTER_ADDR:?' in script and "export MASTER_PORT=${MASTER_PORT:-29500}" in script
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in script  # tp and cp > 1 with Megatron's own DDP
    for arg in megatron_args(plan):
        assert arg in script


def test_single_node_uses_standalone_rendezvous():
    plan = make_plan("llama3-8b", "dgx-h100", 4, 16, 4096, strategy=dict(tp=2, zero_stage=1))
    script = emit(plan, "torchrun")
    assert "torchrun --standalone --nnodes 1 --nproc-per-node 4" in script and "NODE_RANK" not in script


def test_slurm_script_requests_the_plans_nodes():
    plan = PUBLISHED["gpt3-175b-1024xA100-tp8pp8"]()
    script = emit(plan, "slurm", EmitOptions(job_name="gpt3-175b", master_port=29600))
    assert re.search(r"^#SBATCH --nodes=128$", script, re.M) and re.search(r"^#SBATCH --gpus-per-node=8$", script, re.M)
    assert "#SBATCH --job-name=gpt3-175b" in script and "export MASTER_PORT=29600" in script
    assert '--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' in script


def test_megatron_fsdp_does_not_force_one_cuda_connection():
    plan = make_plan("llama3-70b", "dgx-h100", 64, 128, 8192, strategy=dict(tp=8, zero_stage=3))
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in emit(plan, "torchrun")


def test_partial_nodes_are_refused():
    plan = make_plan("llama3-8b", "dgx-h100", 12, 48, 4096, strategy=dict(tp=4, zero_stage=1))
    with pytest.raises(NotExpressibleError, match=r"^not expressible in Slurm: num_gpus \(12\) must fill whole nodes"):
        emit(plan, "slurm")


@needs_bash
def test_user_script_is_quoted(tmp_path):
    plan = make_plan("llama3-8b", "dgx-h100", 8, 32, 4096, strategy=dict(tp=2, zero_stage=1))
    script = emit(plan, "torchrun", EmitOptions(script="train.py --tag $(whoami); echo"))
    check_shell(script, tmp_path)
    assert "train.py --tag '$(whoami);' echo \"${MEGATRON_ARGS[@]}\"" in script  # arguments, never commands
