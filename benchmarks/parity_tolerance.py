"""Loss-parity tolerances, measured: the relative errors of real parallel runs against the reference.

Runs every plan of the executor tests (tests/executors/test_runs.py: dp2 DDP,
ZeRO-1/2/3, tp2+SP, 1F1B and interleaved pipelines, TPxFSDP2, PPxTP, HSDP; and
tests/executors/test_moe.py's MoE model with ep2 over dp2 and dp4, and dp2 DDP) on
this CPU (gloo, 2 or 4 ranks) in fp32 and in bf16 (autocast, fp32 weights),
each once as planned and once with the `grad_x2` fault (every gradient doubled
before each parity update), and prints per plan the two parity errors
(executors.parity): the relative loss error and the relative error of the loss
change since step 1. The tolerances in `executors.validate.PARITY_TOLERANCES`
must sit above every error of the right runs and below the loss-change error
of every faulty run; the summary prints both sides and the current tolerances.
The expert-parallel plans also run the two wrong expert-gradient reductions
(`executors.parallelize.EXPERT_GRAD_FAULTS`), and the MoE rows print the error of
the step-1 gradient norms per group (`executors.validate.GRAD_NORM_TOLERANCES`).

Also reports, single-process, how a 2x gradient changes the loss change of one
plain-SGD step at the step size `executors.parity.parity_learning_rate` chooses
and at three times it (first order: by exactly 1 relative), for the test model
and benchmarks/validate_cpu.py's hidden-512 model.

    python benchmarks/parity_tolerance.py [--precisions fp32 bf16] [--plans dp2-ddp tp2-sp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from executors.launcher import launch, launch_reference  # noqa: E402
from executors.parity import PARITY_LOSS_DECREASE  # noqa: E402
from executors.results import ParityReference, RunConfig  # noqa: E402
from executors.support import executed_model, unsupported_reasons  # noqa: E402
from executors.validate import GRAD_NORM_TOLERANCES, PARITY_TOLERANCES  # noqa: E402
from planner.specs import ModelSpec, Strategy, TrainSpec  # noqa: E402

#: the executor tests' model (tests/executors/executor_fixtures.py)
TEST_MODEL = ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                       ffn_hidden_size=128, gated_mlp=True, vocab_size=256, tie_embeddings=True,
                       source="executor tests")
#: benchmarks/validate_cpu.py's model, for the single-process step-size check only
CPU_SMALL = ModelSpec(name="gpt-cpu-small", num_layers=4, hidden_size=512, num_attention_heads=8,
                      ffn_hidden_size=2048, vocab_size=8192, tie_embeddings=False, position_embedding="rope",
                      norm="layernorm", gated_mlp=False, source="benchmarks/validate_cpu.py")
GLOBAL_BATCH, SEQ_LEN = 8, 32
#: name -> (strategy, ranks, extra RunConfig fields): the plans of tests/executors/test_runs.py
PLANS = {
    "dp2-ddp": (Strategy(dp=2), 2, {}),
    "dp2-zero1": (Strategy(dp=2, zero_stage=1, micro_batch_size=2), 2, {}),
    "tp2-sp": (Strategy(dp=1, tp=2, sequence_parallel=True), 2, {}),
    "pp2-1f1b": (Strategy(dp=1, pp=2, micro_batch_size=2), 2, {}),
    "dp2-zero3-fsdp2": (Strategy(dp=2, zero_stage=3, micro_batch_size=2), 2, {}),
    "dp2-zero2-selective": (Strategy(dp=2, zero_stage=2, recompute="selective", micro_batch_size=4), 2, {}),
    "pp2-vpp2-full-recompute": (Strategy(dp=1, pp=2, vpp=2, recompute="full"), 2, {}),
    "tp2xdp2-fsdp2": (Strategy(dp=2, tp=2, sequence_parallel=True, zero_stage=3), 4, {}),
    "pp2xtp2": (Strategy(dp=1, tp=2, pp=2, micro_batch_size=2), 4, {}),
    "hsdp-2x2": (Strategy(dp=4, zero_stage=3, micro_batch_size=2), 4, {"hsdp_replicate": 2}),
}
#: the MoE test model (tests/executors/executor_fixtures.py TINY_MOE) and its plans: ep = 2 folded
#: over dp = 2 and dp = 4 (edp = 2), and DDP with every expert on every rank
TEST_MOE = ModelSpec(name="tiny-moe", num_layers=3, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                     ffn_hidden_size=128, gated_mlp=True, vocab_size=256, tie_embeddings=True, num_experts=4,
                     moe_top_k=2, moe_ffn_hidden_size=64, num_shared_experts=1, moe_first_k_dense=1,
                     source="executor tests")
MOE_PLANS = {
    "moe-dp2-ep2": (Strategy(dp=2, ep=2), 2, {}),
    "moe-dp4-ep2": (Strategy(dp=4, ep=2, micro_batch_size=2), 4, {}),
    "moe-dp2-ddp": (Strategy(dp=2), 2, {}),
}
PLANS |= MOE_PLANS
#: faults of the expert-parallel plans besides grad_x2 (executors.parallelize.EXPERT_GRAD_FAULTS)
EXPERT_FAULTS = ("expert_grad_edp_mean", "expert_grad_dense")
TIMEOUT_S = 300.0


def step_size_check(model: ModelSpec, seq_len: int, scale: float = 1.0) -> tuple[float, float]:
    """Single process, fp32, one batch, one SGD step `scale` times the parity step size:
    (loss decrease / loss, relative change of that decrease when the gradient is doubled)."""
    import torch

    from executors.model import build_model, loss_fn, synthetic_batch
    from executors.parity import parity_learning_rate

    tokens, targets = synthetic_batch(model, GLOBAL_BATCH, seq_len, 1234, 0)
    changes = []
    for factor in (1.0, 2.0):
        net = build_model(model, seq_len, 1234)
        loss = loss_fn(net(tokens), targets)
        loss.backward()
        params = list(net.parameters())
        lr = scale * parity_learning_rate(float(loss.detach()), sum(float(p.grad.double().pow(2).sum())
                                                                    for p in params))
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-lr * factor)
            changes.append(float(loss_fn(net(tokens), targets)) - float(loss.detach()))
    return -changes[0] / float(loss.detach()), abs(changes[1] - changes[0]) / abs(changes[0])


def run_plan(name: str, precision: str, fault: str, references: dict, work: Path) -> dict:
    st, ranks, extra = PLANS[name]
    st = st.resolve(ranks)
    train = TrainSpec(global_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN, precision=precision)
    built, notes = executed_model(TEST_MOE if name in MOE_PLANS else TEST_MODEL, st)
    reasons = unsupported_reasons(built, train, st, "cpu", extra.get("hsdp_replicate", 1))
    if reasons:
        return {"plan": name, "precision": precision, "fault": fault, "outcome": "unsupported", "reason": reasons}
    rtol, update_rtol = PARITY_TOLERANCES[precision]
    base = RunConfig(label=name, model=built, train=train, strategy=st, num_gpus=ranks, warmup_steps=1,
                     timed_steps=1, timeout_s=TIMEOUT_S, notes=notes, fault=fault, parity_rtol=rtol,
                     update_rtol=update_rtol, grad_rtol=GRAD_NORM_TOLERANCES[precision], **extra)
    key = (built.model_dump_json(), precision)
    if key not in references:
        ref_cfg = base.model_copy(update={"strategy": Strategy(dp=1).resolve(1), "num_gpus": 1, "fault": "none"})
        ref, error = launch_reference(ref_cfg, work / f"reference-{len(references)}")
        if ref is None:
            raise SystemExit(error)
        references[key] = ref
    ref: ParityReference = references[key]
    result = launch(base.with_reference(ref), work / f"{name}-{precision}-{fault}")
    row = {"plan": name, "precision": precision, "fault": fault, "outcome": result.outcome,
           "parity_learning_rate": ref.learning_rate, "reference": ref.losses}
    if result.parity is None:
        return row | {"reason": result.reason[:300]}
    return row | {"measured": result.parity.measured, "loss_rel_error": result.parity.max_rel_error,
                  "update_rel_error": result.parity.update_rel_error, "grad_rel_error": result.parity.grad_rel_error}


def summarise(rows: list[dict], precision: str) -> None:
    right = [r for r in rows if r["precision"] == precision and r["fault"] == "none" and "loss_rel_error" in r]
    wrong = [r for r in rows if r["precision"] == precision and r["fault"] != "none" and "update_rel_error" in r]
    rtol, update_rtol = PARITY_TOLERANCES[precision]
    if right:
        print(f"{precision}: right runs ({len(right)}): largest loss error "
              f"{max(r['loss_rel_error'] for r in right):.2e} (parity_rtol {rtol:.0e}), largest loss-change error "
              f"{max(r['update_rel_error'] for r in right):.2e} "
              f"(update_rtol {update_rtol:.0e})")
    doubled = [r for r in wrong if r["fault"] == "grad_x2"]
    if doubled:
        print(f"{precision}: grad_x2 runs ({len(doubled)}): smallest loss-change error "
              f"{min(r['update_rel_error'] for r in doubled):.2e}; outcomes "
              f"{sorted({r['outcome'] for r in doubled})}")
    grad_right = [r["grad_rel_error"] for r in right if r.get("grad_rel_error") is not None]
    if grad_right:
        print(f"{precision}: MoE right runs ({len(grad_right)}): largest step-1 gradient-norm error "
              f"{max(grad_right):.2e} (grad_rtol {GRAD_NORM_TOLERANCES[precision]:.0e})")
    for fault in EXPERT_FAULTS:
        rows_f = [r for r in wrong if r["fault"] == fault]
        if rows_f:
            print(f"{precision}: {fault} runs ({len(rows_f)}): smallest gradient-norm error "
                  f"{min(r['grad_rel_error'] for r in rows_f):.2e}, largest loss-change error "
                  f"{max(r['update_rel_error'] for r in rows_f):.2e}; outcomes {sorted({r['outcome'] for r in rows_f})}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--no-faults", action="store_true", help="skip the grad_x2 runs")
    parser.add_argument("--work-dir", type=Path, default=None, help="run directories (default: temporary)")
    parser.add_argument("--json", type=Path, default=None, help="write every row here")
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="meshplan-parity-"))
    start = time.perf_counter()
    print("one plain-SGD step, single process, fp32 (loss decrease / loss; change of it under a 2x gradient),")
    print(f"at the parity step size (PARITY_LOSS_DECREASE = {PARITY_LOSS_DECREASE}) and at 3x it:")
    for model, seq_len in ((TEST_MODEL, SEQ_LEN), (CPU_SMALL, 64)):
        for scale in (1.0, 3.0):
            decrease, x2 = step_size_check(model, seq_len, scale)
            print(f"  {model.name:14} {scale:.0f}x step: decrease {decrease:.4f}  2x gradient: {x2:.3f}")
    rows, references = [], {}
    print(f"\n{'plan':26} {'prec':5} {'fault':20} {'outcome':8} {'loss err':>9} {'change err':>10} {'grad err':>9}")
    for precision in args.precisions:
        for name in args.plans:
            faults = ["none"] if args.no_faults else ["none", "grad_x2"]
            if not args.no_faults and PLANS[name][0].ep > 1:
                faults += list(EXPERT_FAULTS)
            for fault in faults:
                row = run_plan(name, precision, fault, references, work)
                rows.append(row)
                grad = "-" if row.get("grad_rel_error") is None else f"{row['grad_rel_error']:.2e}"
                errs = (f"{row['loss_rel_error']:9.2e} {row['update_rel_error']:10.2e} {grad:>9}"
                        if "loss_rel_error" in row else f"{'-':>9} {'-':>10}  {row.get('reason', '')}")
                print(f"{name:26} {precision:5} {fault:20} {row['outcome']:8} {errs}", flush=True)
    print()
    for precision in args.precisions:
        summarise(rows, precision)
    print(f"wall time {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
