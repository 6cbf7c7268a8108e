"""StrategyArrays: many strategies as one struct of numpy arrays.

The field names are the Strategy field names (one vocabulary); categorical
fields are integer codes (`recompute`: 0 none, 1 selective, 2 full; `rank_order`: the index in
RANK_ORDERS). Optional
integers use 0 for "not set" (`recompute_num_layers` 0 = all layers of the
chunk; `num_layers_in_first_stage` 0 = even split; `offload_activation_layers` 0 = off). `stage_layers`, the one
field that is a list (pp counts, or pp·vpp counts one per virtual stage, where 0
is a real count), is an (N, P) array padded with -1 (P = the longest explicit
split; P = 0 when no candidate has one; a row without a positive count has none).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable

import numpy as np

from planner.specs.strategy import RANK_ORDERS, RECOMPUTE_MODULES

RECOMPUTE_NAMES = ("none", "selective", "full")
RECOMPUTE_CODE = {name: code for code, name in enumerate(RECOMPUTE_NAMES)}
# `recompute_modules` holds Megatron-core's module names (planner.specs.strategy.RECOMPUTE_MODULES)
# as a bit mask (bit i = RECOMPUTE_MODULES[i]; 0 = not set, which selective recompute reads as core_attn).


#: Optional counts of a Strategy (None) held as 0 in the arrays.
OPTIONAL_COUNTS = ("recompute_num_layers", "num_layers_in_first_stage", "num_layers_in_last_stage",
                   "offload_activation_layers")


#: Columns `StrategyArrays.from_columns` may be given without (their Strategy defaults, as codes).
COLUMN_DEFAULTS = {"rank_order": 0, "embedding_as_layer": False, "loss_as_layer": False, "overlap_moe_comm": False,
                   "overlap_p2p_comm": True, "recompute_modules": 0, "offload_activation_layers": 0}


#: Fields a strategy-like object may leave out (their Strategy defaults).
DEFAULTED = {**{name: None for name in OPTIONAL_COUNTS}, "overlap_p2p_comm": True, "rank_order": RANK_ORDERS[0]}
#: A rank order's code in the arrays: its index in planner.specs.strategy.RANK_ORDERS.
RANK_ORDER_CODE = {name: code for code, name in enumerate(RANK_ORDERS)}


def modules_mask(modules: list[str] | tuple[str, ...] | None) -> int:
    """`["core_attn", "moe_act"]` -> 0b10001; None -> 0."""
    return sum(1 << RECOMPUTE_MODULES.index(m) for m in modules or ())


def selected_modules(mask) -> dict[str, np.ndarray]:
    """Which RECOMPUTE_MODULES each candidate's selective recompute repeats (bool arrays):
    mask 0 is Megatron's default, core_attn; `moe` (the whole MoE block) includes
    `moe_act` and `shared_experts`, which are then not counted again."""
    mask = np.where(np.asarray(mask) == 0, 1, mask)
    whole_moe = (mask >> RECOMPUTE_MODULES.index("moe")) & 1 > 0
    out = {m: (mask >> i) & 1 > 0 for i, m in enumerate(RECOMPUTE_MODULES)}
    for m in ("moe_act", "shared_experts"):
        out[m] = out[m] & ~whole_moe
    return {m: on for m, on in out.items() if np.any(on)}  # only modules some candidate selects


def modules_of(mask: int) -> list[str] | None:
    return [m for i, m in enumerate(RECOMPUTE_MODULES) if mask >> i & 1] or None


@dataclass
class StrategyArrays:
    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    cp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    vpp: np.ndarray
    sequence_parallel: np.ndarray  # bool
    zero_stage: np.ndarray
    micro_batch_size: np.ndarray
    recompute: np.ndarray  # 0 none, 1 selective, 2 full
    recompute_num_layers: np.ndarray  # 0 = all
    recompute_modules: np.ndarray  # bit mask of RECOMPUTE_MODULES; 0 = not set (core_attn)
    offload_optimizer: np.ndarray  # bool
    offload_activation_layers: np.ndarray  # 0 = off
    num_layers_in_first_stage: np.ndarray  # 0 = even split
    num_layers_in_last_stage: np.ndarray  # 0 = even split
    overlap_grad_reduce: np.ndarray  # bool
    overlap_param_gather: np.ndarray  # bool
    overlap_moe_comm: np.ndarray  # bool
    overlap_p2p_comm: np.ndarray  # bool
    embedding_as_layer: np.ndarray  # bool
    loss_as_layer: np.ndarray  # bool
    stage_layers: np.ndarray  # (N, P) int, -1-padded; P = 0 when no candidate has an explicit split
    rank_order: np.ndarray  # index into RANK_ORDERS (0: Megatron's default tp-cp-ep-dp-pp)

    BOOL_FIELDS = ("sequence_parallel", "offload_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                   "overlap_moe_comm", "overlap_p2p_comm", "embedding_as_layer", "loss_as_layer")
    LIST_FIELDS = ("stage_layers",)

    def __len__(self) -> int:
        return int(self.dp.shape[0])

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_columns(cls, columns: dict[str, Any], n: int | None = None) -> "StrategyArrays":
        """Build from a mapping of field -> array or scalar (scalars are broadcast)."""
        if n is None:
            n = max((np.size(v) for v in columns.values()), default=0)
        out = {}
        for name in cls.names():
            if name in cls.LIST_FIELDS:
                value = np.asarray(columns.get(name, np.zeros((n, 0))), dtype=np.int64)
                if value.ndim != 2:
                    value = value.reshape(-1, value.shape[-1] if value.ndim else 0)
                out[name] = np.broadcast_to(value, (n, value.shape[1])).copy()
                continue
            dtype = bool if name in cls.BOOL_FIELDS else np.int64
            value = columns[name] if name in columns or name not in COLUMN_DEFAULTS else COLUMN_DEFAULTS[name]
            out[name] = np.broadcast_to(np.asarray(value, dtype=dtype), (n,)).copy()
        return cls(**out)

    @classmethod
    def from_strategies(cls, strategies: Iterable[Any]) -> "StrategyArrays":
        """From resolved Strategy objects (dp must be an int)."""
        rows = [row_of(s) for s in strategies]
        columns = {name: np.array([r[name] for r in rows]) for name in cls.names() if name not in cls.LIST_FIELDS}
        width = max((len(r["stage_layers"]) for r in rows), default=0)
        columns["stage_layers"] = np.array([list(r["stage_layers"]) + [-1] * (width - len(r["stage_layers"]))
                                            for r in rows], dtype=np.int64).reshape(len(rows), width)
        return cls.from_columns(columns, len(rows))

    @classmethod
    def concat(cls, parts: list["StrategyArrays"]) -> "StrategyArrays":
        width = max(p.stage_layers.shape[1] for p in parts)
        out = {name: np.concatenate([getattr(p, name) for p in parts]) for name in cls.names()
               if name not in cls.LIST_FIELDS}
        out["stage_layers"] = np.concatenate([np.pad(p.stage_layers, ((0, 0), (0, width - p.stage_layers.shape[1])),
                                                     constant_values=-1) for p in parts])
        return cls(**out)

    def take(self, index: Any) -> "StrategyArrays":
        return StrategyArrays(**{name: getattr(self, name)[index] for name in self.names()})

    def row(self, i: int) -> dict[str, Any]:
        """Row i as Strategy keyword arguments."""
        out: dict[str, Any] = {}
        for name in self.names():
            value = getattr(self, name)[i]
            if name in self.LIST_FIELDS:
                out[name] = [int(v) for v in value if v >= 0] if (value > 0).any() else None
                continue
            out[name] = bool(value) if name in self.BOOL_FIELDS else int(value)
        out["recompute"] = RECOMPUTE_NAMES[out["recompute"]]
        out["recompute_modules"] = modules_of(out["recompute_modules"])
        out["rank_order"] = RANK_ORDERS[out["rank_order"]]
        for name in OPTIONAL_COUNTS:
            out[name] = out[name] or None
        return out


def row_of(strategy: Any) -> dict[str, Any]:
    """A Strategy (attribute access) as one row of codes."""
    row = {name: getattr(strategy, name) if name not in DEFAULTED else getattr(strategy, name, DEFAULTED[name])
           for name in StrategyArrays.names()}
    row["recompute"] = RECOMPUTE_CODE[row["recompute"]]
    row["recompute_modules"] = modules_mask(row["recompute_modules"])
    row["rank_order"] = RANK_ORDER_CODE[row["rank_order"]]
    for name in OPTIONAL_COUNTS:
        row[name] = row[name] or 0
    row["stage_layers"] = list(row["stage_layers"] or [])
    return row


def spread(distinct: tuple[np.ndarray, np.ndarray] | None, n: int, fn, *arrays):
    """`fn(*arrays)` for arrays (last axis the n candidates, or scalars) whose values are the same
    for all candidates of one class of `distinct` = (the first candidate of each class, each
    candidate's class): evaluated on the first of each class and spread back to all of them."""
    if distinct is None:
        return fn(*arrays)
    first, index = distinct
    small = [a[..., first] if isinstance(a, np.ndarray) and a.ndim and a.shape[-1] == n else a for a in arrays]
    return np.asarray(fn(*small))[..., index]
