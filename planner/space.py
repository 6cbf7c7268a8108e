"""The search space: every strategy worth scoring, as StrategyArrays.

Default choices per field (constraints replace them):
- tp, cp, pp: divisors of the GPU count; tp dividing both the query and KV head counts and at most the
  cluster's NVLink domain (tensor parallelism across the scale-out network is never worth scoring by
  default; a constraint can still ask for it), pp ≤ num_layers,
  cp only where each rank keeps at least `MIN_CP_TOKENS` tokens; dp = GPUs / (tp·cp·pp).
- Pipeline splits, per (pp, vpp) with pp > 1 (vpp: every value that makes one of them
  possible; whether a split is possible is always `ParallelLayout.split_ok`'s answer):
  - even: L / (pp·vpp) layers per virtual chunk;
  - embedding and/or loss counted as layers (Megatron's --account-for-embedding- and
    --account-for-loss-in-pipeline-split) when pp·vpp divides L + 2 (both) or L + 1 (one);
    Llama 3.1 405B's published pp 16 × vpp 8 layout is the first of these (126 + 2 = 128);
  - first / last ranks shaved (Megatron's first/last-stage layer counts): middle ranks hold
    m layers, the first and last m - a·vpp and m - b·vpp, for (a, b) in `SHAVES` (a, b whole
    layers shaved per chunk, at most `MAX_SHAVE` from each end; m solves (pp - 2)·m + first +
    last = L and is a multiple of vpp, so each rank's chunks stay equal). This covers the
    uneven split when pp·vpp does not divide L (Llama 3's 7/8…8/7 on pp 16, DeepSeek-V3's
    61 layers) and the lighter first/last rank when it does (the first rank keeps the most
    micro-batches in flight, the last carries the output layer and the loss).
  - a constrained vpp > 1 that none of those serves: every virtual stage ⌈L/(pp·vpp)⌉ layers but the
    last, which holds the rest (`short_last_split`, an explicit split: DeepSeek-V3's 61 layers on pp 4 x
    vpp 4 as Megatron-Bridge's recipes lay them out); not tried unless vpp is constrained;
  - when none of those exists, today's fallback: middle ranks ⌈L/pp⌉, the first and last share
    the rest, and the first rank full with the last holding the remainder (DeepSeek-V3's 61 layers on pp 16
    as 4 x 15 + 1, Megatron-Bridge's layout; vpp 1, only where vpp 1 is allowed), and failing that the plain
    even split, which the rules reject and count.
  Splits that give the same layers per chunk are kept once (even, then shaved, then
  embedding/loss: with vpp 1 embedding+loss is the same split as shaving one layer per end).
- stage_layers: only as constrained: pp counts (vpp: the divisors of all of them, or as
  constrained) or pp·vpp counts, one per virtual stage (vpp = their number / pp), so one
  per-virtual-stage list of 16 counts is a plan for pp 16, 8, 4 and 2 with vpp 1, 2, 4 and 8
  (Megatron-Bridge's DeepSeek-V3 layouts). num_layers_in_first/last_stage, embedding_as_layer,
  loss_as_layer: as above, or as constrained (a constrained first/last keeps only those; vpp
  then ranges over the divisors of the given counts).
- micro_batch_size: every divisor of global_batch_size / dp.
- sequence_parallel: off, and on when tp > 1; only on for a mixture-of-experts model with
  tp > 1 (Megatron-core needs it there). zero_stage: 0-3.
- ep, etp (mixture-of-experts models; dense models keep 1, 1): etp in {1, tp} (Megatron's two
  common choices) and ep every divisor of num_experts such that etp·ep divides tp·cp·dp (the
  expert mesh is folded over the attention's tensor, context and data ranks).
- offload_optimizer: off, and on wherever zero_stage >= 1 (the search scores the offloaded
  twin of a plan only when the plan does not fit without it: offload only adds time).
- recompute: none, selective, full (all layers) and full with recompute_num_layers (Megatron's
  block method) on the ladder `RECOMPUTE_LAYER_STEPS` below the layers per chunk. recompute_modules:
  unset (selective recompute is core_attn), and for mixture-of-experts and latent-attention models the
  search adds, for each plan over the memory limit without recomputation, its twins that recompute
  `planner.search.MODULE_RECOMPUTE_SETS` (moe_act, layernorm, mla_up_proj), unless a constraint fixes
  recompute or recompute_modules.
- offload_activation_layers: off (the search adds, for each plan that does not fit with pp 1 and no
  recomputation, the twin that offloads just enough layers' activations to fit).
- overlap_grad_reduce / overlap_param_gather / overlap_p2p_comm: on. overlap_moe_comm: off (a constraint turns it on:
  Megatron's restrictions on it, below the rules, would halve the MoE space to search it).
- rank_order: Megatron's default tp-cp-ep-dp-pp, and for framework megatron also tp-cp-ep-pp-dp
  (--use-tp-pp-dp-mapping) wherever the two differ and the rules allow it: pp > 1, dp > 1, cp 1 and, for an
  MoE model, etp·ep = tp·cp. Which is faster depends on the fabric: pipeline transfers inside an NVLink
  domain or a pod against data-parallel rings spread over more of them.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from cost_models.arrays import RANK_ORDER_CODE, RECOMPUTE_CODE, RECOMPUTE_MODULES, StrategyArrays, modules_mask
from cost_models.layout import ParallelLayout
from planner.errors import SpecError, short_repr
from planner.rules import RULES, Context, check, first_failure_counts
from planner.specs import Strategy
from planner.specs.base import MAX_BATCH, MAX_GPUS, MAX_LAYERS

#: A context-parallel rank below this many tokens leaves GEMMs too thin to be worth scoring by default.
MIN_CP_TOKENS = 512

STRATEGY_FIELDS = tuple(Strategy.model_fields)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (from n's prime factors: fast for any n the specs allow)."""
    return list(_divisors(int(n)))


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    if n < 1:
        return ()
    out = [1]
    rest, p = n, 2
    while p * p <= rest:
        k = 0
        while rest % p == 0:
            rest //= p
            k += 1
        if k:
            out = [d * p**e for d in out for e in range(k + 1)]
        p += 1 if p == 2 else 2
    if rest > 1:
        out += [d * rest for d in out]
    return tuple(sorted(out))


#: The most values one constraint may list (after duplicates are dropped).
MAX_CONSTRAINT_VALUES = 256


INT_FIELDS = {"dp", "tp", "pp", "cp", "ep", "etp", "vpp", "micro_batch_size", "zero_stage"}
OPTIONAL_INT_FIELDS = {"recompute_num_layers", "num_layers_in_first_stage", "num_layers_in_last_stage",
                       "offload_activation_layers"}
#: Constraint fields that count transformer layers: bounded by MAX_LAYERS as Strategy bounds them, and
#: by the model's own num_layers once the model is known (`check_against_model`).
LAYER_COUNT_FIELDS = ("num_layers_in_first_stage", "num_layers_in_last_stage", "recompute_num_layers",
                      "offload_activation_layers")
#: The largest value of an integer constraint (the bound its Strategy field has); the rest: MAX_GPUS.
INT_HIGH = {"zero_stage": 3, "micro_batch_size": MAX_BATCH, **{k: MAX_LAYERS for k in LAYER_COUNT_FIELDS}}
BOOL_FIELDS = {"sequence_parallel", "offload_optimizer", "overlap_grad_reduce", "overlap_param_gather", "overlap_moe_comm",
               "overlap_p2p_comm",
               "embedding_as_layer", "loss_as_layer"}


def _check_value(key: str, v: Any) -> Any:
    if key == "dp" and v == "auto":
        return v
    if key in INT_FIELDS or key in OPTIONAL_INT_FIELDS:
        if v is None and key in OPTIONAL_INT_FIELDS:
            return v
        low = 0 if key == "zero_stage" else 1
        high = INT_HIGH.get(key, MAX_GPUS)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            rule = "an integer 0..3" if key == "zero_stage" else f"an integer between {low} and {high}"
            raise SpecError(f"constraint {key}={short_repr(v)} must be {rule}")
        return v
    if key in BOOL_FIELDS:
        if not isinstance(v, bool):
            raise SpecError(f"constraint {key}={v!r} must be true or false")
        return v
    if key == "stage_layers":
        if v is None:
            return v
        if (not isinstance(v, (list, tuple)) or not v or len(v) > MAX_LAYERS
                or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LAYERS for n in v)
                or not any(v)):
            raise SpecError(f"constraint stage_layers={v!r} must be a list of layer counts >= 0 (at least one "
                            "positive), one per pipeline stage or one per virtual stage")
        return tuple(v)
    if key == "recompute_modules":  # one list of Megatron module names -> its bit mask (0: not set)
        if v is None:
            return 0
        if (not isinstance(v, (list, tuple)) or not v
                or any(not isinstance(m, str) or m not in RECOMPUTE_MODULES for m in v)):
            raise SpecError(f"constraint recompute_modules={v!r} must be a list of {', '.join(RECOMPUTE_MODULES)}")
        return modules_mask(list(v))
    if key == "rank_order":
        if not isinstance(v, str) or v not in RANK_ORDER_CODE:
            raise SpecError(f"constraint rank_order={short_repr(v)} must be one of {', '.join(RANK_ORDER_CODE)}")
        return RANK_ORDER_CODE[v]
    if key == "recompute":
        if not isinstance(v, str) or v not in RECOMPUTE_CODE:
            raise SpecError(f"constraint recompute={v!r} must be one of {', '.join(RECOMPUTE_CODE)}")
        return v
    raise SpecError(f"constraint field {key!r} cannot be constrained")


CONSTRAINTS_RULE = "a mapping of Strategy field -> value or list of values, e.g. {'tp': 4, 'pp': [2, 4]}"


def normalise_constraints(constraints: dict[str, Any], model=None) -> dict[str, list[Any]]:
    """Validate constraint keys and values (against `model`'s layer count too when it is given,
    `check_against_model`); each becomes a list of allowed values."""
    if not isinstance(constraints, dict):
        raise SpecError(f"constraints must be {CONSTRAINTS_RULE} (got {type(constraints).__name__} "
                        f"{short_repr(constraints)})")
    out: dict[str, list[Any]] = {}
    for key, value in constraints.items():
        if key not in STRATEGY_FIELDS:
            raise SpecError(f"unknown constraint field {key!r}; fields: {', '.join(STRATEGY_FIELDS)}")
        if key in ("stage_layers", "recompute_modules"):  # one list, or a list of lists to choose from
            nested = isinstance(value, (list, tuple)) and bool(value) and all(
                isinstance(v, (list, tuple)) or v is None for v in value)
            values = list(value) if nested else [value]
        else:
            values = list(value) if isinstance(value, (list, tuple, set)) else [value]
        if not values:
            raise SpecError(f"constraint {key!r} allows no value (empty list)")
        checked = list(dict.fromkeys(_check_value(key, v) for v in values))  # duplicates once, order kept
        if len(checked) > MAX_CONSTRAINT_VALUES:
            raise SpecError(f"constraint {key!r} lists {len(checked)} values; at most {MAX_CONSTRAINT_VALUES}")
        out[key] = checked
    if any(out.get("recompute_modules", [])) and "recompute" not in out:
        out["recompute"] = ["selective"]  # modules are what selective recompute repeats
    if model is not None:
        check_against_model(out, model)
    return out


def check_against_model(cons: dict[str, list[Any]], model) -> None:
    """Refuse a layer count no layout of `model` can hold: a first/last-stage count, a recompute or an
    activation-offload layer count, or one stage's count in stage_layers above the model's num_layers
    (values that fit the model but not a given layout are left to the rules, which count them)."""
    L = model.num_layers
    for key in LAYER_COUNT_FIELDS:
        for v in cons.get(key, []):
            if v is not None and v > L:
                raise SpecError(f"constraint {key}={v} must be at most the model's num_layers ({L})")
    for split in cons.get("stage_layers", []):
        if split is not None and max(split) > L:
            raise SpecError(f"constraint stage_layers={list(split)} must hold at most the model's num_layers "
                            f"({L}) on any stage (got {max(split)})")


def _allowed(cons: dict[str, list[Any]], key: str, default: list[Any]) -> list[Any]:
    return list(cons[key]) if key in cons else default


#: Layers shaved from each virtual chunk of the first and of the last pipeline rank, at most.
MAX_SHAVE = 1
#: (first, last) shaves tried per (pp, vpp), fewest layers moved first.
SHAVES = tuple(sorted(((a, b) for a in range(MAX_SHAVE + 1) for b in range(MAX_SHAVE + 1) if a or b),
                      key=lambda ab: (ab[0] + ab[1], abs(ab[0] - ab[1]))))


#: Rules that read the recompute fields. The search checks every other rule once per "head"
#: (a candidate with its recompute choice left out) and expands only the heads that pass; the
#: generated recompute_num_layers never exceed the largest chunk, so while recompute_num_layers
#: is not constrained these rules cannot fail (tests compare both paths).
def _recompute_rules_can_fail(cons: dict[str, list[Any]]) -> bool:
    """Whether a rule that reads a candidate's recompute choice can reject one: the enumerated
    choices always satisfy them (recompute_num_layers within the chunk, no recompute modules, no
    overlapped MoE all-to-all, no activation offloading) unless a constraint asks for those fields."""
    return ("recompute_num_layers" in cons or any(cons.get("recompute_modules", []))
            or True in cons.get("overlap_moe_comm", []) or any(cons.get("offload_activation_layers", [])))


@dataclass
class Heads:
    """Candidates without their recompute choice: `arrays` has recompute 'none' in every row,
    and head i stands for the recompute choices `choices[choice_id[i], :num_choices[i]]`
    (rows of (recompute code, recompute_num_layers))."""

    arrays: StrategyArrays
    choice_id: np.ndarray
    choices: np.ndarray  # (C, K, 2), 0-padded
    num_choices_of: np.ndarray  # (C,)

    @property
    def num_choices(self) -> np.ndarray:
        return self.num_choices_of[self.choice_id]

    def expand(self, index: np.ndarray | None = None) -> StrategyArrays:
        """Every candidate of the heads `index` (all when None), head by head, recompute innermost."""
        index = np.arange(len(self.arrays)) if index is None else np.asarray(index)
        k = self.num_choices[index]
        rows = np.repeat(index, k)
        starts = np.cumsum(k) - k
        pos = np.arange(int(k.sum())) - np.repeat(starts, k)
        picked = self.choices[self.choice_id[rows], pos]
        out = self.arrays.take(rows)
        out.recompute, out.recompute_num_layers = picked[:, 0].copy(), picked[:, 1].copy()
        return out


@dataclass
class SearchSpace:
    """What the search scores: the valid candidates, how many were enumerated, and how many each
    rule rejected (each counted once, under the first rule it breaks, in planner.rules order)."""

    valid: StrategyArrays
    num_candidates: int
    rejected: dict[str, int]


def enumerate_space(model, train, num_gpus: int, constraints: dict[str, Any], cluster=None) -> StrategyArrays:
    """All candidate strategies for the question, constraints applied (tp bounded by the
    cluster's NVLink domain when a cluster is given)."""
    return enumerate_heads(model, train, num_gpus, normalise_constraints(constraints, model), cluster).expand()


def search_space(model, train, num_gpus: int, constraints: dict[str, Any], cluster=None) -> SearchSpace:
    """The valid candidates and the rejection counts, as `planner.rules.check` on
    `enumerate_space` gives them, without building the candidates that rules reject whatever
    their recompute choice (checked once per head, counted once per candidate)."""
    cons = normalise_constraints(constraints, model)
    heads = enumerate_heads(model, train, num_gpus, cons, cluster)
    ctx = Context(model, train, num_gpus, cluster)
    # a head's verdict would not hold for all its choices: adapter plans refuse selective and partial recompute
    # (planner.rules ADAPTER_RULE), and their space is data parallel only, small enough to check whole
    if _recompute_rules_can_fail(cons) or getattr(train, "transformers", False):
        space = heads.expand()
        valid, failures = check(ctx, space)
        return SearchSpace(space.take(valid), len(space), first_failure_counts(failures))
    valid, failures = check(ctx, heads.arrays)
    k = heads.num_choices
    rejected: dict[str, int] = {}
    taken = np.zeros(len(k), dtype=bool)
    for rule in RULES:
        new = failures[rule.key] & ~taken
        n = int(k[new].sum())
        if n:
            rejected[rule.key] = n
        taken |= new
    return SearchSpace(heads.expand(np.flatnonzero(valid)), int(k.sum()), rejected)


def enumerate_heads(model, train, num_gpus: int, cons: dict[str, list[Any]], cluster=None) -> Heads:
    """Every candidate for the question as heads (see `Heads`); `cons` already normalised."""
    L, s, B = model.num_layers, train.seq_len, train.global_batch_size
    divs = divisors(num_gpus)
    head_groups = math.gcd(model.num_attention_heads, model.kv_heads)
    max_tp = cluster.domain_size if cluster is not None else num_gpus
    tps = _allowed(cons, "tp", [d for d in divs if head_groups % d == 0 and d <= max_tp])
    cps = _allowed(cons, "cp", [d for d in divs if d == 1 or (s % (2 * d) == 0 and s // d >= MIN_CP_TOKENS)])
    pps = _allowed(cons, "pp", [d for d in divs if d <= L])
    # only degrees dividing the GPU count can combine to it (the loop below skips the rest)
    tps, cps, pps = ([d for d in ds if num_gpus % d == 0] for ds in (tps, cps, pps))
    dps = cons.get("dp")
    zeros = tuple(_allowed(cons, "zero_stage", [0, 1, 2, 3]))
    offloads = tuple(_allowed(cons, "offload_optimizer", [False, True]))
    free_offload = "offload_optimizer" not in cons  # searched offload only where zero_stage >= 1
    pipe_key = _pipeline_key(cons)
    rc_key = (tuple(_allowed(cons, "recompute", ["none", "selective", "full"])),
              None if cons.get("recompute_num_layers") is None else tuple(cons["recompute_num_layers"]))
    ep_key = tuple(cons["ep"]) if "ep" in cons else None
    etp_key = tuple(cons["etp"]) if "etp" in cons else None
    moe = model.num_experts > 0
    orders = cons.get("rank_order")  # None: the default order, and Megatron's tp-pp-dp mapping where it differs
    alt_order = getattr(train, "framework", "megatron") == "megatron"
    # One row per structure: (dp, tp, pp, cp, ep, etp, vpp, first, last, split index, emb, loss, choice id,
    # rank order code).
    structure: list[tuple[int, ...]] = []
    split_index: dict[tuple[int, ...], int] = {(): 0}  # explicit stage_layers choices; index 0 = none
    choice_index: dict[tuple, int] = {}  # recompute choice lists
    blocks: list[np.ndarray] = []  # per structure: (k, 4) rows of (mbs, sp, zero, offload)
    for tp, cp, pp in itertools.product(tps, cps, pps):
        if num_gpus % (tp * cp * pp):
            continue
        dp = num_gpus // (tp * cp * pp)
        if dps is not None and dp not in dps and "auto" not in dps:
            continue
        mbss = tuple(_allowed(cons, "micro_batch_size", divisors(B // dp) if B % dp == 0 else [1]))
        sps = tuple(_allowed(cons, "sequence_parallel", [False] if tp == 1 else [True] if moe else [False, True]))
        grid = _grid(mbss, sps, zeros, offloads, free_offload)
        experts = _expert_choices(model.num_experts, tp, tp * cp * dp, ep_key, etp_key)
        for vpp, first, last, explicit, emb, loss, chunk in _pipeline_splits(L, pp, pipe_key):
            index = split_index.setdefault(explicit, len(split_index))
            choice = choice_index.setdefault(_recompute_choices(rc_key, chunk), len(choice_index))
            for ep, etp in experts:
                if orders is not None:
                    codes = orders
                elif alt_order and pp > 1 and dp > 1 and cp == 1 and (not moe or ep * etp == tp * cp):
                    codes = (0, 1)  # the two orders place pipeline and data-parallel groups differently
                else:
                    codes = (0,)  # the orders coincide (pp or dp of 1), or the rules refuse the other
                for code in codes:
                    structure.append((dp, tp, pp, cp, ep, etp, vpp, first, last, index, emb, loss, choice, code))
                    blocks.append(grid)
    if not blocks:
        raise SpecError(_empty_space_message(num_gpus, cons))
    sizes = np.fromiter((len(b) for b in blocks), dtype=np.int64, count=len(blocks))
    struct = np.repeat(np.array(structure, dtype=np.int64), sizes, axis=0)
    inner = np.concatenate(blocks)
    n = len(inner)
    cols = {
        "dp": struct[:, 0], "tp": struct[:, 1], "pp": struct[:, 2], "cp": struct[:, 3], "ep": struct[:, 4],
        "etp": struct[:, 5], "vpp": struct[:, 6],
        "num_layers_in_first_stage": struct[:, 7], "num_layers_in_last_stage": struct[:, 8],
        "micro_batch_size": inner[:, 0], "sequence_parallel": inner[:, 1].astype(bool), "zero_stage": inner[:, 2],
        "offload_optimizer": inner[:, 3].astype(bool), "recompute": 0, "recompute_num_layers": 0,
        "stage_layers": _split_table(list(split_index))[struct[:, 9]] if len(split_index) > 1 else np.zeros((n, 0)),
        "embedding_as_layer": struct[:, 10].astype(bool), "loss_as_layer": struct[:, 11].astype(bool),
        "rank_order": struct[:, 13],
    }
    lists = list(choice_index)
    width = max(len(c) for c in lists)
    choices = np.zeros((len(lists), width, 2), dtype=np.int64)
    for i, c in enumerate(lists):
        choices[i, :len(c)] = c
    num_choices_of = np.array([len(c) for c in lists], dtype=np.int64)
    choice_id = struct[:, 12]
    rare = _inner_columns(cons)
    base = StrategyArrays.from_columns({**cols, **{k: v[0] for k, v in rare.items()}}, n)
    combos = list(itertools.product(*rare.values()))
    if len(combos) == 1:
        return Heads(base, choice_id, choices, num_choices_of)
    parts = []
    for combo in combos:
        part = base.take(np.arange(len(base)))  # a copy: the loop below writes into it
        for key, value in zip(rare, combo):
            getattr(part, key)[:] = value
        parts.append(part)
    return Heads(StrategyArrays.concat(parts), np.tile(choice_id, len(combos)), choices, num_choices_of)


@functools.lru_cache(maxsize=4096)
def _grid(mbss: tuple, sps: tuple, zeros: tuple, offloads: tuple, free_offload: bool) -> np.ndarray:
    """Cartesian product of the per-structure choices as an (n, 4) integer array of (mbs, sp,
    zero, offload); a searched (unconstrained) offload_optimizer is kept only where zero_stage >= 1."""
    axes = [np.asarray(a, dtype=np.int64) for a in (mbss, sps, zeros, offloads)]
    out = np.stack([a.ravel() for a in np.meshgrid(*axes, indexing="ij")], axis=1)
    if free_offload:
        out = out[(out[:, 3] == 0) | (out[:, 2] >= 1)]
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=4096)
def _expert_choices(num_experts: int, tp: int, folded: int, eps: tuple | None, etps: tuple | None
                    ) -> tuple[tuple[int, int], ...]:
    """(ep, etp) pairs for one (tp, tp·cp·dp): dense models 1, 1; mixture-of-experts models etp in
    {1, tp} and every ep dividing num_experts with etp·ep dividing tp·cp·dp (constraints replace
    either list; what they allow is left to the rules to accept or explain)."""
    if not num_experts:
        return tuple(itertools.product(eps or (1,), etps or (1,)))
    out: list[tuple[int, int]] = []
    for etp in etps or sorted({1, tp}):
        allowed = eps or [e for e in divisors(num_experts) if folded % (etp * e) == 0] or [1]
        out += [(e, etp) for e in allowed]
    return tuple(out)


def _inner_columns(cons: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Fields that are rarely searched: one value each unless constrained to several."""
    return {
        "recompute_modules": _allowed(cons, "recompute_modules", [0]),
        "overlap_grad_reduce": _allowed(cons, "overlap_grad_reduce", [True]),
        "overlap_param_gather": _allowed(cons, "overlap_param_gather", [True]),
        "overlap_moe_comm": _allowed(cons, "overlap_moe_comm", [False]),
        "overlap_p2p_comm": _allowed(cons, "overlap_p2p_comm", [True]),
        # activation offloading: off unless constrained (the search adds offloaded twins of the plans that do
        # not fit, planner.search); None in a constraint is off
        "offload_activation_layers": [v or 0 for v in _allowed(cons, "offload_activation_layers", [0])],
    }


def _pipeline_key(cons: dict[str, list[Any]]) -> tuple:
    """The constraints that shape pipeline splits, hashable (for the per-pp cache)."""
    def opt(key: str) -> tuple | None:
        return tuple(cons[key]) if key in cons else None
    explicit = tuple(tuple(x) for x in cons.get("stage_layers", []) if x)
    return (opt("vpp"), explicit, opt("num_layers_in_first_stage"), opt("num_layers_in_last_stage"),
            opt("embedding_as_layer"), opt("loss_as_layer"))


Split = tuple[int, int, int, tuple, bool, bool, int]  # vpp, first, last, explicit, emb, loss, largest chunk


@functools.lru_cache(maxsize=1024)
def _pipeline_splits(L: int, pp: int, key: tuple) -> tuple[Split, ...]:
    """(vpp, first-stage layers, last-stage layers, explicit split, embedding as layer, loss as
    layer, layers of the largest chunk) choices for pp stages (0 / () = not set); the module
    docstring says which. Impossible combinations that constraints ask for are kept: the rules
    reject and count them."""
    vpps, explicit, firsts, lasts, embs, losses = key
    if explicit:
        fixed = [(v, 0, 0, x, e, lo) for x in explicit
                 for v in (vpps or _vpps_dividing(*x) if len(x) == pp else (len(x) // pp,))
                 if len(x) == pp or (len(x) % pp == 0 and (vpps is None or len(x) // pp in vpps))
                 for e in (embs or (False,)) for lo in (losses or (False,))]
        return _with_chunks(L, pp, fixed or [(1, 0, 0, explicit[0], False, False)])
    if firsts is not None or lasts is not None:
        given = [n for n in (firsts or ()) + (lasts or ()) if n]
        return _with_chunks(L, pp, [(v, f or 0, la or 0, (), e, lo) for v in (vpps or _vpps_dividing(*given))
                                    for f in (firsts or (None,)) for la in (lasts or (None,))
                                    for e in (embs or (False,)) for lo in (losses or (False,))])
    if pp == 1:
        return _with_chunks(L, pp, [(v, 0, 0, (), e, lo) for v in (vpps or (1,)) for e in (embs or (False,))
                                    for lo in (losses or (False,))])
    embs, losses = embs or (False, True), losses or (False, True)
    plain = False in embs and False in losses
    out: list[Split] = []
    seen: set[tuple[int, ...]] = set()

    def add(v: int, first: int, last: int, emb: bool, loss: bool, explicit: tuple[int, ...] = ()) -> None:
        chunks = _chunk_layers(L, pp, v, first, last, explicit, emb, loss)
        if chunks is not None and chunks not in seen:
            seen.add(chunks)
            out.append((v, first, last, explicit, emb, loss, max(1, max(chunks))))

    candidates = vpps or sorted(v for v in set(divisors(L)) | set(divisors(L + 1)) | set(divisors(L + 2))
                                if pp * v <= L + 2)
    for v in candidates:
        if plain:
            add(v, 0, 0, False, False)
        if pp == 2 and (v > 1 or L % pp == 0):  # no middle rank: only the odd-L split below
            continue
        for a, b in SHAVES if plain else ():  # middle ranks m layers, first m - a·v, last m - b·v
            m, r = divmod(L + (a + b) * v, pp)
            if r == 0 and m % v == 0:
                add(v, m - a * v if a else 0, m - b * v if b else 0, False, False)
        for emb, loss in itertools.product(embs, losses):
            if emb or loss:
                add(v, 0, 0, emb, loss)
    if plain and vpps and not any(x[0] > 1 for x in out):
        # an asked-for interleaving that no split above serves: the last virtual stage short, as
        # Megatron-Bridge's DeepSeek-V3 recipes run it (not searched unasked: explicit splits are costed
        # per candidate at the width of the deepest, which would slow every search)
        for v in sorted((v for v in vpps if v > 1), reverse=True):
            split = short_last_split(L, pp * v)
            if split:
                add(v, 0, 0, False, False, split)
                break
    if plain and (not vpps or 1 in vpps) and not any(x[4:6] == (False, False) and not x[3] for x in out):
        # A deficit beyond MAX_SHAVE: middle ranks ⌈L/pp⌉, the first and last share the rest (vpp 1: never
        # where the constraints exclude it, which would answer a vpp the user did not allow).
        middle = -(-L // pp)
        rest = L - middle * (pp - 2)
        if rest >= 2:
            add(1, rest // 2, rest - rest // 2, False, False)
        if 1 <= rest - middle < middle:  # the first rank full too, the last the remainder: the last rank carries
            add(1, 0, rest - middle, False, False)  # the output layer and loss (Megatron-Bridge's DeepSeek-V3 pp 16)
    if out:
        return tuple(out)
    return _with_chunks(L, pp, [(v, 0, 0, (), e, lo) for v in (vpps or (1,)) for e in (embs if not plain else (False,))
                                for lo in (losses if not plain else (False,))])


def short_last_split(L: int, stages: int) -> tuple[int, ...] | None:
    """Layers per virtual stage, in schedule order, with every stage but the last holding ⌈L/stages⌉
    and the last the rest (at least one layer): Megatron's --pipeline-model-parallel-layout as
    Megatron-Bridge's DeepSeek-V3 recipes write it ("Et*4|(t*4|)*14tmL": 61 layers over 16 virtual
    stages, the last with one layer beside the MTP module and the loss). None where `stages` divides
    L (the even split) or no such split exists.

    >>> short_last_split(61, 16), short_last_split(61, 8), short_last_split(64, 16), short_last_split(126, 64)
    ((4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 1), (8, 8, 8, 8, 8, 8, 8, 5), None, None)
    """
    if stages < 2 or L % stages == 0:
        return None
    q = -(-L // stages)
    rest = L - (stages - 1) * q
    return (q,) * (stages - 1) + (rest,) if 1 <= rest < q else None


def _vpps_dividing(*counts: int) -> tuple[int, ...]:
    """1 and every v > 1 dividing all the given per-rank layer counts."""
    g = math.gcd(*counts) if counts else 1
    return tuple(divisors(g)) if g else (1,)


def _with_chunks(L: int, pp: int, splits: list[tuple]) -> tuple[Split, ...]:
    return tuple(x + (_largest_chunk(L, pp, x[0], x[1], x[2], x[3], x[4], x[5]),) for x in splits)


def _layout_of(L: int, pp: int, vpp: int, first: int, last: int, explicit: tuple, emb: bool, loss: bool
               ) -> ParallelLayout:
    one = np.ones(1, np.int64)
    return ParallelLayout(num_layers=L, tp=one, cp=one, dp=one, pp=np.array([pp]), vpp=np.array([vpp]), ep=one,
                          etp=one, first=np.array([first]), last=np.array([last]), embedding_as_layer=np.array([emb]),
                          loss_as_layer=np.array([loss]),
                          stage_layers=np.array([explicit], dtype=np.int64) if explicit else None)


@functools.lru_cache(maxsize=8192)
def _chunk_layers(L: int, pp: int, vpp: int, first: int, last: int, explicit: tuple, emb: bool, loss: bool
                  ) -> tuple[int, ...] | None:
    """Layers of every virtual chunk in schedule order, or None when the layout refuses the split."""
    lay = _layout_of(L, pp, vpp, first, last, explicit, emb, loss)
    return tuple(lay.layers_per_chunk(0)) if bool(lay.split_ok()[0]) else None


@functools.lru_cache(maxsize=4096)
def _largest_chunk(L: int, pp: int, vpp: int, first: int, last: int, explicit: tuple, emb: bool = False,
                   loss: bool = False) -> int:
    """Layers of the largest virtual chunk of a split (the recompute_num_layers range)."""
    lay = _layout_of(L, pp, vpp, first, last, explicit, emb, loss)
    return max(1, max(lay.layers_per_chunk(0), default=1))


def _split_table(splits: list[tuple[int, ...]]) -> np.ndarray:
    """Explicit splits as a -1-padded (len(splits), P) table (`StrategyArrays.stage_layers`); row 0 is 'none'."""
    width = max(len(x) for x in splits)
    return np.array([list(x) + [-1] * (width - len(x)) for x in splits], dtype=np.int64).reshape(len(splits), width)


@functools.lru_cache(maxsize=4096)
def _recompute_choices(key: tuple, chunk_layers: int) -> tuple[tuple[int, int], ...]:
    """(recompute code, recompute_num_layers) pairs; key = (allowed modes, allowed layer counts or None)."""
    modes, counts = key
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
            out += [(code, 0)] + [(code, n) for n in RECOMPUTE_LAYER_STEPS if n < chunk_layers]
    return tuple(out)


#: Partial full-recompute layer counts the search tries by default (a 1-2-3 ladder: memory and
#: time are linear in the count, so the neighbours of the best rung are within a few per cent);
#: any other count can be asked for with a `recompute_num_layers` constraint.
RECOMPUTE_LAYER_STEPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def _empty_space_message(num_gpus: int, cons: dict[str, list[Any]]) -> str:
    fixed = ", ".join(f"{k}={v if len(v) > 1 else v[0]}" for k, v in cons.items() if k in {"dp", "tp", "cp", "pp"})
    return (f"no strategy has dp·tp·cp·pp equal to the number of GPUs ({num_gpus})"
            + (f" under the constraints {fixed}" if fixed else ""))
