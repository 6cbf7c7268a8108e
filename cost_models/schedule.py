"""Pipeline layout and schedule: layers per stage, in-flight micro-batches, bubble.

Three stage kinds are modelled for every candidate: the first stage (embedding),
a middle stage and the last stage (output layer and loss). With pp = 1 the one
stage is both first and last; with pp = 2 there is no middle stage (its row is
a copy of the first so that maxima are unchanged).

Sources: 1F1B and interleaved 1F1B from Narayanan et al., SC'21, Sec. 2.2
(bubble fraction (p-1)/(v·m)); warm-up depths from Megatron-core's interleaved
schedule (rank i runs 2·(p-i-1) + (v-1)·p warm-up chunks, capped at m·v), which
give Korthikanti et al. (2022) Sec. 4.2.3's first-stage factor 1 + (p-1)/(p·v).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIRST, MIDDLE, LAST = 0, 1, 2
STAGE_NAMES = ("first", "middle", "last")


@dataclass
class PipelineLayout:
    """Per stage kind (axis 0: first, middle, last) and candidate (axis 1)."""

    layers: np.ndarray  # transformer layers on the stage
    inflight_chunks: np.ndarray  # (micro-batch, chunk) activations held at the peak
    chunk_layers: np.ndarray  # layers per virtual chunk (layers / vpp)
    has_embedding: np.ndarray  # bool: the stage holds the input embedding
    has_head: np.ndarray  # bool: the stage holds the output layer and loss
    inflight_microbatches: np.ndarray  # micro-batches whose stage input is held


def layout(num_layers: int, pp: np.ndarray, vpp: np.ndarray, first: np.ndarray, last: np.ndarray,
           num_microbatches: np.ndarray) -> PipelineLayout:
    """Layers and in-flight work per stage kind.

    `first`/`last` are the uneven first/last stage layer counts (0 = even split):
    with both set, the middle stages share `L - first - last` evenly over pp - 2.
    """
    p, v, m = pp, vpp, np.maximum(num_microbatches, 1)
    even = num_layers / p
    first_l = np.where(first > 0, first, even)
    last_l = np.where(last > 0, last, even)
    rest = num_layers - np.where(first > 0, first, 0) - np.where(last > 0, last, 0)
    mid_stages = p - (first > 0) - (last > 0)
    mid_l = np.where(mid_stages > 0, rest / np.maximum(mid_stages, 1), even)
    last_l = np.where(p == 1, first_l, last_l)
    mid_l = np.where(p <= 2, first_l, mid_l)

    def chunks(rank: np.ndarray) -> np.ndarray:
        interleaved = np.minimum(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
        plain = np.minimum(p - rank, m)
        return np.where(v > 1, interleaved, plain)

    first_c = chunks(np.zeros_like(p))
    mid_c = np.where(p <= 2, first_c, chunks(np.ones_like(p)))
    last_c = chunks(p - 1)
    ones = np.ones_like(p, dtype=bool)
    return PipelineLayout(
        layers=np.stack([first_l, mid_l, last_l]).astype(float),
        inflight_chunks=np.stack([first_c, mid_c, last_c]).astype(float),
        chunk_layers=np.stack([first_l, mid_l, last_l]) / v,
        has_embedding=np.stack([ones, p <= 2, p == 1]),
        has_head=np.stack([p == 1, p == 1, ones]),
        inflight_microbatches=np.stack([
            np.minimum(p, m), np.where(p <= 2, np.minimum(p, m), np.minimum(p - 1, m)), np.ones_like(p)
        ]).astype(float),
    )


def bubble_fraction(pp: np.ndarray, vpp: np.ndarray, num_microbatches: np.ndarray) -> np.ndarray:
    """Pipeline bubble over ideal time: (p - 1) / (v · m) (SC'21 Sec. 2.2.2)."""
    return (pp - 1) / (vpp * np.maximum(num_microbatches, 1))
