"""The public Python API: `plan()` and `evaluate()` (see DESIGN.md, "Public contract")."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
from typing import Any

from cost_models.arrays import StrategyArrays
from cost_models.attention_kernels import kernel_problem
from planner.errors import InputWarning, SpecError, SpecValidationError, short_repr
from planner.rules import (
    batch_warning,
    context_warning,
    cuda_graph_problem,
    eager_problem,
    finetune_problem,
    family_warning,
    fp8_recipe_problem,
    nvfp4_problem,
    node_warning,
)
from planner.knobs import choose
from planner.search import evaluate_one, search
from planner.specs import (
    ClusterSpec,
    Estimate,
    ModelSpec,
    PlanResult,
    Strategy,
    TrainSpec,
)
from planner.specs.base import MAX_GPUS
from planner.specs.results import DEFAULT_HEADROOM
from profiles import Calibration, apply_calibration, list_presets, load_cluster, load_model

ModelRef = str | Path | ModelSpec | dict
ClusterRef = str | Path | ClusterSpec | dict
#: A user calibration: a file path, a mapping of the file's keys, or a loaded Calibration (profiles.calibration_file).
CalibrationRef = str | Path | dict | Calibration


def make_inputs(
    model: ModelRef,
    cluster: ClusterRef,
    num_gpus: int,
    global_batch_size: int,
    seq_len: int,
    precision: str = "bf16",
    calibration: CalibrationRef | None = None,
    **train_options: Any,
) -> tuple[ModelSpec, ClusterSpec, TrainSpec]:
    """Load and validate the three inputs; every problem is a SpecError naming the field.

    `calibration` (a user calibration file, `profiles.apply_calibration`) sets its fitted values on
    the loaded cluster before anything else reads it.

    Input that is valid but probably not meant gives an `InputWarning` (Python's `warnings`;
    the CLI prints one `warning:` line each): a global batch that leaves only dp = 1, a GPU
    count that does not fill whole nodes, a sequence longer than the model's context, a
    hand-built model of a preset's shape that disagrees with the preset."""
    model_spec = load_model(model)
    cluster_spec = load_cluster(cluster)
    if calibration is not None:
        cluster_spec = apply_calibration(cluster_spec, calibration)
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or not 1 <= num_gpus <= MAX_GPUS:
        raise SpecError(f"num_gpus must be a positive integer, at most {MAX_GPUS} (got {short_repr(num_gpus)})")
    if cluster_spec.max_gpus is not None and num_gpus > cluster_spec.max_gpus:
        raise SpecError(f"num_gpus ({num_gpus}) exceeds cluster {cluster_spec.name}'s max_gpus ({cluster_spec.max_gpus})")
    if not isinstance(precision, str):
        raise SpecError(f"precision must be one of bf16, fp16, fp8, nvfp4, fp32 (got {short_repr(precision)})")
    try:
        train = TrainSpec(global_batch_size=global_batch_size, seq_len=seq_len, precision=precision, **train_options)
    except SpecValidationError as exc:
        raise SpecError(f"invalid training settings: {exc.problems}") from None
    train = _adapter_defaults(train)
    train = _framework_zero3(train, cluster_spec)
    if (problem := finetune_problem(train, model_spec)) is not None:
        raise SpecError(problem)
    if (problem := eager_problem(train, model_spec)) is not None:
        raise SpecError(problem)
    if (problem := nvfp4_problem(train, cluster_spec.gpu)) is not None:
        raise SpecError(problem)
    cluster_spec.gpu.peak(train.precision)  # the GPU must have a rate for this precision
    if (problem := fp8_recipe_problem(train, cluster_spec.gpu)) is not None:
        raise SpecError(problem)
    if (problem := cuda_graph_problem(train, model_spec)) is not None:
        raise SpecError(problem)
    if (problem := kernel_problem(cluster_spec.gpu, train.attention_kernel,
                                  windowed=any(model_spec.local_attention_mask()))) is not None:
        raise SpecError(problem)
    checks = [batch_warning(train, num_gpus), node_warning(cluster_spec, num_gpus), context_warning(model_spec, train)]
    if _hand_built(model, model_spec):
        checks.append(family_warning(model_spec))
    for message in filter(None, checks):
        warnings.warn(message, InputWarning, stacklevel=3)
    return model_spec, cluster_spec, train


def _hand_built(ref: ModelRef, spec: ModelSpec) -> bool:
    """A model described by the user (ModelSpec, mapping or YAML file), not a preset name or a
    Hugging Face config (whose fields are the model's own)."""
    if spec.source.startswith("Hugging Face"):
        return False
    return not (isinstance(ref, str) and ref in list_presets("models"))


#: The most plans one search returns (`top_k`): every one is built and scored in full.
MAX_TOP_K = 10_000


def check_top_k(top_k: Any) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise SpecError(f"top_k must be an integer between 1 and {MAX_TOP_K} (got {short_repr(top_k)})")
    return top_k


def _adapter_defaults(train: TrainSpec) -> TrainSpec:
    """A LoRA / QLoRA run, or any with model_code transformers, is the Hugging Face model: framework deepspeed unless
    one was given, and the model's element-wise work eager (torch_compile false, the Trainer's default) unless
    torch_compile was given."""
    if not train.transformers:
        return train
    update = {"model_code": "transformers"} if train.model_code != "transformers" else {}
    if "framework" not in train.model_fields_set:
        update["framework"] = "deepspeed"
    if "torch_compile" not in train.model_fields_set:
        update["torch_compile"] = False
    return train.model_copy(update=update) if update else train


def _framework_zero3(train: TrainSpec, cluster: ClusterSpec) -> TrainSpec:
    """A framework with a ZeRO-3 of its own (torchtitan: FSDP2, DeepSpeed: its stage 3) sets zero3_impl;
    a zero3_impl given that contradicts it is refused rather than silently overridden. A framework whose
    loss is not Megatron's fused cross-entropy (torchtitan) sets cross_entropy_fusion unless it was given."""
    framework = cluster.gpu.tables.framework(train.framework)
    loss = framework.cross_entropy_fusion
    if loss is not None and "cross_entropy_fusion" not in train.model_fields_set:
        train = train.model_copy(update={"cross_entropy_fusion": loss})
    own = framework.zero3_impl
    if own is None or own == train.zero3_impl:
        return train
    if "zero3_impl" in train.model_fields_set:
        raise SpecError(f"zero3_impl {train.zero3_impl!r} contradicts framework {train.framework!r}, whose "
                        f"zero_stage 3 is {own!r} (profiles/frameworks/{train.framework}.yaml); drop zero3_impl "
                        "or choose framework 'megatron' or 'colossalai'")
    return train.model_copy(update={"zero3_impl": own})


def plan(
    model: ModelRef,
    cluster: ClusterRef,
    num_gpus: int,
    global_batch_size: int,
    seq_len: int,
    precision: str = "bf16",
    constraints: dict[str, Any] | None = None,
    top_k: int = 10,
    headroom: float | None = None,
    ranking: str = "simple",
    calibration: CalibrationRef | None = None,
    strict_numerics: bool = False,
    **train_options: Any,
) -> PlanResult:
    """Search every valid strategy and return the fastest that fit, best first.

    `model`: preset name, ModelSpec, mapping, YAML path, or Hugging Face
    config.json path/dict. `cluster`: preset name, ClusterSpec, mapping or YAML
    path. `constraints` fixes (`{"tp": 4}`) or restricts (`{"pp": [2, 4]}`) any
    Strategy field. Extra keyword arguments go to TrainSpec (`grad_precision`,
    `optimizer`, `attention_kernel`).

    `headroom` is the memory safety margin, a fraction of each GPU's memory a
    plan must leave free (default 0.05: peak memory at most 95 % of capacity).
    `ranking`: "simple" (default: near-ties go to the simpler layout and
    near-duplicates fold into one row, planner.ranking) or "fastest" (strict
    step-time order, one row per strategy, as a benchmark predicting a tuned
    published run wants).

    `calibration`: a user calibration file (path, mapping or `profiles.Calibration`,
    format in docs/extending.md) whose fitted values replace the cluster profile's;
    `result.cluster.gpu.calibration` then names the file.

    Training settings left out of `train_options` that the vendors' recipes turn (gradient
    reduction precision, FP8 parameter gather, Transformer Engine's cross-entropy, the router's
    FP8 padding, the MoE dispatcher and its SMs) are chosen by the planner, per plan where they
    depend on the layout (planner.knobs); each plan's `train` holds its settings and
    `estimate.settings` the ones chosen. Settings that change numerics (bf16 gradient reduction,
    FP8 parameter gather) are allowed, as the recipes allow them; `strict_numerics=True`
    keeps the framework's defaults for them.

    When nothing fits, `result.plans` is empty and `result.closest` holds the
    valid strategies that came closest (their `estimate.reasons` say by how much),
    with `result.advice` and `result.min_gpus_to_fit`. When no strategy is valid,
    both are empty and `result.rejections` counts the candidates by rule.
    """
    check_top_k(top_k)
    if headroom is None:
        headroom = DEFAULT_HEADROOM
    if (isinstance(headroom, bool) or not isinstance(headroom, (int, float))
            or not 0 <= headroom < 1):  # NaN fails the range test too
        raise SpecError(f"headroom must be a fraction of GPU memory in [0, 1), e.g. 0.05 (got {headroom!r})")
    if ranking not in ("simple", "fastest"):
        raise SpecError(f"ranking must be 'simple' or 'fastest' (got {ranking!r})")
    model_spec, cluster_spec, train = make_inputs(
        model, cluster, num_gpus, global_batch_size, seq_len, precision, calibration, **train_options
    )
    knobs = choose(train, model_spec, cluster_spec.gpu, _strict(strict_numerics))
    constraints = {} if constraints is None else constraints
    return search(model_spec, cluster_spec, train, num_gpus, constraints, top_k, headroom=float(headroom),
                  ranking=ranking, knobs=knobs)


def _strict(value: Any) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"strict_numerics must be true or false (got {short_repr(value)})")
    return value


def evaluate(
    model: ModelRef,
    cluster: ClusterRef,
    num_gpus: int,
    global_batch_size: int,
    seq_len: int,
    precision: str = "bf16",
    strategy: Strategy | dict | None = None,
    calibration: CalibrationRef | None = None,
    strict_numerics: bool = False,
    **train_options: Any,
) -> Estimate:
    """Score one strategy. Training settings left free are chosen as `plan` chooses them (with
    expert parallelism, the fastest dispatcher); `estimate.settings` names them. An invalid or non-fitting strategy still gets an
    Estimate, with `fits=False` and its `reasons` (a strategy whose degrees do not
    multiply to the GPU count is scored at the nearest data-parallel degree, dp =
    max(1, GPUs // (tp·cp·pp)), and the mismatch is its first reason);
    malformed input raises SpecError. `calibration` as in `plan`."""
    model_spec, cluster_spec, train = make_inputs(
        model, cluster, num_gpus, global_batch_size, seq_len, precision, calibration, **train_options
    )
    knobs = choose(train, model_spec, cluster_spec.gpu, _strict(strict_numerics))
    strategy = coerce_strategy(strategy)
    try:
        resolved = strategy.resolve(num_gpus)
        mismatch = None
    except SpecError as exc:
        mp = strategy.model_parallel_size
        dp = strategy.dp if strategy.dp != "auto" else max(1, num_gpus // mp)
        resolved, mismatch = strategy.model_copy(update={"dp": dp}), str(exc)
    one = StrategyArrays.from_strategies([resolved])
    variant = knobs.assign(one)
    options = [int(variant[0])]
    if resolved.ep > 1:
        options += [int(v[0]) for v in knobs.other_dispatchers(variant)]
    if knobs.graphs_searched and bool(knobs.graph_ok(one)[0]):
        options += [int(knobs.with_graphs(np.array([v]))[0]) for v in options]
    scored = [evaluate_one(model_spec, cluster_spec, knobs.trains[i], resolved).model_copy(
        update={"settings": knobs.settings(i)}) for i in options]
    est = min(scored, key=lambda e: (not e.fits, e.step_time_s))
    if mismatch is None:
        return est
    return est.model_copy(update={"fits": False, "valid": False, "reasons": [mismatch, *est.reasons]})


def coerce_strategy(strategy: Strategy | dict | None) -> Strategy:
    if strategy is None:
        return Strategy()
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, dict):
        try:
            return Strategy(**strategy)
        except SpecValidationError as exc:
            raise SpecError(f"invalid strategy: {exc.problems}") from None
        except TypeError as exc:  # a key that is not text
            raise SpecError(f"invalid strategy: {exc}") from None
    raise SpecError(f"strategy must be a Strategy or a mapping (got {type(strategy).__name__})")
