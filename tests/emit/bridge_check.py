"""Run Megatron-Bridge override lists through Megatron-Bridge's own recipe, override and
`runtime_config_update` (mixed precision, communication overlap, then
`ConfigContainer.validate()`) path, and print what the validated config holds.

This script runs under the Python that has `megatron-bridge` (scripts/test.sh builds one; see
requirements/megatron-bridge.txt); it does not import the planner. Input on stdin, a JSON object:

    {"hf_home": DIR, "cases": [{"recipe": "llama.llama3.llama31_8b_pretrain_config",
                                "world_size": 8, "overrides": ["model.tensor_model_parallel_size=2", ...]}]}

Output on stdout, one JSON list: per case `{"ok": true, "config": {...}}` or
`{"ok": false, "stage": "recipe|override|validate", "error": "..."}`.

Two things stand between the installed package and a CPU-only machine, and both are handled
without standing in for anything the checked path runs:

- `megatron.bridge` imports its LoRA layers at package import, and those two modules
  (`peft/lora_layers.py`, `peft/lora.py`) import `transformer_engine.pytorch` unguarded. While the
  package is imported, exactly those two modules receive an inert module whose every class raises
  when instantiated and whose every other attribute raises when read; every other import of
  `transformer_engine` (the guarded `HAVE_TE` probes in megatron-core and Megatron-Bridge) still
  fails as it really does here. After the import the script checks that no other module holds the
  inert module, and any use of it on the checked path raises, failing the case.
- every recipe reads its model's Hugging Face `config.json` (`AutoBridge.from_hf_pretrained(...,
  load_weights=False)`); the caller points `HF_HOME` at an offline cache built from the
  published config.json files in tests/fixtures/hf.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import importlib
import json
import os
import sys
import types

#: the only modules that import Transformer Engine unguarded at package import
_UNGUARDED_TE_IMPORTERS = frozenset({"megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora"})


class _Unavailable:
    """Stands for a Transformer Engine class in a class statement or an annotation; never usable."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"Transformer Engine is not installed: {type(self).__name__} cannot be built")


def _inert_te() -> types.ModuleType:
    def missing(name):
        raise AttributeError(f"Transformer Engine is not installed: transformer_engine.{name}")

    def classes(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Unavailable,), {})

    top = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    ops = types.ModuleType("transformer_engine.pytorch.ops")
    pytorch.Linear = type("Linear", (_Unavailable,), {})
    pytorch.LayerNormLinear = type("LayerNormLinear", (_Unavailable,), {})
    ops.__getattr__ = classes  # only annotations read te.ops.<Class> at import time
    pytorch.ops = ops
    pytorch.__getattr__ = missing
    top.pytorch = pytorch
    top.__getattr__ = missing
    return top


def import_bridge() -> None:
    # megatron-core first, so that its own Transformer Engine probes run before anything is served
    importlib.import_module("megatron.core")
    inert = _inert_te()
    real_import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__", "")
        if level == 0 and name.split(".")[0] == "transformer_engine" and importer in _UNGUARDED_TE_IMPORTERS:
            return inert if not fromlist else inert.pytorch if name == "transformer_engine.pytorch" else inert
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = guarded_import
    try:
        importlib.import_module("megatron.bridge")
        importlib.import_module("megatron.bridge.training.config")
        importlib.import_module("megatron.bridge.training.utils.omegaconf_utils")
    finally:
        builtins.__import__ = real_import
    held = {id(inert), id(inert.pytorch), id(inert.pytorch.ops)}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name in _UNGUARDED_TE_IMPORTERS:
            continue
        for attr, value in list(vars(mod).items()):
            if id(value) in held:
                raise SystemExit(f"{mod_name}.{attr} holds the inert transformer_engine module")
    assert "transformer_engine" not in sys.modules


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


#: what the caller compares against the plan: section -> fields
READ_BACK = {
    "model": ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
              "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
              "account_for_loss_in_pipeline_split", "context_parallel_size", "expert_model_parallel_size",
              "expert_tensor_parallel_size", "sequence_parallel", "recompute_granularity", "recompute_method",
              "recompute_num_layers", "recompute_modules", "cpu_offloading", "cpu_offloading_num_layers",
              "cpu_offloading_activations", "cpu_offloading_weights", "seq_length", "num_layers", "hidden_size",
              "num_moe_experts", "moe_router_topk", "multi_latent_attention", "bf16", "fp16", "fp8",
              "params_dtype", "pipeline_dtype", "tp_comm_overlap", "overlap_moe_expert_parallel_comm",
              "moe_shared_expert_overlap", "moe_token_dispatcher_type", "moe_grouped_gemm"),
    "ddp": ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "grad_reduce_in_fp32",
            "use_megatron_fsdp", "data_parallel_sharding_strategy", "fp8_param_gather"),
    "optimizer": ("optimizer", "use_distributed_optimizer", "optimizer_cpu_offload", "optimizer_offload_fraction",
                  "use_precision_aware_optimizer", "bf16", "fp16"),
    "train": ("micro_batch_size", "global_batch_size"),
    "dataset": ("seq_length", "sequence_length"),
    "checkpoint": ("ckpt_format",),
    "dist": ("use_megatron_fsdp",),
}


def read_back(cfg) -> dict:
    out = {}
    for section, names in READ_BACK.items():
        obj = getattr(cfg, section, None)
        for name in names:
            if obj is not None and hasattr(obj, name):
                out[f"{section}.{name}"] = _plain(getattr(obj, name))
    out["data_parallel_size"] = cfg.data_parallel_size
    out["comm_overlap"] = None if cfg.comm_overlap is None else {
        f.name: _plain(getattr(cfg.comm_overlap, f.name)) for f in dataclasses.fields(cfg.comm_overlap)
        if isinstance(getattr(cfg.comm_overlap, f.name), (bool, int, type(None)))}
    mp = cfg.mixed_precision
    out["mixed_precision"] = None if mp is None or isinstance(mp, str) else {
        name: _plain(getattr(mp, name)) for name in ("bf16", "fp16", "fp8", "fp8_recipe", "grad_reduce_in_fp32")}
    return out


#: fused kernels that megatron-core's own config validation refuses without Transformer Engine or
#: Apex (absent on a CPU-only machine); none of them changes the parallel layout, batch or precision.
#: Applied before the emitted overrides, so an emitted value of one of these fields wins.
CPU_OVERRIDES = ("model.apply_rope_fusion=false", "model.moe_permute_fusion=false")


def run_case(case: dict) -> dict:
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    module_name, func_name = case["recipe"].rsplit(".", 1)
    os.environ["WORLD_SIZE"] = str(case["world_size"])
    try:
        cfg = getattr(importlib.import_module(f"megatron.bridge.recipes.{module_name}"), func_name)()
    except Exception as exc:  # noqa: BLE001 - reported to the caller, which fails the test
        return {"ok": False, "stage": "recipe", "error": f"{type(exc).__name__}: {exc}"}
    try:
        cfg = process_config_with_overrides(cfg, cli_overrides=[*CPU_OVERRIDES, *case["overrides"]])
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "stage": "override", "error": f"{type(exc).__name__}: {exc}"}
    try:
        runtime_config_update(cfg)  # what pretrain() runs: mixed precision, comm overlap, then validate()
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "stage": "validate", "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "config": read_back(cfg)}


def main() -> None:
    request = json.load(sys.stdin)
    os.environ["HF_HOME"] = request["hf_home"]
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import_bridge()
    results = [run_case(case) for case in request["cases"]]
    sys.stdout.write("\n" + json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
