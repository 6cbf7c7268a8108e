"""Launching a plan: the `torchrun` command every node runs, and a Slurm `sbatch` script.

Both start `options.launch_for` (Megatron-LM by default) with that backend's
emitted flags or config, written inline so the script is self-contained:
Megatron-LM and Megatron-DeepSpeed get a bash array of flags, DeepSpeed its JSON,
torchtitan its TOML and Colossal-AI its plugin JSON, each through a quoted
here-document whose terminator the file does not contain (planner.emit.quoting:
every name in the scripts is quoted or escaped there, never written as code).

Environment a multi-node run needs: MASTER_ADDR/MASTER_PORT (the rendezvous on
the first node), the node's rank (torchrun's static rendezvous; Slurm uses the
c10d rendezvous, which assigns ranks itself), and what the backend needs on
every rank (Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP).
Interconnect settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA) depend on the site and
are left as comments. The Slurm script writes its config files once, in the
submission directory, which every node must see (a shared filesystem); the
torchrun script writes them on each node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from planner.emit import colossalai, deepspeed, megatron, torchtitan
from planner.emit.base import REGISTRY, EmitOptions, NotExpressibleError, PlanFacts, describe, facts, shell_array
from planner.emit.quoting import SHELL_IDENTIFIER, check_name, comment, heredoc, shell_command, shell_word
from planner.specs import Plan

#: launch target -> default entry point (argv after torchrun's own flags)
DEFAULT_SCRIPT = {"megatron": "pretrain_gpt.py", "deepspeed": "pretrain_gpt.py", "colossalai": "train.py",
                  "torchtitan": "-m torchtitan.train"}
SITE_COMMENTS = ("# export NCCL_SOCKET_IFNAME=...   # the interface that reaches the other nodes (site-specific)\n"
                 "# export NCCL_IB_HCA=...          # InfiniBand adapters to use (site-specific)\n")


@dataclass(frozen=True)
class Workload:
    """What torchrun starts: files to write first, environment, and the entry point with its arguments."""

    files: dict[str, str]
    env: dict[str, str]
    arrays: dict[str, list[str]]
    command: str


def workload(plan: Plan, options: EmitOptions) -> Workload:
    target = options.launch_for
    # a user's entry point is re-quoted word by word so it cannot break the script
    script = (" ".join(shell_word(w) for w in shell_command("script", options.script)) if options.script is not None
              else DEFAULT_SCRIPT[target])
    if target == "megatron":
        return Workload({}, megatron.environment(plan), {"MEGATRON_ARGS": megatron.megatron_args(plan)},
                        f'{script} "${{MEGATRON_ARGS[@]}}"')
    if target == "deepspeed":
        config = json.dumps(deepspeed.ds_config(plan), indent=2) + "\n"
        args = deepspeed.megatron_deepspeed_args(plan, deepspeed.CONFIG_PATH)
        env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if facts(plan).strategy.tp > 1 else {}
        return Workload({deepspeed.CONFIG_PATH: config}, env, {"MEGATRON_DS_ARGS": args},
                        f'{script} "${{MEGATRON_DS_ARGS[@]}}"')
    if target == "torchtitan":
        return Workload({torchtitan.CONFIG_PATH: torchtitan.to_toml(plan)}, {}, {},
                        f"{script} --job.config_file {shell_word(torchtitan.CONFIG_PATH)}")
    return Workload({colossalai.CONFIG_PATH: colossalai.plugin_json(plan)}, {}, {},
                    script + "  " + comment("# builds its booster plugin from ", colossalai.CONFIG_PATH))


def _layout(plan: Plan, framework: str) -> PlanFacts:
    f = facts(plan)
    per_node = plan.cluster.gpus_per_node
    if plan.num_gpus > per_node and plan.num_gpus % per_node:
        raise NotExpressibleError(framework, f"num_gpus ({plan.num_gpus}) must fill whole nodes of {per_node} GPUs "
                                             "(torchrun starts the same number of processes on every node)")
    return f


def _preamble(w: Workload) -> str:
    out = ""
    for path, text in w.files.items():
        out += heredoc(path, text)
    out += "".join(f"export {check_name('environment variable', k, SHELL_IDENTIFIER)}={shell_word(v)}\n"
                   for k, v in w.env.items())
    out += "".join(shell_array(name, args) for name, args in w.arrays.items())
    return out


def torchrun_script(plan: Plan, options: EmitOptions) -> str:
    f = _layout(plan, "torchrun")
    w = workload(plan, options)
    head = "#!/usr/bin/env bash\n" + comment("# torchrun for ", describe(plan, options.launch_for)) + "\n"
    if f.num_nodes == 1:
        launcher = f"torchrun --standalone --nnodes 1 --nproc-per-node {f.gpus_per_node}"
        rendezvous = ""
    else:
        head += (f"# Run this on each of the {f.num_nodes} nodes with NODE_RANK=0..{f.num_nodes - 1} and MASTER_ADDR "
                 "set to node 0's address.\n")
        rendezvous = (": \"${MASTER_ADDR:?set MASTER_ADDR to node 0's hostname or IP}\"\n"
                      f": \"${{NODE_RANK:?set NODE_RANK to this node's rank, 0..{f.num_nodes - 1}}}\"\n"
                      f"export MASTER_PORT=${{MASTER_PORT:-{int(options.master_port)}}}\n" + SITE_COMMENTS)
        launcher = (f"torchrun --nnodes {f.num_nodes} --nproc-per-node {f.gpus_per_node} --node-rank \"$NODE_RANK\" "
                    "--master-addr \"$MASTER_ADDR\" --master-port \"$MASTER_PORT\"")
    return head + "set -euo pipefail\n" + rendezvous + _preamble(w) + f"{launcher} \\\n  {w.command}\n"


def slurm_script(plan: Plan, options: EmitOptions) -> str:
    f = _layout(plan, "Slurm")
    w = workload(plan, options)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={check_name('job_name', options.job_name)}",
        f"#SBATCH --nodes={f.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={f.gpus_per_node}",
        "#SBATCH --exclusive",
        comment("# ", describe(plan, options.launch_for)),
        "set -euo pipefail",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_ADDR",
        f"export MASTER_PORT={int(options.master_port)}",
    ]
    script = "\n".join(lines) + "\n" + SITE_COMMENTS + _preamble(w)
    launcher = (f"srun --kill-on-bad-exit=1 torchrun --nnodes \"$SLURM_NNODES\" --nproc-per-node {f.gpus_per_node} "
                "--rdzv-id \"$SLURM_JOB_ID\" --rdzv-backend c10d --rdzv-endpoint \"$MASTER_ADDR:$MASTER_PORT\"")
    return script + f"{launcher} \\\n  {w.command}\n"


def _data(plan: Plan, options: EmitOptions, framework: str) -> dict[str, Any]:
    f = _layout(plan, framework)
    w = workload(plan, options)
    return {"num_nodes": f.num_nodes, "nproc_per_node": f.gpus_per_node, "launch_for": options.launch_for,
            "files": w.files, "env": w.env, "arrays": w.arrays, "command": w.command}


def _omissions(plan: Plan, options: EmitOptions) -> list[str]:
    """What the started framework's part of the script cannot carry (the Megatron-LM flags' RoPE base)."""
    workload(plan, options)
    return megatron.flag_omissions(plan) if options.launch_for == "megatron" else []


class TorchrunEmitter:
    name = "torchrun"
    framework = "torchrun"
    runs = None  # the framework the script starts: EmitOptions.launch_for
    syntax = "shell"

    def data(self, plan: Plan, options: EmitOptions) -> dict[str, Any]:
        return _data(plan, options, self.framework)

    def render(self, plan: Plan, options: EmitOptions) -> str:
        return torchrun_script(plan, options)

    def omissions(self, plan: Plan, options: EmitOptions) -> list[str]:
        return _omissions(plan, options)


class SlurmEmitter:
    name = "slurm"
    framework = "Slurm"
    runs = None  # the framework the script starts: EmitOptions.launch_for
    syntax = "shell"

    def data(self, plan: Plan, options: EmitOptions) -> dict[str, Any]:
        return _data(plan, options, self.framework)

    def render(self, plan: Plan, options: EmitOptions) -> str:
        return slurm_script(plan, options)

    def omissions(self, plan: Plan, options: EmitOptions) -> list[str]:
        return _omissions(plan, options)


REGISTRY.register(TorchrunEmitter())
REGISTRY.register(SlurmEmitter())
