"""Where each parallel dimension's groups land on the fabric: the link tier their collectives cross and the
bandwidth each group gets there, for explanations (`planner.evaluate`'s `Estimate.groups`, `meshplan
explain`). The step model prices the same groups through the same communication model; this module only
reads the comm model's per-level shares back for one strategy (cost_models.comm.TierCommModel.describe).
"""

from __future__ import annotations

from typing import Any

from cost_models.collectives import comm_model_for
from cost_models.layout import ParallelLayout


def group_links(cluster: Any, strategy: Any, num_layers: int, moe: bool) -> list[dict[str, Any]]:
    """One entry per dimension of `strategy` with more than one rank (fields of planner.specs.results.GroupLink)."""
    lay = ParallelLayout.of_strategy(strategy, num_layers)
    comm = comm_model_for(cluster).with_world(lay.num_gpus)
    zero = int(getattr(strategy, "zero_stage", 0))
    dims: list[tuple[str, int, int, str]] = []

    def add(dim: str, size, stride, collective: str) -> None:
        size, stride = int(size[0]), int(stride[0])
        if size > 1:
            dims.append((dim, size, stride, collective))

    add("tp", lay.tp, lay.stride("tp"), "all_gather / reduce_scatter" if strategy.sequence_parallel else "all_reduce")
    add("cp", lay.cp, lay.stride("cp"), "send_recv")
    size, stride = lay.group("cp", "dp")
    add("dp", size, stride, "all_gather / reduce_scatter" if zero >= 1 else "all_reduce")
    add("pp", lay.pp, lay.stride("pp"), "send_recv")
    if moe:
        add("ep", *lay.expert_group("ep"), "all_to_all")
        add("edp", *lay.expert_group("edp"), "all_gather / reduce_scatter" if zero >= 1 else "all_reduce")
    out = []
    for dim, size, stride, collective in dims:
        if collective == "send_recv":
            d = comm.describe_p2p(stride, size * stride)
        else:
            op = "all_reduce" if collective == "all_reduce" else "all_to_all" if collective == "all_to_all" else "gather"
            d = comm.describe(size, stride, op)
        level = d["crosses"]
        tier = cluster.intra_node.name if level is None else f"{cluster.inter_node.name} across {level}"
        out.append({"dim": dim, "size": size, "stride": stride, "collective": collective, "tier": tier,
                    "level": level, "bus_bw_bytes_per_s": d["busbw"], "limited_by": d["bottleneck"],
                    "shares_bytes_per_s": d["shares"]})
    return out
