"""The tuner's search space: the strategies `plan()` finds under the user's constraints, as Optuna parameters.

The analytic search (`planner.plan`, same constraints) ranks every valid strategy that fits; the
tuner keeps the `POOL_SIZE` fastest as its pool. Each `Strategy` field whose value differs
somewhere in the pool (`TUNED_FIELDS`) becomes one categorical Optuna parameter whose choices
are the values the pool holds; a field the pool never varies stays fixed. dp is never a
parameter: it is what the GPUs leave (dp='auto').

A sampled combination that is a pool strategy runs as that strategy (with its non-tuned fields,
e.g. an uneven pipeline split); any other combination is scored by the cost model
(`evaluate_one`) and runs only if it is valid and fits. The choices are fixed when the study is
created and stored on it (`Space.to_attr`), because Optuna refuses a categorical parameter
whose choices change between trials: every worker and every resumed run reads them back.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from planner.errors import SpecError, format_validation_error
from planner.specs import Plan, Strategy

POOL_SIZE = 256
"""Fastest fitting strategies kept from the analytic search. Their field values are the Optuna
choices; the seeds and the re-ranked candidates come from them. 256 covers every fitting
strategy of a one-node job with a small model and the fastest region of a large one."""
TUNED_FIELDS = ("tp", "pp", "cp", "ep", "etp", "vpp", "sequence_parallel", "zero_stage", "micro_batch_size",
                "recompute", "offload_optimizer")
"""The Strategy fields the sampler may change (dp follows from them)."""


def strategy_key(st: Strategy) -> str:
    """A strategy's identity across trials and workers: its resolved fields as canonical JSON."""
    return json.dumps(st.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def params_of(st: Strategy, names: tuple[str, ...]) -> dict[str, Any]:
    """The Optuna parameters of `st`: its values of the tuned fields `names`."""
    return {n: getattr(st, n) for n in names}


class Space(BaseModel):
    """The tuned fields, their choices, and the fixed values of the fields the pool never varies."""

    model_config = ConfigDict(frozen=True)

    choices: dict[str, list[Any]]
    fixed: dict[str, Any]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.choices)

    def to_attr(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_attr(cls, text: str) -> Space:
        return cls.model_validate_json(text)

    def holds(self, st: Strategy) -> bool:
        """Whether every tuned field of `st` is among the choices and every fixed field as fixed
        (a re-ranked strategy outside the stored choices cannot be enqueued)."""
        return (all(getattr(st, n) in values for n, values in self.choices.items())
                and all(getattr(st, n) == v for n, v in self.fixed.items()))


def build_space(pool: list[Strategy]) -> Space:
    """The choices of each tuned field over `pool` (sorted, so that every worker builds the same)."""
    if not pool:
        raise SpecError("tune: no strategy fits under the constraints: nothing to tune (see `meshplan plan`)")
    choices, fixed = {}, {}
    for name in TUNED_FIELDS:
        values = sorted({getattr(st, name) for st in pool}, key=lambda v: (str(type(v)), v))
        if len(values) > 1:
            choices[name] = values
        else:
            fixed[name] = values[0]
    return Space(choices=choices, fixed=fixed)


def strategy_for(params: dict[str, Any], space: Space, pool: list[Strategy],
                 num_gpus: int) -> tuple[Strategy | None, str]:
    """The strategy a sampled parameter set stands for: the fastest pool strategy with these
    values of the tuned fields, else those values on the fixed ones with every other field
    at its default (the caller scores it); (None, why) when they make no strategy (e.g. tp·pp
    does not divide the GPUs)."""
    want = space.fixed | params
    for st in pool:  # fastest first
        if all(getattr(st, n) == v for n, v in want.items()):
            return st, ""
    try:
        return Strategy(dp="auto", **want).resolve(num_gpus), ""
    except (SpecError, ValidationError) as exc:
        why = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        return None, why


LAYOUT_FIELDS = ("tp", "pp", "cp", "ep", "etp", "vpp", "zero_stage")
"""What makes two strategies different layouts (not just another micro-batch or recomputation)."""
NEAR_TIE_DEPTH = 64
"""Ranked plans searched for near-ties of the top plan."""


def layout_of(st: Strategy) -> tuple:
    return tuple(getattr(st, n) for n in LAYOUT_FIELDS)


def seeds_of(plans: list[Plan], worth: list[int], top_k: int, near_ties: int) -> list[Strategy]:
    """The analytic top-K, then at most `near_ties` near-ties inside the top plan's error band
    (`worth_a_real_run`) in rank order, each of a layout the seeds do not have yet: the error band
    of a planner's estimate is often wide enough to hold dozens of plans, and the real question is
    between layouts (the sampler and the re-ranking explore the rest)."""
    out = [p.strategy for p in plans[:top_k]]
    layouts = {layout_of(st) for st in out}
    added = 0
    for rank in worth:
        if added >= near_ties:
            break
        st = plans[rank - 1].strategy if 0 < rank <= len(plans) else None
        if st is not None and st not in out and layout_of(st) not in layouts:
            out.append(st)
            layouts.add(layout_of(st))
            added += 1
    return out
