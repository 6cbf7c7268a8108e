"""Pure analytic cost models: memory, compute, communication, pipeline schedule.

Every function works on numpy arrays of candidates (`StrategyArrays`), so the
same code scores one strategy or a million. Nothing here imports torch or the
planner package at run time; specs are read by attribute only.
"""

from cost_models.arrays import StrategyArrays
from cost_models.step import CostArrays, evaluate_arrays

__all__ = ["CostArrays", "StrategyArrays", "evaluate_arrays"]
