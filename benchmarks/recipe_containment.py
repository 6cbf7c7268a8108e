"""Recipe containment: does the planner find the vendor's recipe, or something as fast, when told only
what a user knows?

    python -m benchmarks.recipe_containment                  # every Megatron-Bridge row, the table and the summary
    python -m benchmarks.recipe_containment --sets 26_04,26_06 --rows   # two releases, one line per row

Every Megatron-Bridge performance row of benchmarks/data (the `mbridge_*` public sets that meshplan can
score; rows refused by benchmarks.validation are counted, not scored) is predicted three ways with the same
cost model:

- **recipe**: the recipe's full settings, as benchmarks.validation states them (layout, stage split,
  recompute modules, FP8 recipe, dispatcher, gradient precision, FP8 parameter gather, fusions), the rest
  searched: what the planner predicts when it is told the whole recipe;
- **degrees**: only the published degrees fixed (tp, pp, cp, ep, vpp and the micro-batch), every other
  strategy field and training setting left to the planner (`plan()`'s defaults, numerics-changing
  settings allowed as the recipes allow them);
- **free**: nothing fixed but what defines the job: model, cluster, GPU count, global batch, sequence,
  precision and FP8 recipe.

Each prediction is the fastest plan that fits with no safety margin (the published runs ran), ranked
strictly by step time. The table gives each way's predicted step time over the published one (median and
the rows more than 10 % slower), and **containment**: the share of rows where the free plan is predicted no
slower than 1.01 x the recipe's own configuration. The figures are predictions against predictions except
for the ratios to the published step time; nothing here is fitted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.validation import PUBLIC_SETS, StepCase, predict, public_runs
from planner import plan
from planner.errors import SpecError

#: The strategy fields a published row's degrees fix in the `degrees` way.
DEGREES = ("tp", "pp", "cp", "ep", "vpp", "micro_batch_size")
#: The training settings that define the job (not knobs): kept in the `degrees` and `free` ways.
JOB_SETTINGS = ("precision", "fp8_recipe", "moe_load_imbalance", "framework")
#: Containment: the free plan counts as containing the recipe when predicted no slower than this times it.
CONTAINMENT_SLACK = 1.01


@dataclass(frozen=True)
class Scored:
    case: StepCase
    set_name: str
    recipe_s: float | None
    degrees_s: float | None
    free_s: float | None
    free_plan: str
    recipe_plan: str
    degrees_plan: str

    def ratio(self, value: float | None) -> float | None:
        return None if value is None else value / self.case.measured_step_s

    @property
    def contained(self) -> bool:
        if self.recipe_s is None:  # the recipe itself does not fit the model: anything that fits contains it
            return self.free_s is not None
        return self.free_s is not None and self.free_s <= CONTAINMENT_SLACK * self.recipe_s


def bridge_sets(only: list[str] | None = None) -> list[str]:
    names = [n for n in PUBLIC_SETS if n.startswith("mbridge_") and n != "mbridge_skills"]
    if only:
        wanted = {"mbridge_" + s.removeprefix("mbridge_") for s in only}
        unknown = wanted - set(names)
        if unknown:
            raise SpecError(f"--sets: {sorted(unknown)} not among {names}")
        names = [n for n in names if n in wanted]
    return names


def _fastest(case: StepCase, constraints: dict[str, Any], train: dict[str, Any]) -> tuple[float | None, str]:
    options = dict(train)
    precision = options.pop("precision", "bf16")
    result = plan(model=case.model, cluster=case.cluster, num_gpus=case.num_gpus,
                  global_batch_size=case.global_batch_size, seq_len=case.seq_len, precision=precision,
                  constraints=constraints, top_k=1, headroom=0.0, ranking="fastest", **options)
    if not result.plans:
        return None, "(nothing fits)"
    best = result.plans[0]
    return best.estimate.step_time_s, best.strategy.short() + _settings_label(best.train)


def _settings_label(train) -> str:
    bits = []
    if train.grad_precision != "fp32":
        bits.append(f"grad={train.grad_precision}")
    if train.fp8_param_gather:
        bits.append("fp8-gather")
    if train.moe_dispatcher != "alltoall":
        bits.append(train.moe_dispatcher + (f"@{train.moe_flex_num_sms}" if train.moe_flex_num_sms else ""))
    return (" [" + " ".join(bits) + "]") if bits else ""


def score(case: StepCase, set_name: str) -> Scored:
    recipe = predict(case)
    job = {k: v for k, v in case.train_options.items() if k in JOB_SETTINGS}
    degrees = {k: v for k, v in case.constraints.items() if k in DEGREES}
    deg_s, deg_plan = _fastest(case, degrees, job)
    free_s, free_plan = _fastest(case, {}, job)
    return Scored(case, set_name, recipe.predicted_step_s, deg_s, free_s, free_plan, recipe.strategy, deg_plan)


def _pct(r: float | None) -> str:
    return "   -   " if r is None else f"{100 * (r - 1):+6.1f}%"


def summary_table(rows: list[Scored]) -> str:
    lines = ["| given to `plan()` | predicted / published step time, median | rows > 10 % slower than published |",
             "|---|---|---|"]
    for label, attr in (("the recipe's full settings", "recipe_s"), ("the published degrees only, the rest searched",
                                                                     "degrees_s"),
                        ("nothing fixed (model, cluster, GPUs, batch, sequence, precision, FP8 recipe)", "free_s")):
        ratios = [r.ratio(getattr(r, attr)) for r in rows]
        known = [x for x in ratios if x is not None]
        med = statistics.median(known) if known else float("nan")
        slow = sum(1 for x in ratios if x is None or x > 1.10)
        lines.append(f"| {label} | {100 * (med - 1):+.1f} % | {slow} / {len(rows)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", help="comma-separated releases, e.g. 26_04,26_06 (default: every Megatron-Bridge set)")
    ap.add_argument("--rows", action="store_true", help="one line per row with the three plans")
    args = ap.parse_args(argv)
    try:
        names = bridge_sets(args.sets.split(",") if args.sets else None)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    scored: list[Scored] = []
    refused = 0
    for name in names:
        pub = public_runs(name)
        refused += len(pub.refused)
        for case in pub.cases:
            s = score(case, name)
            scored.append(s)
            if args.rows:
                print(f"{name[8:]:9s} {case.label[:46]:46s} recipe {_pct(s.ratio(s.recipe_s))} degrees "
                      f"{_pct(s.ratio(s.degrees_s))} free {_pct(s.ratio(s.free_s))} "
                      f"{'ok ' if s.contained else 'LOSS'} | {s.free_plan}", flush=True)
    print(f"\nMegatron-Bridge sets: {', '.join(n[8:] for n in names)}; {len(scored)} rows scored, {refused} refused "
          f"by benchmarks.validation\n")
    print(summary_table(scored))
    contained = [s for s in scored if s.contained]
    losses = sorted((s for s in scored if not s.contained),
                    key=lambda s: -(s.free_s or float("inf")) / (s.recipe_s or 1.0))
    print(f"\ncontainment: the free plan is predicted no slower than {CONTAINMENT_SLACK} x the recipe in "
          f"{len(contained)} / {len(scored)} rows ({100 * len(contained) / max(len(scored), 1):.1f} %)")
    for s in losses[:10]:
        gap = "nothing fits" if s.free_s is None else f"{100 * (s.free_s / s.recipe_s - 1):+.1f} %"
        print(f"  loses {gap:>8s}: {s.set_name[8:]} {s.case.label}\n      free:   {s.free_plan}\n"
              f"      recipe: {s.recipe_plan}")
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
