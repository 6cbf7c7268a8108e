"""How much the A100 accuracy moves when an estimated (not fitted, not measured)
profile constant moves by +-50 %.

    python -m benchmarks.sensitivity

The constants: the GPU's `kernel_overhead_us` (profiles/gpus/a100-80gb.yaml)
and the cluster's `comm_overlap` (profiles/clusters/dgx-a100-80gb.yaml; 1.0,
so only -50 % is possible). For each value every A100 table is predicted twice:
with the shipped calibration kept, and with the shipped fit re-run under the
changed value (the calibration absorbs part of any change). The profiles'
`kernel_overhead_source` and `comm_overlap_source` quote this table.
"""

from __future__ import annotations

import sys

from benchmarks.calibration import A100_TABLES, BOUNDS, FITS, SHIPPED, Summary, base_cluster, fit, table_errors


def summaries(params: dict[str, float]) -> dict[str, Summary]:
    return {t.name: Summary.of(table_errors(t, params)) for t in A100_TABLES}


def main() -> int:
    cluster = base_cluster("dgx-a100-80gb")
    shipped = {k: getattr(cluster.gpu, k) for k in BOUNDS}
    overhead, overlap = cluster.gpu.kernel_overhead_s, cluster.comm_overlap
    scenarios = [
        (f"kernel_overhead_us {overhead * 0.5e6:g} (-50 %)", {"kernel_overhead_s": overhead * 0.5}),
        (f"kernel_overhead_us {overhead * 1.5e6:g} (+50 %)", {"kernel_overhead_s": overhead * 1.5}),
        (f"comm_overlap {overlap * 0.5:g} (-50 %; +50 % is above the bound 1)", {"comm_overlap": overlap * 0.5}),
    ]
    base = summaries(shipped)
    print(f"A100 tables as shipped: kernel_overhead_us {overhead * 1e6:g}, comm_overlap {overlap:g}, "
          f"fit {SHIPPED!r} ({', '.join(f'{k} {v:g}' for k, v in shipped.items())})")
    print(f"  {'table':30s} {'median':>7s} {'mean':>7s}")
    for name, s in base.items():
        print(f"  {name:30s} {s.median_abs:7.1%} {s.mean:+7.1%}")
    for label, change in scenarios:
        kept = summaries(shipped | change)
        refit = fit(FITS[SHIPPED], fixed=change)
        again = summaries(refit.params)
        print(f"\n{label}; re-fitted: " + ", ".join(f"{k} {refit.params[k]:g}" for k in BOUNDS))
        print(f"  {'table':30s} {'fit kept: median':>17s} {'(change)':>9s} {'mean':>7s} {'(change)':>9s}"
              f" | {'re-fitted: median':>18s} {'(change)':>9s} {'mean':>7s} {'(change)':>9s}")
        for name, b in base.items():
            k, a = kept[name], again[name]
            print(f"  {name:30s} {k.median_abs:17.1%} {(k.median_abs - b.median_abs) * 100:+8.1f}pp "
                  f"{k.mean:+7.1%} {(k.mean - b.mean) * 100:+8.1f}pp | {a.median_abs:18.1%} "
                  f"{(a.median_abs - b.median_abs) * 100:+8.1f}pp {a.mean:+7.1%} {(a.mean - b.mean) * 100:+8.1f}pp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
