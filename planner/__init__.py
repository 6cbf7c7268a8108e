"""meshplan: parallelism strategy planner for training large models.

    from planner import plan, evaluate, Strategy
    result = plan(model="llama3-70b", cluster="dgx-h100", num_gpus=64,
                  global_batch_size=128, seq_len=8192)
    best = result.plans[0]
"""

from planner.api import evaluate, plan
from planner.errors import NoFeasibleStrategyError, SpecError
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

__all__ = [
    "ClusterSpec",
    "Estimate",
    "GpuSpec",
    "LinkTier",
    "ModelSpec",
    "NoFeasibleStrategyError",
    "Plan",
    "PlanResult",
    "SearchStats",
    "SpecError",
    "Strategy",
    "TrainSpec",
    "evaluate",
    "plan",
]
