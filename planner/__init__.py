"""meshplan: parallelism strategy planner for training large models.

    from planner import plan, evaluate, Strategy
    result = plan(model="llama3-70b", cluster="dgx-h100", num_gpus=64,
                  global_batch_size=128, seq_len=8192)
    best = result.plans[0]

    from planner import tune            # the auto-tuner (executors.tune): real trials in an Optuna study
    report = tune("llama3-8b", "dgx-h100", num_gpus=8, global_batch_size=64, seq_len=8192)

    import planner                      # graph auto-parallel for any PyTorch module (planner.autoshard)
    result = planner.autoshard(module, example_inputs, "dgx-h100", num_gpus=8)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below resolve to
    from planner.api import evaluate, plan
    from planner.capacity import plan_capacity
    from planner.specs.capacity import CapacityResult, CapacityRow, Goodput
    from planner.autoshard import AutoshardResult, autoshard
    from executors.tune import tune
    from planner.errors import SpecError
    from planner.specs import (
        ClusterSpec,
        Estimate,
        GpuSpec,
        LinkTier,
        ModelSpec,
        Plan,
        PlanResult,
        SearchStats,
        Strategy,
        TrainSpec,
    )

# The public names are resolved on first use (PEP 562), so that importing the bottom layer
# (`planner.errors`, `planner.specs`) from `profiles` or `cost_models` does not run the planner
# core, which imports those layers in turn. `tune` is the executors' (it runs real trials and needs
# optuna): `import planner` loads neither until it is used.
_HOME = {"plan": "planner.api", "evaluate": "planner.api", "SpecError": "planner.errors", "tune": "executors.tune",
         "plan_capacity": "planner.capacity",
         **{name: "planner.specs.capacity" for name in ("CapacityResult", "CapacityRow", "Goodput")},
         "autoshard": None, "AutoshardResult": "planner.autoshard",
         **{name: "planner.specs" for name in ("ClusterSpec", "Estimate", "GpuSpec", "LinkTier", "ModelSpec", "Plan",
                                                 "PlanResult", "SearchStats", "Strategy", "TrainSpec")}}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    if _HOME[name] is None:  # a callable subpackage (planner.autoshard)
        value = importlib.import_module(f"planner.{name}")
    else:
        value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__all__ = [
    "AutoshardResult",
    "CapacityResult",
    "CapacityRow",
    "ClusterSpec",
    "Estimate",
    "Goodput",
    "GpuSpec",
    "LinkTier",
    "ModelSpec",
    "Plan",
    "PlanResult",
    "SearchStats",
    "SpecError",
    "Strategy",
    "TrainSpec",
    "autoshard",
    "evaluate",
    "plan",
    "plan_capacity",
    "tune",
]
