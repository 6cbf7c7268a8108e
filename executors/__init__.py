"""Executors: short profiled runs of plans and micro-benchmarks of the hardware.

Importing this package (and `executors.results`, `executors.support`,
`executors.launcher`, `executors.validate`, `executors.compare`,
`executors.parity`, `executors.profiler`) does not import torch; the worker processes
(`executors.worker`, `executors.profile_worker`) do.

    from executors.validate import validate_plans
    report = validate_plans(result.plans, options)
"""

from executors.results import ParityCheck, ParityReference, RankResult, RunConfig, RunResult

__all__ = ["ParityCheck", "ParityReference", "RankResult", "RunConfig", "RunResult"]
