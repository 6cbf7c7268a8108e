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
from planner.cli.capacity_cmd import (CapacityArgs, CkptBandwidthOpt, DeadlineOpt, FailureRateOpt, GpusArgOpt,
                                      PriceOpt, PueOpt, TokensOpt, print_plan_lines, run_capacity)
from planner.cli.common import (
    GIB,
    AdapterPrecisionOpt,
    AttentionOpt,
    DoubleQuantOpt,
    FinetuneOpt,
    LoraAlphaOpt,
    LoraDropoutOpt,
    LoraLayersOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    ModelCodeOpt,
    PagedOptimizerOpt,
    finetune_options,
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
from planner.cli.plot_out import PlotFileOpt, check_plot, write_plot
from planner.cli.topology_plot import draw_topology
from planner.show.labels import (TextTable, estimate_lines, header_line, layout_label, memory_rows, plan_legend,
                                 plan_table, plans_shown, stats_lines, time_rows)
from planner.cli.topology_view import (check_png_target, group_spans, print_summary, rank_order, topology_summary,
                                       write_png)
from planner.errors import SpecError
from planner.show.plots import explain_figure, plan_figure
from planner.specs import Estimate, Plan, PlanResult, Strategy
from planner.specs.results import DEFAULT_HEADROOM

#: Above this share of communication assumed hidden behind compute, `plan` warns under its table:
#: the prediction then rests on near-perfect overlap, which real runs rarely reach (a profile's
#: comm_overlap, measured by `meshplan profile`, is usually well below 1).
COMM_HIDDEN_WARN_FRACTION = 0.9


# ---- plan -------------------------------------------------------------------
@app.command("plan")
def plan_cmd(
    model: ModelOpt,
    cluster: ClusterOpt,
    gpus: GpusArgOpt,
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
    framework: FrameworkOpt = None,
    finetune: FinetuneOpt = "none",
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_dropout: LoraDropoutOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_layers: LoraLayersOpt = None,
    adapter_precision: AdapterPrecisionOpt = None,
    double_quant: DoubleQuantOpt = None,
    paged_optimizer: PagedOptimizerOpt = False,
    model_code: ModelCodeOpt = None,
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
    plot: PlotFileOpt = None,
    fmt: FormatOpt = Format.table,
    tokens: TokensOpt = None,
    price: PriceOpt = None,
    deadline: DeadlineOpt = None,
    pue: PueOpt = None,
    failure_rate: FailureRateOpt = None,
    ckpt_bandwidth: CkptBandwidthOpt = None,
) -> None:
    """Rank every valid strategy by predicted throughput; show the fastest that fit (near-ties go to the
    simpler layout, near-duplicates share a row: see the README's "Reading the plan table"). --plot draws
    speed against memory over every candidate above the best plans' step-time terms. Several GPU counts
    (--gpus 256:4096) print the capacity table: the best plan per count and, with --tokens, the time to train,
    GPU-hours, cost (--price) and energy; --deadline picks the cheapest count that meets it."""
    target = check_plot(plot)
    capacity = CapacityArgs.parse(gpus, tokens, price, deadline, pue, failure_rate, ckpt_bandwidth)
    gpus = capacity.num_gpus
    kwargs = dict(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=global_batch_size, seq_len=seq_len,
                  precision=precision.value, constraints=parse_constraints(constraint, constraints), top_k=top,
                  calibration=calibration, strict_numerics=strict_numerics,
                  headroom=parse_headroom(headroom), **train_options(grad_precision, attention_kernel, optimizer,
                                                                      moe_load_imbalance, zero3_impl, fp8_recipe,
                                                                      cross_entropy_fusion, framework, moe_dispatcher,
                                                                      fp8_param_gather, torch_compile,
                                                                      cross_entropy_fusion_impl, moe_flex_num_sms,
                                                                      moe_router_padding_for_quantization,
                                                                      cuda_graph_impl, cuda_graph_scope),
                  **finetune_options(finetune, lora_rank, lora_alpha, lora_dropout, lora_targets, lora_layers,
                                     adapter_precision, double_quant, paged_optimizer, model_code))
    if capacity.table_wanted(fmt):
        return run_capacity(capacity, kwargs, fmt, target, searching)
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
        print_plan_lines(result, capacity)
        warn_hidden_comm(result)
    write_plot(target, lambda: plan_figure(result))
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
    """The ranked plans (or, when nothing fits, the closest) with their legend (cells and lines from
    planner.show.labels). The default table fits a 100-column terminal; `wide` adds the bands, tokens/s,
    TFLOP/s and headroom columns."""
    from planner.ranking import TIE_FRACTION

    out = console or stdout
    m = result.model
    out.print(header_line(result, num_params(m), num_active_params(m), name=shown,
                          model_name=lambda n: f"[bold]{shown(n)}[/]"), soft_wrap=False)
    plans = plans_shown(result)
    cells = plan_table(result, wide)
    table = rich_table(cells, wide)
    if wide:  # as wide as the table needs: the full detail was asked for
        from rich.console import Console
        from rich.measure import Measurement

        need = Measurement.get(out, out.options.update(width=10_000), table).maximum
        if need > out.width:
            out = Console(file=out.file, width=need, soft_wrap=True, no_color=out.no_color,
                          force_terminal=out.is_terminal)
    out.print(table)
    for line in plan_legend(result, plans, wide, TIE_FRACTION):  # the band's basis comes from a profile file: plain
        out.print(message_lines(line), markup=False, highlight=False, soft_wrap=False)
    for line in stats_lines(result):
        out.print(line, markup=False, highlight=False, soft_wrap=False)


def rich_table(cells: TextTable, wide: bool) -> Table:
    """A planner.show.labels table as a rich Table: every cell escaped (user text), narrow tables fold a cell that
    would be cut onto a second line, the wide one never cuts the columns typed back into `evaluate`."""
    if wide:
        table = Table(title=cells.title, title_justify="left")
        widths = {c: max([len(r[cells.columns.index(c)]) for r in cells.rows] + [len(c)]) for c in cells.whole}
        for col in cells.columns:
            table.add_column(col, justify="left" if col in cells.left else "right", no_wrap=col in cells.whole,
                             min_width=widths.get(col))
    else:
        table = Table(title=cells.title, title_justify="left", box=None, pad_edge=False, padding=(0, 1),
                      header_style="bold underline")
        for col in cells.columns:
            table.add_column(col, justify="left" if col in cells.left else "right", overflow="fold",
                             no_wrap=col in cells.whole)
    for row in cells.rows:
        table.add_row(*(shown(c, MESSAGE_CHARS) for c in row))
    return table


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
        framework: FrameworkOpt = None, finetune: FinetuneOpt = "none", lora_rank: LoraRankOpt = None,
        lora_alpha: LoraAlphaOpt = None, lora_dropout: LoraDropoutOpt = None, lora_targets: LoraTargetsOpt = None,
        lora_layers: LoraLayersOpt = None, adapter_precision: AdapterPrecisionOpt = None,
        double_quant: DoubleQuantOpt = None, paged_optimizer: PagedOptimizerOpt = False,
        model_code: ModelCodeOpt = None,
        moe_dispatcher: MoeDispatcherOpt = None, moe_flex_num_sms: FlexSmsOpt = None,
        moe_router_padding_for_quantization: RouterPaddingOpt = None,
        torch_compile: TorchCompileOpt = None, strict_numerics: StrictNumericsOpt = False,
        cuda_graph_impl: CudaGraphImplOpt = None, cuda_graph_scope: CudaGraphScopeOpt = None,
        plan_file: PlanFileOpt = None, rank: RankOpt = 1, calibration: CalibrationOpt = None,
        plot: PlotFileOpt = None, fmt: FormatOpt = Format.table,
    ) -> None:
        target = check_plot(plot)
        if plan_file is not None:  # the plan file holds the whole question and the strategy: nothing else may be given
            given = _given_options(ctx, skip={"plan_file", "rank", "fmt", "strict_numerics", "plot"})
            if given:
                raise SpecError(f"--plan gives the model, cluster, batch and strategy; drop {', '.join(given)}")
            chosen = load_plan(plan_file, rank)
            est = api_evaluate(strategy=chosen.strategy, **plan_inputs(chosen))
            render(chosen.strategy, est, fmt)
            write_plot(target, lambda: explain_figure(chosen.strategy, est, DEFAULT_HEADROOM))
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
                                           cuda_graph_scope),
                           **finetune_options(finetune, lora_rank, lora_alpha, lora_dropout, lora_targets,
                                              lora_layers, adapter_precision, double_quant, paged_optimizer,
                                              model_code))
        if not est.valid:  # a strategy that breaks a rule is bad input, not a plan that does not fit
            raise ExitWith(2, "invalid strategy: " + "; ".join(est.reasons))
        render(strategy.resolve(gpus), est, fmt)
        if fmt is Format.table:
            calibration_note(calibration)
        write_plot(target, lambda: explain_figure(strategy.resolve(gpus), est, DEFAULT_HEADROOM))
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
    for line in estimate_lines(est):  # the band's basis comes from a profile file: made plain
        stdout.print(plain(line, MESSAGE_CHARS), markup=False, highlight=False)
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
    for row in memory_rows(est):
        mem.add_row(*(shown(c) for c in row))
    mem.add_row("[bold]peak[/]", f"{est.peak_memory_bytes / GIB:.2f}", "100.0")
    mem.add_row("capacity", f"{est.memory_capacity_bytes / GIB:.2f}", "")
    stdout.print(mem)
    tim = Table(title="step time (exposed seconds per term)", title_justify="left")
    for col in ("term", "s", "% of step"):
        tim.add_column(col, justify="left" if col == "term" else "right")
    for row in time_rows(est):
        tim.add_row(*(shown(c, MESSAGE_CHARS) for c in row))
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
                     "rank_order": rank_order(placed), "domain_gpus": cluster.job_domain_gpus(inputs["num_gpus"]),
                     "strategy": placed.model_dump(mode="json"),
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
