"""The dispatch table (`profiles/kernels/dispatch/<set>.yaml`) as typed measurements: a GPU's flex MoE
dispatchers (DeepEP, HybridEP), each call's rate by tier, expert-parallel group size and SM count, and the
benchmark the rates were measured with. `cost_models.dispatch` turns them into per-call costs at the plan's
SM count (`dispatch_table`)."""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import SpecError

#: The dispatchers a table may measure (the all-to-all dispatcher is priced by the collectives table).
FLEX_DISPATCHERS = ("deepep", "hybridep")
DIRECTIONS = ("dispatch", "combine")
TIERS = ("nvlink", "network")
#: The benchmark's fields every table gives (positive numbers).
BENCH_FIELDS = ("tokens", "hidden", "top_k", "local_experts", "bytes_per_element")


@dataclass(frozen=True)
class DispatchBench:
    """The benchmark behind a table's rates, numbers as the file gives them: its tokens per rank, hidden size,
    routed experts per token, experts per rank, bytes per element, and (network rows) ranks per node."""

    tokens: int | float
    hidden: int | float
    top_k: int | float
    local_experts: int | float
    bytes_per_element: int | float
    ranks_per_node: int | None = None


@dataclass(frozen=True)
class DispatchRow:
    """One measured call: group size `ep`, `sms` SMs, rates in GB/s of the benchmark's bytes per call, as the
    file gives them (`*_torch`: the Python API, `*_kernel`: the kernel alone, None when not measured)."""

    ep: int
    sms: int
    dispatch_torch: int | float
    combine_torch: int | float
    dispatch_kernel: int | float | None = None
    combine_kernel: int | float | None = None


@dataclass(frozen=True, eq=False)
class DispatchMeasurements:
    """A GPU's measured flex dispatchers: per (dispatcher, tier) the rows it has, by group size."""

    name: str
    bench: DispatchBench
    rows: dict[tuple[str, str], dict[int, tuple[DispatchRow, ...]]]


def dispatch_measurements_from(data: dict, name: str) -> DispatchMeasurements:
    """Parse a dispatch table of table set `name`; a SpecError naming the field on a bad one."""
    where = f"dispatch table {name}"
    bench = data.get("bench")
    if not isinstance(bench, dict) or any(not isinstance(bench.get(f), (int, float)) or bench[f] <= 0
                                          for f in BENCH_FIELDS):
        raise SpecError(f"{where}: bench needs positive {', '.join(BENCH_FIELDS)}")
    per_node = bench.get("ranks_per_node")
    rows: dict[tuple[str, str], dict[int, tuple[DispatchRow, ...]]] = {}
    for dispatcher in ("alltoall", *FLEX_DISPATCHERS):
        for tier, entries in (data.get(dispatcher) or {}).items():
            if tier not in TIERS:
                raise SpecError(f"{where}: {dispatcher}: unknown tier {tier!r}; known: {', '.join(TIERS)}")
            by_ep: dict[int, list[DispatchRow]] = {}
            for r in entries or []:
                if not isinstance(r, dict) or not isinstance(r.get("ep"), int) or r["ep"] < 2 \
                        or not isinstance(r.get("sms"), int) or r["sms"] < 1:
                    raise SpecError(f"{where}: {dispatcher}.{tier}: every row needs an integer ep >= 2 and sms >= 1")
                rates = {}
                for d in DIRECTIONS:
                    for kind in ("torch", "kernel"):
                        v = r.get(f"{d}_{kind}")
                        if (v is None and kind == "torch") or (v is not None and (not isinstance(v, (int, float)) or v <= 0)):
                            raise SpecError(f"{where}: {dispatcher}.{tier} ep {r['ep']}: {d}_{kind} must be a positive "
                                            f"rate in GB/s" + (" (required)" if kind == "torch" else ""))
                        rates[f"{d}_{kind}"] = v
                by_ep.setdefault(r["ep"], []).append(DispatchRow(r["ep"], r["sms"], **rates))
            if by_ep:
                rows[(dispatcher, tier)] = {ep: tuple(by_ep[ep]) for ep in sorted(by_ep)}
    return DispatchMeasurements(name, DispatchBench(*(bench[f] for f in BENCH_FIELDS), ranks_per_node=per_node),
                                rows)
