"""Shared pieces of the CLI: option types, error handling, output formats.

Library code never prints; everything that reaches stdout goes through here or
a command module. User errors (SpecError, malformed files, bad options) become
one line on stderr and exit code 2; "no strategy fits" exits 1.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import warnings
from enum import Enum
from typing import Annotated, Any, Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from planner.cli.text import MESSAGE_CHARS, message_lines, plain
from planner.errors import SpecError, short_repr
from planner.specs.files import MAX_PLAN_FILE_BYTES, MAX_PLAN_VALUES, parse_json, read_input

GIB = 2**30

# Pipes and files get a wide console so tables are not squeezed to 80 columns, unless COLUMNS says
# how wide the output may be.
_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else 200
stdout = Console(soft_wrap=True, width=_WIDTH)
stderr = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 200)


class Format(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


class Precision(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"
    nvfp4 = "nvfp4"
    fp32 = "fp32"


class RecomputeOpt(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


# ---- option types shared by commands ----------------------------------------
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model preset name (see `meshplan models`), model YAML, or Hugging Face config.json path.")]
ClusterOpt = Annotated[str, typer.Option("--cluster", "-c", help="Cluster preset name (see `meshplan clusters`) or cluster YAML path.")]
GpusOpt = Annotated[int, typer.Option("--gpus", "-n", help="Number of GPUs in the job.")]
GbsOpt = Annotated[int, typer.Option("--global-batch-size", "-b", help="Sequences per optimizer step.")]
SeqOpt = Annotated[int, typer.Option("--seq-len", "-s", help="Tokens per sequence.")]
PrecisionOpt = Annotated[Precision, typer.Option("--precision", help="GEMM precision.")]
GradPrecisionOpt = Annotated[Optional[str], typer.Option("--grad-precision", help="Gradient buffer precision reduced across data parallel ranks: fp32, bf16 or fp16 (default: chosen, bf16 as the vendors' recipes run it where the framework can, fp32 with --strict-numerics).")]
StrictNumericsOpt = Annotated[bool, typer.Option(
    "--strict-numerics", help="Keep the framework's default numerics: no bf16 gradient reduction, no FP8 parameter "
    "gather unless asked for (by default the planner chooses them where they are faster, as the recipes do).")]
AttentionOpt = Annotated[str, typer.Option("--attention-kernel", help="flash (fused, the GPU's fastest measured kernel), flash2 (FlashAttention-2), flash1 (FlashAttention v1 or a Triton kernel of its era) or unfused (scores stored).")]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", help="adam or sgd.")]
FormatOpt = Annotated[Format, typer.Option("--format", "-f", help="Output format: table, json or csv.")]
CalibrationOpt = Annotated[Optional[str], typer.Option(
    "--calibration", metavar="FILE", help="A user calibration file (YAML: values fitted on your own runs, e.g. "
    "sustained_compute_fraction, comm_overlap, intra_node_bw_gb_per_s; format in docs/extending.md) whose values "
    "replace the cluster profile's; its gpu: and cluster: must match --cluster.")]


def calibration_note(calibration: str | None) -> None:
    """Under a table: one line naming the user calibration applied and its values (nothing without one)."""
    if calibration is not None:
        from profiles import load_calibration

        stdout.print(f"calibration: {plain(load_calibration(calibration).summary(), MESSAGE_CHARS)}", markup=False,
                     highlight=False, soft_wrap=False)


MoeImbalanceOpt = Annotated[Optional[float], typer.Option(
    "--moe-load-imbalance", help="MoE: tokens the busiest expert rank receives over the mean (>= 1; default: the "
    "cluster profile's value).")]


Zero3ImplOpt = Annotated[Optional[str], typer.Option(
    "--zero3-impl", help="Which ZeRO-3 implementation runs zero_stage=3 plans: fsdp2 (PyTorch FSDP2, torchtitan; "
    "the default) or deepspeed (DeepSpeed ZeRO-3); --framework torchtitan or deepspeed fixes it.")]

Fp8RecipeOpt = Annotated[str, typer.Option("--fp8-recipe", help="FP8 scaling with --precision fp8: delayed, "
                                           "tensorwise, blockwise or mxfp8 (Blackwell only).")]
Fp8ParamGatherOpt = Annotated[Optional[bool], typer.Option(
    "--fp8-param-gather/--no-fp8-param-gather", help="With --precision fp8: keep the FP8 GEMMs' weights in FP8 only "
    "and all-gather them in FP8 under ZeRO (Megatron's --fp8-param-gather; needs zero_stage >= 1). Default: chosen "
    "per plan (on with zero_stage >= 1 under Megatron, off with --strict-numerics).")]
FrameworkOpt = Annotated[Optional[str], typer.Option(
    "--framework", help="Framework the plan runs on, costed as it runs (per-micro-batch gradient reductions, "
    "selective recompute) and ranked only where it can run: megatron, torchtitan, deepspeed or colossalai "
    "(default megatron; deepspeed with --finetune lora or qlora).")]
CeFusionOpt = Annotated[Optional[bool], typer.Option(
    "--cross-entropy-fusion/--no-cross-entropy-fusion",
    help="Fused vocabulary-parallel cross-entropy (Megatron's --cross-entropy-loss-fusion); default: the "
    "framework's loss (fused for megatron, PyTorch's cross_entropy for torchtitan).")]

CeFusionImplOpt = Annotated[Optional[str], typer.Option(
    "--cross-entropy-fusion-impl",
    help="Which fused cross-entropy Megatron runs (its --cross-entropy-fusion-impl): native (megatron-core's "
    "default) or te (Transformer Engine's, in place over the 16-bit logits; Megatron-Bridge's recipes).")]

FlexSmsOpt = Annotated[Optional[int], typer.Option(
    "--moe-flex-num-sms",
    help="SMs of the flex dispatcher's kernels with --moe-dispatcher deepep or hybridep (Megatron's "
    "--moe-deepep-num-sms / --moe-hybridep-num-sms; default megatron-core's, 20 and 16).")]

RouterPaddingOpt = Annotated[Optional[bool], typer.Option(
    "--moe-router-padding-for-quantization/--no-router-padding",
    help="With --precision fp8: the router pads each expert's tokens to the FP8 alignment (Megatron's "
    "--moe-router-padding-for-quantization), so the grouped MLP copies nothing to pad them (default: on under "
    "Megatron with fp8, as the recipes run it).")]

TorchCompileOpt = Annotated[Optional[bool], typer.Option(
    "--torch-compile/--no-torch-compile",
    help="torch.compile of the model (framework torchtitan; default on, as the emitted job runs): "
    "--no-torch-compile costs element-wise work as torchtitan's eager PyTorch operators.")]

MoeDispatcherOpt = Annotated[Optional[str], typer.Option(
    "--moe-dispatcher", help="MoE token dispatcher: alltoall (a copy per routed expert), or the flex dispatcher's "
    "deepep or hybridep backend (a copy per destination GPU, one per node across nodes). Default: searched under "
    "Megatron on GPUs with measured flex dispatchers (Hopper, Blackwell), else alltoall.")]


CudaGraphImplOpt = Annotated[Optional[str], typer.Option(
    "--cuda-graph-impl", help="CUDA graphs (Megatron's --cuda-graph-impl): none, transformer_engine or local. Default: "
    "searched under Megatron (Transformer Engine's graphs where they shorten a host-bound step).")]
CudaGraphScopeOpt = Annotated[Optional[str], typer.Option(
    "--cuda-graph-scope", help="Comma-separated scopes the graphs capture (Megatron's --cuda-graph-scope): attn, mlp, "
    "moe_router, moe_preprocess, full_iteration (local); empty: the whole layer.")]


FinetuneOpt = Annotated[str, typer.Option(
    "--finetune", help="What the run trains: none (pre-training), full (every parameter), lora (adapters over a "
    "frozen 16-bit base) or qlora (adapters over a 4-bit NF4 base); lora and qlora plan the Hugging Face model with "
    "peft under --framework deepspeed (default) or torchtitan (FSDP2), data parallel with ZeRO.")]
LoraRankOpt = Annotated[Optional[int], typer.Option("--lora-rank", help="LoRA rank r (default 16).")]
LoraAlphaOpt = Annotated[Optional[float], typer.Option("--lora-alpha", help="LoRA alpha (default twice the rank).")]
LoraDropoutOpt = Annotated[Optional[float], typer.Option("--lora-dropout", help="LoRA dropout on the adapters' "
                                                         "input (default 0; above 0 it stores a copy per module).")]
LoraTargetsOpt = Annotated[Optional[str], typer.Option(
    "--lora-targets", help="Comma-separated linear layers to adapt: q_proj, k_proj, v_proj, o_proj, gate_proj, "
    "up_proj, down_proj (default: all the model has).")]
LoraLayersOpt = Annotated[Optional[str], typer.Option(
    "--lora-layers", help="Transformer layers (0-based) that get adapters: 0,1,2 or 40-79 (default: all).")]
AdapterPrecisionOpt = Annotated[Optional[str], typer.Option(
    "--adapter-precision", help="Adapters' weights and gradients: fp32 (peft's default) or bf16.")]
DoubleQuantOpt = Annotated[Optional[bool], typer.Option(
    "--double-quant/--no-double-quant", help="QLoRA: quantise the 4-bit weights' constants too (default on).")]
ModelCodeOpt = Annotated[Optional[str], typer.Option(
    "--model-code", help="Whose code builds the layers: framework (the framework's own; the default) or transformers "
    "(Hugging Face's, as the Trainer, Axolotl and LLaMA-Factory run them: data parallel, its layers' own memory; "
    "every --finetune lora or qlora plan is).")]
PagedOptimizerOpt = Annotated[bool, typer.Option(
    "--paged-optimizer", help="Paged optimizer states (bitsandbytes paged_adamw_32bit); counted on the GPU.")]


def parse_layer_list(text: str, what: str) -> list[int]:
    """`0,1,2` or `40-79` (or both, comma-separated) as a list of integers; one SpecError line otherwise."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or len(part) > 2 * MAX_INT_DIGITS:
            raise SpecError(f"{what} must be layer numbers or ranges such as 0,1,2 or 40-79 (got {text!r})")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise SpecError(f"{what}: the range {part!r} ends before it starts")
        if last - first > 100_000:
            raise SpecError(f"{what}: the range {part!r} is longer than any model")
        out.extend(range(first, last + 1))
    return out


def finetune_options(finetune: str, lora_rank: int | None = None, lora_alpha: float | None = None,
                     lora_dropout: float | None = None, lora_targets: str | None = None,
                     lora_layers: str | None = None, adapter_precision: str | None = None,
                     double_quant: bool | None = None, paged_optimizer: bool = False,
                     model_code: str | None = None) -> dict[str, Any]:
    """TrainSpec's fine-tuning fields from the CLI: each only when given (TrainSpec refuses an adapter field
    without --finetune lora or qlora, naming it)."""
    out: dict[str, Any] = {} if model_code is None else {"model_code": model_code}
    if finetune != "none":
        out["finetune"] = finetune
    for key, value in (("lora_rank", lora_rank), ("lora_alpha", lora_alpha), ("lora_dropout", lora_dropout),
                       ("adapter_precision", adapter_precision), ("qlora_double_quant", double_quant)):
        if value is not None:
            out[key] = value
    if lora_targets is not None:
        out["lora_target_modules"] = [p.strip() for p in lora_targets.split(",") if p.strip()]
    if lora_layers is not None:
        out["lora_layers"] = parse_layer_list(lora_layers, "--lora-layers")
    if paged_optimizer:
        out["paged_optimizer"] = True
    return out


def train_options(grad_precision: str | None, attention_kernel: str, optimizer: str,
                  moe_load_imbalance: float | None = None, zero3_impl: str | None = None, fp8_recipe: str = "delayed",
                  cross_entropy_fusion: bool | None = None, framework: str | None = "megatron",
                  moe_dispatcher: str | None = None, fp8_param_gather: bool | None = None,
                  torch_compile: bool | None = None, cross_entropy_fusion_impl: str | None = None,
                  moe_flex_num_sms: int | None = None, router_padding: bool | None = None,
                  cuda_graph_impl: str | None = None, cuda_graph_scope: str | None = None) -> dict[str, Any]:
    """TrainSpec options from the CLI: --zero3-impl only when given (a framework may fix it), --framework only
    when given (None: the default, megatron, or deepspeed for adapters), and the settings the planner chooses when
    left free (planner.knobs) only when given."""
    out: dict[str, Any] = {"attention_kernel": attention_kernel, "optimizer": optimizer, "fp8_recipe": fp8_recipe}
    if framework is not None:
        out["framework"] = framework
    for key, value in (("grad_precision", grad_precision), ("moe_dispatcher", moe_dispatcher),
                       ("fp8_param_gather", fp8_param_gather)):
        if value is not None:
            out[key] = value
    if cross_entropy_fusion is not None:  # else the framework's loss (planner.api)
        out["cross_entropy_fusion"] = cross_entropy_fusion
    if moe_flex_num_sms is not None:
        out["moe_flex_num_sms"] = moe_flex_num_sms
    if router_padding is not None:
        out["moe_router_padding_for_quantization"] = router_padding
    if cuda_graph_impl is not None:
        out["cuda_graph_impl"] = cuda_graph_impl
    if cuda_graph_scope is not None:
        out["cuda_graph_scope"] = [p.strip() for p in cuda_graph_scope.split(",") if p.strip()]
    if cross_entropy_fusion_impl is not None:
        out["cross_entropy_fusion_impl"] = cross_entropy_fusion_impl
    if zero3_impl is not None:
        out["zero3_impl"] = zero3_impl
    if torch_compile is not None:
        out["torch_compile"] = torch_compile
    if moe_load_imbalance is not None:
        out["moe_load_imbalance"] = moe_load_imbalance
    return out


#: What json.loads returns, by the JSON kind it read.
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


#: The most digits an integer given on the command line may have: every count and degree the planner takes
#: is below 2**32 (10 digits), and Python refuses to read integers of more than 4,300 digits at all.
MAX_INT_DIGITS = 18


def json_option(text: str, what: str) -> Any:
    """The JSON value of an option such as --constraints: one SpecError line, never a traceback, for text that
    is not JSON, nests deeper than planner.specs.files.MAX_DEPTH, writes NaN / Infinity, holds an integer of
    more than MAX_INT_DIGITS digits or repeats a key inside one object (`planner.specs.files.parse_json`)."""
    return parse_json(text, what, max_int_digits=MAX_INT_DIGITS)


def parse_constraints(items: list[str] | None, as_json: str | None) -> dict[str, Any]:
    """`-C tp=8 -C pp=2,4 -C recompute=selective` or `--constraints '{"tp": 8}'`, or both for different
    fields: a field given twice (by two -C, or by --constraints and a -C) is refused, naming both values."""
    out: dict[str, Any] = {}
    where: dict[str, str] = {}
    if as_json:
        loaded = json_option(as_json, "--constraints")
        if not isinstance(loaded, dict):
            raise SpecError("--constraints must be a JSON object of Strategy field -> value or list of values, "
                            f"e.g. '{{\"tp\": 4, \"pp\": [2, 4]}}' (got a JSON {_JSON_KINDS[type(loaded)]})")
        out.update(loaded)
        where.update({k: "--constraints" for k in loaded})
    for item in items or []:
        if "=" not in item:
            raise SpecError(f"constraint {short_repr(item)} must look like FIELD=VALUE or FIELD=V1,V2")
        key, raw = item.split("=", 1)
        key = key.strip().replace("-", "_")
        values = [_parse_scalar(v, key) for v in raw.split(",") if v != ""]
        value = values if len(values) != 1 else values[0]
        if key in out:
            raise SpecError(f"constraint {short_repr(key)} is given twice: {short_repr(out[key])} ({where[key]}) and "
                            f"{short_repr(value)} (-C); give each field once, a list for several values "
                            f"(-C {key}=V1,V2)")
        out[key], where[key] = value, "-C"
    return out


HeadroomOpt = Annotated[Optional[str], typer.Option(
    "--headroom", metavar="FRACTION", help="Memory safety margin: the share of each GPU's memory a plan must "
    "leave free, as 5% or 0.05 (default 5%). Plans above capacity x (1 - headroom) do not count as fitting.")]


def parse_headroom(text: str | None) -> float | None:
    """`5%` or `0.05` -> 0.05; None -> None (the default)."""
    if text is None:
        return None
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1:  # NaN fails too
        raise SpecError(f"--headroom must be a fraction of GPU memory in [0, 1) written as 5% or 0.05 (got {text!r})")
    return value


#: Constraint fields whose values are words ("none" is recompute's first, not the absence of a value).
TEXT_FIELDS = ("recompute", "rank_order")


def _parse_scalar(text: str, field: str) -> Any:
    """One value of `-C field=...`: a boolean, None, an integer of at most MAX_INT_DIGITS digits, or text
    (always text for the word-valued TEXT_FIELDS)."""
    if field in TEXT_FIELDS:
        return text.strip()
    low = text.strip().lower()
    if low in {"true", "on", "yes"}:
        return True
    if low in {"false", "off", "no"}:
        return False
    if low in {"none", "null", "all"}:
        return None
    if low.lstrip("+-").isdigit() and len(low.lstrip("+-")) > MAX_INT_DIGITS:
        raise SpecError(f"constraint {short_repr(field)}: an integer must have at most {MAX_INT_DIGITS} digits "
                        f"(got one of {len(low.lstrip('+-')):,} digits)")
    try:
        return int(low)
    except ValueError:
        return text.strip()


# ---- output ---------------------------------------------------------------
def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def emit_csv(rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    sys.stdout.write(buf.getvalue())


def gib(x: float) -> str:
    return f"{x / GIB:.1f}"


# ---- running ----------------------------------------------------------------
class ExitWith(Exception):
    """Stop the command with a code after output was written."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def run_app(app: typer.Typer, argv: list[str]) -> int:
    """Run the typer app in standalone mode (it reports usage errors itself, exit 2)
    and turn our own errors into one line on stderr."""
    from profiles import format_validation_error

    command = typer.main.get_command(app)
    with warnings.catch_warnings():
        _print_config_warnings_once()
        return _run(command, argv, format_validation_error)


def _print_config_warnings_once() -> None:
    """Show each ConfigWarning (an assumption made reading a model config) once on stderr as
    `warning: ...`; other warnings keep Python's own display."""
    from planner.specs.hf import ConfigWarning

    shown: set[str] = set()
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, ConfigWarning):
            return default(message, category, filename, lineno, file, line)
        if str(message) not in shown:
            shown.add(str(message))
            stderr.print(f"warning: {plain(message, MESSAGE_CHARS)}", markup=False, highlight=False)

    warnings.simplefilter("always", ConfigWarning)
    warnings.showwarning = show


def _run(command, argv: list[str], format_validation_error) -> int:
    try:
        code = command.main(args=argv, prog_name="meshplan", standalone_mode=False)
        return code if isinstance(code, int) else 0
    except typer.TyperException as exc:  # a bad option or value: one line, as for SpecError
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `meshplan`: the help text
            exc.show()
            return exc.exit_code
        where = f" (see '{exc.ctx.command_path} --help')" if getattr(exc, "ctx", None) is not None else ""
        text = ' '.join(exc.format_message().replace('Value error, ', '').split())
        _error_line(f"{text}{where}")
        return getattr(exc, "exit_code", 2)
    except typer.Abort:
        return 130
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except ExitWith as exc:
        if exc.message:  # the command's own lines, each made plain
            stderr.print(message_lines(exc.message), markup=False, highlight=False)
        return exc.code
    except SpecError as exc:
        _error_line(str(exc))
        return 2
    except ValidationError as exc:
        _error_line(format_validation_error(exc))
        return 2
    except BrokenPipeError:
        return 0
    return 0


def _error_line(text: str) -> None:
    """`error: ...` on stderr as one plain line: a message quoting a user value can neither break the line
    (newlines, ESC, bidi controls are shown as escapes) nor be read as markup, and is cut at MESSAGE_CHARS."""
    stderr.print(f"error: {plain(text, MESSAGE_CHARS)}", markup=False, highlight=False)


def read_text_arg(path: str, what: str = "plan") -> str:
    """A file path or '-' for stdin, read by the bounded reader (`planner.specs.files.read_input`:
    a regular UTF-8 file of at most MAX_FILE_BYTES); errors name the path."""
    return read_input(path, what, MAX_PLAN_FILE_BYTES)



# ---- plans read back from `meshplan plan --format json` --------------------------
PlanFileOpt = Annotated[Optional[str], typer.Option(
    "--plan", metavar="FILE", help="A plan file written by `meshplan plan --format json` (or - for stdin); "
    "--rank picks the plan.")]
RankOpt = Annotated[int, typer.Option("--rank", "-r", help="With --plan: which plan of the file (1 = the first).")]


def plan_result_from_json(text: str, source: str):
    """`meshplan plan --format json` output (a PlanResult), or a single Plan's JSON wrapped as one;
    the flag says which."""
    from planner.specs import Plan, PlanResult

    obj = parse_json(text, f"plan file {source!r}", MAX_PLAN_VALUES)
    if not isinstance(obj, dict) or not ({"plans"} <= obj.keys() or {"strategy", "estimate"} <= obj.keys()):
        raise SpecError(f"{source!r} is not a meshplan plan: expected the output of `meshplan plan --format json`")
    try:
        if "plans" in obj:
            return PlanResult.model_validate(obj), False
        single = Plan.model_validate(obj)
    except ValidationError as exc:
        from profiles import format_validation_error

        raise SpecError(f"{source!r} is not a valid meshplan plan: {format_validation_error(exc)}") from None
    stats = {"num_candidates": 1, "num_valid": 1, "num_feasible": 1, "rejected": {}, "search_time_s": 0.0}
    return PlanResult(plans=[single], stats=stats, model=single.model, cluster=single.cluster, train=single.train,
                      num_gpus=single.num_gpus), True


def load_plan(path: str, rank: int):
    """The plan ranked `rank` in a plan file (a single Plan's JSON is returned whatever `rank`)."""
    if rank < 1:
        raise SpecError(f"--rank must be >= 1 (got {rank})")
    result, single = plan_result_from_json(read_text_arg(path), path)
    if single:
        return result.plans[0]
    for p in result.plans:
        if p.rank == rank:
            return p
    if not result.plans:
        raise SpecError(f"{path!r} holds no plan that fits (nothing to pick with --rank)")
    ranks = [p.rank for p in result.plans]
    raise SpecError(f"--rank {rank} is not in {path!r}: it has plans ranked {ranks[0]}-{ranks[-1]}")


def plan_inputs(p) -> dict[str, Any]:
    """The `evaluate()` keyword arguments that reproduce plan `p` exactly (its own model, cluster and
    training settings, not the presets' current ones)."""
    train = {k: v for k, v in p.train.model_dump().items() if v is not None}
    return {"model": p.model, "cluster": p.cluster, "num_gpus": p.num_gpus, **train}
