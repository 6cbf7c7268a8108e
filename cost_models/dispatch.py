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

from functools import lru_cache

import numpy as np

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
