"""The search space: every strategy worth scoring, as StrategyArrays.

Default choices per field (constraints replace them):
- tp, cp, pp: divisors of the GPU count; tp dividing both the query and KV head counts, pp ≤ num_layers,
  cp only where each rank keeps at least `MIN_CP_TOKENS` tokens; dp = GPUs / (tp·cp·pp).
- vpp: 1 and every v > 1 that divides the layers per stage. When pp does not
  divide the layers, one uneven split: middle stages get ⌈L/pp⌉ layers and the
  first and last stages share the rest (Megatron's first/last-stage layer flags).
  Whether a split is possible is `ParallelLayout.split_ok`'s answer (the rules).
- stage_layers, embedding_as_layer, loss_as_layer: only as constrained (default:
  none, off, off).
- micro_batch_size: every divisor of global_batch_size / dp.
- sequence_parallel: off, and on when tp > 1. zero_stage: 0-3.
- recompute: none, selective, full (all layers) and full with every
  recompute_num_layers from 1 to the layers per chunk - 1 (Megatron's block method).
- offload_optimizer: off; overlap_grad_reduce / overlap_param_gather: on.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import numpy as np

from cost_models.arrays import RECOMPUTE_CODE, StrategyArrays
from cost_models.layout import ParallelLayout
from planner.errors import SpecError
from planner.specs import Strategy

#: A context-parallel rank below this many tokens leaves GEMMs too thin to be worth scoring by default.
MIN_CP_TOKENS = 512

STRATEGY_FIELDS = tuple(Strategy.model_fields)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


INT_FIELDS = {"dp", "tp", "pp", "cp", "ep", "etp", "vpp", "micro_batch_size", "zero_stage"}
OPTIONAL_INT_FIELDS = {"recompute_num_layers", "num_layers_in_first_stage", "num_layers_in_last_stage"}
BOOL_FIELDS = {"sequence_parallel", "offload_optimizer", "overlap_grad_reduce", "overlap_param_gather",
               "embedding_as_layer", "loss_as_layer"}


def _check_value(key: str, v: Any) -> Any:
    if key == "dp" and v == "auto":
        return v
    if key in INT_FIELDS or key in OPTIONAL_INT_FIELDS:
        if v is None and key in OPTIONAL_INT_FIELDS:
            return v
        low = 0 if key == "zero_stage" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (key == "zero_stage" and v > 3):
            rule = "an integer 0..3" if key == "zero_stage" else "a positive integer"
            raise SpecError(f"constraint {key}={v!r} must be {rule}")
        return v
    if key in BOOL_FIELDS:
        if not isinstance(v, bool):
            raise SpecError(f"constraint {key}={v!r} must be true or false")
        return v
    if key == "stage_layers":
        if v is None:
            return v
        if (not isinstance(v, (list, tuple)) or not v
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in v)):
            raise SpecError(f"constraint stage_layers={v!r} must be a list of positive layer counts, one per stage")
        return tuple(v)
    if key == "recompute":
        if v not in RECOMPUTE_CODE:
            raise SpecError(f"constraint recompute={v!r} must be one of {', '.join(RECOMPUTE_CODE)}")
        return v
    raise SpecError(f"constraint field {key!r} cannot be constrained")


def normalise_constraints(constraints: dict[str, Any]) -> dict[str, list[Any]]:
    """Validate constraint keys and values; each becomes a list of allowed values."""
    if not isinstance(constraints, dict):
        raise SpecError(f"constraints must be a mapping of Strategy fields (got {type(constraints).__name__})")
    out: dict[str, list[Any]] = {}
    for key, value in constraints.items():
        if key not in STRATEGY_FIELDS:
            raise SpecError(f"unknown constraint field {key!r}; fields: {', '.join(STRATEGY_FIELDS)}")
        if key == "stage_layers":  # one split [1, 2, 2, 3], or a list of splits to choose from
            nested = isinstance(value, (list, tuple)) and bool(value) and all(
                isinstance(v, (list, tuple)) or v is None for v in value)
            values = list(value) if nested else [value]
        else:
            values = list(value) if isinstance(value, (list, tuple, set)) else [value]
        if not values:
            raise SpecError(f"constraint {key!r} allows no value (empty list)")
        out[key] = [_check_value(key, v) for v in values]
    return out


def _allowed(cons: dict[str, list[Any]], key: str, default: list[Any]) -> list[Any]:
    return list(cons[key]) if key in cons else default


def enumerate_space(model, train, num_gpus: int, constraints: dict[str, Any]) -> StrategyArrays:
    """All candidate strategies for the question, constraints applied."""
    cons = normalise_constraints(constraints)
    L, s, B = model.num_layers, train.seq_len, train.global_batch_size
    divs = divisors(num_gpus)
    head_groups = math.gcd(model.num_attention_heads, model.kv_heads)
    tps = _allowed(cons, "tp", [d for d in divs if head_groups % d == 0])
    cps = _allowed(cons, "cp", [d for d in divs if d == 1 or (s % (2 * d) == 0 and s // d >= MIN_CP_TOKENS)])
    pps = _allowed(cons, "pp", [d for d in divs if d <= L])
    dps = cons.get("dp")
    zeros = _allowed(cons, "zero_stage", [0, 1, 2, 3])
    structure: list[tuple[int, ...]] = []  # (dp, tp, pp, cp, vpp, first, last, split index, emb, loss) per block
    splits: list[tuple[int, ...]] = [()]  # explicit stage_layers choices; index 0 = none
    blocks: list[np.ndarray] = []  # (k, 4) rows of (mbs, sp, zero, recompute code, recompute layers) per block
    for tp, cp, pp in itertools.product(tps, cps, pps):
        if num_gpus % (tp * cp * pp):
            continue
        dp = num_gpus // (tp * cp * pp)
        if dps is not None and dp not in dps and "auto" not in dps:
            continue
        mbss = _allowed(cons, "micro_batch_size", divisors(B // dp) if B % dp == 0 else [1])
        sps = _allowed(cons, "sequence_parallel", [False, True] if tp > 1 else [False])
        for vpp, first, last, explicit, emb, loss in _pipeline_splits(L, pp, cons):
            if explicit not in splits:
                splits.append(explicit)
            chunk = _largest_chunk(model.num_layers, pp, vpp, first, last, explicit, emb, loss)
            structure.append((dp, tp, pp, cp, vpp, first, last, splits.index(explicit), emb, loss))
            blocks.append(_grid(tuple(mbss), tuple(sps), tuple(zeros), tuple(_recompute_choices(cons, chunk))))
    if not blocks:
        raise SpecError(_empty_space_message(num_gpus, cons))
    sizes = np.array([len(b) for b in blocks])
    struct = np.repeat(np.array(structure, dtype=np.int64), sizes, axis=0)
    inner = np.concatenate(blocks)
    cols = {
        "dp": struct[:, 0], "tp": struct[:, 1], "pp": struct[:, 2], "cp": struct[:, 3], "vpp": struct[:, 4],
        "num_layers_in_first_stage": struct[:, 5], "num_layers_in_last_stage": struct[:, 6],
        "micro_batch_size": inner[:, 0], "sequence_parallel": inner[:, 1].astype(bool), "zero_stage": inner[:, 2],
        "recompute": inner[:, 3], "recompute_num_layers": inner[:, 4],
        "stage_layers": _split_table(splits)[struct[:, 7]],
        "embedding_as_layer": struct[:, 8].astype(bool), "loss_as_layer": struct[:, 9].astype(bool),
    }
    rare = _inner_columns(cons)
    base = StrategyArrays.from_columns({**cols, **{k: v[0] for k, v in rare.items()}}, len(inner))
    combos = list(itertools.product(*rare.values()))
    if len(combos) == 1:
        return base
    parts = []
    for combo in combos:
        part = base.take(np.arange(len(base)))  # a copy: the loop below writes into it
        for key, value in zip(rare, combo):
            getattr(part, key)[:] = value
        parts.append(part)
    return StrategyArrays.concat(parts)


@functools.lru_cache(maxsize=4096)
def _grid(mbss: tuple, sps: tuple, zeros: tuple, rcs: tuple) -> np.ndarray:
    """Cartesian product of the per-structure choices as an (n, 5) integer array."""
    i, j, k, r = np.meshgrid(np.arange(len(mbss)), np.arange(len(sps)), np.arange(len(zeros)), np.arange(len(rcs)),
                             indexing="ij")
    rc = np.array(rcs, dtype=np.int64).reshape(-1, 2)
    out = np.stack([np.array(mbss, dtype=np.int64)[i.ravel()], np.array(sps, dtype=np.int64)[j.ravel()],
                    np.array(zeros, dtype=np.int64)[k.ravel()], rc[r.ravel(), 0], rc[r.ravel(), 1]], axis=1)
    out.setflags(write=False)
    return out


def _inner_columns(cons: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Fields that are rarely searched: one value each unless constrained to several."""
    return {
        "ep": _allowed(cons, "ep", [1]),
        "etp": _allowed(cons, "etp", [1]),
        "offload_optimizer": _allowed(cons, "offload_optimizer", [False]),
        "overlap_grad_reduce": _allowed(cons, "overlap_grad_reduce", [True]),
        "overlap_param_gather": _allowed(cons, "overlap_param_gather", [True]),
    }


def _pipeline_splits(L: int, pp: int, cons: dict[str, list[Any]]) -> list[tuple[int, int, int, tuple, bool, bool]]:
    """(vpp, first-stage layers, last-stage layers, explicit split, embedding as layer, loss as
    layer) choices; 0 / () = not set. Impossible combinations are kept: the rules reject and
    count them."""
    out = []
    for emb in _allowed(cons, "embedding_as_layer", [False]):
        for loss in _allowed(cons, "loss_as_layer", [False]):
            out += [split + (emb, loss) for split in _splits_of(L, pp, cons, int(emb) + int(loss))]
    return out


def _splits_of(L: int, pp: int, cons: dict[str, list[Any]], extra: int) -> list[tuple[int, int, int, tuple]]:
    """Splits of L layers (+ `extra` embedding/loss layers counted in an even split)."""
    vpps = cons.get("vpp")
    explicit = [tuple(x) for x in cons.get("stage_layers", []) if x]
    if explicit:
        return [(v, 0, 0, x) for v in (vpps or [1]) for x in explicit if len(x) == pp] or [(1, 0, 0, explicit[0])]
    firsts, lasts = cons.get("num_layers_in_first_stage"), cons.get("num_layers_in_last_stage")
    if firsts is not None or lasts is not None:
        return [(v, f or 0, la or 0, ()) for v in (vpps or [1]) for f in (firsts or [None]) for la in (lasts or [None])]
    if (L + extra) % pp == 0 or extra:
        per_stage = (L + extra) // pp
        default = [1] + ([v for v in divisors(per_stage) if v > 1] if pp > 1 and per_stage else [])
        return [(v, 0, 0, ()) for v in (vpps or default)]
    # Uneven: ⌈L/pp⌉ layers on middle stages, the rest shared by the first and last.
    k = -(-L // pp)
    rest = L - k * (pp - 2)
    first, last = rest // 2, rest - rest // 2
    if pp < 2 or first < 1 or last > k:
        return [(v, 0, 0, ()) for v in (vpps or [1])]
    return [(v, first, last, ()) for v in (vpps or [1])]


@functools.lru_cache(maxsize=4096)
def _largest_chunk(L: int, pp: int, vpp: int, first: int, last: int, explicit: tuple, emb: bool = False,
                   loss: bool = False) -> int:
    """Layers of the largest virtual chunk of a split (the recompute_num_layers range)."""
    lay = ParallelLayout(num_layers=L, tp=np.ones(1, np.int64), cp=np.ones(1, np.int64), dp=np.ones(1, np.int64),
                         pp=np.array([pp]), vpp=np.array([vpp]), ep=np.ones(1, np.int64), etp=np.ones(1, np.int64),
                         first=np.array([first]), last=np.array([last]), embedding_as_layer=np.array([emb]),
                         loss_as_layer=np.array([loss]),
                         stage_layers=np.array([explicit], dtype=np.int64) if explicit else None)
    return max(1, max(lay.layers_per_chunk(0), default=1))


def _split_table(splits: list[tuple[int, ...]]) -> np.ndarray:
    """Explicit splits as a zero-padded (len(splits), P) table; row 0 is 'none'."""
    width = max(len(x) for x in splits)
    return np.array([list(x) + [0] * (width - len(x)) for x in splits], dtype=np.int64).reshape(len(splits), width)


def _recompute_choices(cons: dict[str, list[Any]], chunk_layers: int) -> list[tuple[int, int]]:
    modes = _allowed(cons, "recompute", ["none", "selective", "full"])
    counts = cons.get("recompute_num_layers")
    out: list[tuple[int, int]] = []
    for mode in modes:
        code = RECOMPUTE_CODE[mode]
        if mode != "full":
            if counts is None or None in counts:
                out.append((code, 0))
            continue
        if counts is not None:
            out += [(code, n or 0) for n in counts]
        else:
            out += [(code, 0)] + [(code, n) for n in range(1, chunk_layers)]
    return out


def _empty_space_message(num_gpus: int, cons: dict[str, list[Any]]) -> str:
    fixed = ", ".join(f"{k}={v if len(v) > 1 else v[0]}" for k, v in cons.items() if k in {"dp", "tp", "cp", "pp"})
    return (f"no strategy has dp·tp·cp·pp equal to the number of GPUs ({num_gpus})"
            + (f" under the constraints {fixed}" if fixed else ""))
