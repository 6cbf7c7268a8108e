"""The validated inputs and outputs of meshplan (pydantic v2, frozen, no extra fields)."""

from planner.specs.hardware import ClusterSpec, GpuSpec, HostSpec, LinkTier
from planner.specs.model import ModelSpec
from planner.specs.results import Estimate, Plan, PlanResult, SearchStats
from planner.specs.strategy import Strategy
from planner.specs.train import TrainSpec

__all__ = [
    "ClusterSpec",
    "HostSpec",
    "Estimate",
    "GpuSpec",
    "LinkTier",
    "ModelSpec",
    "Plan",
    "PlanResult",
    "SearchStats",
    "Strategy",
    "TrainSpec",
]
