"""`meshplan emit`: a plan as flags, a config file or a launch script for one framework.

The plan comes from `meshplan plan --format json` (a file, or `-` for stdin;
`--rank` picks one, default the best) or is searched here from the same plan
options `meshplan plan` takes, ranked by the costs of the framework the backend
runs (`planner.emit.runs_framework`: DeepSpeed's config is searched as `plan
--framework deepspeed` would search it). Search options given with a plan file
are refused: its plans were searched already; a plan of the file costed for
another framework than the backend's is emitted with a note saying so.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Annotated, Any, Optional, get_args

import typer
from pydantic import ValidationError

from planner.cli.app import app
from planner.cli.common import (
    AttentionOpt,
    CalibrationOpt,
    CeFusionImplOpt,
    CeFusionOpt,
    ClusterOpt,
    ExitWith,
    FlexSmsOpt,
    Fp8ParamGatherOpt,
    Fp8RecipeOpt,
    GbsOpt,
    GpusOpt,
    GradPrecisionOpt,
    HeadroomOpt,
    ModelOpt,
    MoeDispatcherOpt,
    MoeImbalanceOpt,
    OptimizerOpt,
    PlanFileOpt,
    PrecisionOpt,
    RouterPaddingOpt,
    StrictNumericsOpt,
    CudaGraphImplOpt,
    CudaGraphScopeOpt,
    AdapterPrecisionOpt,
    DoubleQuantOpt,
    FinetuneOpt,
    LoraAlphaOpt,
    LoraDropoutOpt,
    LoraLayersOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    PagedOptimizerOpt,
    finetune_options,
    SeqOpt,
    TorchCompileOpt,
    Zero3ImplOpt,
    emit_json,
    parse_constraints,
    parse_headroom,
    plan_result_from_json,
    read_text_arg,
    train_options,
)
from planner.errors import SpecError
from planner.specs import Plan, PlanResult, TrainSpec


class EmitFormat(str, Enum):
    text = "text"
    json = "json"


class LaunchFor(str, Enum):
    megatron = "megatron"
    deepspeed = "deepspeed"
    colossalai = "colossalai"
    torchtitan = "torchtitan"


EmitFrameworkOpt = Annotated[Optional[str], typer.Option(
    "--framework", help="Framework whose costs rank the searched plans: megatron, torchtitan, deepspeed or "
    "colossalai; default: the one --backend runs (megatron-deepspeed: deepspeed; torchrun and slurm: --launch-for's). "
    "A framework other than the backend's is refused.")]


#: what --bridge-version takes, for its help; planner.emit.base.BRIDGE_VERSIONS (not imported here: the emitters
#: load when a command emits) is the table, and tests/emit/test_emit_cli.py checks the two agree
BRIDGE_CHOICES = "0.6 (Megatron-Bridge 0.6.0, the default), 0.3 (0.3.1) or main (main@067f987df)"


def _backend_help() -> str:
    from planner.emit import backends

    return "Framework to emit for: " + ", ".join(backends()) + "."


@app.command("emit")
def emit_cmd(
    plan_json: Annotated[Optional[str], typer.Argument(
        metavar="[PLAN_JSON]", help="Output of `meshplan plan --format json` (a path, or - for stdin).")] = None,
    backend: Annotated[str, typer.Option("--backend", "-B", help=_backend_help())] = "megatron",
    rank: Annotated[int, typer.Option("--rank", "-r", help="Which plan to emit: 1 = the fastest.")] = 1,
    best_expressible: Annotated[bool, typer.Option("--best-expressible", help="Emit the best plan (from --rank down) that the backend can run, skipping the ones it cannot express.")] = False,
    model: ModelOpt = None,
    cluster: ClusterOpt = None,
    gpus: GpusOpt = None,
    global_batch_size: GbsOpt = None,
    seq_len: SeqOpt = None,
    precision: PrecisionOpt = None,
    constraint: Annotated[Optional[list[str]], typer.Option("--constraint", "-C", help="Fix or restrict a Strategy field when searching: tp=8, pp=2,4 (repeatable).")] = None,
    constraints: Annotated[Optional[str], typer.Option("--constraints", help='Constraints as a JSON object, e.g. \'{"tp": 8}\'.')] = None,
    grad_precision: GradPrecisionOpt = None,
    attention_kernel: AttentionOpt = None,
    optimizer: OptimizerOpt = None,
    fp8_param_gather: Fp8ParamGatherOpt = None,
    moe_load_imbalance: MoeImbalanceOpt = None,
    zero3_impl: Zero3ImplOpt = None,
    fp8_recipe: Fp8RecipeOpt = None,
    cross_entropy_fusion: CeFusionOpt = None,
    cross_entropy_fusion_impl: CeFusionImplOpt = None,
    framework: EmitFrameworkOpt = None,
    finetune: FinetuneOpt = "none",
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_dropout: LoraDropoutOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_layers: LoraLayersOpt = None,
    adapter_precision: AdapterPrecisionOpt = None,
    double_quant: DoubleQuantOpt = None,
    paged_optimizer: PagedOptimizerOpt = False,
    moe_dispatcher: MoeDispatcherOpt = None,
    moe_flex_num_sms: FlexSmsOpt = None,
    moe_router_padding_for_quantization: RouterPaddingOpt = None,
    torch_compile: TorchCompileOpt = None,
    cuda_graph_impl: CudaGraphImplOpt = None,
    cuda_graph_scope: CudaGraphScopeOpt = None,
    strict_numerics: StrictNumericsOpt = False,
    headroom: HeadroomOpt = None,
    calibration: CalibrationOpt = None,
    launch_for: Annotated[LaunchFor, typer.Option("--launch-for", help="Framework the torchrun/slurm scripts start.")] = LaunchFor.megatron,
    script: Annotated[Optional[str], typer.Option("--script", help="Training entry point the torchrun/slurm scripts run (default depends on --launch-for).")] = None,
    master_port: Annotated[int, typer.Option("--master-port", help="Rendezvous TCP port on the first node.")] = 29500,
    job_name: Annotated[str, typer.Option("--job-name", help="Slurm job name.")] = "meshplan",
    bridge_version: Annotated[Optional[str], typer.Option("--bridge-version", help="Megatron-Bridge release the "
                                                          "megatron-bridge overrides are written for: "
                                                          + BRIDGE_CHOICES + ".")] = None,
    hf_model: Annotated[Optional[str], typer.Option("--hf-model", help="The model the axolotl and llamafactory "
                                                    "configs load: a Hugging Face id or a local model folder of the "
                                                    "plan's model shape (default: the model preset's id).")] = None,
    fmt: Annotated[EmitFormat, typer.Option("--format", "-f", help="text: what you paste; json: the structured form.")] = EmitFormat.text,
    plan_file: PlanFileOpt = None,
    allow_partial: Annotated[bool, typer.Option("--allow-partial", help="Print text that cannot carry the whole plan (what it drops goes to stderr) instead of exiting 2.")] = False,
) -> None:
    """Emit a plan as Megatron-LM flags, Megatron-Bridge overrides, a DeepSpeed JSON, Colossal-AI plugin
    kwargs, a torchtitan TOML, a MaxText config with its JAX mesh, a torchrun / Slurm launch script, or (for a
    fine-tuning plan) an Axolotl or LLaMA-Factory config with the DeepSpeed or FSDP2 files it references."""
    from planner.emit import (EmitOptions, accepted_frameworks, costed_elsewhere, get_emitter, imposed_settings,
                              runs_framework)
    from planner.emit.base import DEFAULT_BRIDGE_VERSION, check_bridge_version
    from planner.emit.quoting import check_name, shell_command

    emitter = get_emitter(backend)
    bridge_version = check_bridge_version("--bridge-version", bridge_version or DEFAULT_BRIDGE_VERSION)
    if plan_file is not None:  # --plan FILE is PLAN_JSON by name, as evaluate and explain take it
        if plan_json is not None:
            raise SpecError(f"give the plan file once: PLAN_JSON ({plan_json!r}) or --plan ({plan_file!r})")
        plan_json = plan_file
    if rank < 1:
        raise SpecError(f"--rank must be >= 1 (got {rank})")
    search = {"--model": model, "--cluster": cluster, "--gpus": gpus, "--global-batch-size": global_batch_size,
              "--seq-len": seq_len}
    # options that only shape the search: given with PLAN_JSON they would be ignored, so they are refused
    search_only = {"--precision": precision, "--constraint": constraint, "--constraints": constraints,
                   "--grad-precision": grad_precision, "--attention-kernel": attention_kernel, "--optimizer": optimizer,
                   "--fp8-param-gather": fp8_param_gather, "--moe-load-imbalance": moe_load_imbalance,
                   "--zero3-impl": zero3_impl, "--fp8-recipe": fp8_recipe, "--cross-entropy-fusion": cross_entropy_fusion,
                   "--cross-entropy-fusion-impl": cross_entropy_fusion_impl, "--framework": framework,
                   "--moe-dispatcher": moe_dispatcher, "--moe-flex-num-sms": moe_flex_num_sms,
                   "--moe-router-padding-for-quantization": moe_router_padding_for_quantization,
                   "--strict-numerics": strict_numerics or None, "--cuda-graph-impl": cuda_graph_impl,
                   "--cuda-graph-scope": cuda_graph_scope,
                   "--torch-compile": torch_compile, "--headroom": headroom, "--calibration": calibration,
                   "--finetune": None if finetune == "none" else finetune, "--lora-rank": lora_rank,
                   "--lora-alpha": lora_alpha, "--lora-dropout": lora_dropout, "--lora-targets": lora_targets,
                   "--lora-layers": lora_layers, "--adapter-precision": adapter_precision,
                   "--double-quant/--no-double-quant": double_quant, "--paged-optimizer": paged_optimizer or None}
    if plan_json is not None:
        given = [k for k, v in {**search, **search_only}.items() if v is not None]
        if given:
            raise SpecError(f"give either PLAN_JSON or plan options, not both (got PLAN_JSON and {', '.join(given)}): "
                            "the plan file's plans were searched already")
        result, single = plan_result_from_json(read_text_arg(plan_json), plan_json)
        source = repr(plan_json)
        if single:  # one Plan's JSON: emit it, whatever its rank
            rank = result.plans[0].rank
    else:
        missing = [k for k, v in search.items() if v is None]
        if len(missing) == len(search):
            raise SpecError("give a plan: PLAN_JSON (from `meshplan plan --format json`, - for stdin) or the plan "
                            "options --model --cluster --gpus --global-batch-size --seq-len")
        if missing:
            raise SpecError(f"missing plan option(s) {', '.join(missing)} (or give PLAN_JSON instead)")
        runs = runs_framework(backend, EmitOptions(launch_for=launch_for.value))
        frameworks = sorted(get_args(TrainSpec.model_fields["framework"].annotation))
        if framework is not None and framework not in frameworks:
            raise SpecError(f"--framework must be one of {', '.join(frameworks)} (got {framework!r})")
        if framework is not None and framework in accepted_frameworks(backend):
            runs = framework  # a fine-tuning toolkit's config runs either of its frameworks' plans
        if framework is not None and framework != runs:
            raise SpecError(f"--framework {framework} disagrees with --backend {backend}, which runs framework {runs}: "
                            f"the plans would be ranked by costs of a framework the emitted "
                            f"{'script starts' if backend in ('torchrun', 'slurm') else 'config'} does not run "
                            f"(drop --framework, or emit for {framework}'s backend)")
        top_k = max(rank, SEARCH_DEPTH) if best_expressible else rank
        train = train_options(grad_precision, attention_kernel or "flash", optimizer or "adam",
                              moe_load_imbalance, zero3_impl, fp8_recipe or "delayed", cross_entropy_fusion, runs,
                              moe_dispatcher, fp8_param_gather, torch_compile, cross_entropy_fusion_impl,
                              moe_flex_num_sms, moe_router_padding_for_quantization, cuda_graph_impl,
                              cuda_graph_scope)
        train |= finetune_options(finetune, lora_rank, lora_alpha, lora_dropout, lora_targets, lora_layers,
                                  adapter_precision, double_quant, paged_optimizer)
        if getattr(emitter, "loads_hf_model", False) and finetune == "full":
            train["model_code"] = "transformers"  # the toolkit runs Transformers' layers: cost those
        # the settings the backend's output imposes (Megatron-Bridge's mixed-precision recipe), unless given
        fixed = imposed_settings(backend, getattr(precision, "value", precision or "bf16"), fp8_recipe or "delayed")
        train = {k: v for k, v in fixed.items() if k not in train} | train
        result, source = _search(model, cluster, gpus, global_batch_size, seq_len, (precision or "bf16"), top_k,
                                 parse_constraints(constraint, constraints), train, parse_headroom(headroom),
                                 calibration, strict_numerics), "the search"
    # checked here too so the message names the options as typed (EmitOptions checks them for the API)
    if script is not None:
        shell_command("--script", script)
    check_name("--job-name", job_name)
    if hf_model is not None and not getattr(emitter, "loads_hf_model", False):
        raise SpecError(f"--hf-model names the model a fine-tuning toolkit's config loads; --backend {backend} "
                        "takes none (emit axolotl or llamafactory)")
    try:
        options = EmitOptions(launch_for=launch_for.value, script=script, master_port=master_port, job_name=job_name,
                              bridge_version=bridge_version, hf_model=hf_model)
    except ValidationError as exc:
        from profiles import format_validation_error

        raise SpecError(f"invalid emit option: {format_validation_error(exc)}") from None
    chosen = pick(result, rank, source)
    if best_expressible:
        chosen = _best_expressible(result, chosen, backend, options)
    # a plan file's plan ranked for another framework: its prediction is not this one's, said once it is emitted
    accepted = accepted_frameworks(backend, options)
    note = costed_elsewhere(chosen, chosen.train.framework if chosen.train.framework in accepted
                            else runs_framework(backend, options))
    if fmt is EmitFormat.json:
        data = emitter.data(chosen, options)
        _note(note)
        emit_json(data)
    else:
        _text(emitter, chosen, options, backend, allow_partial, note)


def _note(note: str | None) -> None:
    if note:
        from planner.cli.common import stderr
        from planner.emit.quoting import one_line

        stderr.print(f"note: {one_line(note)}", markup=False, highlight=False)


def _text(emitter, chosen: Plan, options, backend: str, allow_partial: bool, note: str | None = None) -> None:
    """The text form; what it cannot carry of the plan goes to stderr, and without --allow-partial
    nothing is printed and the exit code is 2."""
    from planner.cli.common import stderr
    from planner.emit import omissions
    from planner.emit.quoting import one_line

    text = emitter.render(chosen, options)
    _note(note)
    dropped = omissions(chosen, backend, options)
    for reason in dropped:
        stderr.print(f"{backend} text drops part of plan {chosen.rank}: {one_line(reason)}", markup=False,
                     highlight=False)
    if dropped and not allow_partial:
        raise ExitWith(2, "not emitted: pass --allow-partial to print it anyway")  # each reason says where else it goes
    sys.stdout.write(text)


#: plans searched for --best-expressible when the plan comes from plan options
SEARCH_DEPTH = 2000


def _search(model: str, cluster: str, gpus: int, gbs: int, seq: int, precision, top_k: int,
            constraints: dict[str, Any], train: dict[str, Any], headroom: float | None,
            calibration: str | None = None, strict_numerics: bool = False) -> PlanResult:
    from planner.api import plan as api_plan

    return api_plan(model=model, cluster=cluster, num_gpus=gpus, global_batch_size=gbs, seq_len=seq,
                    precision=getattr(precision, "value", precision), constraints=constraints, top_k=top_k,
                    headroom=headroom, calibration=calibration, strict_numerics=strict_numerics, **train)


def _best_expressible(result: PlanResult, chosen: Plan, backend: str, options) -> Plan:
    from planner.cli.common import stderr
    from planner.emit import first_expressible, summarize

    candidates = [p for p in result.plans if p.rank >= chosen.rank]
    best, refused = first_expressible(candidates, backend, options)
    if refused:
        stderr.print(f"emitting plan {best.rank} ({best.strategy.short()}): plans {chosen.rank}-{best.rank - 1} are "
                     f"not expressible in {refused[0][1].framework} ({summarize(refused)})", markup=False,
                     highlight=False)
    return best


def pick(result: PlanResult, rank: int, source: str) -> Plan:
    for p in result.plans:
        if p.rank == rank:
            return p
    if not result.plans:
        from planner.cli.plan_cmds import no_fit_message, no_valid_message

        if not result.stats.num_valid:  # every candidate breaks a rule (the framework's among them): as `plan`
            raise ExitWith(2, no_valid_message(result))
        raise ExitWith(1, f"{source}: " + no_fit_message(result))
    ranks = [p.rank for p in result.plans]
    listed = (f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 3 and ranks == list(range(ranks[0], ranks[-1] + 1))
              else ", ".join(map(str, ranks)))
    raise SpecError(f"--rank {rank} is not in {source}: it has plans ranked {listed}")
