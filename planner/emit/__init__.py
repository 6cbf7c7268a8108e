"""Emitters: a plan as ready-to-run flags, configs and launch scripts.

    from planner.emit import emit, emit_data, backends
    print(emit(plan, "megatron"))            # text to paste
    cfg = emit_data(plan, "deepspeed")       # structured form (JSON values)

Backends: megatron, megatron-bridge, deepspeed, megatron-deepspeed, colossalai,
torchtitan, maxtext, torchrun, slurm, and for fine-tuning plans axolotl and llamafactory.
A strategy a backend cannot run as planned raises
`NotExpressibleError` ("not expressible in <framework>: ..."), a SpecError.
See planner/emit/base.py for the Emitter contract and docs/emitters.md.
"""

from __future__ import annotations

from typing import Any

from planner.emit.base import (  # noqa: F401
    REGISTRY,
    EmitOptions,
    Emitter,
    NotExpressibleError,
    Registry,
    accepted_frameworks,
    costed_elsewhere,
    runs_framework,
)
from planner.specs import Plan

# Importing a backend module registers its emitters (order = `backends()` order).
from planner.emit import megatron, megatron_bridge, deepspeed, colossalai, torchtitan  # noqa: E402,F401  isort:skip
from planner.emit import maxtext, launch  # noqa: E402,F401  isort:skip
from planner.emit import axolotl, llamafactory  # noqa: E402,F401  isort:skip
# Each backend's structured form as a plain function of a plan (each raises NotExpressibleError
# when the framework cannot run the plan as planned).
from planner.emit.colossalai import plugin_spec  # noqa: E402,F401  isort:skip
from planner.emit.deepspeed import ds_config  # noqa: E402,F401  isort:skip
from planner.emit.megatron import megatron_args  # noqa: E402,F401  isort:skip
from planner.emit.megatron_bridge import bridge_overrides  # noqa: E402,F401  isort:skip
from planner.emit.torchtitan import to_toml  # noqa: E402,F401  isort:skip
from planner.emit.maxtext import jax_mesh, to_yaml  # noqa: E402,F401  isort:skip


#: Backends whose emitted config overrides some training settings whatever the plan says (a function of the
#: precision and FP8 recipe giving them): a search for such a backend takes them as given (planner.knobs would
#: otherwise choose values the config cannot keep).
IMPOSED_SETTINGS = {"megatron-bridge": megatron_bridge.imposed_settings}


def imposed_settings(backend: str, precision: str, fp8_recipe: str) -> dict[str, Any]:
    """The training settings `backend`'s output imposes for `precision` (and `fp8_recipe`); empty for most
    (Megatron-Bridge's mixed-precision recipe: its gradient precision and FP8 parameter gather)."""
    rule = IMPOSED_SETTINGS.get(backend)
    return rule(precision, fp8_recipe) if rule else {}


def backends() -> list[str]:
    """Names of the registered emitters."""
    return REGISTRY.names()


def get_emitter(name: str) -> Emitter:
    """The emitter called `name`; an unknown name is a SpecError listing close matches."""
    return REGISTRY.get(name)


def register(emitter: Emitter) -> Emitter:
    """Add an emitter; a duplicate name is refused."""
    return REGISTRY.register(emitter)


def emit(plan: Plan, backend: str, options: EmitOptions | None = None) -> str:
    """The text a user pastes for `backend`."""
    return get_emitter(backend).render(plan, options or EmitOptions())


def emit_data(plan: Plan, backend: str, options: EmitOptions | None = None) -> Any:
    """The structured (JSON-serialisable) form of `emit`."""
    return get_emitter(backend).data(plan, options or EmitOptions())


def omissions(plan: Plan, backend: str, options: EmitOptions | None = None) -> list[str]:
    """What of the plan `emit(plan, backend)`'s text cannot carry, one reason per item ([] when it
    carries everything). An emitter that can drop nothing has no `omissions` method."""
    emitter = get_emitter(backend)
    method = getattr(emitter, "omissions", None)
    return list(method(plan, options or EmitOptions())) if method is not None else []


def first_expressible(plans: list[Plan], backend: str,
                      options: EmitOptions | None = None) -> tuple[Plan, list[tuple[Plan, NotExpressibleError]]]:
    """The best-ranked of `plans` that `backend` can run, and the better ones it refused (with why).

    Raises NotExpressibleError, counting the reasons, when it can run none of them.
    """
    emitter = get_emitter(backend)
    options = options or EmitOptions()
    refused: list[tuple[Plan, NotExpressibleError]] = []
    for p in plans:
        try:
            emitter.data(p, options)
        except NotExpressibleError as exc:
            refused.append((p, exc))
            continue
        return p, refused
    raise NotExpressibleError(emitter.framework, f"none of the {len(plans)} plans: " + summarize(refused))


def summarize(refused: list[tuple[Plan, NotExpressibleError]]) -> str:
    """`cp > 1: 180, vpp > 1: 40` style counts of refusal reasons (first clause, numbers dropped)."""
    import re
    from collections import Counter

    counts = Counter(re.sub(r" \(\d+\)", "", exc.reason.split(";")[0]) for _, exc in refused)
    return ", ".join(f"{reason}: {n}" for reason, n in counts.most_common())


__all__ = ["EmitOptions", "Emitter", "NotExpressibleError", "Registry", "backends", "emit", "emit_data",
           "first_expressible", "get_emitter", "omissions", "register", "summarize"]
