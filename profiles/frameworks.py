"""Framework profiles (`profiles/frameworks/<name>.yaml`) and the ZeRO-3 implementations
(`profiles/frameworks/zero3.yaml`) as typed objects.

A framework profile says what the training framework that runs a plan does with it: when it repeats a
data parallel collective every micro-batch, how selective recompute checkpoints, which plans it cannot
run (`cannot_run`: conditions over a candidate, parsed here, evaluated by `cost_models.frameworks`),
how its loss holds the logits, and so on. Every setting names its source (`<field>_source`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.errors import SpecError

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed", "colossalai")
ZERO3_IMPLS = ("fsdp2", "deepspeed")
#: When a framework repeats a data parallel collective every micro-batch (profiles/frameworks/<name>.yaml).
EACH_MICROBATCH = ("always", "never", "without_pp")
SELECTIVE_POLICIES = ("megatron_modules", "op_sac", "none")
#: How a framework's loss holds the logits (cost_models.memory.cross_entropy_bytes_per_logit).
CROSS_ENTROPY_MEMORY = ("megatron", "pytorch")
#: The comparisons a `cannot_run` clause may make.
OPERATORS = ("==", "!=", ">=", "<=", ">", "<")

#: One clause of a `cannot_run` condition: (negated, name, operator or None, value word or None).
Clause = tuple[bool, str, str | None, str | None]


@dataclass(frozen=True)
class Zero3Impl:
    """What one ZeRO-3 implementation costs beyond the collectives themselves."""

    name: str
    copy_out: bool  # the gathered buffer is copied into the parameters on the compute stream
    cross_node_nic_fraction: float | None  # None: collectives at the comm model's rate


@dataclass(frozen=True)
class CannotRun:
    """One `cannot_run` entry: a condition over a candidate (clauses joined by `and`) and why."""

    when: str
    reason: str
    clauses: tuple[Clause, ...] = ()


@dataclass(frozen=True)
class Framework:
    """What one training framework does with a plan, as profiles/frameworks/<name>.yaml says."""

    name: str
    zero3_impl: str | None  # None: TrainSpec.zero3_impl
    grad_reduce_each_microbatch: dict[int, str]  # zero_stage 0-2 -> EACH_MICROBATCH
    param_gather_each_microbatch: dict[int, str]  # zero_stage 1-2 -> EACH_MICROBATCH
    selective_recompute: str  # SELECTIVE_POLICIES
    cannot_run: tuple[CannotRun, ...]
    fp8_weight_cache: bool  # FP8 copies of the weights kept across micro-batches (cost_models.memory)
    cross_entropy_memory: str = "megatron"  # CROSS_ENTROPY_MEMORY
    zero3_param_is_master: bool = False  # ZeRO-3 keeps one fp32 shard that is both parameter and master weight
    tp_head_saves_gathered_input: bool = False  # the sequence-parallel output layer saves its all-gathered input
    zero3_head_unsharded: bool = False  # ZeRO-3 keeps the output layer gathered across the loss
    cross_entropy_fusion: bool | None = None  # the loss the framework runs when the plan does not say; None: TrainSpec's
    p2p_overlap: bool = False  # its interleaved schedule overlaps steady-state p2p transfers (Strategy.overlap_p2p_comm)

    def _each(self, table: dict[int, str], zero_stage, pp) -> np.ndarray:
        zero_stage, pp = np.asarray(zero_stage), np.asarray(pp)
        out = np.zeros(np.broadcast(zero_stage, pp).shape, dtype=bool)
        for stage, when in table.items():
            on = (when == "always") | ((when == "without_pp") & (pp == 1))
            out = out | ((zero_stage == stage) & on)
        return out

    def reduces_each_microbatch(self, zero_stage, pp) -> np.ndarray:
        """Whether the gradients of a zero_stage 0-2 candidate are reduced after every micro-batch's
        backward (True) or once per step (False)."""
        return self._each(self.grad_reduce_each_microbatch, zero_stage, pp)

    def gathers_each_microbatch(self, zero_stage, pp) -> np.ndarray:
        """Whether a zero_stage 1-2 candidate all-gathers its parameters before every micro-batch's
        forward (True) or once per step after the optimizer (False)."""
        return self._each(self.param_gather_each_microbatch, zero_stage, pp)


def parse_clauses(when: str) -> tuple[Clause, ...]:
    """`a > 1 and not b` -> ((False, "a", ">", "1"), (True, "b", None, None)).

    >>> parse_clauses("tp > 1 and not is_moe")
    ((False, 'tp', '>', '1'), (True, 'is_moe', None, None))
    """
    out = []
    for clause in when.split(" and "):
        words = clause.split()
        negate = words[:1] == ["not"]
        words = words[1:] if negate else words
        if len(words) == 1:
            out.append((negate, words[0], None, None))
        elif len(words) == 3 and words[1] in OPERATORS and not negate:
            out.append((False, words[0], words[1], words[2]))
        else:
            raise SpecError(f"cannot_run condition {when!r}: clause {clause!r} is not `name`, `not name` or "
                            "`name op value`")
    return tuple(out)


def zero3_impls_from(doc: dict, path: str) -> dict[str, Zero3Impl]:
    """The implementations of a zero3.yaml; every number there must name its source (`<field>_source`)."""
    out = {}
    for name in ZERO3_IMPLS:
        entry = doc.get(name)
        if not isinstance(entry, dict):
            raise SpecError(f"{path}: needs a mapping for ZeRO-3 implementation {name!r}")
        for key, value in entry.items():
            if not key.endswith("_source") and not str(entry.get(f"{key}_source", "")).strip():
                raise SpecError(f"{path}: {name}.{key} ({value!r}) names no source ({key}_source)")
        fraction = entry.get("cross_node_nic_fraction")
        out[name] = Zero3Impl(name, bool(entry["copy_out"]), None if fraction is None else float(fraction))
    return out


def framework_from(doc: dict, name: str, path: str) -> Framework:
    """Framework `name` from its profile; like zero3.yaml, every setting names its source (`<field>_source`)."""
    for key, value in doc.items():
        if not key.endswith("_source") and key != "source" and not str(doc.get(f"{key}_source", "")).strip():
            raise SpecError(f"{path}: {key} ({value!r}) names no source ({key}_source)")
    each = {k: {int(z): str(w) for z, w in doc[k].items()} for k in ("grad_reduce_each_microbatch",
                                                                    "param_gather_each_microbatch")}
    for key, table in each.items():
        if bad := {w for w in table.values() if w not in EACH_MICROBATCH}:
            raise SpecError(f"{path}: {key} values must be {', '.join(EACH_MICROBATCH)} (got {sorted(bad)})")
    if doc["selective_recompute"] not in SELECTIVE_POLICIES:
        raise SpecError(f"{path}: selective_recompute must be one of {', '.join(SELECTIVE_POLICIES)}")
    # parsed now: a typo fails on load, not in a search
    rules = tuple(CannotRun(str(r["when"]), str(r["reason"]), parse_clauses(str(r["when"])))
                  for r in doc.get("cannot_run") or ())
    if doc.get("cross_entropy_memory", "megatron") not in CROSS_ENTROPY_MEMORY:
        raise SpecError(f"{path}: cross_entropy_memory must be one of {', '.join(CROSS_ENTROPY_MEMORY)}")
    impl = doc.get("zero3_impl")
    if impl is not None and impl not in ZERO3_IMPLS:
        raise SpecError(f"{path}: zero3_impl {impl!r} is not one of {', '.join(ZERO3_IMPLS)}")
    return Framework(name, impl, each["grad_reduce_each_microbatch"], each["param_gather_each_microbatch"],
                     doc["selective_recompute"], rules, bool(doc["fp8_weight_cache"]),
                     str(doc.get("cross_entropy_memory", "megatron")), bool(doc.get("zero3_param_is_master", False)),
                     bool(doc.get("tp_head_saves_gathered_input", False)), bool(doc.get("zero3_head_unsharded", False)),
                     None if doc.get("cross_entropy_fusion") is None else bool(doc["cross_entropy_fusion"]),
                     bool(doc.get("p2p_overlap", False)))
