"""Graph auto-parallel: trace a PyTorch module's operator graph, choose each operator's sharding on a device mesh
by integer programming, split it into pipeline stages, and write the result as DTensor placements.

    import planner
    result = planner.autoshard(module, example_inputs, "dgx-h100", num_gpus=8)   # an AutoshardResult

`planner.autoshard` is both this package and the function (`planner.autoshard.api.autoshard`): calling the
package calls the function. torch is imported only by `planner.autoshard.trace` and only when a module is
traced, so the planner core stays torch-free.
"""

from __future__ import annotations

import sys
import types

from planner.autoshard.api import autoshard
from planner.autoshard.result import AutoshardResult

__all__ = ["AutoshardResult", "autoshard"]


class _CallablePackage(types.ModuleType):
    """This package, callable as `autoshard` (DESIGN.md names the entry point `planner.autoshard(...)`)."""

    def __call__(self, *args, **kwargs) -> AutoshardResult:
        return autoshard(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
