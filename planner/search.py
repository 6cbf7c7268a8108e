"""Exhaustive search: enumerate, check rules, score all at once, rank.

Ranking (planner.ranking): plans that fit under the memory safety margin, fastest first, with
near-ties (within the tie tolerance and the error band) going to the simpler layout and
near-duplicates folded into one row.
"""

from __future__ import annotations

import time

import numpy as np

from cost_models import CostArrays, StrategyArrays, evaluate_arrays
from cost_models.arrays import RECOMPUTE_CODE, modules_mask
from cost_models.blocks import Micro, model_blocks
from cost_models.layout import STAGE_NAMES
from cost_models.memory import kind_activation_bytes
from cost_models.placement import group_links
from cost_models.step import (MEMORY_TERMS, TIME_TERMS, adapter_breakdown, concat_costs, memory_arrays,
                               stage_breakdown)
from planner.advice import advice_for, memory_floor_gpus, min_gpus_to_fit
from planner.error_band import band_fields, errors_of, overlaps_best
from planner.knobs import KNOB_MARGIN, MAX_GRAPH_GAIN, Knobs
from planner.errors import SpecError
from planner.ranking import Row, closest_rows, headroom_limit, rank_rows
from planner.rules import RULES, Context, check, first_failure_counts, messages
from planner.space import enumerate_space, normalise_constraints, search_space
from planner.specs import Estimate, GpuSpec, Plan, PlanResult, SearchStats, Strategy
from planner.specs.results import Candidates, StageEstimate
from planner.specs.results import DEFAULT_HEADROOM, Folded, GroupLink, Rejection

GIB = 2**30
NUM_CLOSEST = 3


def search(model, cluster, train, num_gpus: int, constraints: dict, top_k: int,
           headroom: float = DEFAULT_HEADROOM, find_min_gpus: bool = True, ranking: str = "simple",
           knobs: Knobs | None = None) -> PlanResult:
    """Score every valid candidate and rank those that fit under the memory safety margin
    (planner.ranking). When none is valid, the result has no plans and counts the rejections by rule;
    when none fits, it holds the closest candidates, advice and the smallest GPU count that fits
    (searched only then, and only when `find_min_gpus`).

    `knobs` (planner.knobs.choose) are the training-settings variants the planner may choose among; each
    candidate is scored with its own and each plan carries them in `Plan.train`. None: `train` as given."""
    start = time.perf_counter()
    knobs = knobs if knobs is not None else Knobs.fixed(train)
    train = knobs.base
    normalise_constraints(constraints, model)  # a malformed constraint is refused before it is merged below
    # Offloading the optimizer only adds time to a plan (the host's memory bandwidth per GPU is far
    # below HBM's), so a searched offload is scored only for the plans that do not fit without it.
    free_offload = "offload_optimizer" not in (constraints or {})
    first = {**(constraints or {}), "offload_optimizer": False} if free_offload else constraints
    space = search_space(model, train, num_gpus, first, cluster)
    rejected = dict(space.rejected)
    candidates = space.valid
    num_candidates = space.num_candidates
    common = dict(model=model, cluster=cluster, train=train, num_gpus=num_gpus, headroom=headroom)
    if not len(candidates):  # every candidate breaks a rule: count by rule, each with an example (rare path)
        rejections = _rejections(Context(model, train, num_gpus, cluster), model, train, num_gpus, first, cluster,
                                 rejected)
        stats = SearchStats(num_candidates=num_candidates, num_valid=0, num_feasible=0, rejected=rejected,
                            search_time_s=time.perf_counter() - start)
        return PlanResult(plans=[], stats=stats, rejections=rejections, **common)
    variant = knobs.assign(candidates)
    limit = headroom_limit(cluster.gpu.memory_bytes, headroom)
    candidates, variant, costs = _score(model, cluster, knobs, candidates, variant, limit)
    # the offloaded twins of the plans that do not fit, scored together (one more evaluation, one concatenation)
    twins = ([_activation_offload_twins(model, candidates, costs, limit)]
             if "offload_activation_layers" not in (constraints or {}) else [])
    twins += ([_module_recompute_twins(model, candidates, costs, limit)]
              if not {"recompute", "recompute_modules"} & set(constraints or {}) else [])
    twins += [_optimizer_offload_twins(candidates, costs)] if free_offload else []
    twins = [t for t in twins if len(t)]
    if twins:
        twins = StrategyArrays.concat(twins) if len(twins) > 1 else twins[0]
        num_candidates += len(twins)
        valid, failures = check(Context(model, train, num_gpus, cluster), twins)
        for key, n in first_failure_counts(failures).items():
            rejected[key] = rejected.get(key, 0) + n
        twins = twins.take(valid)
        if len(twins):
            twins, twin_variant, twin_costs = _score(model, cluster, knobs, twins, knobs.assign(twins), limit)
            candidates = StrategyArrays.concat([candidates, twins])
            variant = np.concatenate([variant, twin_variant])
            costs = concat_costs([costs, twin_costs])
    if model.num_experts > 0 or knobs.graphs_searched:
        # the searched settings are tried on plans that fit only: the makers see those (a small share of the
        # candidates), and the twins join everything else once, at the end
        ctx = Context(model, train, num_gpus, cluster)
        keep = np.flatnonzero(costs.fits & (costs.peak_memory_bytes <= limit))
        pool = (candidates.take(keep), variant[keep], _take_costs(costs, keep))
        added = []
        for make in _knob_twin_makers(knobs, constraints or {}, model.num_experts > 0):
            twins, twin_variant = make(*pool, limit, top_k)
            if not len(twins):
                continue
            num_candidates += len(twins)
            valid, failures = check(ctx, twins)
            for key, n in first_failure_counts(failures).items():
                rejected[key] = rejected.get(key, 0) + n
            twins, twin_variant = twins.take(valid), twin_variant[valid]
            if len(twins):
                scored = _score(model, cluster, knobs, twins, twin_variant, limit)
                added.append(scored)
                ok = np.flatnonzero(scored[2].fits & (scored[2].peak_memory_bytes <= limit))
                pool = (StrategyArrays.concat([pool[0], scored[0].take(ok)]), np.concatenate([pool[1], scored[1][ok]]),
                        concat_costs([pool[2], _take_costs(scored[2], ok)]))
        if added:
            candidates = StrategyArrays.concat([candidates] + [a[0] for a in added])
            variant = np.concatenate([variant] + [a[1] for a in added])
            costs = concat_costs([costs] + [a[2] for a in added])
    fits = costs.fits & (costs.peak_memory_bytes <= limit)
    if not fits.any() and np.isinf(costs.step_time_s).any():  # nothing fits: the closest plans need their times
        candidates, variant, costs = _score(model, cluster, knobs, candidates, variant)
        fits = costs.fits & (costs.peak_memory_bytes <= limit)
    over = ~costs.fits
    host_over = costs.host_memory_bytes > costs.host_capacity_bytes
    if host_over.any():
        rejected["host memory (offloaded optimizer)"] = int(host_over.sum())
    over = over & ~host_over
    largest = np.zeros(0, dtype=np.int64)
    if over.any():  # the largest term of each candidate over the GPU's memory (those rows only)
        rows = np.flatnonzero(over)
        n_all = len(costs.step_time_s)
        terms = np.stack([np.broadcast_to(costs.memory_bytes[t], (n_all,))[rows] for t in MEMORY_TERMS])
        largest = np.argmax(terms, axis=0)
        counts = np.bincount(largest, minlength=len(MEMORY_TERMS))
        for term, n in zip(MEMORY_TERMS, counts):
            if n:
                rejected[f"memory ({term} largest)"] = int(n)
    margin = int((costs.fits & ~fits).sum())
    if margin:
        rejected[f"memory (inside the {headroom:.0%} headroom)"] = margin
    table = _candidate_table(candidates, variant, knobs, costs, fits, host_over, over, largest, limit, headroom,
                             num_gpus, train.tokens_per_step, constraints or {})
    feasible = np.flatnonzero(fits)
    moe = model.num_experts > 0
    high = costs.step_time_s / (1.0 + errors_of(cluster.gpu, moe)[0])  # the band's slow edge, as band_fields has it
    if ranking == "fastest":  # strict step-time order; ties to the lower peak memory, then fewer model-parallel GPUs
        order = feasible[np.lexsort(((candidates.tp * candidates.cp * candidates.pp)[feasible],
                                     costs.peak_memory_bytes[feasible], costs.step_time_s[feasible]))][:top_k]
        rows = [Row(int(i), np.array([i])) for i in order]
    else:
        rows = rank_rows(candidates, costs.step_time_s, high, feasible, top_k, train.seq_len)
    closest: list[Row] = []
    if len(feasible) == 0:
        host_cap = costs.host_capacity_bytes
        host_miss = (np.where(host_over, (costs.host_memory_bytes - host_cap) / host_cap, 0.0)
                     if np.isfinite(host_cap) and host_cap > 0 else 0.0)
        miss = (costs.peak_memory_bytes - limit) / limit + host_miss
        closest = closest_rows(candidates, miss, costs.step_time_s, costs.peak_memory_bytes,
                               np.arange(len(candidates)), NUM_CLOSEST)
    elapsed = time.perf_counter() - start

    def make_plan(rank: int, row: Row) -> Plan:
        i = row.index
        strategy = Strategy(**candidates.row(i))
        reasons = _memory_reason(costs, i) + _headroom_reason(costs, i, limit, headroom)
        own = knobs.trains[int(variant[i])]
        est = estimate_from(costs, i, num_gpus, own, reasons=reasons, gpu=cluster.gpu, moe=moe,
                            settings=knobs.settings(int(variant[i])))
        est = est.model_copy(update={"stages": stages[i]})
        if own.adapters:
            est = est.model_copy(update={"finetune": adapter_breakdown(model, cluster, own, candidates.take([i]))[0]})
        return Plan(rank=rank, strategy=strategy, estimate=est, model=model, cluster=cluster, train=own,
                    num_gpus=num_gpus, folded=_folded(candidates, costs, row))

    stats = SearchStats(num_candidates=num_candidates, num_valid=len(candidates), num_feasible=int(len(feasible)),
                        rejected=rejected, search_time_s=elapsed)
    stages = _stages(model, cluster, knobs, candidates, variant, [row.index for row in rows + closest])
    plans = [make_plan(r + 1, row) for r, row in enumerate(rows)]
    overlap = overlaps_best([p.estimate.step_time_s_low for p in plans], [p.estimate.step_time_s_high for p in plans])
    near = [make_plan(r + 1, row) for r, row in enumerate(closest)]
    extra: dict = {}
    if not plans and near:
        fixed = all(isinstance((constraints or {}).get(k), int) for k in ("dp", "tp", "pp", "cp"))

        def fits_at(n: int) -> bool:
            try:
                return bool(search(model, cluster, train, n, constraints, 1, headroom=headroom,
                                   find_min_gpus=False, knobs=knobs).plans)
            except SpecError:  # the constraints leave no strategy at this count
                return False

        found, tried = (min_gpus_to_fit(cluster, num_gpus, fits_at, memory_floor_gpus(model, train, cluster, headroom))
                        if find_min_gpus and not fixed else (None, []))  # fixed degrees fix the GPU count
        extra = dict(min_gpus_to_fit=found, min_gpus_searched=tried,
                     advice=advice_for(near[0], constraints or {}, headroom, found, tried))
    result = PlanResult(
        plans=plans, worth_a_real_run=[p.rank for p, o in zip(plans, overlap) if o], closest=near,
        stats=stats, **common, **extra,
    )
    result._candidates = table
    return result


def _stages(model, cluster, knobs: Knobs, candidates: StrategyArrays, variant: np.ndarray,
            index: list[int]) -> dict[int, list[StageEstimate]]:
    """Per pipeline rank, the figures of the candidates `index` (the plans shown): one breakdown per settings
    variant among them (cost_models.step.stage_breakdown)."""
    out: dict[int, list[StageEstimate]] = {}
    index = np.unique(np.asarray(index, dtype=np.int64))
    for v in np.unique(variant[index]) if len(index) else []:
        rows = index[variant[index] == v]
        for i, ranks in zip(rows, stage_breakdown(model, cluster, knobs.trains[int(v)], candidates.take(rows))):
            out[int(i)] = [StageEstimate(**r) for r in ranks]
    return out


def _candidate_table(candidates: StrategyArrays, variant: np.ndarray, knobs: Knobs, costs: CostArrays,
                     fits: np.ndarray, host_over: np.ndarray, over: np.ndarray, largest: np.ndarray, limit: float,
                     headroom: float, num_gpus: int, tokens_per_step: int, constraints: dict) -> Candidates:
    """Every scored candidate's figures with why each does not fit, under the same reason keys as
    SearchStats.rejected counts them (`over`: over the GPU's memory, not the host's; `largest`: the index in
    MEMORY_TERMS of the largest term of each of those rows)."""
    n = len(costs.step_time_s)
    labels = ["fits", "host memory (offloaded optimizer)", f"memory (inside the {headroom:.0%} headroom)"]
    labels += [f"memory ({t} largest)" for t in MEMORY_TERMS]
    reason = np.zeros(n, dtype=np.int16)
    reason[costs.fits & ~fits] = 2
    reason[over] = 3 + largest
    reason[host_over] = 1
    return Candidates(strategies=candidates, step_time_s=np.asarray(costs.step_time_s, dtype=float),
                      peak_memory_bytes=costs.peak_memory_bytes, variant=variant, trains=list(knobs.trains),
                      time_s=costs.time_s, memory_bytes=costs.memory_bytes,
                      model_flop_per_step=np.broadcast_to(costs.model_flop_per_step, (n,)), reason=reason,
                      reason_labels=tuple(labels), memory_limit_bytes=float(limit),
                      host_memory_bytes=np.broadcast_to(costs.host_memory_bytes, (n,)),
                      host_capacity_bytes=float(costs.host_capacity_bytes),
                      memory_capacity_bytes=float(costs.memory_capacity_bytes),
                      peak_flop_per_s=float(costs.peak_flop_per_s), num_gpus=num_gpus,
                      tokens_per_step=tokens_per_step, constraints=dict(constraints))


#: Below this many candidates a variant is scored in full at once: the memory pass first would cost more than the
#: times it saves (its memory is computed again for the candidates that fit).
MEMORY_FIRST_MIN = 20_000


def _score(model, cluster, knobs: Knobs, candidates: StrategyArrays, variant: np.ndarray,
           limit: float | None = None) -> tuple[StrategyArrays, np.ndarray, CostArrays]:
    """Score `candidates`, each with its settings variant (`knobs.trains[variant[i]]`): one evaluation per
    variant present. With `limit`, the memory of every candidate and the time of those whose peak is within it
    only (`cost_models.step.memory_arrays`: the others' step time is infinite; a plan over the limit is never
    ranked, and its memory says what it would take). Returns the candidates and variants regrouped in the
    order they were scored."""
    parts, variants, costs = [], [], []
    for v in np.unique(variant):
        idx = np.flatnonzero(variant == v)
        part = candidates.take(idx) if len(idx) < len(variant) else candidates
        train = knobs.trains[int(v)]
        if limit is None or len(part) < MEMORY_FIRST_MIN:
            parts.append(part), variants.append(variant[idx]), costs.append(evaluate_arrays(model, cluster, train, part))
            continue
        memory, rows = memory_arrays(model, cluster, train, part)
        under = memory.fits & (memory.peak_memory_bytes <= limit)
        if under.all():
            parts.append(part), variants.append(variant[idx])
            costs.append(evaluate_arrays(model, cluster, train, part, mem_rows=rows))
            continue
        ok = np.flatnonzero(under)
        parts.append(part), variants.append(variant[idx])
        if len(ok):
            sub = {k: np.broadcast_to(v, (v.shape[0] if v.ndim == 2 else 1, len(part)))[:, ok] for k, v in rows.items()}
            memory = _scatter(memory, ok, evaluate_arrays(model, cluster, train, part.take(ok), mem_rows=sub))
        costs.append(memory)
    if len(parts) == 1:
        return parts[0], variants[0], costs[0]
    return StrategyArrays.concat(parts), np.concatenate(variants), concat_costs(costs)


def _take_costs(costs: CostArrays, index: np.ndarray) -> CostArrays:
    """Rows `index` of `costs`."""
    n = len(costs.step_time_s)
    out = {}
    for name in CostArrays.__dataclass_fields__:
        value = getattr(costs, name)
        if isinstance(value, dict):
            out[name] = {k: np.broadcast_to(v, (n,))[index] for k, v in value.items()}
        elif isinstance(value, np.ndarray):
            out[name] = np.broadcast_to(value, (n,))[index]
        else:
            out[name] = value
    return CostArrays(**out)


def _scatter(memory: CostArrays, index: np.ndarray, scored: CostArrays) -> CostArrays:
    """`memory` (every candidate's memory, no times) with the full scores of rows `index` written in: `scored`
    holds those rows, in that order. The memory terms are the same numbers in both and are kept."""
    n = len(memory.step_time_s)
    out = {}
    for name in CostArrays.__dataclass_fields__:
        value, new = getattr(memory, name), getattr(scored, name)
        if name == "memory_bytes" or not isinstance(value, (dict, np.ndarray)):
            out[name] = value
        elif isinstance(value, dict):
            out[name] = {}
            for k, v in value.items():
                full = np.array(np.broadcast_to(v, (n,)), dtype=np.result_type(v, new[k]))
                full[index] = new[k]
                out[name][k] = full
        else:
            full = np.array(np.broadcast_to(value, (n,)), dtype=np.result_type(value, new))
            full[index] = new
            out[name] = full
    return CostArrays(**out)


def _knob_twin_makers(knobs: Knobs, constraints: dict, moe: bool) -> list:
    """The searched knobs the user left free, as twin makers run in order (planner.knobs): for an MoE model the
    other dispatchers, then the all-to-all overlap (over every dispatcher's rows); then CUDA graphs (over all)."""
    makers = []
    if moe and len(knobs.dispatchers) > 1:
        makers.append(lambda c, v, costs, limit, k: _dispatcher_twins(knobs, c, v, costs, limit, k))
    if moe and "overlap_moe_comm" not in constraints:
        makers.append(_overlap_twins)
    if knobs.graphs_searched:
        makers.append(lambda c, v, costs, limit, k: _graph_twins(knobs, c, v, costs, limit, k))
    return makers


def _bar(costs: CostArrays, limit: float, top_k: int) -> tuple[float | None, np.ndarray]:
    """The top_k-th best fitting plan's step time with `KNOB_MARGIN` on it (None when nothing fits), and which
    candidates fit under the limit."""
    fits = costs.fits & (costs.peak_memory_bytes <= limit)
    if not fits.any():
        return None, fits
    steps = costs.step_time_s[fits]
    k = min(max(top_k, 1), len(steps)) - 1
    return float(np.partition(steps, k)[k]) * (1.0 + KNOB_MARGIN), fits


def _graph_twins(knobs: Knobs, candidates: StrategyArrays, variant: np.ndarray, costs: CostArrays, limit: float,
                 top_k: int) -> tuple[StrategyArrays, np.ndarray]:
    """The fitting candidates without CUDA graphs that graphs could bring into the ranking (their step less
    `MAX_GRAPH_GAIN` of it within the bar), with Transformer Engine's graphs (planner.knobs.graph_scope), where
    megatron-core captures them (`Knobs.graph_ok`)."""
    bar, fits = _bar(costs, limit, top_k)
    if bar is None:
        return candidates.take(np.array([], dtype=np.int64)), np.array([], dtype=np.int64)
    off = knobs.parts(variant)[1] == 0
    need = np.flatnonzero(fits & off & knobs.graph_ok(candidates)
                          & (costs.step_time_s * (1.0 - MAX_GRAPH_GAIN) <= bar))
    return candidates.take(need), knobs.with_graphs(variant[need])


def _could_win(candidates: StrategyArrays, costs: CostArrays, limit: float, top_k: int) -> np.ndarray:
    """Candidates with expert parallelism whose step time less their exposed expert-parallel time is within
    `KNOB_MARGIN` of the `top_k`-th best fitting plan: the only ones another dispatcher or the all-to-all
    overlap could bring into the ranking (those changes act on that time). Nothing fits: none."""
    bar, fits = _bar(costs, limit, top_k)
    if bar is None:
        return fits
    return fits & (candidates.ep > 1) & (costs.step_time_s - costs.time_s["ep_comm"] <= bar)


def _dispatcher_twins(knobs: Knobs, candidates: StrategyArrays, variant: np.ndarray, costs: CostArrays,
                      limit: float, top_k: int) -> tuple[StrategyArrays, np.ndarray]:
    """The candidates that could win (`_could_win`) with each other dispatcher of `knobs`."""
    need = np.flatnonzero(_could_win(candidates, costs, limit, top_k))
    alternatives = knobs.other_dispatchers(variant[need])
    twins = candidates.take(np.tile(need, len(alternatives)))
    return twins, (np.concatenate(alternatives) if alternatives else np.array([], dtype=np.int64))


def _overlap_twins(candidates: StrategyArrays, variant: np.ndarray, costs: CostArrays, limit: float,
                   top_k: int) -> tuple[StrategyArrays, np.ndarray]:
    """The candidates that could win (`_could_win`) without the all-to-all overlap, with it (Megatron's
    --overlap-moe-expert-parallel-comm; the rules refuse where Megatron cannot run it)."""
    need = np.flatnonzero(_could_win(candidates, costs, limit, top_k) & ~candidates.overlap_moe_comm)
    twins = candidates.take(need)
    twins.overlap_moe_comm[:] = True
    return twins, variant[need]


def _folded(candidates: StrategyArrays, costs: CostArrays, row: Row) -> Folded | None:
    members = row.members
    if len(members) < 2:
        return None
    layers = sorted({int(v) for v in candidates.recompute_num_layers[members] if v > 0})
    every = bool((candidates.recompute_num_layers[members] == 0).any())
    times = costs.step_time_s[members]
    return Folded(num_plans=len(members), zero_stages=sorted({int(z) for z in candidates.zero_stage[members]}),
                  recompute_num_layers=layers + ([None] if every else []), step_time_s_min=float(times.min()),
                  step_time_s_max=float(times.max()),
                  peak_memory_bytes_min=float(costs.peak_memory_bytes[members].min()))


def _headroom_reason(costs: CostArrays, i: int, limit: float, headroom: float) -> list[str]:
    """The reason of a plan that fits the GPU but not the safety margin."""
    peak, cap = costs.peak_memory_bytes[i], costs.memory_capacity_bytes
    if not costs.fits[i] or peak <= limit:
        return []
    return [f"peak memory {peak / GIB:.1f} GiB is inside the {headroom:.0%} safety margin: above the "
            f"{limit / GIB:.1f} GiB limit of {cap / GIB:.1f} GiB per GPU by {(peak - limit) / GIB:.1f} GiB"]


def _rejections(ctx: Context, model, train, num_gpus: int, constraints: dict, cluster,
                rejected: dict[str, int]) -> list[Rejection]:
    """Every rule that rejected candidates, most first, with its message for one of them."""
    every = enumerate_space(model, train, num_gpus, constraints, cluster)
    _, failures = check(ctx, every)
    out = []
    for key, count in sorted(rejected.items(), key=lambda kv: -kv[1]):
        rule = next((r for r in RULES if r.key == key), None)
        hit = np.flatnonzero(failures[key]) if rule is not None and key in failures else []
        example = rule.message(ctx, every.row(int(hit[0]))) if len(hit) else key
        out.append(Rejection(rule=key, count=count, example=example))
    return out


def _optimizer_offload_twins(candidates: StrategyArrays, costs: CostArrays) -> StrategyArrays:
    """For every plan with zero_stage >= 1 that does not fit, the same plan with the optimizer offloaded
    (to be scored and counted as candidates; the offload rule may refuse them)."""
    # Offload frees the optimizer states of every stage, so the twin's peak is at least the binding
    # stage's peak less its optimizer states: where that is still over, the twin cannot fit.
    could_fit = costs.peak_memory_bytes - costs.memory_bytes["optimizer"] <= costs.memory_capacity_bytes
    need = np.flatnonzero(~costs.fits & (candidates.zero_stage >= 1) & could_fit)
    twins = candidates.take(need)
    twins.offload_optimizer[:] = True
    return twins


def _activation_offload_twins(model, candidates: StrategyArrays, costs: CostArrays, limit: float) -> StrategyArrays:
    """For every plan over the memory limit that could offload activations (pp 1, no recomputation),
    the plans that offload just enough of its layers' activations to fit: the least count that frees the
    excess with the allocator's slack on it, and one and two more. Offloading more only adds copies, so
    no other count is scored; the rules refuse what the framework or the cluster cannot run."""
    L = model.num_layers
    over = costs.peak_memory_bytes - limit
    need = np.flatnonzero((over > 0) & (candidates.pp == 1) & (candidates.recompute == 0)
                          & (candidates.offload_activation_layers == 0))
    per_layer = costs.memory_bytes["activations"][need] / L  # one stage, one micro-batch in flight
    tensors = costs.peak_memory_bytes[need] - costs.memory_bytes["allocator_slack"][need]
    slack = np.where(tensors > 0, costs.peak_memory_bytes[need] / np.maximum(tensors, 1.0), 1.0)  # slack scales with
    least = np.ceil(over[need] / np.maximum(per_layer * slack, 1.0))                              # the tensors freed
    counts = np.concatenate([least, least + 1, least + 2])
    keep = (counts >= 1) & (counts <= L - 1)
    twins = candidates.take(np.tile(need, 3)[keep])
    twins.offload_activation_layers[:] = counts[keep].astype(np.int64)
    return twins


#: Megatron's `--recompute-modules` sets the search tries on mixture-of-experts and latent-attention models,
#: the modules that free the most for the least recompute first. They are what NVIDIA's recipes run:
#: Megatron-Bridge's DeepSeek-V3 recipes recompute mla_up_proj (with mlp on H100), its MoE recipes moe_act
#: and layernorm (src/megatron/bridge/recipes/, perf_recipes/, at 067f987d). Each set applies where the
#: model has its modules.
MODULE_RECOMPUTE_SETS = (("moe_act",), ("layernorm", "moe_act"), ("mla_up_proj",), ("mla_up_proj", "moe_act"),
                         ("layernorm", "mla_up_proj", "moe_act"))


def module_recompute_sets(model) -> list[int]:
    """The `MODULE_RECOMPUTE_SETS` (as bit masks) whose modules `model` has: none for a dense model
    without latent attention (its recompute choices are the searched none, selective and full)."""
    has = {"moe_act": model.num_experts > 0, "mla_up_proj": bool(model.is_mla), "layernorm": True}
    if not (has["moe_act"] or has["mla_up_proj"]):
        return []
    return [modules_mask(s) for s in MODULE_RECOMPUTE_SETS if all(has[m] for m in s)]


def _module_recompute_twins(model, candidates: StrategyArrays, costs: CostArrays, limit: float) -> StrategyArrays:
    """For every plan over the memory limit without recomputation, the same plan with selective recompute
    of each of the model's `module_recompute_sets`: recomputing a module frees part of the activations
    for a share of the forward, which may fit where no recomputation does not and run faster than full
    recompute. A set gets a twin only where the excess is within what it can free (`_freed_shares`, with
    `MODULE_SHARE_SLACK`); the rules refuse what the framework cannot run."""
    sets = module_recompute_sets(model)
    if not sets:
        return candidates.take(np.array([], dtype=np.int64))
    over = costs.peak_memory_bytes - limit
    base = (over > 0) & (candidates.recompute == 0) & (candidates.offload_activation_layers == 0)
    rows, masks = [], []
    for mask, share in zip(sets, _freed_shares(model, sets)):
        # a set frees at most its share of the activations (with the allocator's slack on top: 10 %)
        need = np.flatnonzero(base & (over <= MODULE_SHARE_SLACK * share * costs.memory_bytes["activations"]))
        rows.append(need)
        masks.append(np.full(len(need), mask, dtype=np.int64))
    twins = candidates.take(np.concatenate(rows))
    twins.recompute[:] = RECOMPUTE_CODE["selective"]
    twins.recompute_modules[:] = np.concatenate(masks)
    return twins


#: Headroom on a module set's freed share when deciding whether its twin could fit (the allocator's slack
#: grows with the tensors; the shares are taken at one micro-batch shape).
MODULE_SHARE_SLACK = 1.1


def _freed_shares(model, sets: list[int]) -> list[float]:
    """For each module set, the largest share of one layer's stored activations it frees, over the model's
    layer kinds (one micro-batch of 4,096 tokens, no model parallelism: the shares hardly move with the
    shape; cost_models.memory.kind_activation_bytes)."""
    one = np.ones(1, dtype=np.int64)
    x = Micro(4096, one, one, np.ones(1), np.zeros(1, bool), "bf16", "flash", ep=one, etp=one)
    kinds = model_blocks(model).kinds
    full = [float(kind_activation_bytes(k, x, 0)[0]) for k in kinds]
    return [max(1.0 - float(kind_activation_bytes(k, x, 1, mask)[0]) / f for k, f in zip(kinds, full) if f > 0)
            for mask in sets]


def evaluate_one(model, cluster, train, strategy: Strategy) -> Estimate:
    """Score one resolved strategy; rule violations and memory overflow become reasons."""
    st = StrategyArrays.from_strategies([strategy])
    num_gpus = strategy.num_gpus
    ctx = Context(model, train, num_gpus, cluster)
    reasons = messages(ctx, st, 0)
    valid = not reasons
    costs = evaluate_arrays(model, cluster, train, st)
    reasons += _memory_reason(costs, 0)
    est = estimate_from(costs, 0, num_gpus, train, reasons=reasons, valid=valid, gpu=cluster.gpu,
                        moe=model.num_experts > 0)
    if not valid:
        return est
    links = group_links(cluster, strategy, model.num_layers, model.num_experts > 0)
    stages = [StageEstimate(**r) for r in stage_breakdown(model, cluster, train, st)[0]]
    return est.model_copy(update={"groups": [GroupLink(**g) for g in links], "stages": stages,
                                  "finetune": adapter_breakdown(model, cluster, train, st)[0]})


def _memory_reason(costs: CostArrays, i: int) -> list[str]:
    peak, cap = costs.peak_memory_bytes[i], costs.memory_capacity_bytes
    host, host_cap = costs.host_memory_bytes[i], costs.host_capacity_bytes
    out = []
    if host > host_cap:
        out.append(f"offloaded optimizer states {host / GIB:.1f} GiB > {host_cap / GIB:.1f} GiB of host memory per GPU")
    if peak <= cap:
        return out
    term = max(MEMORY_TERMS, key=lambda t: costs.memory_bytes[t][i])
    return out + [f"peak memory {peak / GIB:.1f} GiB > {cap / GIB:.1f} GiB per GPU by {(peak - cap) / GIB:.1f} GiB on the "
            f"{STAGE_NAMES[costs.binding_stage[i]]} pipeline stage (pipeline rank {int(costs.binding_pipeline_rank[i])}; largest term: {term} "
            f"{costs.memory_bytes[term][i] / GIB:.1f} GiB)"]


def estimate_from(costs: CostArrays, i: int, num_gpus: int, train, reasons: list[str], valid: bool = True,
                  gpu: GpuSpec | None = None, moe: bool | None = None, settings: dict | None = None) -> Estimate:
    """The Estimate of candidate `i`, with its error band from `gpu`'s residuals (planner.error_band),
    the band of its model's kind (`moe`) where the profile has one."""
    step = float(costs.step_time_s[i])
    if not np.isfinite(step) or step <= 0:
        raise SpecError(f"the cost model produced a non-positive step time ({step}) for this strategy")
    tokens = train.tokens_per_step
    model_flop = float(costs.model_flop_per_step[i])
    hw_flop = float(costs.hardware_flop_per_step[i])
    memory = {k: float(v[i]) for k, v in costs.memory_bytes.items()}
    mfu = model_flop / step / num_gpus / costs.peak_flop_per_s
    band = band_fields(step, tokens / step / num_gpus, mfu, gpu, moe) if gpu is not None else {}
    return Estimate(
        step_time_s=step,
        tokens_per_s=tokens / step,
        tokens_per_s_per_gpu=tokens / step / num_gpus,
        model_tflops_per_gpu=model_flop / step / num_gpus / 1e12,
        hardware_tflops_per_gpu=hw_flop / step / num_gpus / 1e12,
        mfu=mfu,
        peak_memory_bytes=float(costs.peak_memory_bytes[i]),
        memory_capacity_bytes=float(costs.memory_capacity_bytes),
        memory_bytes=memory,
        time_s={k: float(costs.time_s[k][i]) for k in TIME_TERMS},
        binding_stage=STAGE_NAMES[int(costs.binding_stage[i])],
        binding_pipeline_rank=int(costs.binding_pipeline_rank[i]),
        comm_hidden_fraction=float(costs.comm_hidden_fraction[i]),
        binding_memory_term=max(memory, key=memory.get),
        num_microbatches=int(costs.num_microbatches[i]),
        bubble_fraction=float(costs.bubble_fraction[i]),
        fits=not reasons,
        valid=valid,
        reasons=reasons,
        settings=settings or {},
        **band,
    )
