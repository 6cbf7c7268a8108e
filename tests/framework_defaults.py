"""`plan` and `evaluate` at the framework's default training settings, for tests of the cost model's physics.

Where the input leaves them free, `planner.plan()` and `planner.evaluate()` choose the settings vendors'
recipes turn (planner.knobs: bf16 gradient reduction, FP8 parameter gather, Transformer Engine's
cross-entropy, the router's FP8 padding, the MoE dispatcher). The tests below that derive a term by hand
from the framework's own defaults (fp32 main gradients, bf16 weight copies, Megatron's native loss, the
alltoall dispatcher) call these instead: every setting a test does not give is the framework's default,
as `planner.calibrate.run_settings` fixes it for a published run.
"""

from __future__ import annotations

from typing import Any

import planner
from planner.calibrate import run_settings


def evaluate(*args: Any, **kwargs: Any):
    return planner.evaluate(*args, **run_settings(kwargs))


def plan(*args: Any, **kwargs: Any):
    return planner.plan(*args, **run_settings(kwargs))
