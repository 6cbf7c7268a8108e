"""Prediction vs measurement on this machine's CPU (gloo, 2 ranks).

Plans a small GPT for two ranks on the measured `local-cpu` profile
(profiles/clusters/local-cpu.yaml, written by `meshplan profile`), then runs
with the executor the predicted top plans and the best plan of every
structurally different strategy (dp2, tp2, pp2, ZeRO-3), each first checked
for loss parity against a single-process run, and prints predicted next to
measured step time and peak memory.

Targets (issue 4): median |step-time error| <= 25%, and the measured fastest
plan among the predicted top 2.

The machine is shared and small, so every plan is run `--repeats` times (in
rounds, so that a burst of load from other processes hits one round, not one
plan) and the round with the fastest median step is kept: interference only
ever adds time. The load average before and after is printed with the table,
and per round the load around its runs (executors.host_load); a run measured
while other processes competed for its cores is marked busy (`*` after its time
in the rounds column, `busy` in the host column), and the median step-time error
is printed again over the kept runs that were not busy.

`--moe` runs an MoE variant (layers 1-3 with 4 experts of width 1024, top-2) and
its best plans with ep = 2, without ep (every expert on every rank) and with pp = 2.

    python benchmarks/validate_cpu.py [--cluster local-cpu] [--repeats 2] [--moe] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from executors.compare import ValidationReport, rank_and_summarise  # noqa: E402
from executors.validate import ValidateOptions, validate_strategies  # noqa: E402
from planner import ModelSpec, plan  # noqa: E402
from planner.api import make_inputs  # noqa: E402
from profiles import load_cluster  # noqa: E402

MODEL = ModelSpec(
    name="gpt-cpu-small", num_layers=4, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
    vocab_size=8192, tie_embeddings=False, position_embedding="rope", norm="layernorm", gated_mlp=False,
    source="benchmarks/validate_cpu.py: a GPT-style model sized for a short run on a 2-core CPU",
)
MOE_MODEL = ModelSpec(
    name="moe-cpu-small", num_layers=4, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
    vocab_size=8192, tie_embeddings=False, position_embedding="rope", norm="layernorm", gated_mlp=False,
    num_experts=4, moe_top_k=2, moe_ffn_hidden_size=1024, moe_first_k_dense=1,
    source="benchmarks/validate_cpu.py --moe: gpt-cpu-small with layers 1-3 MoE (4 experts of width 1024, top-2)",
)
NUM_RANKS = 2
GLOBAL_BATCH = 8
SEQ_LEN = 256
TOP_K = 3
#: one representative per structure: the planner's best plan under each constraint
STRUCTURES = {
    "dp2": {"dp": 2, "zero_stage": 0},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "zero3": {"dp": 2, "zero_stage": 3},
}
#: with --moe: expert parallel against every expert on every rank
MOE_STRUCTURES = {
    "ep2": {"ep": 2, "zero_stage": 0},
    "dp2": {"dp": 2, "ep": 1, "zero_stage": 0},
    "pp2": {"pp": 2},
}
STEP_TARGET = 0.25


def strategies_to_run(cluster) -> tuple[list, list[str]]:
    """The predicted top-K plans, then the best plan of each structure not already in."""
    common = dict(model=MODEL, cluster=cluster, num_gpus=NUM_RANKS, global_batch_size=GLOBAL_BATCH,
                  seq_len=SEQ_LEN, precision="fp32")
    chosen, why = [], []
    for p in plan(top_k=TOP_K, **common).plans:
        chosen.append(p.strategy)
        why.append(f"predicted #{p.rank}")
    for name, constraint in STRUCTURES.items():
        best = plan(top_k=1, constraints=constraint, **common).plans
        if not best:
            continue
        if best[0].strategy in chosen:
            why[chosen.index(best[0].strategy)] += f", best {name}"
        else:
            chosen.append(best[0].strategy)
            why.append(f"best {name}")
    return chosen, why


def fastest_rounds(reports: list[ValidationReport]) -> ValidationReport:
    """Per plan, the round with the fastest measured step; summary recomputed."""
    best = reports[0].model_copy(deep=True)
    for i in range(len(best.comparisons)):
        ok = [j for j, r in enumerate(reports) if r.comparisons[i].outcome == "ok"]
        if ok:
            j = min(ok, key=lambda j: reports[j].comparisons[i].measured_step_time_s)
            best.comparisons[i] = reports[j].comparisons[i].model_copy(deep=True)
            best.runs[i] = reports[j].runs[i].model_copy(deep=True)
    for key, value in rank_and_summarise(best.comparisons).items():
        setattr(best, key, value)
    return best


def print_table(report: ValidationReport, why: list[str], rounds: list[ValidationReport]) -> None:
    mib = 2**20
    print(f"\n{MODEL.name}: {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, vocab {MODEL.vocab_size}; "
          f"{NUM_RANKS} ranks, global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, fp32, cluster {report.cluster}")
    head = (f"{'#':>2} {'strategy':34} {'why':26} {'outcome':8} {'pred (s)':>9} {'meas (s)':>9} {'err':>6} "
            f"{'rounds (s)':>18} {'pred MiB':>9} {'meas MiB':>9} {'err':>6} {'rank p/m':>8} parity host")
    print(head)
    print("-" * len(head))
    for i, c in enumerate(report.comparisons):
        per_round = "/".join(_round_time(r.comparisons[i]) for r in rounds)
        err = "-" if c.step_time_error is None else f"{100 * c.step_time_error:+.0f}%"
        merr = "-" if c.memory_error is None else f"{100 * c.memory_error:+.0f}%"
        parity = "-" if c.parity is None else ("pass" if c.parity.passed else "FAIL")
        print(f"{i + 1:>2} {c.label:34} {why[i][:26]:26} {c.outcome:8} {c.predicted_step_time_s or 0:9.3f} "
              f"{c.measured_step_time_s or 0:9.3f} {err:>6} {per_round:>18} "
              f"{(c.predicted_memory_bytes or 0) / mib:9.0f} "
              f"{(c.measured_memory_bytes or 0) / mib:9.0f} {merr:>6} {c.predicted_rank or '-'!s:>3}/{c.measured_rank or '-'!s:<4} "
              f"{parity:6} {'-' if c.host_load is None else ('busy' if c.busy else 'quiet')}")
        if c.outcome != "ok":
            print(f"   {c.reason}")
        if c.busy:
            print(f"   busy host: {c.host_load.reason}")
    step = report.median_abs_step_time_error
    print(f"\nmedian |step-time error|: {100 * step:.1f}% (target <= {100 * STEP_TARGET:.0f}%: "
          f"{'met' if step <= STEP_TARGET else 'NOT met'})")
    quiet = report.median_abs_step_time_error_quiet
    print("median |step-time error| over the kept runs on a quiet host: "
          + ("-" if quiet is None else f"{100 * quiet:.1f}%")
          + (f" ({report.host.num_busy_runs} of {report.host.num_runs_sampled} kept runs busy)" if report.host else ""))
    print(f"median |memory error|: {100 * (report.median_abs_memory_error or 0):.1f}%")
    print(f"measured best: {report.measured_best} (predicted rank {report.measured_best_predicted_rank} of the ok "
          f"plans; in predicted top 2: {'yes' if report.measured_best_in_predicted_top2 else 'NO'})")
    ok = [c for c in report.comparisons if c.predicted_rank]
    if ok:
        p_best = min(ok, key=lambda c: c.predicted_rank)
        m_best = min(ok, key=lambda c: c.measured_rank)
        print(f"predicted step of the measured best vs the predicted best: "
              f"{100 * (m_best.predicted_step_time_s / p_best.predicted_step_time_s - 1):+.1f}%; "
              f"measured step of the predicted best vs the measured best: "
              f"{100 * (p_best.measured_step_time_s / m_best.measured_step_time_s - 1):+.1f}%")


def main(argv: list[str] | None = None) -> int:
    global GLOBAL_BATCH, SEQ_LEN, MODEL, STRUCTURES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="local-cpu", help="cluster profile (name or YAML path)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over all plans; the fastest is kept")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--work-dir", type=Path, default=None, help="run directories (default: temporary)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--global-batch-size", type=int, default=GLOBAL_BATCH, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per sequence")
    parser.add_argument("--moe", action="store_true", help="the MoE model (4 experts, top-2) and its ep2 / dp2 / "
                        "pp2 plans instead of the dense one")
    args = parser.parse_args(argv)
    GLOBAL_BATCH, SEQ_LEN = args.global_batch_size, args.seq_len
    if args.moe:
        MODEL, STRUCTURES = MOE_MODEL, MOE_STRUCTURES
    cluster = load_cluster(args.cluster)
    _, _, train = make_inputs(MODEL, cluster, NUM_RANKS, GLOBAL_BATCH, SEQ_LEN, "fp32")
    strategies, why = strategies_to_run(cluster)
    load_before = os.getloadavg()
    start = time.perf_counter()
    rounds = []
    for r in range(args.repeats):
        work = (args.work_dir / f"round{r}") if args.work_dir else None
        options = ValidateOptions(device="cpu", timed_steps=args.steps, warmup_steps=1, timeout_s=600, work_dir=work)
        rounds.append(validate_strategies(
            strategies, MODEL, cluster, train, NUM_RANKS, options, progress=lambda i, n, run: print(f"  [{i}/{n}] {run.label}: {run.outcome} "
                                             f"{run.step_time_s or 0:.3f} s", file=sys.stderr, flush=True)))
    report = fastest_rounds(rounds)
    print_table(report, why, rounds)
    for r, rnd in enumerate(rounds, start=1):
        print(round_load(r, rnd))
    load_after = os.getloadavg()
    print(f"load average (1 min) before/after: {load_before[0]:.2f}/{load_after[0]:.2f}; "
          f"wall time {time.perf_counter() - start:.0f} s; median round-to-round spread "
          f"{100 * _spread(rounds):.0f}%")
    if args.json:
        args.json.write_text(json.dumps(report.model_dump(mode="json"), indent=1))
    return 0


def _round_time(c) -> str:
    """A run's measured step in the rounds column, `*` when it was measured on a busy host."""
    if not c.measured_step_time_s:
        return "-"
    return f"{c.measured_step_time_s:.2f}" + ("*" if c.busy else "")


def round_load(index: int, report: ValidationReport) -> str:
    """One round's load: the 1-minute load average before and after each run, and its busy runs."""
    loads = [c.host_load for c in report.comparisons if c.host_load is not None]
    if not loads:
        return f"round {index}: no run launched"
    per_run = ", ".join(f"{h.load_before:.1f}->{h.load_after:.1f}{'*' if h.busy else ''}" for h in loads)
    host = report.host
    return (f"round {index}: load average before->after each run (* busy) {per_run} on {host.cpu_count} cores; "
            f"{host.num_busy_runs} of {host.num_runs_sampled} runs busy; median |step-time error| "
            + ("-" if report.median_abs_step_time_error is None else f"{100 * report.median_abs_step_time_error:.1f}%")
            + ", over quiet runs "
            + ("-" if report.median_abs_step_time_error_quiet is None
               else f"{100 * report.median_abs_step_time_error_quiet:.1f}%"))


def _spread(rounds: list[ValidationReport]) -> float:
    spreads = []
    for i in range(len(rounds[0].comparisons)):
        times = [r.comparisons[i].measured_step_time_s for r in rounds if r.comparisons[i].measured_step_time_s]
        if len(times) > 1:
            spreads.append((max(times) - min(times)) / min(times))
    return statistics.median(spreads) if spreads else 0.0


if __name__ == "__main__":
    sys.exit(main())
