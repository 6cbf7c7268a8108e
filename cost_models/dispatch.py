"""How many copies of a token an MoE dispatcher sends, and over which tier.

Megatron-core's MoE layer sends each token's hidden vector to the ranks that hold its top-k
experts (the dispatch) and brings the expert outputs back (the combine, the same volume). Two
kinds of dispatcher differ in how many copies travel (`TrainSpec.moe_dispatcher`):

- **alltoall** (`--moe-token-dispatcher-type alltoall`, `MoEAlltoAllTokenDispatcher`): the
  tokens are permuted per (token, expert) pair and exchanged with one NCCL all-to-all, so a token
  travels once per routed expert: k copies, (local - 1)/ep of them over NVLink and (ep - local)/ep
  over the network (`local` = members of the expert-parallel group in one NVLink domain).
- **deepep / hybridep** (the flex dispatcher, `--moe-token-dispatcher-type flex
  --moe-flex-dispatcher-backend deepep|hybridep`): a token is sent once per destination GPU, and
  across nodes once per destination node: it crosses the network to the GPU of the same local
  index on that node, which forwards it over NVLink to the GPUs there that need it (DeepSeek-V3
  technical report, arXiv 2412.19437, Sec. 3.2.2: "each token ... transmitted via IB to the GPUs
  with the same in-node index on its target nodes ... instantaneously forwarded via NVLink";
  DeepEP README, deepseek-ai/DeepEP: normal kernels forward from the RDMA to the NVLink domain;
  HybridEP, the flex backend Megatron-core 0.15 added for GB200/B200/H100, dispatches the same
  way). The combine reduces a token's outputs per GPU and per node on the way back.

Per token, with the k experts drawn uniformly without replacement from E (the routing is
balanced on average; the load imbalance scales the bytes, `Micro.moe_load_imbalance`):

- distinct destination GPUs D_r = ep · (1 - P(a GPU holds none of the k)), and distinct
  destination nodes D_n likewise with a node's E · local / ep experts (`expected_distinct`);
- group-limited routing (DeepSeek-V3: `moe_router_num_groups` 8, `moe_router_group_topk` 4) keeps
  the k experts inside g of G expert groups: where a node (or GPU) holds whole groups, the token
  reaches at most the units holding its g groups (`distinct_units`);
- over the network: D_n · (N - 1)/N copies (N = nodes of the group) against alltoall's
  k · (N - 1)/N; over NVLink every delivery but the one landing from the network, so
  D_r · (local - 1)/local copies against alltoall's k · (local - 1)/ep.

`tier_scales` returns those two ratios: the factors by which the flex dispatcher's NVLink and
network bytes differ from alltoall's, which `CommModel.all_to_all_s` applies to each tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner.errors import SpecError
from profiles.dispatch import DIRECTIONS, DispatchBench, DispatchMeasurements, DispatchRow

DISPATCHERS = ("alltoall", "deepep", "hybridep")


def expected_distinct(units: int, per_unit: int, picks: int) -> float:
    """Expected number of `units` equal bins (of `per_unit` items each) that `picks` distinct items,
    drawn uniformly without replacement from all units · per_unit items, fall into.

    8 experts of 256 over 32 GPUs of 8 experts each reach 7.27 GPUs; over 4 nodes, 3.61 nodes:

    >>> round(expected_distinct(32, 8, 8), 2), round(expected_distinct(4, 64, 8), 2)
    (7.27, 3.61)
    >>> expected_distinct(8, 1, 8)  # as many picks as single-item bins: every bin
    8.0
    """
    total = units * per_unit
    miss = 1.0  # P(one given unit receives none of the picks), hypergeometric
    for i in range(picks):
        miss *= max(total - per_unit - i, 0) / (total - i)
    return units * (1.0 - miss)


def distinct_units(experts: int, top_k: int, units: int, groups: int = 0, group_topk: int = 0) -> float:
    """Expected distinct units (GPUs or nodes, each holding experts / units experts) a token's
    top-k experts fall into; with group-limited routing, where each unit holds whole groups, the
    token reaches at most the units holding its `group_topk` groups.

    DeepSeek-V3 (256 experts, top 8, 8 groups, top 4 groups) over 8 nodes of one group each: at most
    4 nodes, 3.63 on average, against 5.29 without the group limit; over 32 GPUs (4 per group), 6.6
    GPUs against 7.27:

    >>> round(distinct_units(256, 8, 8, 8, 4), 2), round(distinct_units(256, 8, 8), 2)
    (3.63, 5.29)
    >>> round(distinct_units(256, 8, 32, 8, 4), 2), round(distinct_units(256, 8, 32), 2)
    (6.6, 7.27)
    """
    per_unit = experts // units
    free = expected_distinct(units, per_unit, top_k)
    if not groups:
        return free
    if units > groups:  # a group spans units / groups whole units: k picks among the g groups' units
        if units % groups:
            return free  # groups not aligned with the units: the uniform estimate (an upper bound)
        return min(free, expected_distinct(group_topk * units // groups, per_unit, top_k))
    if groups % units:
        return free
    # whole groups per unit: the g chosen groups reach expected_distinct(units, G / units, g) units,
    # each only if one of the k experts lands in it (k experts over the g·E/G experts of its groups)
    group_units = expected_distinct(units, groups // units, group_topk)
    per_group = experts // groups
    inside = expected_distinct(group_topk, per_group, top_k) / group_topk  # share of chosen groups hit
    return min(free, group_units * inside)


@lru_cache(maxsize=4096)
def _scales(dispatcher: str, experts: int, top_k: int, ep: int, local: int, groups: int, group_topk: int
            ) -> tuple[float, float]:
    if dispatcher == "alltoall" or ep < 2:
        return 1.0, 1.0
    local = max(1, min(local, ep))
    nodes = max(1, ep // local)
    d_rank = distinct_units(experts, top_k, ep, groups, group_topk)
    d_node = distinct_units(experts, top_k, nodes, groups, group_topk) if nodes > 1 else 1.0
    # NVLink copies: d_rank (local-1)/local (flex) against k (local-1)/ep (alltoall); inside one domain
    # (nodes == 1, local == ep) both are per destination GPU over NVLink
    intra = d_rank * ep / (top_k * local)
    inter = d_node / top_k  # network copies: d_node (N-1)/N against k (N-1)/N
    return intra, inter


def tier_scales(dispatcher: str, experts: int, top_k: int, ep, local, groups: int = 0, group_topk: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
    """(NVLink, network) byte ratios of `dispatcher` to alltoall for expert-parallel groups of `ep`
    ranks with `local` of them per NVLink domain (arrays over candidates).

    DeepEP over 32 GPUs on 4 nodes of 8 (DeepSeek-V3): 0.36 of alltoall's network bytes, 3.3 times
    its NVLink bytes (the forwarding); inside one 8-GPU node 0.45 of its NVLink bytes (a token's
    4 groups sit on 4 of the 8 GPUs):

    >>> intra, inter = tier_scales("deepep", 256, 8, np.array([32, 8]), np.array([8, 8]), 8, 4)
    >>> [round(float(v), 2) for v in intra], [round(float(v), 2) for v in inter[:1]]
    ([3.3, 0.45], [0.36])
    """
    ep_a, local_a = np.broadcast_arrays(np.asarray(ep, dtype=np.int64), np.asarray(local, dtype=np.int64))
    intra, inter = np.ones(ep_a.shape), np.ones(ep_a.shape)
    if dispatcher == "alltoall":
        return intra, inter
    for e, lo in {(int(e), int(lo)) for e, lo in zip(ep_a.ravel(), local_a.ravel())}:
        mask = (ep_a == e) & (local_a == lo)
        intra[mask], inter[mask] = _scales(dispatcher, experts, top_k, e, lo, groups, group_topk)
    return intra, inter


# ---- measured dispatchers -----------------------------------------------------------------------
#: Megatron-core's default SMs of each flex backend (TransformerConfig `moe_deepep_num_sms` 20,
#: `moe_hybridep_num_sms` 16; megatron/core/transformer/transformer_config.py, core_v0.16.1): the
#: measured rates are read at this SM count, or at the plan's (TrainSpec.moe_flex_num_sms), linear
#: between the measured counts and the nearest measured count outside them.
DEFAULT_SMS = {"deepep": 20, "hybridep": 16}


@dataclass(frozen=True)
class DispatchCurve:
    """One dispatcher's measured calls on one tier, by expert-parallel group size: a fixed cost per call
    (the Python API's time beyond its kernel's) and seconds per byte (the kernel's rate), each linear in
    log2(ep) between the measured sizes and the nearest measured value outside them."""

    log2_ep: np.ndarray
    fixed_s: dict[str, np.ndarray]  # direction -> seconds per call at each measured ep
    per_byte_s: dict[str, np.ndarray]  # direction -> seconds per byte at each measured ep

    def call_s(self, direction: str, ep, nbytes) -> np.ndarray:
        """Seconds of one `direction` call of a group of `ep` ranks moving `nbytes` per rank (the bytes
        the table's rates count: NVLink receive bytes, or network send bytes)."""
        x = np.log2(np.maximum(np.asarray(ep, dtype=float), 1.0))
        return (np.interp(x, self.log2_ep, self.fixed_s[direction])
                + np.asarray(nbytes, dtype=float) * np.interp(x, self.log2_ep, self.per_byte_s[direction]))


@dataclass(frozen=True)
class DispatchTable:
    """A GPU's measured flex dispatchers (profiles/kernels/dispatch/<name>.yaml): a curve per
    (dispatcher, tier) it has measurements of."""

    name: str
    curves: dict[tuple[str, str], DispatchCurve]

    def curve(self, dispatcher: str, tier: str) -> DispatchCurve | None:
        return self.curves.get((dispatcher, tier))

    def exchange_s(self, dispatcher: str, nbytes, size, members, intra_scale, inter_scale) -> np.ndarray:
        """Seconds of one dispatch and one combine of a group of `size` ranks with `members` of them per
        NVLink domain, each rank routing `nbytes` (the all-to-all's bytes: a token once per routed expert);
        `intra_scale`, `inter_scale` as `tier_scales` gives them. Inside one domain the table's NVLink
        bytes are the tokens a rank receives, once per destination GPU: nbytes x intra_scale. Across
        domains its network bytes are those a rank sends to other domains, once per destination domain:
        nbytes x inter_scale x (domains - 1) / domains. NaN where the table has no curve for the tier (the
        caller keeps the collective curves there); 0 for a group of one.

        Qwen3-30B-A3B on 8 GB200s (HybridEP, ep 8): 16,384 tokens of hidden 2048 sent to 5.34 GPUs each
        (358 MB received per rank and call) take 1.28 ms for the dispatch and the combine together:

        >>> from profiles.bundle import load_tables
        >>> t = dispatch_table(load_tables("gb200").dispatch)
        >>> intra, inter = tier_scales("hybridep", 128, 8, 8, 8)
        >>> nbytes = 16384 * 8 * 2048 * 2
        >>> round(float(t.exchange_s("hybridep", nbytes, 8, 8, intra, inter)) * 1e3, 2)
        1.28
        """
        nbytes, size, members, intra_scale, inter_scale = np.broadcast_arrays(
            *(np.asarray(v, dtype=float) for v in (nbytes, size, members, intra_scale, inter_scale)))
        out = np.full(size.shape, np.nan)
        inside = members >= size
        nv, ib = self.curve(dispatcher, "nvlink"), self.curve(dispatcher, "network")
        if nv is not None and inside.any():
            b, e = nbytes[inside] * intra_scale[inside], size[inside]
            out[inside] = nv.call_s("dispatch", e, b) + nv.call_s("combine", e, b)
        span = ~inside
        if ib is not None and span.any():
            domains = size[span] / np.maximum(members[span], 1.0)
            b, e = nbytes[span] * inter_scale[span] * (domains - 1) / domains, size[span]
            out[span] = ib.call_s("dispatch", e, b) + ib.call_s("combine", e, b)
        return np.where(size > 1, out, 0.0)


def _bench_bytes(bench: DispatchBench, tier: str, ep: int, where: str) -> float:
    """Bytes per rank and call of the table's benchmark at group size `ep`, as its bandwidth counts them:
    NVLink, the tokens a rank receives once per destination GPU, its own included; network, the tokens
    it sends once per remote node holding one of their experts (DeepEP tests/test_hybrid_ep.py)."""
    tokens, hidden, k, local = bench.tokens, bench.hidden, bench.top_k, bench.local_experts
    per_token = hidden * bench.bytes_per_element
    if tier == "nvlink":
        return tokens * expected_distinct(ep, local, k) * per_token
    per_node = bench.ranks_per_node
    if not per_node or ep % per_node or ep // per_node < 2:
        raise SpecError(f"{where}: a network row needs bench.ranks_per_node dividing ep ({ep}) into two or more nodes")
    nodes = ep // per_node
    return tokens * expected_distinct(nodes, local * per_node, k) * (nodes - 1) / nodes * per_token


def _interp_sms(rows: tuple[DispatchRow, ...], sms: int, key: str) -> float | None:
    """`key` of the rows (one group size) at `sms` SMs: linear between the measured SM counts, the nearest
    outside; None when no row has it."""
    have = sorted((r.sms, float(getattr(r, key))) for r in rows if getattr(r, key) is not None)
    if not have:
        return None
    return float(np.interp(sms, [h[0] for h in have], [h[1] for h in have]))


def dispatch_table(measured: DispatchMeasurements | None, dispatcher: str | None = None, sms: int | None = None
                   ) -> DispatchTable | None:
    """A GPU's measured dispatchers (`GpuSpec.tables.dispatch`) as per-call costs, their rates read at Megatron's
    default SMs (`DEFAULT_SMS`), or with `sms` (and its `dispatcher`) that dispatcher's at that many SMs; None
    when the GPU has no dispatch table. Built once per table object and SM count.

    >>> from profiles.bundle import load_tables
    >>> gb200 = load_tables("gb200").dispatch
    >>> hybrid = dispatch_table(gb200).curve("hybridep", "nvlink")
    >>> wide = dispatch_table(gb200, "hybridep", 32).curve("hybridep", "nvlink")
    >>> bool(wide.per_byte_s["combine"][0] < hybrid.per_byte_s["combine"][0])  # more SMs, a faster kernel
    True
    """
    if measured is None:
        return None
    return _dispatch_table(measured, dispatcher, sms) if dispatcher and sms else _dispatch_table(measured, None, None)


@lru_cache(maxsize=64)
def _dispatch_table(measured: DispatchMeasurements, dispatcher: str | None, sms: int | None) -> DispatchTable:
    where = f"dispatch table {measured.name}"
    at_sms = {dispatcher: sms} if sms else {}
    curves: dict[tuple[str, str], DispatchCurve] = {}
    for (flex, tier), by_ep in measured.rows.items():
        at = at_sms.get(flex, DEFAULT_SMS[flex])
        fixed = {d: [] for d in DIRECTIONS}
        per_byte = {d: [] for d in DIRECTIONS}
        for ep, rows in by_ep.items():
            nbytes = _bench_bytes(measured.bench, tier, ep, f"{where}: {flex}.{tier}")
            for d in DIRECTIONS:
                torch_rate = _interp_sms(rows, at, f"{d}_torch") * 1e9
                kernel = _interp_sms(rows, at, f"{d}_kernel")
                kernel_rate = torch_rate if kernel is None else kernel * 1e9
                if kernel_rate < torch_rate:
                    raise SpecError(f"{where}: {flex}.{tier} ep {ep}: {d}_kernel is below {d}_torch (the API "
                                    f"cannot outrun its own kernel)")
                fixed[d].append(nbytes / torch_rate - nbytes / kernel_rate)
                per_byte[d].append(1.0 / kernel_rate)
        curves[(flex, tier)] = DispatchCurve(np.log2(np.array(list(by_ep), dtype=float)),
                                             {d: np.array(v) for d, v in fixed.items()},
                                             {d: np.array(v) for d, v in per_byte.items()})
    return DispatchTable(measured.name, curves)
