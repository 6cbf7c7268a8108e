"""ParallelLayout: the parallel degrees, the rank order, every group, the stage split
and the micro-batch rules of many candidates at once (numpy arrays over candidates).

This is the one place that knows how ranks are laid out and how layers are split
over pipeline stages; the cost model, the rules, the search space, the executors,
the emitters and the CLI all ask it. Nothing else does stride or split arithmetic.

Rank order. A rank order names the dimensions innermost first; Megatron-core's
default is ``"tp-cp-ep-dp-pp"``. The dense mesh uses the dimensions tp, cp, dp and
pp (ep subdivides dp for the expert layers only and has no stride of its own in the
dense mesh). A dimension's stride is the product of the sizes of the dimensions
inside it. Worked example, 16 GPUs with tp=2, dp=2, pp=4 (cp=1): ranks {0, 1} are
a TP group (stride 1), {0, 2} a DP group (stride 2), {0, 4, 8, 12} a pipeline
(stride 4), and the first and last stages' embedding copies are ranks 0 and 12.

Expert layers (Megatron-core's expert mesh) order etp innermost, then ep, then the
expert-data-parallel group edp = tp·cp·dp / (etp·ep) over the same ranks, pp outermost.

Stage split (Megatron-core's `get_num_layers_to_build` and its pipeline layout):
- even: L / pp layers per pipeline rank, L / (pp·vpp) per virtual chunk;
- uneven first/last: the first (last) pipeline rank gets `first` (`last`) layers,
  the other ranks share the rest evenly; with vpp > 1 each rank's layers split
  evenly over its vpp chunks (so each rank's count must divide by vpp);
- explicit: `stage_layers` gives the layers of every pipeline rank (pp counts, each
  split evenly over the rank's vpp chunks), or of every virtual stage (pp·vpp counts in
  virtual-stage order, Megatron's `--pipeline-model-parallel-layout`; a virtual stage
  may hold no layer, as Megatron allows, but every pipeline rank holds at least one).
  Virtual stage j runs on pipeline rank j mod pp as its chunk j // pp, so DeepSeek-V3's
  Megatron-Bridge layout [4]*15 + [1] on pp 4, vpp 4 gives rank 3 chunks of 4, 4, 4 and
  1 layers (13 layers). The embedding stays on the first virtual stage, the output
  layer, the loss and the MTP layers on the last (pipeline rank pp-1), as for every split;
- embedding / loss as layers (`--account-for-embedding-in-pipeline-split`,
  `--account-for-loss-in-pipeline-split`): the input embedding (and the output
  layer with the loss) count as one layer each in an even split over pp·vpp
  virtual stages; the first (last) virtual stage builds one transformer layer fewer.

Stage rows. Per-stage quantities are (S, N) arrays: row 0 is pipeline rank 0, the
last row is rank pp-1. Without an explicit split S = 3 and row 1 stands for every
middle rank (rank 1, the one holding the most in-flight micro-batches; all middle
ranks have the same layers); with explicit splits S is the largest pp among them and
every rank has its row (shorter pipelines repeat their first row, which changes no
maximum). With pp = 1 every row is the single stage; with pp = 2 row 1 repeats row 0.

Schedules (SC'21 Sec. 2.2; Megatron-core's interleaved schedule): pipeline rank r
holds min(pp - r, m) micro-batches in flight under 1F1B; interleaved 1F1B keeps
2·(pp - r - 1) + (vpp - 1)·pp + 1 (micro-batch, chunk) pairs, capped at m·vpp, which
gives Korthikanti et al. (2022) Sec. 4.2.3's first-stage factor 1 + (pp-1)/(pp·vpp).

Chunks of unequal size (a per-virtual-stage `stage_layers`). The stage rows keep one
row per pipeline rank; a rank's layers are the sum of its chunks, and where the cost
model needs one chunk size it takes the rank's average, `chunk_layers` = layers / vpp:
- in-flight activations: each (micro-batch, chunk) pair holds an average chunk. Exact
  for every rank whose chunks are equal (all ranks but the last in the published
  DeepSeek-V3 layouts, including rank 0, which holds the most pairs); on a rank with
  chunks 4, 4, 4, 1 the warm-up holds its first chunks more often than its last, so the
  average (3.25) underestimates by at most (4 - 3.25) layers per pair there;
- the interleaved bubble, (pp - 1)/vpp of the slowest rank's micro-batch time: the
  slowest rank's average chunk time. The published uneven layouts balance chunk time
  (the last stage's single layer carries the MTP layer and the loss), where the average
  chunk time and the largest one agree;
- full recompute of n layers per chunk: min(n, average chunk) per chunk (the rules
  bound n by the largest chunk of any rank).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.specs.strategy import RANK_ORDERS

#: Megatron-core's default order, innermost first.
DEFAULT_RANK_ORDER = RANK_ORDERS[0]
DENSE_DIMS = ("tp", "cp", "dp", "pp")
STAGE_NAMES = ("first", "middle", "last")


def _arr(x: Any, n: int, dtype=np.int64) -> np.ndarray:
    return np.broadcast_to(np.asarray(x, dtype=dtype), (n,))


@dataclass
class ParallelLayout:
    """Degrees, rank order, groups and stage split of N candidates.

    Integer arrays of length N; 0 in `first`/`last` means "not set" (even split).
    `stage_layers` holds explicit splits as given (pp or pp·vpp counts) in an (N, P) array
    padded with -1 (0 is a real count: an empty virtual stage); a row without a positive
    count means no explicit split. `explicit` reads them as counts per virtual stage.
    """

    num_layers: int
    tp: np.ndarray
    cp: np.ndarray
    dp: np.ndarray
    pp: np.ndarray
    vpp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    first: np.ndarray
    last: np.ndarray
    embedding_as_layer: np.ndarray  # bool
    loss_as_layer: np.ndarray  # bool
    stage_layers: np.ndarray | None = None
    rank_order: str = DEFAULT_RANK_ORDER
    orders: np.ndarray | None = None
    order_names: tuple[str, ...] = RANK_ORDERS
    _rows: "StageRows | None" = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """`orders` (each candidate's index into `order_names`) defaults to `rank_order` for every candidate;
        a `rank_order` outside RANK_ORDERS gets a list of its own."""
        if self.orders is None:
            if self.rank_order not in self.order_names:
                self.order_names = (self.rank_order,)
            self.orders = np.full(len(self.tp), self.order_names.index(self.rank_order), dtype=np.int64)
        for name in self.order_names:
            dims = [d for d in name.split("-") if d in DENSE_DIMS]
            if sorted(dims) != sorted(DENSE_DIMS):
                raise ValueError(f"rank order {name!r} must name each of {', '.join(DENSE_DIMS)} once")

    # ---- construction -------------------------------------------------------
    @classmethod
    def of(cls, st: Any, num_layers: int, rank_order: str | None = None) -> "ParallelLayout":
        """From `StrategyArrays` (arrays) or a resolved `Strategy` (one candidate), each candidate in its own
        rank order (`rank_order` given: every candidate in that one)."""
        if isinstance(st.tp, (int, np.integer)):
            return cls.of_strategy(st, num_layers, rank_order)
        n = len(st.tp)
        explicit = getattr(st, "stage_layers", None)
        codes = getattr(st, "rank_order", None)
        return cls(num_layers=int(num_layers), tp=st.tp, cp=st.cp, dp=st.dp, pp=st.pp, vpp=st.vpp, ep=st.ep,
                   etp=st.etp, first=st.num_layers_in_first_stage, last=st.num_layers_in_last_stage,
                   embedding_as_layer=_arr(getattr(st, "embedding_as_layer", False), n, bool),
                   loss_as_layer=_arr(getattr(st, "loss_as_layer", False), n, bool),
                   stage_layers=explicit if explicit is not None and explicit.size and (explicit > 0).any() else None,
                   rank_order=rank_order if rank_order is not None else DEFAULT_RANK_ORDER,
                   orders=_arr(codes, n) if rank_order is None and codes is not None else None)

    @classmethod
    def of_strategy(cls, s: Any, num_layers: int, rank_order: str | None = None) -> "ParallelLayout":
        """One resolved Strategy (dp an integer) as a layout of one candidate, in its rank order (or
        `rank_order`)."""
        explicit = getattr(s, "stage_layers", None)
        one = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
        return cls(num_layers=int(num_layers), tp=one(s.tp), cp=one(s.cp), dp=one(s.dp), pp=one(s.pp),
                   vpp=one(s.vpp), ep=one(s.ep), etp=one(s.etp), first=one(s.num_layers_in_first_stage or 0),
                   last=one(s.num_layers_in_last_stage or 0),
                   embedding_as_layer=np.array([bool(getattr(s, "embedding_as_layer", False))]),
                   loss_as_layer=np.array([bool(getattr(s, "loss_as_layer", False))]),
                   stage_layers=np.array([list(explicit)], dtype=np.int64) if explicit else None,
                   rank_order=rank_order or getattr(s, "rank_order", DEFAULT_RANK_ORDER))

    def __len__(self) -> int:
        return int(self.tp.shape[0])

    # ---- degrees --------------------------------------------------------------
    @property
    def num_gpus(self) -> np.ndarray:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def shard(self) -> np.ndarray:
        """Ranks that hold the same dense parameters and see different tokens: dp·cp (the ZeRO group)."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> np.ndarray:
        """Expert-data-parallel degree: the ranks of one pipeline stage left over by etp·ep."""
        return np.maximum(self.tp * self.cp * self.dp // np.maximum(self.etp * self.ep, 1), 1)  # 1 where the rules refuse

    # ---- rank order and groups -------------------------------------------------
    def _order(self, i: int = 0) -> list[str]:
        """Candidate i's dense dimensions, innermost first."""
        return [d for d in self.order_names[int(self.orders[i])].split("-") if d in DENSE_DIMS]

    def _per_order(self, fn) -> np.ndarray:
        """`fn(order)` (an array over all candidates, for one rank order given as its dense dimensions) taken
        for each candidate from its own order: one evaluation per order in use."""
        codes = np.unique(self.orders)
        if len(codes) == 1:
            return fn([d for d in self.order_names[int(codes[0])].split("-") if d in DENSE_DIMS])
        out = None
        for code in codes:
            value = fn([d for d in self.order_names[int(code)].split("-") if d in DENSE_DIMS])
            out = value.copy() if out is None else np.where(self.orders == code, value, out)
        return out

    def stride(self, dim: str) -> np.ndarray:
        """Rank distance between neighbours of a group along `dim` (product of the inner sizes).

        The 16-GPU example of the module docstring (tp=2, dp=2, pp=4):

        >>> from types import SimpleNamespace as S
        >>> s = S(tp=2, cp=1, dp=2, pp=4, vpp=1, ep=1, etp=1, num_layers_in_first_stage=None,
        ...       num_layers_in_last_stage=None, stage_layers=None)
        >>> lay = ParallelLayout.of_strategy(s, 8)
        >>> [int(lay.stride(d)[0]) for d in ("tp", "dp", "pp")], lay.stage_ranks(3)
        ([1, 2, 4], [12, 13, 14, 15])
        >>> lay.mesh_dims(), lay.mesh_shape(), lay.coords(13)
        (('pp', 'dp', 'cp', 'tp'), (4, 2, 1, 2), {'tp': 1, 'cp': 0, 'dp': 0, 'pp': 3})
        """
        if dim not in DENSE_DIMS:
            raise ValueError(f"unknown dimension {dim!r}; dimensions: {', '.join(DENSE_DIMS)}")
        return self._per_order(lambda order: self.stride_in(order, dim))

    def group(self, *dims: str) -> tuple[np.ndarray, np.ndarray]:
        """(size, stride) of the group spanning `dims` together (e.g. `group("dp", "cp")`,
        the ZeRO group). The stride is the innermost member's. Dimensions must be adjacent in the rank
        order (the group is then a strided range) once those of size 1 are left out; a candidate whose
        group is not (tp-cp-ep-pp-dp with cp > 1 for the dp·cp group, which planner.rules refuses) gets the
        product of the sizes at the innermost member's stride."""
        size = np.ones(len(self), dtype=np.int64)
        for d in dims:
            size = size * getattr(self, d)

        def one(order):
            pos = sorted(order.index(d) for d in dims)
            inner = np.full(len(self), len(order))  # the innermost dimension of size > 1 (any, if all are 1)
            for d in dims:
                p = order.index(d)
                inner = np.where(getattr(self, d) > 1, np.minimum(inner, p), inner)
            inner = np.where(inner == len(order), pos[0], inner)
            strides = {p: self.stride_in(order, order[p]) for p in set(pos)}
            out = np.ones(len(self), dtype=np.int64)
            for p, st in strides.items():
                out = np.where(inner == p, st, out)
            return out
        return size, self._per_order(one)

    def stride_in(self, order: list[str], dim: str) -> np.ndarray:
        """`dim`'s stride under `order` (dense dimensions, innermost first) for every candidate."""
        out = np.ones(len(self), dtype=np.int64)
        for d in order[:order.index(dim)]:
            out = out * getattr(self, d)
        return out

    def embedding_group(self) -> tuple[np.ndarray, np.ndarray]:
        """The first and last pipeline ranks holding copies of tied word embeddings:
        (2, (pp-1)·pp stride) when pp > 1, else (1, 1)."""
        two = self.pp > 1
        return np.where(two, 2, 1), np.where(two, (self.pp - 1) * self.stride("pp"), 1)

    def expert_group(self, dim: str) -> tuple[np.ndarray, np.ndarray]:
        """(size, stride) of an expert-mesh group: etp (stride 1), ep (stride etp),
        edp (stride etp·ep)."""
        if dim == "etp":
            return self.etp.copy(), np.ones(len(self), dtype=np.int64)
        if dim == "ep":
            return self.ep.copy(), self.etp.copy()
        if dim == "edp":  # pipeline inside data parallelism (tp-cp-ep-pp-dp): the edp ranks lie pp stages apart
            pp_inside = self._per_order(lambda order: np.full(len(self), order.index("pp") < order.index("dp")))
            return self.expert_dp, self.etp * self.ep * np.where(pp_inside, self.pp, 1)
        raise ValueError(f"unknown expert dimension {dim!r}; dimensions: etp, ep, edp")

    def mesh_dims(self, i: int = 0) -> tuple[str, ...]:
        """Candidate i's dense dimensions outermost first: the axis order of a row-major device mesh
        (e.g. torch's DeviceMesh) whose coordinates are `coords`. Default: pp, dp, cp, tp
        (example in `stride`)."""
        return tuple(reversed(self._order(i)))

    def mesh_shape(self, i: int = 0) -> tuple[int, ...]:
        """Sizes of candidate i along `mesh_dims()`."""
        return tuple(int(getattr(self, d)[i]) for d in self.mesh_dims(i))

    def coords(self, rank: int, i: int = 0) -> dict[str, int]:
        """Coordinates of global `rank` of candidate i along each dense dimension."""
        out, rest = {}, int(rank)
        for d in self._order(i):
            size = int(getattr(self, d)[i])
            out[d] = rest % size
            rest //= size
        return out

    def rank(self, i: int = 0, **coords: int) -> int:
        """Global rank of candidate i at the given coordinates (missing ones are 0)."""
        return int(sum(int(coords.get(d, 0)) * int(self.stride(d)[i]) for d in self._order(i)))

    def stage_ranks(self, stage: int, i: int = 0) -> list[int]:
        """Every global rank of pipeline stage `stage` of candidate i, ascending."""
        world = int(self.num_gpus[i])
        return [r for r in range(world) if self.coords(r, i)["pp"] == stage]

    # ---- stage split ------------------------------------------------------------
    def layers_per_stage(self, i: int = 0) -> list[int]:
        """Transformer layers of each pipeline rank of candidate i, first to last, for a split
        `split_ok` accepts (an impossible one reads as an even split, as the cost model costs it).

        Llama 3.1 405B (126 layers) on pp 16 with vpp 8, embedding and loss counted as
        layers (Llama 3 paper, Sec. 3.3.2: first and last stage one layer short):

        >>> from types import SimpleNamespace as S
        >>> s = S(tp=8, cp=1, dp=1, pp=16, vpp=8, ep=1, etp=1, num_layers_in_first_stage=None,
        ...       num_layers_in_last_stage=None, embedding_as_layer=True, loss_as_layer=True, stage_layers=None)
        >>> counts = ParallelLayout.of_strategy(s, 126).layers_per_stage()
        >>> counts[:2], counts[-1], sum(counts)
        ([7, 8], 7, 126)
        """
        p = int(self.pp[i])
        ex = self.explicit
        if ex is not None and ex.has[i]:
            if ex.shape_ok[i]:
                return [int(x) for x in ex.rank_layers[ex.of(i), :p]]
            return (self.given_split(i) + [0] * p)[:p]
        # Every other split is the stage rows' (rank 0, a middle rank, rank pp-1).
        first, middle, last = (int(self.rows.layers[k, i]) for k in (0, 1, -1))
        return [first] if p == 1 else [first] + [middle] * (p - 2) + [last]

    def layers_per_chunk(self, i: int = 0) -> list[int]:
        """Layers of each virtual stage in schedule order (virtual stage c·pp + r runs on rank r).

        DeepSeek-V3 (61 layers) on Megatron-Bridge's pp 4, vpp 4 layout (one count per virtual
        stage): rank 3 runs virtual stages 3, 7, 11 and 15.

        >>> from types import SimpleNamespace as S
        >>> s = S(tp=1, cp=1, dp=1, pp=4, vpp=4, ep=1, etp=1, num_layers_in_first_stage=None,
        ...       num_layers_in_last_stage=None, stage_layers=[4] * 15 + [1])
        >>> lay = ParallelLayout.of_strategy(s, 61)
        >>> [lay.layers_per_chunk()[j] for j in lay.virtual_stages(3)], lay.layers_per_stage()
        ([4, 4, 4, 1], [16, 16, 16, 13])
        """
        p, v = int(self.pp[i]), int(self.vpp[i])
        ex = self.explicit
        if ex is not None and ex.has[i] and ex.shape_ok[i]:
            return [int(x) for x in ex.chunks[ex.of(i), :p * v]]
        emb, loss = bool(self.embedding_as_layer[i]), bool(self.loss_as_layer[i])
        if emb or loss:  # an even split of L + emb + loss; the first (last) virtual stage has one layer fewer
            each = (self.num_layers + emb + loss) // (p * v)
            out = [each] * (p * v)
            out[0] -= emb
            out[-1] -= loss
            return out
        per_rank = self.layers_per_stage(i)
        return [per_rank[r] // v for _ in range(v) for r in range(p)]

    def largest_chunk(self) -> np.ndarray:
        """Layers of each candidate's largest virtual chunk (float array; the bound of
        `recompute_num_layers`): an explicit split's largest count per virtual stage, else the
        largest of the stage rows' chunks (equal within a rank)."""
        out = self.rows.chunk_layers.max(axis=0)
        ex = self.explicit
        if ex is not None:
            out = np.where(ex.has & self.split_ok(), ex.per_candidate(ex.chunks.max(axis=1)), out)
        return out

    def virtual_stages(self, pp_rank: int, i: int = 0) -> list[int]:
        """The virtual stages pipeline rank `pp_rank` runs, its first chunk first (c·pp + r);
        indices into `layers_per_chunk`."""
        p, v = int(self.pp[i]), int(self.vpp[i])
        return [c * p + pp_rank for c in range(v)]

    def given_split(self, i: int = 0) -> list[int]:
        """Candidate i's `stage_layers` as given (pp or pp·vpp counts; empty when none)."""
        if self.stage_layers is None:
            return []
        return [int(x) for x in self.stage_layers[i] if x >= 0] if (self.stage_layers[i] > 0).any() else []

    @functools.cached_property
    def explicit(self) -> "ExplicitSplit | None":
        """The explicit splits read per virtual stage (None when no candidate has one)."""
        if self.stage_layers is None:
            return None
        # A few distinct (split, pp, vpp) among thousands of candidates: read each once, then spread
        ids = row_ids(np.column_stack([self.split_ids, self.pp, self.vpp]))
        _, first, index = np.unique(ids, return_index=True, return_inverse=True)
        small = _explicit_split(self.stage_layers[first], self.pp[first], self.vpp[first])
        index = index.ravel()
        return ExplicitSplit(has=small.has[index], shape_ok=small.shape_ok[index], chunks=small.chunks,
                             rank_layers=small.rank_layers, row_pp=small.row_pp, index=index)

    @functools.cached_property
    def split_ids(self) -> np.ndarray:
        """One integer per candidate, equal where the explicit `stage_layers` rows are (zeros without any)."""
        if self.stage_layers is None:
            return np.zeros(len(self), dtype=np.int64)
        return row_ids(np.asarray(self.stage_layers) + 1)  # -1 pads: every entry non-negative

    def split_ok(self) -> np.ndarray:
        """Whether each candidate's stage split is possible (bool array): every rank and
        virtual chunk gets a whole, non-negative number of layers summing to L; only the
        first or last rank may be empty, and only when it holds the embedding or the loss.
        An explicit split lists pp counts (each a positive multiple of vpp) or pp·vpp counts
        (each >= 0, every rank holding at least one layer)."""
        L, p, v = self.num_layers, self.pp, self.vpp
        first, last = self.first, self.last
        uneven = (first > 0) | (last > 0)
        emb, loss = self.embedding_as_layer, self.loss_as_layer
        total = L + emb + loss
        even_ok = (total % (p * v) == 0) & (total >= p * v)
        rest = L - first - last
        inner = p - (first > 0) - (last > 0)
        each = rest // np.maximum(inner, 1)
        inner_ok = np.where(inner > 0, (rest > 0) & (rest % np.maximum(inner, 1) == 0), rest == 0)
        per_rank_div = ((first % v) == 0) & ((last % v) == 0) & np.where(inner > 0, each % v == 0, True)
        uneven_ok = (p > 1) & inner_ok & per_rank_div & ~emb & ~loss
        ok = np.where(uneven, uneven_ok, even_ok)
        ex = self.explicit
        if ex is not None:
            counts_ok = (ex.chunks.sum(axis=1) == L) & (ex.chunks >= 0).all(axis=1)
            every_rank = (ex.rank_layers >= 1) | (np.arange(ex.rank_layers.shape[1])[None, :] >= ex.row_pp[:, None])
            explicit_ok = (ex.shape_ok & ex.per_candidate(counts_ok & every_rank.all(axis=1)) & ~uneven & ~emb & ~loss)
            ok = np.where(ex.has, explicit_ok, ok)
        return ok

    def split_message(self, i: int = 0) -> str:
        """Why candidate i's split is impossible, naming the fields and the values."""
        L, p, v = self.num_layers, int(self.pp[i]), int(self.vpp[i])
        ex = self.explicit
        if ex is not None and ex.has[i]:
            return (f"stage_layers {self.given_split(i)} must give each of the pp ({p}) stages at least one "
                    f"layer, a multiple of vpp ({v}), and sum to num_layers ({L})"
                    + (f"; or list pp·vpp ({p * v}) counts >= 0, one per virtual stage, giving every pipeline rank "
                       "at least one layer" if v > 1 else ""))
        if self.first[i] or self.last[i]:
            return (f"uneven pipeline: num_layers ({L}) minus first ({int(self.first[i])}) and last "
                    f"({int(self.last[i])}) stage layers must split evenly over the other stages of pp ({p}), and "
                    f"every stage's layers must be a multiple of vpp ({v}) (not combined with embedding/loss as layers)")
        extra = int(self.embedding_as_layer[i]) + int(self.loss_as_layer[i])
        if extra:
            return f"pp·vpp ({p}·{v}) must divide num_layers ({L}) plus the embedding/loss counted as layers ({extra})"
        return f"pp·vpp ({p}·{v}) must divide num_layers ({L})"

    @functools.cached_property
    def distinct(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The distinct layouts among the candidates: (the first candidate of each, each candidate's
        index into them), or None when there is nothing to gain. Hundreds of thousands of candidates
        (micro-batch, recomputation, ZeRO stage, ... around the same layout) share a few hundred
        layouts, so what depends on the layout alone (its groups, the bytes each stage holds) is
        looked up once per layout.

        >>> import types
        >>> one = lambda *v: np.array(v)
        >>> lay = ParallelLayout(8, one(2, 2, 4, 2), one(1, 1, 1, 1), one(4, 4, 2, 4), one(1, 1, 1, 1), one(1, 1, 1, 1),
        ...                      one(1, 1, 1, 1), one(1, 1, 1, 1), one(0, 0, 0, 0), one(0, 0, 0, 0),
        ...                      np.zeros(4, bool), np.zeros(4, bool))
        >>> first, index = lay.distinct
        >>> first.tolist(), index.tolist()
        ([0, 2], [0, 0, 1, 0])
        """
        n = len(self)
        if n < 2:
            return None
        cols = [self.tp, self.cp, self.dp, self.pp, self.vpp, self.ep, self.etp, self.first, self.last,
                self.embedding_as_layer, self.loss_as_layer, self.orders]
        if self.stage_layers is not None:
            cols.append(self.split_ids)
        key = row_ids(np.stack([np.broadcast_to(np.asarray(c, dtype=np.int64), (n,)) for c in cols], axis=1))
        _, first, index = np.unique(key, return_index=True, return_inverse=True)
        if len(first) == n:
            return None
        return first, index.ravel()

    @property
    def rows(self) -> "StageRows":
        """Per-stage-row arrays (S, N); see the module docstring."""
        if self._rows is None:
            self._rows = _stage_rows(self)
        return self._rows

    def pattern_counts(self, pattern: tuple[int, ...], weights: tuple[float, ...]) -> np.ndarray:
        """Layers of each kind on each stage row (K, S, N), for a model whose layer i is of kind
        `pattern[i]` (0..K-1): the layers a pipeline rank builds are its virtual chunks' ranges
        in `layers_per_chunk` order. With implicit rows, row 1 stands for the middle rank
        heaviest by `weights` (a kind's relative cost; every middle rank has as many layers),
        so a middle rank full of MoE layers binds, not one holding the first dense layers.
        A split the rules reject is costed as L/pp layers of the model's kind mix.

        >>> from types import SimpleNamespace as S
        >>> s = S(tp=1, cp=1, dp=1, pp=4, vpp=1, ep=1, etp=1, num_layers_in_first_stage=None,
        ...       num_layers_in_last_stage=None, embedding_as_layer=False, loss_as_layer=False, stage_layers=None)
        >>> c = ParallelLayout.of_strategy(s, 8).pattern_counts((0, 0, 0, 1, 1, 1, 1, 1), (1.0, 2.0))
        >>> c[:, :, 0].tolist()  # kinds × rows (first, heaviest middle, last)
        [[2.0, 0.0, 0.0], [0.0, 2.0, 2.0]]
        """
        K = max(pattern) + 1
        rows = self.rows
        if K == 1:
            return rows.layers[None, :, :]
        ok = self.split_ok()
        # One integer per split structure (mixed radix; every field is below 2^12, explicit splits are
        # numbered by np.unique over their rows first), so grouping is a 1-D unique.
        key = np.zeros(len(self), dtype=np.int64)
        for col in (self.pp, self.vpp, self.first, self.last):
            key = key * 4096 + col
        key = (key * 2 + self.embedding_as_layer) * 2 + self.loss_as_layer
        key = key * 2 + ok
        if self.stage_layers is not None:
            split_id = self.split_ids
            _, dense_id = np.unique(key, return_inverse=True)  # < N, so the product stays far below 2^63
            key = np.asarray(dense_id).reshape(-1) * (len(self) + 1) + split_id
        uniq, first_of, inverse = np.unique(key, return_index=True, return_inverse=True)
        mix = np.bincount(np.asarray(pattern), minlength=K) / len(pattern)
        per_struct = np.empty((K, rows.num_rows, len(uniq)))
        for u, i in enumerate(first_of):
            if not ok[i]:
                per_struct[:, :, u] = mix[:, None] * rows.layers[None, :, i]
                continue
            by_rank = _rank_kind_counts(pattern, K, tuple(self.layers_per_chunk(int(i))), int(self.pp[i]))
            ranks = rows.rank[:, i].copy()
            p = int(self.pp[i])
            if self.explicit is None or not self.explicit.has[i]:
                if p > 2:
                    w = np.asarray(weights)
                    ranks[1] = 1 + int(np.argmax(by_rank[1:p - 1] @ w))
            per_struct[:, :, u] = by_rank[ranks].T
        return per_struct[:, :, np.asarray(inverse).reshape(-1)]

    # ---- micro-batches -------------------------------------------------------------
    def num_microbatches(self, global_batch_size: int, micro_batch_size: np.ndarray) -> np.ndarray:
        """global_batch_size / (micro_batch_size · dp), at least 1 (divisibility: `batch_ok`)."""
        return np.maximum(global_batch_size // (micro_batch_size * self.dp), 1)

    def batch_ok(self, global_batch_size: int, micro_batch_size: np.ndarray) -> np.ndarray:
        return global_batch_size % (micro_batch_size * self.dp) == 0

    def megatron_schedule_ok(self, num_microbatches: np.ndarray) -> np.ndarray:
        """Megatron-core's interleaved 1F1B needs num_microbatches to be a multiple of pp."""
        return (self.vpp == 1) | (num_microbatches % self.pp == 0)

    def torch_schedule_ok(self, num_microbatches: np.ndarray) -> np.ndarray:
        """torch.distributed.pipelining: 1F1B needs num_microbatches >= pp; the interleaved
        schedule needs num_microbatches to be a multiple of max(1, num_microbatches // pp)."""
        m, p = num_microbatches, self.pp
        plain = (p == 1) | (m >= p)
        rounds = np.maximum(1, m // p)
        return np.where(self.vpp > 1, m % rounds == 0, plain)

    def torch_schedule_message(self, num_microbatches: int, i: int = 0) -> str:
        """Why candidate i's schedule is refused by `torch_schedule_ok` (empty when it is not)."""
        m, p, v = int(num_microbatches), int(self.pp[i]), int(self.vpp[i])
        if bool(self.torch_schedule_ok(np.array([m]))[i]):
            return ""
        if v == 1:
            return f"1F1B needs num_microbatches ({m}) >= pp ({p})"
        return (f"interleaved 1F1B needs num_microbatches ({m}) to be a multiple of "
                f"max(1, num_microbatches // pp) ({max(1, m // p)})")

    def inflight_chunks(self, rank: np.ndarray, num_microbatches: np.ndarray) -> np.ndarray:
        """(micro-batch, chunk) activation sets pipeline rank `rank` holds at its peak."""
        p, v, m = self.pp, self.vpp, np.maximum(num_microbatches, 1)
        interleaved = np.minimum(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
        plain = np.minimum(p - rank, m)
        return np.where(v > 1, interleaved, plain)

    def inflight_microbatches(self, rank: np.ndarray, num_microbatches: np.ndarray) -> np.ndarray:
        """Micro-batches whose stage input (ids, embedding output) rank `rank` holds at its peak."""
        return np.minimum(self.pp - rank, np.maximum(num_microbatches, 1))

    def pipeline_transfers(self, num_microbatches: np.ndarray) -> np.ndarray:
        """Point-to-point activation transfers on a pipeline's critical path per step: one
        forward and one backward per (micro-batch, chunk), plus the pp - 1 fill hops; 0 at pp = 1."""
        return np.where(self.pp > 1, 2 * (np.maximum(num_microbatches, 1) * self.vpp + self.pp - 1), 0)

    def blocking_transfers(self, num_microbatches: np.ndarray) -> np.ndarray:
        """Of `pipeline_transfers`, those that block even when the interleaved schedule overlaps the
        steady-state ones (megatron-core schedules.py, overlap_p2p_comm without
        overlap_p2p_comm_warmup_flush): the first rank's warm-up forwards, 2·(pp - 1) + (vpp - 1)·pp
        (capped at m·vpp), the cool-down's as many backwards, and the pp - 1 fill hops each way.

        >>> lay = ParallelLayout(8, *(np.array([v]) for v in (1, 1, 1, 4, 2, 1, 1, 0, 0)), np.zeros(1, bool),
        ...                      np.zeros(1, bool))
        >>> int(lay.pipeline_transfers(np.array([16]))[0]), int(lay.blocking_transfers(np.array([16]))[0])
        (70, 26)
        """
        p, v, m = self.pp, self.vpp, np.maximum(num_microbatches, 1)
        warm = np.minimum(2 * (p - 1) + (v - 1) * p, m * v)
        return np.where(p > 1, 2 * (warm + p - 1), 0)

    def bubble_fraction(self, num_microbatches: np.ndarray) -> np.ndarray:
        """Pipeline bubble over ideal time: (pp - 1) / (vpp · m) (SC'21 Sec. 2.2.2)."""
        return (self.pp - 1) / (self.vpp * np.maximum(num_microbatches, 1))


def row_ids(matrix: np.ndarray) -> np.ndarray:
    """One int64 per row of a (N, C) matrix of small non-negative integers, equal exactly where the rows
    are equal: a mixed-radix number over the columns, renumbered (1-D unique) before it could overflow;
    a wide matrix is hashed to one column first (the index of each hash's first row), and the hash is
    kept only when every row equals its hash's first row. Much faster than np.unique(axis=0), which
    sorts the rows as byte strings.

    >>> row_ids(np.array([[1, 2], [0, 5], [1, 2]])).tolist()
    [8, 5, 8]
    >>> ids = row_ids(np.array([[4, 4, 4, 4, 1], [0, 0, 0, 0, 0], [4, 4, 4, 4, 1], [4, 4, 4, 1, 4]]))
    >>> bool(ids[0] == ids[2]), bool(ids[0] == ids[3]), bool(ids[1] == ids[3])
    (True, False, False)
    """
    m = np.asarray(matrix, dtype=np.int64)
    if m.shape[1] > 4 and m.shape[0] > 1:  # wide: one hashed column, checked exactly, instead of radix renumbering
        weights = np.random.default_rng(0x5EED).integers(1, 2**62, size=m.shape[1], dtype=np.int64) | 1
        with np.errstate(over="ignore"):
            hashed = m @ weights  # wraps modulo 2^64
        _, first, inverse = np.unique(hashed, return_index=True, return_inverse=True)
        inverse = inverse.ravel()
        if (m == m[first][inverse]).all():  # no two different rows share a hash
            return first[inverse].astype(np.int64)
    key = np.zeros(m.shape[0], dtype=np.int64)
    for c in m.T:
        radix = int(c.max()) + 1 if len(c) else 1
        if len(key) and int(key.max()) >= (2**62) // radix:
            key = np.unique(key, return_inverse=True)[1].ravel().astype(np.int64)
        key = key * radix + c
    return key


@dataclass
class ExplicitSplit:
    """Explicit `stage_layers` of N candidates read per virtual stage. The tables hold one row per
    distinct (split, pp, vpp) and `index` maps each candidate to its row (thousands of candidates share
    a few splits); `of(i)` gives candidate i's row."""

    has: np.ndarray  # (N,) bool: the candidate gives an explicit split
    shape_ok: np.ndarray  # (N,) bool: pp counts that are multiples of vpp, or pp·vpp counts
    chunks: np.ndarray  # (U, Q) int: layers of virtual stage j (0 past pp·vpp or where shape_ok is False)
    rank_layers: np.ndarray  # (U, R) int: layers of pipeline rank r, the sum of its chunks (R = largest pp)
    row_pp: np.ndarray  # (U,) int: the pipeline depth of each row
    index: np.ndarray  # (N,) int: each candidate's row

    def of(self, i: int) -> int:
        return int(self.index[i])

    def per_candidate(self, values: np.ndarray) -> np.ndarray:
        """A per-row array spread to the candidates."""
        return values[self.index]


def _explicit_split(sl: np.ndarray, pp: np.ndarray, vpp: np.ndarray) -> ExplicitSplit:
    """Read -1-padded `stage_layers` rows of pp counts (rank r's chunks each get count/vpp) or
    pp·vpp counts (virtual stage j on rank j mod pp) as counts per virtual stage."""
    n = sl.shape[0]
    has = (sl > 0).any(axis=1)
    length = (sl >= 0).sum(axis=1)
    stages = pp * vpp
    per_stage = has & (length == stages)
    per_rank = has & (length == pp) & ~per_stage
    Q = int(stages[has].max()) if has.any() else 1
    R = int(pp[has].max()) if has.any() else 1
    W = max(Q, sl.shape[1])
    wide = np.concatenate([sl, np.full((n, W - sl.shape[1]), -1, dtype=np.int64)], axis=1) if W > sl.shape[1] else sl
    j = np.arange(Q)[None, :]
    inside = j < stages[:, None]
    of_rank = np.take_along_axis(wide, j % pp[:, None], axis=1)
    divides = np.all(np.where(np.arange(W)[None, :] < pp[:, None], wide % vpp[:, None] == 0, True), axis=1)
    shape_ok = per_stage | (per_rank & divides)
    chunks = np.where(per_stage[:, None], wide[:, :Q], of_rank // vpp[:, None])
    chunks = np.where(inside & shape_ok[:, None], chunks, 0).astype(np.int64)
    rank_layers = np.zeros((n, R), dtype=np.int64)
    for r in range(R):
        rank_layers[:, r] = np.where((j % pp[:, None] == r) & inside, chunks, 0).sum(axis=1)
    return ExplicitSplit(has=has, shape_ok=shape_ok, chunks=chunks, rank_layers=rank_layers, row_pp=np.asarray(pp),
                         index=np.arange(n))


@dataclass
class StageRows:
    """Per stage row (axis 0) and candidate (axis 1)."""

    rank: np.ndarray  # pipeline rank of the row
    layers: np.ndarray  # transformer layers on the rank (float; L/pp where the split is impossible)
    chunk_layers: np.ndarray  # layers per virtual chunk of the rank (layers / vpp: its average chunk)
    has_embedding: np.ndarray  # bool: the rank holds the input embedding
    has_head: np.ndarray  # bool: the rank holds the output layer and the loss
    kind: np.ndarray  # 0 first, 1 middle, 2 last (for reports; pp = 1 is "first")

    @property
    def num_rows(self) -> int:
        return int(self.rank.shape[0])


def _stage_rows(lay: ParallelLayout) -> StageRows:
    L, p, v, n = lay.num_layers, lay.pp, lay.vpp, len(lay)
    ok = lay.split_ok()
    first, last = lay.first, lay.last
    emb, loss = lay.embedding_as_layer, lay.loss_as_layer
    # Layers of rank 0, of a middle rank and of rank pp-1 under the even / uneven rules.
    even = (L + emb + loss) / (p * v) * v
    rest = L - np.where(first > 0, first, 0) - np.where(last > 0, last, 0)
    inner = p - (first > 0) - (last > 0)
    mid = np.where(inner > 0, rest / np.maximum(inner, 1), even)
    mid = np.where((first > 0) | (last > 0), mid, even)
    first_l = np.where(first > 0, first, mid) - np.where((first == 0) & (last == 0), emb, 0)
    last_l = np.where(last > 0, last, mid) - np.where((first == 0) & (last == 0), loss, 0)
    first_l = np.where(p == 1, L, first_l)
    last_l = np.where(p == 1, L, last_l)
    mid = np.where(p <= 2, first_l, mid)
    layers = np.stack([first_l, mid, last_l]).astype(float)
    rank = np.stack([np.zeros(n, dtype=np.int64), np.where(p <= 2, 0, 1), p - 1])
    ex = lay.explicit
    if ex is not None:
        explicit = ex.has
        rank_layers = ex.per_candidate(ex.rank_layers)
        P = rank_layers.shape[1]
        S = max(P, 3)
        r = np.arange(S)[:, None]
        # Row r is rank r up to rank pp-2, the last row is rank pp-1 and rows between repeat rank 0, so that
        # for every candidate row 0 is the first rank and row -1 the last (as without explicit splits)
        r_cand = np.where(r == S - 1, p[None, :] - 1, np.where(r < p[None, :] - 1, r, 0))
        sl = np.concatenate([rank_layers.T, np.zeros((S - P, n), dtype=np.int64)]) if S > P else rank_layers.T
        ex_layers = np.take_along_axis(sl, np.minimum(r_cand, S - 1), axis=0).astype(float)  # only explicit ones read
        # Implicit rows widened to S: first, middle, copies of the middle, last.
        pad = S - 3
        imp_layers = np.concatenate([layers[:2], np.repeat(layers[1:2], pad, axis=0), layers[2:]]) if pad else layers
        imp_rank = np.concatenate([rank[:2], np.repeat(rank[1:2], pad, axis=0), rank[2:]]) if pad else rank
        layers = np.where(explicit[None, :], ex_layers, imp_layers)
        rank = np.where(explicit[None, :], r_cand, imp_rank)
    # An impossible split (the rules reject it and say why) is costed as an even one, so that
    # `evaluate` still reports finite, non-negative terms next to its reasons.
    layers = np.where(ok[None, :], layers, L / p)
    has_embedding = rank == 0
    has_head = rank == (p - 1)[None, :]
    kind = np.where(rank == (p - 1)[None, :], 2, np.where(rank == 0, 0, 1))
    kind = np.where((p == 1)[None, :], 0, kind)
    return StageRows(rank=rank, layers=layers, chunk_layers=layers / v, has_embedding=has_embedding,
                     has_head=has_head, kind=kind)


@functools.lru_cache(maxsize=8192)
def _rank_kind_counts(pattern: tuple[int, ...], num_kinds: int, chunks: tuple[int, ...], pp: int) -> np.ndarray:
    """(pp, K) layers of each kind per pipeline rank; virtual stage j runs on rank j % pp."""
    kinds = np.asarray(pattern)
    out = np.zeros((pp, num_kinds))
    start = 0
    for j, n in enumerate(chunks):
        out[j % pp] += np.bincount(kinds[start:start + n], minlength=num_kinds)
        start += n
    out.setflags(write=False)
    return out
