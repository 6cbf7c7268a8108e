"""StrategyArrays: many strategies as one struct of numpy arrays.

The field names are the Strategy field names (one vocabulary); categorical
fields are integer codes (`recompute`: 0 none, 1 selective, 2 full). Optional
integers use 0 for "not set" (`recompute_num_layers` 0 = all layers of the
chunk; `num_layers_in_first_stage` 0 = even split).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable

import numpy as np

RECOMPUTE_NAMES = ("none", "selective", "full")
RECOMPUTE_CODE = {name: code for code, name in enumerate(RECOMPUTE_NAMES)}


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
    offload_optimizer: np.ndarray  # bool
    num_layers_in_first_stage: np.ndarray  # 0 = even split
    num_layers_in_last_stage: np.ndarray  # 0 = even split
    overlap_grad_reduce: np.ndarray  # bool
    overlap_param_gather: np.ndarray  # bool

    BOOL_FIELDS = ("sequence_parallel", "offload_optimizer", "overlap_grad_reduce", "overlap_param_gather")

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
            dtype = bool if name in cls.BOOL_FIELDS else np.int64
            out[name] = np.broadcast_to(np.asarray(columns[name], dtype=dtype), (n,)).copy()
        return cls(**out)

    @classmethod
    def from_strategies(cls, strategies: Iterable[Any]) -> "StrategyArrays":
        """From resolved Strategy objects (dp must be an int)."""
        rows = [row_of(s) for s in strategies]
        columns = {name: np.array([r[name] for r in rows]) for name in cls.names()}
        return cls.from_columns(columns, len(rows))

    @classmethod
    def concat(cls, parts: list["StrategyArrays"]) -> "StrategyArrays":
        return cls(**{name: np.concatenate([getattr(p, name) for p in parts]) for name in cls.names()})

    def take(self, index: Any) -> "StrategyArrays":
        return StrategyArrays(**{name: getattr(self, name)[index] for name in self.names()})

    def row(self, i: int) -> dict[str, Any]:
        """Row i as Strategy keyword arguments."""
        out: dict[str, Any] = {}
        for name in self.names():
            value = getattr(self, name)[i]
            out[name] = bool(value) if name in self.BOOL_FIELDS else int(value)
        out["recompute"] = RECOMPUTE_NAMES[out["recompute"]]
        for name in ("recompute_num_layers", "num_layers_in_first_stage", "num_layers_in_last_stage"):
            out[name] = out[name] or None
        return out


def row_of(strategy: Any) -> dict[str, Any]:
    """A Strategy (attribute access) as one row of codes."""
    row = {name: getattr(strategy, name) for name in StrategyArrays.names()}
    row["recompute"] = RECOMPUTE_CODE[row["recompute"]]
    for name in ("recompute_num_layers", "num_layers_in_first_stage", "num_layers_in_last_stage"):
        row[name] = row[name] or 0
    return row
