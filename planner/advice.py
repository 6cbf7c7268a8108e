"""When nothing fits: what would, computed from the closest plan and the search itself.

`advice_for` reads the closest plan's memory breakdown: the term that binds (the largest of
params, grads, optimizer, activations) and, for that term, the knobs that shrink it and are not at
their limit in that plan. A knob the search chooses (tp, pp, cp, zero_stage, recompute, ...) is
named only when the caller's constraints kept the search from using it: otherwise the search has
tried it already and it did not help. Knobs outside the search (gradient precision, sequence
length) are named when they are not at their limit. `min_gpus_to_fit` searches GPU counts.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from cost_models.params import num_params
from cost_models.units import DTYPE_BYTES, WEIGHT_BYTES, optimizer_state_bytes
from planner.ranking import headroom_limit
from planner.rules import host_known
from planner.specs import Plan

GIB = 2**30
#: Largest multiple of the starting GPU count the GPU-count search tries (doubling up to it).
MAX_SCALE = 4096
#: Node multiples tried one by one from the first count above the GPU count asked for (and the memory floor).
MAX_SCAN = 8
#: Most GPU counts the search tries in all (scan, doubling and bisection): each is a whole search. Enough to
#: finish the bisection from a job of a few nodes up to MAX_SCALE times it.
MAX_PROBES = 32

#: term -> [(Strategy field or None, what it does, applies(plan) -> the knob is not at its limit)]
Knob = tuple[str | None, str, Callable[[Plan], bool]]


def _tp_room(p: Plan) -> bool:
    return p.strategy.tp < min(p.cluster.domain_size, p.model.num_attention_heads)


def _pp_room(p: Plan) -> bool:
    return p.strategy.pp < p.model.num_layers


def _activation_offload_room(p: Plan) -> bool:
    """Megatron can offload (more) layers' activations: the only framework that does, with pp 1, no
    recomputation and fewer offloaded layers than the model has (planner.rules `activation_offload`),
    to a host the cluster profile describes."""
    s = p.strategy
    return (p.train.framework == "megatron" and s.pp == 1 and s.recompute == "none"
            and (s.offload_activation_layers or 0) < p.model.num_layers - 1 and host_known(p.cluster))


KNOBS: dict[str, list[Knob]] = {
    "params": [("tp", "more tensor parallelism (tp) shards the weights", _tp_room),
               ("pp", "more pipeline stages (pp) split the layers", _pp_room),
               ("zero_stage", "ZeRO-3 (zero_stage=3) shards the weights over dp", lambda p: p.strategy.zero_stage < 3)],
    "grads": [("zero_stage", "ZeRO-2 or 3 shards the gradients over dp", lambda p: p.strategy.zero_stage < 2),
              (None, "bf16 gradients (--grad-precision bf16) halve them", lambda p: p.train.grad_precision == "fp32"),
              ("tp", "more tensor parallelism (tp) shards them", _tp_room),
              ("pp", "more pipeline stages (pp) split them", _pp_room)],
    "optimizer": [("zero_stage", "ZeRO-1 or higher shards the optimizer states over dp",
                   lambda p: p.strategy.zero_stage < 1),
                  ("offload_optimizer", "offloading the optimizer moves its states to the host",
                   lambda p: not p.strategy.offload_optimizer),
                  ("tp", "more tensor parallelism (tp) shards them", _tp_room),
                  ("pp", "more pipeline stages (pp) split them", _pp_room)],
    "activations": [("recompute", "recomputation (recompute=full) keeps only layer inputs",
                     lambda p: p.strategy.recompute != "full" or p.strategy.recompute_num_layers is not None),
                    ("offload_activation_layers", "activation offloading (offload_activation_layers, Megatron's "
                     "--cpu-offloading-num-layers) moves layers' activations to host memory", _activation_offload_room),
                    ("micro_batch_size", "a smaller micro-batch (micro_batch_size=1)",
                     lambda p: p.strategy.micro_batch_size > 1),
                    ("sequence_parallel", "sequence parallelism shards them over tp",
                     lambda p: p.strategy.tp > 1 and not p.strategy.sequence_parallel),
                    ("cp", "context parallelism (cp) splits the sequence", lambda p: p.strategy.cp < p.train.seq_len),
                    ("tp", "more tensor parallelism (tp) shards them", _tp_room),
                    (None, "a shorter sequence (--seq-len)", lambda p: p.train.seq_len > 1)],
    "logits": [(None, "fused cross-entropy (--cross-entropy-fusion) never holds the fp32 logits",
                lambda p: not p.train.cross_entropy_fusion),
               ("tp", "more tensor parallelism (tp) splits the vocabulary", _tp_room),
               ("cp", "context parallelism (cp) splits the sequence", lambda p: p.strategy.cp < p.train.seq_len),
               (None, "a shorter sequence (--seq-len)", lambda p: p.train.seq_len > 1)],
}


def advice_for(closest: Plan, constraints: dict[str, Any], headroom: float, min_gpus: int | None,
               tried: list[int]) -> list[str]:
    """Lines of advice for a question where nothing fits, from its closest plan."""
    e = closest.estimate
    limit = e.memory_capacity_bytes * (1 - headroom)
    term = max(e.memory_bytes, key=e.memory_bytes.get)
    out = [f"binding term: {term} {e.memory_bytes[term] / GIB:.1f} GiB of the {e.peak_memory_bytes / GIB:.1f} GiB "
           f"peak ({e.binding_stage} stage); the limit is {limit / GIB:.1f} GiB ({e.memory_capacity_bytes / GIB:.0f} "
           f"GiB less the {headroom:.0%} headroom), {max(e.peak_memory_bytes - limit, 0) / GIB:.1f} GiB over"]
    for field, what, room in KNOBS.get(term, []):
        if not room(closest):
            continue
        if field is None:
            out.append(f"to shrink {term}: {what}")
        elif field in constraints:
            out.append(f"to shrink {term}: {what}; the constraint {field}={constraints[field]} keeps the search "
                       "from it")
    if min_gpus is not None:
        floor = memory_floor_gpus(closest.model, closest.train, closest.cluster, headroom)
        out.append(gpus_line(closest.num_gpus, min_gpus, tried, closest.cluster.gpus_per_node, floor))
    elif tried:
        out.append(f"no plan fits on any GPU count tried up to {tried[-1]:,} ({len(tried)} counts tried)")
    return out


def memory_floor_gpus(model, train, cluster, headroom: float) -> int:
    """Fewer GPUs than this cannot fit any plan: together they could not hold one copy of the gradients
    (never offloaded, each parameter's held once across the GPUs whatever the sharding) and, per parameter, the
    smaller of its weights and its optimizer states (FSDP2's ZeRO-3 keeps no 16-bit weight beside the fp32
    master, optimizer offload no states; FP8 weights count nothing), each GPU filled to its memory less the
    headroom. A bound from cost_models.memory.model_state_bytes' terms, so the count search starts at it."""
    weights = 0 if train.precision == "fp8" else WEIGHT_BYTES[train.precision]
    per_param = DTYPE_BYTES[train.grad_precision] + min(weights, optimizer_state_bytes(train.optimizer, train.precision))
    usable = headroom_limit(cluster.gpu.memory_bytes, headroom)
    return max(1, math.ceil(num_params(model) * per_param / usable))


def gpus_line(num_gpus: int, found: int, tried: list[int], node: int, floor: int = 0) -> str:
    """`needs at least N GPUs` when every node multiple between was tried (or is below the memory floor,
    `memory_floor_gpus`), else what was tried."""
    every = [n for n in range(node, found, node) if n > num_gpus and n >= floor]
    if set(every) <= set(tried) and found % node == 0:
        below = (f"; fewer than {floor:,} cannot hold the gradients and weights" if any(
            num_gpus < n < floor for n in range(node, found, node)) else "")
        return f"needs at least {found:,} GPUs (the smallest multiple of {node} GPUs per node that fits{below})"
    return (f"fits on {found:,} GPUs, the smallest of the {len(tried)} GPU counts tried (multiples of {node} GPUs "
            f"per node; not every multiple below it was tried)")


def min_gpus_to_fit(cluster, num_gpus: int, fits_at: Callable[[int], bool],
                    floor: int = 0) -> tuple[int | None, list[int]]:
    """The smallest GPU count, a multiple of the node size above `num_gpus` and at least `floor` (the
    `memory_floor_gpus`: no fewer can fit), at which a plan fits (`fits_at(n)`: the search, run by the
    caller, found a plan on n GPUs), and every count tried, ascending (None when none of them fits).

    Tries the first MAX_SCAN node multiples one by one; beyond them doubles until a count fits (up to
    MAX_SCALE times `num_gpus` or the cluster's max_gpus, the last step to that bound), then bisects the
    node multiples between the last failure and it. At most MAX_PROBES counts are searched in all: each
    is a whole search, slow on large counts. Past the scan the count found fits and the one bisected
    below it does not, but not every count below it was tried (`gpus_line` says which)."""
    node = cluster.gpus_per_node
    bound = num_gpus * MAX_SCALE if cluster.max_gpus is None else min(cluster.max_gpus, num_gpus * MAX_SCALE)
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return fits_at(n)

    n = max(num_gpus // node + 1, -(-floor // node)) * node
    for _ in range(MAX_SCAN):
        if n > bound:
            return None, tried
        if fits(n):
            return n, tried
        n += node
    lo, hi = n - node, None
    top = bound // node * node  # the largest count allowed, tried when doubling would pass it
    while lo < top and len(tried) < MAX_PROBES:
        n = min(2 * lo, top)
        if fits(n):
            hi = n
            break
        lo = n
    if hi is None:
        return None, sorted(tried)
    while hi - lo > node and len(tried) < MAX_PROBES:  # lo does not fit, hi does
        mid = lo + (hi - lo) // node // 2 * node
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi, sorted(tried)
