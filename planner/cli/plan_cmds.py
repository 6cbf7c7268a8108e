"""`meshplan plan | evaluate | explain | models | clusters`."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from cost_models.layout import ParallelLayout
from cost_models.params import num_active_params, num_params
from planner.api import evaluate as api_evaluate
from planner.api import plan as api_plan
from planner.cli.app import app
from planner.cli.common import (
    GIB,
    AttentionOpt,
    CalibrationOpt,
    CeFusionImplOpt,
    CeFusionOpt,
    ClusterOpt,
    ExitWith,
    FlexSmsOpt,
    Format,
    FormatOpt,
    Fp8ParamGatherOpt,
    Fp8RecipeOpt,
    FrameworkOpt,
    GbsOpt,
    GpusOpt,
    GradPrecisionOpt,
    HeadroomOpt,
    ModelOpt,
    MoeDispatcherOpt,
    MoeImbalanceOpt,
    OptimizerOpt,
    PlanFileOpt,
    Precision,
    PrecisionOpt,
    RankOpt,
    RecomputeOpt,
    RouterPaddingOpt,
    StrictNumericsOpt,
    CudaGraphImplOpt,
    CudaGraphScopeOpt,
    SeqOpt,
    TorchCompileOpt,
    Zero3ImplOpt,
    calibration_note,
    emit_csv,
    emit_json,
    gib,
    json_option,
    load_plan,
    parse_constraints,
    parse_headroom,
    plan_inputs,
    stderr,
    stdout,
    train_options,
)
from planner.cli.text import MESSAGE_CHARS, NAME_CHARS, message_lines, plain, shown
from planner.cli.topology_plot import draw_topology
from planner.cli.topology_view import (check_png_target, group_spans, print_summary, rank_order, topology_summary,
                                       write_png)
from planner.errors import SpecError
from planner.specs import Estimate, Plan, PlanResult, Strategy, TrainSpec

#: Above this share of communication assumed hidden behind compute, `plan` warns under its table:
#: the prediction then rests on near-perfect overlap, which real runs rarely reach (a profile's
#: comm_overlap, measured by `meshplan profile`, is usually well below 1).
COMM_HIDDEN_WARN_FRACTION = 0.9


# ---- plan -------------------------------------------------------------------
@app.command("plan")
def plan_cmd(
    model: ModelOpt,
    cluster: ClusterOpt,
    gpus: GpusOpt,
    global_batch_size: GbsOpt,
    seq_len: SeqOpt,
    precision: PrecisionOpt = Precision.bf16,
    top: Annotated[int, typer.Option("--top", "-k", help="How many plans to show.")] = 10,
    constraint: Annotated[Optional[list[str]], typer.Option("--constraint", "-C", help="Fix or restrict a Strategy field: tp=8, pp=2,4, recompute=selective, zero_stage=1 (repeatable, once per field: a field given twice, here or in --constraints, is refused).")] = None,
    constraints: Annotated[Optional[str], typer.Option("--constraints", help='Constraints as a JSON object, e.g. \'{"tp": 8, "pp": [2, 4]}\'; -C may add other fields, not repeat one.')] = None,
    grad_precision: GradPrecisionOpt = None,
    attention_kernel: AttentionOpt = "flash",
    optimizer: OptimizerOpt = "adam",
    moe_load_imbalance: MoeImbalanceOpt = None,
    zero3_impl: Zero3ImplOpt = None,
    fp8_recipe: Fp8RecipeOpt = "delayed",
    fp8_param_gather: Fp8ParamGatherOpt = None,
    cross_entropy_fusion: CeFusionOpt = None,
    cross_entropy_fusion_impl: CeFusionImplOpt = None,
    framework: FrameworkOpt = "megatron",
    moe_dispatcher: MoeDispatcherOpt = None,
    moe_flex_num_sms: FlexSmsOpt = None,
    moe_router_padding_for_quantization: RouterPaddingOpt = None,
    torch_compile: TorchCompileOpt = None,
    cuda_graph_impl: CudaGraphImplOpt = None,
    cuda_graph_scope: CudaGraphScopeOpt = None,
    strict_numerics: StrictNumericsOpt = False,
    headroom: HeadroomOpt = None,
    calibration: CalibrationOpt = None,
    wide: Annotated[bool, typer.Option("--wide", help="Every column (bands, tokens/s, TFLOP/s, headroom); the "
                                       "default table fits 100 columns.")] = False,
    fmt: FormatOpt = Format.table,
) -> None:
    """Rank every valid strategy by predicted throughput; show the fastest that fit (near-ties go to the
    simpler layout, near-duplicates share a row: see the README's "Reading the plan table")."""
    kwargs = dict(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=global_batch_size, seq_len=seq_len,
                  precision=precision.value, constraints=parse_constraints(constraint, constraints), top_k=top,
                  calibration=calibration, strict_numerics=strict_numerics,
                  headroom=parse_headroom(headroom), **train_options(grad_precision, attention_kernel, optimizer,
                                                                      moe_load_imbalance, zero3_impl, fp8_recipe,
                                                                      cross_entropy_fusion, framework, moe_dispatcher,
                                                                      fp8_param_gather, torch_compile,
                                                                      cross_entropy_fusion_impl, moe_flex_num_sms,
                                                                      moe_router_padding_for_quantization,
                                                                      cuda_graph_impl, cuda_graph_scope))
    with searching(f"searching strategies for {gpus:,} GPUs"):
        result = api_plan(**kwargs)
    if fmt is Format.json:
        emit_json(result.model_dump(mode="json"))
    elif fmt is Format.csv:
        emit_csv([plan_row(p) | {"worth_a_real_run": p.rank in result.worth_a_real_run and bool(result.plans)}
                  for p in result.plans or result.closest])
    elif result.stats.num_valid:
        print_plan_table(result, wide=wide)
        calibration_note(calibration)
        warn_hidden_comm(result)
    if not result.stats.num_valid:
        raise ExitWith(2, no_valid_message(result))
    if not result.plans:
        raise ExitWith(1, no_fit_message(result))


def searching(text: str):
    """A spinner on stderr while a search runs, on a terminal only (never in piped or JSON output)."""
    from contextlib import nullcontext

    return stderr.status(text, spinner="dots") if stderr.is_terminal else nullcontext()


def no_valid_message(result: PlanResult) -> str:
    """`0 valid strategies` with every rule that rejected candidates, counted."""
    n = result.stats.num_candidates
    lines = [f"error: 0 valid strategies for {result.num_gpus:,} GPUs ({n:,} candidates, every one breaks a rule):"]
    for r in result.rejections:
        lines.append(f"  {r.rule}: {r.count:,} (e.g. {r.example})")
    return "\n".join(lines)


def no_fit_message(result: PlanResult) -> str:
    if not result.stats.num_valid:
        return no_valid_message(result)
    lines = [f"no strategy fits in {result.cluster.gpu.memory_bytes / GIB:.0f} GiB per GPU with a "
             f"{result.headroom:.0%} safety margin ({result.stats.num_valid:,} valid strategies scored)."]
    if result.closest:
        near = result.closest[0]
        lines.append(f"closest: {near.strategy.short()}: " + "; ".join(near.estimate.reasons))
        lines += result.advice
        if not result.advice:
            lines.append("try more GPUs, a smaller global batch or sequence, or fewer constraints.")
    return "\n".join(lines)


def plan_row(p: Plan) -> dict[str, Any]:
    row: dict[str, Any] = {"rank": p.rank}
    row.update(p.strategy.model_dump())
    est = p.estimate.model_dump()
    row.update({k: v for k, v in est.items() if not isinstance(v, (dict, list))})
    row.update({f"time_s.{k}": v for k, v in p.estimate.time_s.items()})
    row.update({f"memory_bytes.{k}": v for k, v in p.estimate.memory_bytes.items()})
    row["reasons"] = "; ".join(p.estimate.reasons)
    return row


def print_plan_table(result: PlanResult, wide: bool = False, console=None) -> None:
    """The ranked plans (or, when nothing fits, the closest) with their legend. The default table fits a
    100-column terminal; `wide` adds the bands, tokens/s, TFLOP/s and headroom columns."""
    out = console or stdout
    m, c, t = result.model, result.cluster, result.train
    size = f"{num_params(m) / 1e9:.1f}B params" + (f", {num_active_params(m) / 1e9:.1f}B active" if m.is_moe else "")
    out.print(f"[bold]{shown(m.name)}[/] ({size}) on {result.num_gpus} x {shown(c.gpu.name)} ({shown(c.name)}), "
              f"global batch {t.global_batch_size} x {t.seq_len} tokens, {t.precision}", soft_wrap=False)
    plans = result.plans or result.closest
    title = "ranked plans" if result.plans else "no strategy fits; closest candidates"
    if wide:  # as wide as the table needs: the full detail was asked for
        from rich.console import Console
        from rich.measure import Measurement

        table = _wide_table(result, plans, title)
        need = Measurement.get(out, out.options.update(width=10_000), table).maximum
        if need > out.width:
            out = Console(file=out.file, width=need, soft_wrap=True, no_color=out.no_color,
                          force_terminal=out.is_terminal)
        out.print(table)
    else:
        out.print(_narrow_table(result, plans, title))
    for line in plan_legend(result, plans, wide):  # the band's basis comes from a profile file: made plain
        out.print(message_lines(line), markup=False, highlight=False, soft_wrap=False)
    st = result.stats
    rejected = ", ".join(f"{k}: {v:,}" for k, v in sorted(st.rejected.items(), key=lambda kv: -kv[1])) or "none"
    out.print(f"candidates evaluated: {st.num_candidates:,} | valid: {st.num_valid:,} | feasible: "
              f"{st.num_feasible:,} | search time: {st.search_time_s:.2f} s", soft_wrap=False)
    out.print(f"rejected by reason: {rejected}", markup=False, highlight=False, soft_wrap=False)


def layout_label(s: Strategy, train: TrainSpec | None = None) -> str:
    """`dp64 tp8 pp16 cp2 vpp8 sp`: the degrees (cp, ep, etp, vpp only when > 1) and sequence parallelism, and
    `pp<dp` where the rank order nests the pipeline inside data parallelism (Megatron's --use-tp-pp-dp-mapping);
    with expert parallelism, `a2a-ovl` where the all-to-all overlaps another micro-batch's compute and, given the
    plan's `train`, its flex dispatcher (`hybridep`, `deepep`)."""
    parts = [f"dp{s.dp}", f"tp{s.tp}", f"pp{s.pp}"]
    parts += [f"{k}{v}" for k, v in (("cp", s.cp), ("ep", s.ep), ("etp", s.etp), ("vpp", s.vpp)) if v > 1]
    order = [] if s.rank_order == "tp-cp-ep-dp-pp" else ["pp<dp"]
    moe = (["a2a-ovl"] if s.overlap_moe_comm else []) + (
        [train.moe_dispatcher] if train is not None and s.ep > 1 and train.moe_dispatcher != "alltoall" else [])
    return " ".join(parts + (["sp"] if s.sequence_parallel else []) + order + moe)


def zero_label(p: Plan) -> str:
    """`1`, `1-2` for a folded row, `1+cpu` with the optimizer offloaded."""
    z = p.folded.zero_label() if p.folded else str(p.strategy.zero_stage)
    return z + ("+cpu" if p.strategy.offload_optimizer else "")


def recompute_label(p: Plan) -> str:
    """`none`, `selective`, `selective(mla_up_proj+moe_act)` (Megatron's --recompute-modules), `full`,
    `full(6)` (6 layers per chunk) or `full(1..6)` for a folded row; `none+cpu(20)` with the activations
    of 20 layers offloaded to the host (as `1+cpu` is the optimizer's)."""
    s = p.strategy
    detail = ("+".join(s.recompute_modules) if s.recompute_modules
              else (p.folded.layers_label() if p.folded else "")
              or (str(s.recompute_num_layers) if s.recompute_num_layers else ""))
    offload = f"+cpu({s.offload_activation_layers})" if s.offload_activation_layers else ""
    return s.recompute + (f"({detail})" if detail else "") + offload


def _mark(result: PlanResult, p: Plan) -> str:
    if not result.plans:
        return ""
    return "best" if p.rank == 1 else ("~" if p.rank in result.worth_a_real_run else "")


def _narrow_table(result: PlanResult, plans: list[Plan], title: str) -> Table:
    table = Table(title=title, title_justify="left", box=None, pad_edge=False, padding=(0, 1),
                  header_style="bold underline")
    # every cell is printed whole: a cell that would be cut folds onto a second line instead
    for col in ("#", "layout", "zero", "mbs", "recompute", "split", "step (s)", "MFU %", "GiB/GPU"):
        table.add_column(col, justify="left" if col in ("layout", "recompute", "split") else "right",
                         overflow="fold", no_wrap=col in ("#", "step (s)", "MFU %", "GiB/GPU", "zero"))
    for p in plans:
        s, e = p.strategy, p.estimate
        table.add_row(f"{p.rank}~" if _mark(result, p) == "~" else str(p.rank), layout_label(s, p.train),
                      zero_label(p), str(s.micro_batch_size), shown(recompute_label(p), MESSAGE_CHARS),
                      s.split_label() or "even",
                      f"{e.step_time_s:.3f}", f"{100 * e.mfu:.1f}", gib(e.peak_memory_bytes))
    return table


def _wide_table(result: PlanResult, plans: list[Plan], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    moe = result.model.is_moe or any(p.strategy.ep > 1 or p.strategy.etp > 1 for p in plans)
    cols = ["#", "dp", "tp", "pp", "cp"] + (["ep", "etp"] if moe else []) + [
        "vpp", "sp", "zero", "mbs", "recompute", "split", "step (s)", "step band (s)", "~#1", "tok/s/GPU",
        "model TFLOP/s/GPU", "MFU %", "MFU band %", "mem/GPU (GiB)", "headroom (GiB)"]
    # the split and recompute labels are typed back into `evaluate`: never truncated, the other columns give way
    widths = {"split": max([len(p.strategy.split_label() or "even") for p in plans] + [5]),
              "recompute": max([len(recompute_label(p)) for p in plans] + [9])}
    for col in cols:
        table.add_column(col, justify="left" if col in widths else "right", no_wrap=col in widths,
                         min_width=widths.get(col))
    for p in plans:
        s, e = p.strategy, p.estimate
        experts = [str(s.ep), str(s.etp)] if moe else []
        table.add_row(str(p.rank), str(s.dp), str(s.tp), str(s.pp), str(s.cp), *experts, str(s.vpp),
                      "y" if s.sequence_parallel else "-", zero_label(p), str(s.micro_batch_size),
                      shown(recompute_label(p), MESSAGE_CHARS),
                      s.split_label() or "even", f"{e.step_time_s:.3f}", step_band(e), _mark(result, p),
                      f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.model_tflops_per_gpu:.1f}", f"{100 * e.mfu:.1f}",
                      mfu_band(e), gib(e.peak_memory_bytes),
                      gib(e.memory_capacity_bytes - e.peak_memory_bytes))
    return table


def plan_legend(result: PlanResult, plans: list[Plan], wide: bool) -> list[str]:
    """The lines under the plan table."""
    from planner.ranking import TIE_FRACTION

    if not plans:
        return []
    cap = result.cluster.gpu.memory_bytes
    lines = [f"memory safety margin {result.headroom:.0%} (--headroom): a plan fits when its peak is at most "
             f"{cap * (1 - result.headroom) / GIB:.1f} of {cap / GIB:.1f} GiB per GPU"]
    if result.plans:
        lines.append(f"order: fastest first, but plans within {TIE_FRACTION:.0%} of the fastest remaining (and in "
                     "its band) go to the simpler layout: no offload, fewer stages, no cp, larger micro-batches")
    if any(p.folded for p in plans):
        lines.append("a range (zero 1-2, full(1..6)) folds near-duplicates of one layout into a row; the row's plan "
                     "is one concrete member (--format json)")
    lines.append("reproduce a row: meshplan evaluate|explain|emit --plan plans.json --rank N (plans.json from "
                 "--format json)")
    if not wide:
        lines.append("layout: degrees (cp, ep, etp, vpp shown when > 1), sp = sequence parallel; --wide for the "
                     "bands, tokens/s and TFLOP/s")
    if any(p.strategy.rank_order != "tp-cp-ep-dp-pp" for p in plans):
        lines.append("pp<dp: ranks ordered tp-cp-ep-pp-dp, each pipeline's stages adjacent and the data-parallel "
                     "replicas outermost (Megatron's --use-tp-pp-dp-mapping; evaluate --rank-order tp-cp-ep-pp-dp)")
    if any(p.strategy.offload_activation_layers for p in plans):
        lines.append("recompute none+cpu(N): the activations of the first N layers offloaded to host memory "
                     "(Megatron's --cpu-offloading-num-layers N; evaluate --offload-activation-layers N)")
    chosen = chosen_settings_line(plans)
    band = band_legend(result, plans[0].estimate, wide)
    return lines + ([chosen] if chosen else []) + ([band] if band else [])


#: How the legend names a setting the planner chose (planner.knobs), by TrainSpec field.
SETTING_WORDS = {"grad_precision": "gradients reduced in {}", "fp8_param_gather": "FP8 parameter gather {}",
                 "cross_entropy_fusion_impl": "cross-entropy {}", "moe_router_padding_for_quantization":
                 "router FP8 padding {}", "moe_dispatcher": "dispatcher {}", "moe_flex_num_sms": "flex SMs {}"}


def chosen_settings_line(plans: list[Plan]) -> str:
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


def step_band(e: Estimate) -> str:
    """`low-high` seconds of the step-time band ("-" for an Estimate without one)."""
    return "-" if e.step_time_s_low is None else f"{e.step_time_s_low:.3f}-{e.step_time_s_high:.3f}"


def mfu_band(e: Estimate) -> str:
    return "-" if e.mfu_low is None else f"{100 * e.mfu_low:.1f}-{100 * e.mfu_high:.1f}"


def band_legend(result: PlanResult, best: Estimate, wide: bool = True) -> str:
    """The lines under the plan table: what the band is and what `~` marks."""
    lines = [f"band: where a real run is expected to land; {best.band_basis}"] if wide else []
    if result.plans:
        others = [r for r in result.worth_a_real_run if r != 1]
        lines.append("~ : step-time band overlaps plan 1's, the model cannot order them: worth a real run "
                     "(`meshplan tune` or `validate`)" + ("" if others else "; none here"))
    return "\n".join(lines)


def warn_hidden_comm(result: PlanResult) -> None:
    """One line on stderr when the top plan assumes nearly all communication hidden."""
    if not result.plans:
        return
    hidden = result.plans[0].estimate.comm_hidden_fraction
    if hidden > COMM_HIDDEN_WARN_FRACTION:
        stderr.print(f"warning: the prediction assumes {100 * hidden:.0f}% of communication hidden behind compute; "
                     "real overlap is often lower", markup=False, highlight=False)


# ---- evaluate / explain ----------------------------------------------------------
def _strategy(dp: Optional[int], tp: int, pp: int, cp: int, vpp: int, sp: bool, zero: int, mbs: int,
              recompute: RecomputeOpt, recompute_num_layers: Optional[int], first_stage_layers: Optional[int],
              last_stage_layers: Optional[int], stage_layers: Optional[str], embedding_as_layer: bool,
              loss_as_layer: bool, overlap_grad_reduce: bool, overlap_param_gather: bool, ep: int = 1, etp: int = 1,
              offload_optimizer: bool = False, offload_activation_layers: Optional[int] = None,
              overlap_p2p_comm: bool = True, rank_order: str = "tp-cp-ep-dp-pp", overlap_moe_comm: bool = False,
              recompute_modules: Optional[str] = None) -> Strategy:
    return Strategy(dp=dp if dp is not None else "auto", tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                    offload_optimizer=offload_optimizer, offload_activation_layers=offload_activation_layers,
                    vpp=vpp, sequence_parallel=sp,
                    zero_stage=zero, micro_batch_size=mbs, recompute=recompute.value,
                    recompute_num_layers=recompute_num_layers, num_layers_in_first_stage=first_stage_layers,
                    num_layers_in_last_stage=last_stage_layers, stage_layers=parse_stage_layers(stage_layers),
                    embedding_as_layer=embedding_as_layer, loss_as_layer=loss_as_layer,
                    overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
                    overlap_p2p_comm=overlap_p2p_comm, rank_order=rank_order, overlap_moe_comm=overlap_moe_comm,
                    recompute_modules=parse_modules(recompute_modules))


def parse_modules(text: Optional[str]) -> Optional[list[str]]:
    """`mla_up_proj+moe_act` or `mla_up_proj,moe_act` (the recompute cell of a plan table row reads the first)
    -> ["mla_up_proj", "moe_act"]; Strategy checks the names."""
    if text is None:
        return None
    return [m.strip() for m in text.replace("+", ",").split(",") if m.strip()]


def parse_stage_layers(text: Optional[str]) -> Optional[list[int]]:
    """`1,2,2,3` -> [1, 2, 2, 3] (the `split=` part of a plan table row reads the same)."""
    if text is None:
        return None
    try:
        return [int(v) for v in text.removeprefix("split=").split(",")]
    except ValueError:
        raise SpecError(f"--stage-layers must be comma-separated layer counts, one per pipeline stage (or one per "
                        f"virtual stage), e.g. 1,2,2,3 "
                        f"(got {text!r})") from None


DpOpt = Annotated[Optional[int], typer.Option("--dp", help="Data parallel degree (default: GPUs / (tp·cp·pp)).")]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor parallel degree.")]
PpOpt = Annotated[int, typer.Option("--pp", help="Pipeline parallel degree.")]
CpOpt = Annotated[int, typer.Option("--cp", help="Context parallel degree.")]
EpOpt = Annotated[int, typer.Option("--ep", help="Expert parallel degree (MoE models; folded over tp·cp·dp).")]
EtpOpt = Annotated[int, typer.Option("--etp", help="Tensor parallel degree inside the experts (MoE models).")]
OffloadOpt = Annotated[bool, typer.Option("--offload-optimizer", help="Optimizer states and step on the host CPU (needs ZeRO >= 1).")]
ActOffloadOpt = Annotated[Optional[int], typer.Option("--offload-activation-layers", help="Transformer layers whose activations are offloaded to host memory (Megatron's --cpu-offloading-num-layers; pp 1, no recompute).")]
VppOpt = Annotated[int, typer.Option("--vpp", help="Virtual pipeline chunks per stage.")]
SpOpt = Annotated[bool, typer.Option("--sp/--no-sp", help="Sequence parallelism (needs tp > 1).")]
ZeroOpt = Annotated[int, typer.Option("--zero", "--zero-stage", help="ZeRO stage 0-3 (1 = Megatron distributed optimizer).")]
MbsOpt = Annotated[int, typer.Option("--mbs", help="Micro-batch size (sequences).")]
RecomputeArg = Annotated[RecomputeOpt, typer.Option("--recompute", help="Activation recomputation.")]
RclOpt = Annotated[Optional[int], typer.Option("--recompute-num-layers", help="Layers per chunk recomputed with --recompute full (default: all).")]
FirstOpt = Annotated[Optional[int], typer.Option("--first-stage-layers", help="Layers on the first pipeline stage (uneven split).")]
LastOpt = Annotated[Optional[int], typer.Option("--last-stage-layers", help="Layers on the last pipeline stage (uneven split).")]
StageLayersOpt = Annotated[Optional[str], typer.Option("--stage-layers", help="Explicit split: transformer layers on each pipeline stage, first to last, comma-separated (e.g. 1,2,2,3: pp counts, each a multiple of vpp), or on each virtual stage in schedule order (pp·vpp counts, 0 allowed, e.g. DeepSeek-V3 on --pp 4 --vpp 4: fifteen 4s and a 1); summing to the model's layers.")]
EmbLayerOpt = Annotated[bool, typer.Option("--embedding-as-layer", help="Count the input embedding as one layer in an even split (the first stage gets one transformer layer fewer; Megatron's --account-for-embedding-in-pipeline-split).")]
LossLayerOpt = Annotated[bool, typer.Option("--loss-as-layer", help="Count the output layer and loss as one layer in an even split (the last stage gets one transformer layer fewer; Megatron's --account-for-loss-in-pipeline-split).")]
OgrOpt = Annotated[bool, typer.Option("--overlap-grad-reduce/--no-overlap-grad-reduce", help="Overlap the gradient reduction with backward.")]
OpgOpt = Annotated[bool, typer.Option("--overlap-param-gather/--no-overlap-param-gather", help="Overlap ZeRO parameter gathers with forward.")]
RankOrderOpt = Annotated[str, typer.Option("--rank-order", help="How ranks map onto the dimensions, innermost first: tp-cp-ep-dp-pp (Megatron's default) or tp-cp-ep-pp-dp (Megatron's --use-tp-pp-dp-mapping: pipelines close together, data-parallel replicas far apart).")]
MoeOverlapOpt = Annotated[bool, typer.Option(
    "--overlap-moe-comm/--no-overlap-moe-comm", help="MoE: overlap the token all-to-all with another micro-batch's "
    "compute (Megatron's --overlap-moe-expert-parallel-comm; a2a-ovl in the plan table).")]
ModulesOpt = Annotated[Optional[str], typer.Option(
    "--recompute-modules", help="With --recompute selective: the modules recomputed (Megatron's --recompute-modules), "
    "e.g. mla_up_proj+moe_act as the plan table's recompute cell writes them, or comma-separated.")]
Op2pOpt = Annotated[bool, typer.Option("--overlap-p2p-comm/--no-overlap-p2p-comm", help="With vpp > 1: overlap the steady-state pipeline transfers with compute (Megatron's --overlap-p2p-communication, its default); off: every transfer blocks.")]


def _one_strategy_command(render):
    """A command scoring the strategy given by flags; `render(strategy, estimate, fmt)` prints it.
    `evaluate` and `explain` share every option."""

    def command(
        ctx: typer.Context,
        model: ModelOpt = None, cluster: ClusterOpt = None, gpus: GpusOpt = None, global_batch_size: GbsOpt = None,
        seq_len: SeqOpt = None, precision: PrecisionOpt = Precision.bf16,
        dp: DpOpt = None, tp: TpOpt = 1, pp: PpOpt = 1, cp: CpOpt = 1, ep: EpOpt = 1, etp: EtpOpt = 1,
        vpp: VppOpt = 1, sp: SpOpt = False, offload_optimizer: OffloadOpt = False,
        offload_activation_layers: ActOffloadOpt = None, zero: ZeroOpt = 0, mbs: MbsOpt = 1, recompute: RecomputeArg = RecomputeOpt.none,
        recompute_num_layers: RclOpt = None, first_stage_layers: FirstOpt = None, last_stage_layers: LastOpt = None,
        stage_layers: StageLayersOpt = None, embedding_as_layer: EmbLayerOpt = False, loss_as_layer: LossLayerOpt = False,
        overlap_grad_reduce: OgrOpt = True, overlap_param_gather: OpgOpt = True, overlap_p2p_comm: Op2pOpt = True,
        rank_order: RankOrderOpt = "tp-cp-ep-dp-pp", overlap_moe_comm: MoeOverlapOpt = False,
        recompute_modules: ModulesOpt = None, grad_precision: GradPrecisionOpt = None, attention_kernel: AttentionOpt = "flash",
        optimizer: OptimizerOpt = "adam", moe_load_imbalance: MoeImbalanceOpt = None,
        zero3_impl: Zero3ImplOpt = None, fp8_recipe: Fp8RecipeOpt = "delayed",
        fp8_param_gather: Fp8ParamGatherOpt = None,
        cross_entropy_fusion: CeFusionOpt = None, cross_entropy_fusion_impl: CeFusionImplOpt = None,
        framework: FrameworkOpt = "megatron",
        moe_dispatcher: MoeDispatcherOpt = None, moe_flex_num_sms: FlexSmsOpt = None,
        moe_router_padding_for_quantization: RouterPaddingOpt = None,
        torch_compile: TorchCompileOpt = None, strict_numerics: StrictNumericsOpt = False,
        cuda_graph_impl: CudaGraphImplOpt = None, cuda_graph_scope: CudaGraphScopeOpt = None,
        plan_file: PlanFileOpt = None, rank: RankOpt = 1, calibration: CalibrationOpt = None,
        fmt: FormatOpt = Format.table,
    ) -> None:
        if plan_file is not None:  # the plan file holds the whole question and the strategy: nothing else may be given
            given = _given_options(ctx, skip={"plan_file", "rank", "fmt", "strict_numerics"})
            if given:
                raise SpecError(f"--plan gives the model, cluster, batch and strategy; drop {', '.join(given)}")
            chosen = load_plan(plan_file, rank)
            est = api_evaluate(strategy=chosen.strategy, **plan_inputs(chosen))
            render(chosen.strategy, est, fmt)
            if not est.fits:
                raise ExitWith(1)
            return
        if "--rank" in _given_options(ctx, skip=set()):
            raise SpecError("--rank picks a plan of a plan file: give --plan FILE too")
        question = {"--model": model, "--cluster": cluster, "--gpus": gpus, "--global-batch-size": global_batch_size,
                    "--seq-len": seq_len}
        missing = [k for k, v in question.items() if v is None]
        if missing:
            raise SpecError(f"missing option(s) {', '.join(missing)} (or give --plan FILE --rank N)")
        strategy = _strategy(dp, tp, pp, cp, vpp, sp, zero, mbs, recompute, recompute_num_layers, first_stage_layers,
                             last_stage_layers, stage_layers, embedding_as_layer, loss_as_layer, overlap_grad_reduce,
                             overlap_param_gather, ep, etp, offload_optimizer, offload_activation_layers,
                             overlap_p2p_comm, rank_order, overlap_moe_comm, recompute_modules)
        est = api_evaluate(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=global_batch_size,
                           seq_len=seq_len, precision=precision.value, strategy=strategy, calibration=calibration,
                           strict_numerics=strict_numerics, **train_options(grad_precision, attention_kernel, optimizer, moe_load_imbalance,
                                           zero3_impl, fp8_recipe, cross_entropy_fusion, framework,
                                           moe_dispatcher, fp8_param_gather, torch_compile,
                                           cross_entropy_fusion_impl, moe_flex_num_sms,
                                           moe_router_padding_for_quantization, cuda_graph_impl,
                                           cuda_graph_scope))
        if not est.valid:  # a strategy that breaks a rule is bad input, not a plan that does not fit
            raise ExitWith(2, "invalid strategy: " + "; ".join(est.reasons))
        render(strategy.resolve(gpus), est, fmt)
        if fmt is Format.table:
            calibration_note(calibration)
        if not est.fits:
            raise ExitWith(1)

    return command


def _given_options(ctx: typer.Context, skip: set[str]) -> list[str]:
    """The options typed on the command line (not defaults), by their long name."""
    def typed(name: str) -> bool:
        source = ctx.get_parameter_source(name)
        return source is not None and source.name == "COMMANDLINE"

    return [max(p.opts, key=len) for p in ctx.command.params if p.name not in skip and p.name is not None
            and typed(p.name)]


def render_evaluate(strategy: Strategy, est: Estimate, fmt: Format) -> None:
    if fmt is Format.json:
        emit_json(est.model_dump(mode="json"))
    elif fmt is Format.csv:
        row = {k: v for k, v in est.model_dump().items() if not isinstance(v, (dict, list))}
        row.update({f"time_s.{k}": v for k, v in est.time_s.items()})
        row.update({f"memory_bytes.{k}": v for k, v in est.memory_bytes.items()})
        row["reasons"] = "; ".join(est.reasons)
        emit_csv([row])
    else:
        print_estimate_summary(strategy, est)


def print_estimate_summary(strategy: Strategy, est: Estimate) -> None:
    stdout.print(f"[bold]{shown(strategy.short(), MESSAGE_CHARS)}[/]")
    stdout.print(f"step {est.step_time_s:.3f} s | {est.tokens_per_s:,.0f} tokens/s | {est.tokens_per_s_per_gpu:,.0f} "
                 f"tokens/s/GPU | model {est.model_tflops_per_gpu:.1f} TFLOP/s/GPU | hardware "
                 f"{est.hardware_tflops_per_gpu:.1f} TFLOP/s/GPU | MFU {100 * est.mfu:.1f} %")
    if est.step_time_s_low is not None:
        stdout.print(f"band: step {step_band(est)} s | {est.tokens_per_s_per_gpu_low:,.0f}-"
                     f"{est.tokens_per_s_per_gpu_high:,.0f} tokens/s/GPU | MFU {mfu_band(est)} % "
                     f"({plain(est.band_basis, MESSAGE_CHARS)})",
                     markup=False, highlight=False)
    stdout.print(f"peak memory {gib(est.peak_memory_bytes)} GiB of {gib(est.memory_capacity_bytes)} GiB "
                 f"({est.binding_stage} stage; largest term {est.binding_memory_term}) | "
                 f"{est.num_microbatches} micro-batches, bubble {100 * est.bubble_fraction:.1f} %", markup=False)
    from planner.specs.results import DEFAULT_HEADROOM

    if not est.reasons and est.peak_memory_bytes > est.memory_capacity_bytes * (1 - DEFAULT_HEADROOM):
        stdout.print(f"note: peak memory is inside the {DEFAULT_HEADROOM:.0%} safety margin `meshplan plan` keeps by "
                     "default (--headroom): it fits the GPU, with little to spare", markup=False, highlight=False)
    if est.reasons:
        stdout.print("[bold red]does not fit / invalid:[/]")
        for r in est.reasons:
            stdout.print(f"  - {plain(r, MESSAGE_CHARS)}", markup=False, highlight=False)
    else:
        stdout.print("[green]fits[/]")


def render_explain(strategy: Strategy, est: Estimate, fmt: Format) -> None:
    if fmt is Format.json:
        emit_json(est.model_dump(mode="json"))
        return
    if fmt is Format.csv:
        rows = [{"kind": "memory_bytes", "term": k, "value": v} for k, v in est.memory_bytes.items()]
        rows += [{"kind": "time_s", "term": k, "value": v} for k, v in est.time_s.items()]
        emit_csv(rows)
        return
    print_estimate_summary(strategy, est)
    mem = Table(title=f"memory of the most-loaded rank: {binding_ranks(strategy, est)}", title_justify="left")
    for col in ("term", "GiB", "% of peak"):
        mem.add_column(col, justify="left" if col == "term" else "right")
    for term, value in sorted(est.memory_bytes.items(), key=lambda kv: -kv[1]):
        mark = " <- largest" if term == est.binding_memory_term else ""
        mem.add_row(shown(term) + mark, f"{value / GIB:.2f}", f"{100 * value / est.peak_memory_bytes:.1f}")
    mem.add_row("[bold]peak[/]", f"{est.peak_memory_bytes / GIB:.2f}", "100.0")
    mem.add_row("capacity", f"{est.memory_capacity_bytes / GIB:.2f}", "")
    stdout.print(mem)
    tim = Table(title="step time (exposed seconds per term)", title_justify="left")
    for col in ("term", "s", "% of step"):
        tim.add_column(col, justify="left" if col == "term" else "right")
    for term, value in est.time_s.items():
        tim.add_row(shown(TIME_TERM_LABELS.get(term, term), MESSAGE_CHARS), f"{value:.4f}", f"{100 * value / est.step_time_s:.1f}")
    tim.add_row("[bold]step[/]", f"{est.step_time_s:.4f}", "100.0")
    stdout.print(tim)
    stdout.print(f"communication hidden behind compute (assumed): {100 * est.comm_hidden_fraction:.0f} %",
                 highlight=False)
    if est.groups:
        stdout.print(placement_table(strategy, est))


def placement_table(strategy: Strategy, est: Estimate) -> Table:
    """Per parallel dimension: the link its groups cross and the bus bandwidth each group gets there, with
    every level's share (Estimate.groups)."""
    table = Table(title=f"placement (rank order {strategy.rank_order}, innermost first): the link each group "
                  "crosses, all groups of a dimension at once", title_justify="left")
    for col in ("dim", "group", "ranks apart", "collective", "crosses", "GB/s per group", "limited by",
                "per level (GB/s)"):
        table.add_column(col, justify="right" if col in ("group", "ranks apart", "GB/s per group") else "left")
    for g in est.groups:
        shares = ", ".join(f"{shown(level)} {bw / 1e9:.1f}" for level, bw in g.shares_bytes_per_s.items()) or "-"
        table.add_row(g.dim, str(g.size), str(g.stride), g.collective, shown(g.tier, MESSAGE_CHARS),
                      f"{g.bus_bw_bytes_per_s / 1e9:.1f}", shown(g.limited_by), shares)
    return table


#: What each step-time term is, beside its name in `explain`.
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


app.command("evaluate", help="Score one strategy: step time, throughput, MFU, peak memory and whether it fits.")(
    _one_strategy_command(render_evaluate))
app.command("explain", help="Break one strategy's memory and step time down term by term (which stage, which "
                            "term binds).")(_one_strategy_command(render_explain))


def binding_ranks(strategy: Strategy, est: Estimate) -> str:
    """The global ranks of the pipeline stage that binds memory, from the layout's rank order."""
    # Only the rank order is read: the layer count does not change which ranks a stage holds.
    lay = ParallelLayout.of_strategy(strategy, num_layers=0)
    stage = est.binding_pipeline_rank
    ranks = lay.stage_ranks(stage)
    where = "every rank" if strategy.pp == 1 else f"pipeline stage {stage} ({est.binding_stage})"
    if len(ranks) == 1:
        return f"{where}, rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{where}, ranks {ranks[0]}-{ranks[-1]}"
    return f"{where}, ranks " + ", ".join(map(str, ranks))


# ---- presets ---------------------------------------------------------------------
@app.command("models")
def models_cmd(fmt: FormatOpt = Format.table) -> None:
    """List model presets."""
    from profiles import list_presets, load_model

    rows = []
    for name in list_presets("models"):
        m = load_model(name)
        experts = f"{m.num_experts} top-{m.moe_top_k}" + (f" +{m.num_shared_experts}" if m.num_shared_experts else "")
        rows.append({"name": name, "params_b": round(num_params(m) / 1e9, 2),
                     "active_b": round(num_active_params(m) / 1e9, 2), "experts": experts if m.is_moe else "-",
                     "attention": "mla" if m.is_mla else ("window" if m.sliding_window else "full"),
                     "layers": m.num_layers,
                     "hidden": m.hidden_size, "heads": m.num_attention_heads, "kv_heads": m.kv_heads,
                     "ffn": m.ffn_hidden_size, "gated": m.gated_mlp, "vocab": m.vocab_size, "source": m.source})
    _print_rows(rows, fmt, "model presets")


ShowOpt = Annotated[Optional[str], typer.Option(
    "--show", metavar="NAME", help="Show one cluster's topology (a preset name or cluster YAML): its kind, "
    "levels (GPUs per unit, egress per GPU in GB/s, the oversubscription it implies, latency) and graph; with "
    "--model/--gpus/--global-batch-size/--seq-len also where the best plan's (or --strategy's) groups fall.")]
PlotOpt = Annotated[Optional[str], typer.Option(
    "--plot", metavar="FILE.png", help="With --show: draw the topology to this PNG file (summarised: the first "
    "two units of each level, the rest as blocks; a plan's groups coloured). Needs matplotlib (meshplan[plot]).")]
ShowStrategyOpt = Annotated[Optional[str], typer.Option(
    "--strategy", help='With --show and a model: place this strategy (JSON, e.g. \'{"tp": 8, "pp": 2}\') '
    "instead of planning.")]


@app.command("clusters")
def clusters_cmd(
    fmt: FormatOpt = Format.table,
    show: ShowOpt = None,
    plot: PlotOpt = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="With --show: the model to plan.")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", "-n", help="With --show: GPUs of the plan.")] = None,
    global_batch_size: Annotated[Optional[int], typer.Option("--global-batch-size", "-b", help="With --show: "
                                                             "sequences per optimizer step.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", "-s", help="With --show: tokens per "
                                                   "sequence.")] = None,
    strategy: ShowStrategyOpt = None,
    constraint: Annotated[Optional[list[str]], typer.Option("--constraint", "-C", help="With --show: restrict "
                                                            "the plan as `plan -C` does.")] = None,
    constraints: Annotated[Optional[str], typer.Option("--constraints", help="With --show: constraints as a "
                                                       "JSON object.")] = None,
) -> None:
    """List cluster presets, and where each GPU's numbers come from: kernel tables per topic (measured by
    `meshplan profile`, public kernel data, or none), the calibrated constants (fitted on which runs, or
    carried over from which GPU) and the error band (end-to-end residuals, or widened). With --show NAME: one
    cluster's topology (and --plot FILE.png its picture)."""
    from planner.cli.provenance import gpu_provenance
    from profiles import list_presets, load_cluster

    question = {"--model": model, "--gpus": gpus, "--global-batch-size": global_batch_size, "--seq-len": seq_len}
    if show is not None:
        show_topology(show, fmt, plot, question, strategy, constraint, constraints)
        return
    given = [k for k, v in {"--plot": plot, **question, "--strategy": strategy, "--constraint": constraint,
                            "--constraints": constraints}.items() if v is not None]
    if given:
        raise SpecError(f"{', '.join(given)} work with --show NAME (the cluster whose topology is shown)")

    rows, gpus = [], {}
    for name in list_presets("clusters"):
        c = load_cluster(name)
        peak = c.gpu.peak_flop_per_s.get("bf16") or max(c.gpu.peak_flop_per_s.values())
        where = gpus.setdefault(c.gpu.name, gpu_provenance(c.gpu))
        rows.append({"name": name, "gpu": c.gpu.name, "memory_gib": round(c.gpu.memory_bytes / GIB, 1),
                     "bf16_tflops": round(peak / 1e12, 1), "gpus_per_node": c.gpus_per_node,
                     "nvlink_domain": c.domain_size, "intra_gb_per_s": round(c.intra_node.bw_bytes_per_s / 1e9),
                     "inter_gb_per_s": round(c.inter_node.bw_bytes_per_s / 1e9),
                     "efficiencies": calibration_status(c.gpu.calibration),
                     "ep_overlap": ep_overlap_status(name, c),
                     "provenance": {k: v for k, v in where.items() if k != "gpu"}})
    if fmt is not Format.table:
        flat = [{k: v for k, v in r.items() if k != "provenance"} | {f"provenance.{k}": v
                for k, v in r["provenance"].items()} for r in rows]
        _print_rows(rows if fmt is Format.json else flat, fmt, "cluster presets")
        return
    _print_rows([{k: v for k, v in r.items() if k != "provenance"} for r in rows], fmt, "cluster presets")
    _print_rows([{k: v for k, v in g.items() if k not in ("error_band_basis", "calibration")}
                 for g in gpus.values()], fmt, "where each GPU's numbers come from")
    stdout.print(PROVENANCE_LEGEND, markup=False, highlight=False)


def show_topology(name: str, fmt: Format, plot: str | None, question: dict[str, Any], strategy: str | None,
                  constraint: list[str] | None, constraints: str | None) -> None:
    """`clusters --show NAME`: the topology summary, a plan's groups on it, and the picture."""
    from planner.api import coerce_strategy
    from profiles import load_cluster, load_model
    from profiles.topology import build_graph

    target = check_png_target(plot) if plot is not None else None
    if target is not None:
        try:
            import matplotlib  # noqa: F401  (the plot extra)
        except ImportError:
            raise SpecError("--plot needs matplotlib: pip install 'meshplan[plot]'") from None
    asked = {k: v for k, v in question.items() if v is not None}
    if not asked and (strategy is not None or constraint or constraints is not None):
        raise SpecError("--strategy and constraints need --model, --gpus, --global-batch-size and --seq-len")
    missing = [k for k, v in question.items() if v is None]
    if asked and missing:
        raise SpecError(f"--show with a plan needs {', '.join(missing)} too (or none of --model, --gpus, "
                        "--global-batch-size, --seq-len for the topology alone)")
    if strategy is not None and (constraint or constraints is not None):
        raise SpecError("--strategy fixes the strategy; drop --constraint/--constraints (or --strategy to plan)")
    cluster = load_cluster(name)
    graph = build_graph(cluster)
    summary = topology_summary(cluster, graph)
    placed, num_layers, plan_info, note = None, 1, None, ""
    if asked:
        inputs = dict(model=question["--model"], cluster=cluster, num_gpus=question["--gpus"],
                      global_batch_size=question["--global-batch-size"], seq_len=question["--seq-len"])
        if strategy is not None:
            data = json_option(strategy, "--strategy")
            if not isinstance(data, dict):
                raise SpecError(f"--strategy must be a JSON object of Strategy fields (got {shown(strategy)})")
            given = coerce_strategy(data)
            est = api_evaluate(strategy=given, **inputs)
            if not est.valid:
                raise ExitWith(2, "invalid strategy: " + "; ".join(est.reasons))
            placed, how = given.resolve(inputs["num_gpus"]), "the given strategy"
            num_layers = load_model(inputs["model"]).num_layers
            if not est.fits:
                note = "the given strategy does not fit: " + "; ".join(est.reasons)
        else:
            with searching(f"searching strategies for {inputs['num_gpus']:,} GPUs"):
                result = api_plan(**inputs, constraints=parse_constraints(constraint, constraints), top_k=1)
            if not result.stats.num_valid:
                raise ExitWith(2, no_valid_message(result))
            if not result.plans:
                raise ExitWith(1, no_fit_message(result))
            placed, how, num_layers = result.plans[0].strategy, "the best plan", result.model.num_layers
        plan_info = {"label": layout_label(placed), "num_gpus": inputs["num_gpus"], "how": how,
                     "rank_order": rank_order(placed), "strategy": placed.model_dump(mode="json"),
                     "groups": group_spans(placed, num_layers, inputs["num_gpus"], cluster)}
    if target is not None:
        title = f"{cluster.name}: " + (f"{plan_info['label']} on {plan_info['num_gpus']:,} GPUs ({plan_info['how']}, "
                                       f"rank order {plan_info['rank_order']})" if plan_info else "topology")
        figure = draw_topology(cluster, graph, num_gpus=question["--gpus"], strategy=placed, num_layers=num_layers,
                               title=title)
        size = write_png(target, figure)
        summary["plot"] = {"file": str(target), "bytes": size}
    if fmt is Format.json:
        emit_json(summary | {"plan": plan_info})
    elif fmt is Format.csv:
        emit_csv(summary["levels"])
    else:
        print_summary(summary, plan_info)
        if target is not None:
            stdout.print(plain(f"wrote {target} ({summary['plot']['bytes']:,} bytes)", MESSAGE_CHARS), markup=False,
                         highlight=False)
    if note:
        raise ExitWith(1, note)


#: The lines under `meshplan clusters`' provenance table.
PROVENANCE_LEGEND = (
    "gemm .. memory: kernel tables (profiles/kernels/<topic>/<kernel_set>.yaml): measured = by `meshplan profile`, "
    "public = published kernel data (the GPU in brackets is the one measured), none = the calibrated constants\n"
    "constants: the calibrated GPU constants (profiles/calibration/<gpu>.yaml): fitted, carried over from another "
    "GPU, or measured\n"
    "error_band: step-time error (predicted / measured - 1) behind every estimate's band: end-to-end = residuals "
    "of published runs on this GPU, widened = no end-to-end check on this GPU (other GPUs' band widened), "
    "estimate = no residuals; `--format json` gives the full notes")


def ep_overlap_status(name: str, cluster) -> str:
    """The share of the MoE exchange Megatron's EP overlap hides on `cluster` and where it comes from: the
    first word of its preset's `ep_comm_overlap_source` (fitted, carried, measured), or the generic overlap
    efficiency where the preset has none."""
    from profiles import _resolve, read_yaml

    if cluster.ep_comm_overlap is None:
        return f"{cluster.overlap_efficiency:.2f} (generic overlap)"
    doc = read_yaml(_resolve("clusters", name), f"cluster {name}")
    how = str(doc.get("ep_comm_overlap_source", "")).split(" ", 1)[0].strip(":,;") or "stated"
    return f"{cluster.ep_comm_overlap:.2f} ({how})"


def calibration_status(text: str) -> str:
    if not text:
        return "defaults (assumed)"
    return "carried over from A100 (assumed)" if "carried over" in text else "fitted"


#: Columns of `models` and `clusters` that hold a name (cut shorter than the other texts).
NAME_COLUMNS = ("name", "gpu")


def _print_rows(rows: list[dict[str, Any]], fmt: Format, title: str) -> None:
    if fmt is Format.json:
        emit_json(rows)
    elif fmt is Format.csv:
        emit_csv(rows)
    else:
        table = Table(title=title, title_justify="left")
        for col in rows[0]:
            table.add_column(col, overflow="fold", max_width=60 if col in ("source", "calibration", "constants") else None)
        for r in rows:  # names cut at NAME_CHARS, longer texts (sources, provenance) at MESSAGE_CHARS
            table.add_row(*(shown(v, NAME_CHARS if k in NAME_COLUMNS else MESSAGE_CHARS) for k, v in r.items()))
        stdout.print(table)
