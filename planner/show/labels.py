"""The words and numbers of a plan as a person reads them: table cells, column names, legend lines, the
summary and breakdown of one estimate.

Everything here returns plain strings (or lists of them) and reads plans, estimates and strategies by their
attributes, so the CLI (rich tables), the HTML report and notebooks print the same cells from one place.
User-given text (model and cluster names) is returned as given: each renderer escapes it for its medium
(`planner.cli.text` for the terminal, `html.escape` for the report).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from planner.specs.adapters import adapter_params

if TYPE_CHECKING:
    from planner.specs import Estimate, Plan, PlanResult, Strategy, TrainSpec

GIB = 2**30
MIB = 2**20

#: What each step-time term is, beside its name (`meshplan explain`, the report's breakdown).
TIME_TERM_LABELS = {
    "tp_comm": "tp_comm (TP all-reduce / all-gather + reduce-scatter)",
    "cp_comm": "cp_comm (context-parallel KV ring)",
    "ep_comm": "ep_comm (MoE token all-to-all: dispatch + combine, fwd + bwd)",
    "pp_comm": "pp_comm (pipeline send/recv)",
    "pp_bubble": "pp_bubble (pipeline fill and drain)",
    "activation_offload": "activation_offload (copies to and from the host the compute waits for)",
    "dp_comm": "dp_comm (gradient reduce / ZeRO gathers, exposed)",
    "optimizer": "optimizer (step; on the host when offloaded)",
}

#: Each step-time term as a sentence names it ("B loses 11% to the pipeline bubble").
TIME_TERM_WORDS = {
    "compute": "compute",
    "recompute": "recomputation",
    "activation_offload": "activation offload copies",
    "tp_comm": "tensor-parallel communication",
    "cp_comm": "context-parallel communication",
    "ep_comm": "the MoE all-to-all",
    "pp_comm": "pipeline sends",
    "pp_bubble": "the pipeline bubble",
    "dp_comm": "exposed gradient reduction and ZeRO gathers",
    "optimizer": "the optimizer step",
}

#: Each memory term as a sentence names it.
MEMORY_TERM_WORDS = {
    "params": "parameters",
    "adapters": "adapter weights",
    "grads": "gradients",
    "optimizer": "optimizer states",
    "fp8_weights": "FP8 weight copies",
    "dequant_buffer": "dequantised weight buffer",
    "activations": "stored activations",
    "recompute_working": "recomputation working memory",
    "embedding_activations": "embedding activations",
    "logits": "logits",
    "zero3_buffers": "ZeRO-3 gather buffers",
    "comm_buffers": "pipeline buffers",
    "cuda_graph_buffers": "CUDA graph buffers",
}

#: How the legend names a setting the planner chose (planner.knobs), by TrainSpec field.
SETTING_WORDS = {"grad_precision": "gradients reduced in {}", "fp8_param_gather": "FP8 parameter gather {}",
                 "cross_entropy_fusion_impl": "cross-entropy {}", "moe_router_padding_for_quantization":
                 "router FP8 padding {}", "moe_dispatcher": "dispatcher {}", "moe_flex_num_sms": "flex SMs {}"}

#: The default layout of ranks (Megatron's): any other is marked in the layout label.
DEFAULT_RANK_ORDER = "tp-cp-ep-dp-pp"


def gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def time_word(term: str) -> str:
    return TIME_TERM_WORDS.get(term, term)


def memory_word(term: str) -> str:
    return MEMORY_TERM_WORDS.get(term, term.replace("_", " "))


def layout_label(s: "Strategy", train: "TrainSpec | None" = None) -> str:
    """`dp64 tp8 pp16 cp2 vpp8 sp`: the degrees (cp, ep, etp, vpp only when > 1) and sequence parallelism, and
    `pp<dp` where the rank order nests the pipeline inside data parallelism (Megatron's --use-tp-pp-dp-mapping);
    with expert parallelism, `a2a-ovl` where the all-to-all overlaps another micro-batch's compute and, given the
    plan's `train`, its flex dispatcher (`hybridep`, `deepep`)."""
    parts = [f"dp{s.dp}", f"tp{s.tp}", f"pp{s.pp}"]
    parts += [f"{k}{v}" for k, v in (("cp", s.cp), ("ep", s.ep), ("etp", s.etp), ("vpp", s.vpp)) if v > 1]
    order = [] if s.rank_order == DEFAULT_RANK_ORDER else ["pp<dp"]
    moe = (["a2a-ovl"] if s.overlap_moe_comm else []) + (
        [train.moe_dispatcher] if train is not None and s.ep > 1 and train.moe_dispatcher != "alltoall" else [])
    return " ".join(parts + (["sp"] if s.sequence_parallel else []) + order + moe)


def zero_label(p: "Plan") -> str:
    """`1`, `1-2` for a folded row, `1+cpu` with the optimizer offloaded."""
    z = p.folded.zero_label() if p.folded else str(p.strategy.zero_stage)
    return z + ("+cpu" if p.strategy.offload_optimizer else "")


def recompute_label(p: "Plan") -> str:
    """`none`, `selective`, `selective(mla_up_proj+moe_act)` (Megatron's --recompute-modules), `full`,
    `full(6)` (6 layers per chunk) or `full(1..6)` for a folded row; `none+cpu(20)` with the activations
    of 20 layers offloaded to the host (as `1+cpu` is the optimizer's)."""
    s = p.strategy
    detail = ("+".join(s.recompute_modules) if s.recompute_modules
              else (p.folded.layers_label() if p.folded else "")
              or (str(s.recompute_num_layers) if s.recompute_num_layers else ""))
    offload = f"+cpu({s.offload_activation_layers})" if s.offload_activation_layers else ""
    return s.recompute + (f"({detail})" if detail else "") + offload


def plan_label(p: "Plan") -> str:
    """One line naming a plan as the table shows it: `#2 dp8 tp8 pp2 sp, zero 1, mbs 1, recompute none`."""
    s = p.strategy
    split = s.split_label()
    return (f"#{p.rank} {layout_label(s, p.train)}, zero {zero_label(p)}, mbs {s.micro_batch_size}, "
            f"recompute {recompute_label(p)}" + (f", {split}" if split else ""))


def step_band(e: "Estimate") -> str:
    """`low-high` seconds of the step-time band ("-" for an Estimate without one)."""
    return "-" if e.step_time_s_low is None else f"{e.step_time_s_low:.3f}-{e.step_time_s_high:.3f}"


def mfu_band(e: "Estimate") -> str:
    return "-" if e.mfu_low is None else f"{100 * e.mfu_low:.1f}-{100 * e.mfu_high:.1f}"


def mark(result: "PlanResult", p: "Plan") -> str:
    """`best` for plan 1, `~` for a plan worth a real run beside it, else empty (and empty for closest misses)."""
    if not result.plans:
        return ""
    return "best" if p.rank == 1 else ("~" if p.rank in result.worth_a_real_run else "")


@dataclass
class TextTable:
    """A table as cells: what the CLI renders with rich and the report as HTML."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    #: Columns aligned left (the rest right).
    left: set[str] = field(default_factory=set)
    #: Columns that must never be cut (typed back into `evaluate`).
    whole: set[str] = field(default_factory=set)


#: The default table's columns: it fits a 100-column terminal.
NARROW_COLUMNS = ("#", "layout", "zero", "mbs", "recompute", "split", "step (s)", "MFU %", "GiB/GPU")


def plans_shown(result: "PlanResult") -> list["Plan"]:
    """The ranked plans, or, when nothing fits, the closest candidates."""
    return result.plans or result.closest


def table_title(result: "PlanResult") -> str:
    return "ranked plans" if result.plans else "no strategy fits; closest candidates"


def header_line(result: "PlanResult", num_params: float, num_active_params: float | None = None,
                name=str, model_name=None) -> str:
    """`gpt3-175b (174.6B params) on 1024 x A100-SXM4-80GB (dgx-a100-80gb), global batch 1536 x 2048 tokens, bf16`:
    the question. The parameter counts are the caller's (cost_models.params); `name` renders each user-given
    name for the medium (escaped, cut), `model_name` the model's (default `name`)."""
    m, c, t = result.model, result.cluster, result.train
    size = f"{num_params / 1e9:.1f}B params" + (f", {num_active_params / 1e9:.1f}B active"
                                                 if num_active_params is not None and m.is_moe else "")
    return (f"{(model_name or name)(m.name)} ({size}) on {result.num_gpus} x {name(c.gpu.name)} ({name(c.name)}), "
            f"global batch {t.global_batch_size} x {t.seq_len} tokens, {t.precision}{finetune_words(t, m)}")


def finetune_words(train, model) -> str:
    """`, QLoRA r16 (207.1M adapter parameters, deepspeed)`: what a fine-tuning run trains, for the header; empty
    for pre-training."""
    mode = getattr(train, "finetune", "none")
    if mode == "none":
        return ""
    if mode == "full":
        return ", full fine-tuning"
    count = adapter_params(model, train)
    return (f", {'QLoRA' if mode == 'qlora' else 'LoRA'} r{train.lora_rank} ({count / 1e6:,.1f}M adapter "
            f"parameters, {train.framework})")


def plan_table(result: "PlanResult", wide: bool = False) -> TextTable:
    """The ranked plans (or the closest) as cells: the default columns fit 100 terminal columns; `wide` adds
    the degrees one by one, the bands, tokens/s, TFLOP/s and headroom."""
    plans = plans_shown(result)
    if not wide:
        rows = []
        for p in plans:
            s, e = p.strategy, p.estimate
            rows.append([f"{p.rank}~" if mark(result, p) == "~" else str(p.rank), layout_label(s, p.train),
                         zero_label(p), str(s.micro_batch_size), recompute_label(p), s.split_label() or "even",
                         f"{e.step_time_s:.3f}", f"{100 * e.mfu:.1f}", gib(e.peak_memory_bytes)])
        return TextTable(table_title(result), list(NARROW_COLUMNS), rows, left={"layout", "recompute", "split"},
                         whole={"#", "step (s)", "MFU %", "GiB/GPU", "zero"})
    moe = result.model.is_moe or any(p.strategy.ep > 1 or p.strategy.etp > 1 for p in plans)
    cols = ["#", "dp", "tp", "pp", "cp"] + (["ep", "etp"] if moe else []) + [
        "vpp", "sp", "zero", "mbs", "recompute", "split", "step (s)", "step band (s)", "~#1", "tok/s/GPU",
        "model TFLOP/s/GPU", "MFU %", "MFU band %", "mem/GPU (GiB)", "headroom (GiB)"]
    rows = []
    for p in plans:
        s, e = p.strategy, p.estimate
        experts = [str(s.ep), str(s.etp)] if moe else []
        rows.append([str(p.rank), str(s.dp), str(s.tp), str(s.pp), str(s.cp), *experts, str(s.vpp),
                     "y" if s.sequence_parallel else "-", zero_label(p), str(s.micro_batch_size), recompute_label(p),
                     s.split_label() or "even", f"{e.step_time_s:.3f}", step_band(e), mark(result, p),
                     f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.model_tflops_per_gpu:.1f}", f"{100 * e.mfu:.1f}",
                     mfu_band(e), gib(e.peak_memory_bytes), gib(e.memory_capacity_bytes - e.peak_memory_bytes)])
    return TextTable(table_title(result), cols, rows, left={"recompute", "split"}, whole={"recompute", "split"})


def plan_legend(result: "PlanResult", plans: list["Plan"], wide: bool, tie_fraction: float) -> list[str]:
    """The lines under the plan table; `tie_fraction` is the ranking's (planner.ranking.TIE_FRACTION)."""
    if not plans:
        return []
    cap = result.cluster.gpu.memory_bytes
    lines = [f"memory safety margin {result.headroom:.0%} (--headroom): a plan fits when its peak is at most "
             f"{cap * (1 - result.headroom) / GIB:.1f} of {cap / GIB:.1f} GiB per GPU"]
    if result.plans:
        lines.append(f"order: fastest first, but plans within {tie_fraction:.0%} of the fastest remaining (and in "
                     "its band) go to the simpler layout: no offload, fewer stages, no cp, larger micro-batches")
    if any(p.folded for p in plans):
        lines.append("a range (zero 1-2, full(1..6)) folds near-duplicates of one layout into a row; the row's plan "
                     "is one concrete member (--format json)")
    lines.append("reproduce a row: meshplan evaluate|explain|emit --plan plans.json --rank N (plans.json from "
                 "--format json)")
    if not wide:
        lines.append("layout: degrees (cp, ep, etp, vpp shown when > 1), sp = sequence parallel; --wide for the "
                     "bands, tokens/s and TFLOP/s")
    if any(p.strategy.rank_order != DEFAULT_RANK_ORDER for p in plans):
        lines.append("pp<dp: ranks ordered tp-cp-ep-pp-dp, each pipeline's stages adjacent and the data-parallel "
                     "replicas outermost (Megatron's --use-tp-pp-dp-mapping; evaluate --rank-order tp-cp-ep-pp-dp)")
    if any(p.strategy.offload_activation_layers for p in plans):
        lines.append("recompute none+cpu(N): the activations of the first N layers offloaded to host memory "
                     "(Megatron's --cpu-offloading-num-layers N; evaluate --offload-activation-layers N)")
    chosen = chosen_settings_line(plans)
    band = band_legend(result, plans[0].estimate, wide)
    return lines + ([chosen] if chosen else []) + ([band] if band else [])


def chosen_settings_line(plans: list["Plan"]) -> str:
    """The training settings the planner chose for the shown plans (left free by the input): each with its
    value, or `per plan` where the plans differ; empty when every setting was given."""
    keys = [k for k in SETTING_WORDS if any(k in p.estimate.settings for p in plans)]
    if not keys:
        return ""

    def word(v: Any) -> str:
        return {True: "on", False: "off", None: "default"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)

    bits = []
    for k in keys:
        values = {word(p.estimate.settings.get(k)) for p in plans if k in p.estimate.settings}
        bits.append(SETTING_WORDS[k].format(values.pop() if len(values) == 1 else "per plan"))
    return ("settings chosen (not given; --strict-numerics keeps the framework's numerics): " + ", ".join(bits)
            + "; each plan's own are in --format json (train, estimate.settings)")


def band_legend(result: "PlanResult", best: "Estimate", wide: bool = True) -> str:
    """The lines under the plan table: what the band is and what `~` marks."""
    lines = [f"band: where a real run is expected to land; {best.band_basis}"] if wide else []
    if result.plans:
        others = [r for r in result.worth_a_real_run if r != 1]
        lines.append("~ : step-time band overlaps plan 1's, the model cannot order them: worth a real run "
                     "(`meshplan tune` or `validate`)" + ("" if others else "; none here"))
    return "\n".join(lines)


def stats_lines(result: "PlanResult") -> list[str]:
    """How the search went: counts, time, rejections by reason."""
    st = result.stats
    rejected = ", ".join(f"{k}: {v:,}" for k, v in sorted(st.rejected.items(), key=lambda kv: -kv[1])) or "none"
    return [f"candidates evaluated: {st.num_candidates:,} | valid: {st.num_valid:,} | feasible: "
            f"{st.num_feasible:,} | search time: {st.search_time_s:.2f} s", f"rejected by reason: {rejected}"]


def estimate_lines(e: "Estimate") -> list[str]:
    """The summary of one estimate under its strategy's label: speed, band, memory."""
    lines = [f"step {e.step_time_s:.3f} s | {e.tokens_per_s:,.0f} tokens/s | {e.tokens_per_s_per_gpu:,.0f} "
             f"tokens/s/GPU | model {e.model_tflops_per_gpu:.1f} TFLOP/s/GPU | hardware "
             f"{e.hardware_tflops_per_gpu:.1f} TFLOP/s/GPU | MFU {100 * e.mfu:.1f} %"]
    if e.step_time_s_low is not None:
        lines.append(f"band: step {step_band(e)} s | {e.tokens_per_s_per_gpu_low:,.0f}-"
                     f"{e.tokens_per_s_per_gpu_high:,.0f} tokens/s/GPU | MFU {mfu_band(e)} % ({e.band_basis})")
    lines.append(f"peak memory {gib(e.peak_memory_bytes)} GiB of {gib(e.memory_capacity_bytes)} GiB "
                 f"({e.binding_stage} stage; largest term {e.binding_memory_term}) | "
                 f"{e.num_microbatches} micro-batches, bubble {100 * e.bubble_fraction:.1f} %")
    if e.finetune:
        lines.append(adapter_line(e.finetune))
    return lines


def adapter_line(f: dict) -> str:
    """What the frozen base and the adapters cost per step (Estimate.finetune), one line: `frozen base: forward 2.24
    s, input gradients 2.55 s (the weight gradients skipped would add 1.89 s); adapters 0.58 s; dequantisation 0.22 s
    (207.1M trainable parameters)`."""
    below = f.get("layers_without_backward", 0)
    skipped = f" layers 0-{below - 1} run no backward;" if below else ""
    deq = f"; dequantisation {f['dequantisation_s']:.2f} s" if f.get("dequantisation_s") else ""
    return (f"frozen base per step: forward {f['base_forward_s']:.2f} s, input gradients {f['input_gradients_s']:.2f} "
            f"s (the weight gradients it skips would add {f['weight_gradients_skipped_s']:.2f} s);{skipped} adapters "
            f"{f['adapters_s']:.2f} s{deq} ({f['trainable_params'] / 1e6:,.1f}M trainable parameters)")


def memory_rows(e: "Estimate") -> list[list[str]]:
    """The memory breakdown, largest first: term (marked where it is the largest), GiB, % of peak."""
    rows = []
    for term, value in sorted(e.memory_bytes.items(), key=lambda kv: -kv[1]):
        mark_ = " <- largest" if term == e.binding_memory_term else ""
        rows.append([term + mark_, f"{value / GIB:.2f}", f"{100 * value / e.peak_memory_bytes:.1f}"])
    return rows


def time_rows(e: "Estimate") -> list[list[str]]:
    """The step-time breakdown in the cost model's order: term (with what it is), seconds, % of step."""
    return [[TIME_TERM_LABELS.get(term, term), f"{value:.4f}", f"{100 * value / e.step_time_s:.1f}"]
            for term, value in e.time_s.items()]


# ---- measured runs: `meshplan validate` and `meshplan tune` ---------------------------------------------------
def _or_dash(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def validation_table(report) -> TextTable:
    """A ValidationReport (executors.compare) as cells: each run's outcome, predicted and measured step and memory,
    their errors in %, ranks, parity and the host's load."""
    title = (f"{report.model.name}: {report.num_gpus} ranks on {report.cluster} ({report.device}, {report.engine}), "
             f"global batch {report.train.global_batch_size} x {report.train.seq_len}, {report.train.precision}")
    columns = ["#", "strategy", "outcome", "step pred (s)", "step meas (s)", "step err %", "mem pred (MiB)",
               "mem meas (MiB)", "mem err %", "rank pred", "rank meas", "parity", "host"]
    rows = []
    for i, c in enumerate(report.comparisons, start=1):
        parity = "-" if c.parity is None else ("pass" if c.parity.passed else "FAIL")
        host = "-" if c.host_load is None else ("busy" if c.busy else "quiet")
        rows.append([str(i), c.label, c.outcome, _or_dash(c.predicted_step_time_s), _or_dash(c.measured_step_time_s),
                     _or_dash(c.step_time_error and 100 * c.step_time_error, "{:+.0f}"),
                     _or_dash(c.predicted_memory_bytes and c.predicted_memory_bytes / MIB, "{:.0f}"),
                     _or_dash(c.measured_memory_bytes and c.measured_memory_bytes / MIB, "{:.0f}"),
                     _or_dash(c.memory_error and 100 * c.memory_error, "{:+.0f}"),
                     _or_dash(c.predicted_rank, "{}"), _or_dash(c.measured_rank, "{}"), parity, host])
    return TextTable(title, columns, rows, left={"strategy", "outcome"})


def trials_table(report) -> TextTable:
    """A TuneReport (executors.tune) as cells: each trial that ran or failed (not the queued or skipped ones)."""
    job = report.job
    title = (f"study {report.study_name}: {job['model']} on {job['num_gpus']} x {job['cluster']}, batch "
             f"{job['global_batch_size']} x {job['seq_len']}, {job['precision']} ({report.measured} measured trials)")
    columns = ["#", "strategy", "origin", "status", "pred (s)", "meas (s)", "err", "err cal.", "spread",
               "mem pred (MiB)", "mem meas (MiB)", "tokens/s"]
    rows = []
    for r in report.trials:
        if r.state in ("WAITING", "PRUNED") and r.status in ("", "not run"):
            continue  # queued for a later run, or a proposal that did not run (counted by the caller)
        status = r.status + (" (busy)" if r.busy else "") if r.status else r.state.lower()
        rows.append([str(r.number), r.label, r.origin, status, _or_dash(r.predicted_step_s),
                     _or_dash(r.measured_step_s), _or_dash(r.error and 100 * r.error, "{:+.0f}%"),
                     _or_dash(r.error_calibrated and 100 * r.error_calibrated, "{:+.0f}%"),
                     _or_dash(r.spread and 100 * r.spread, "{:.0f}%"),
                     _or_dash(r.predicted_peak_memory_bytes and r.predicted_peak_memory_bytes / MIB, "{:.0f}"),
                     _or_dash(r.measured_peak_memory_bytes and r.measured_peak_memory_bytes / MIB, "{:.0f}"),
                     _or_dash(r.tokens_per_s, "{:,.0f}")])
    return TextTable(title, columns, rows, left={"strategy", "origin", "status"})
