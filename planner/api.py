"""The public Python API: `plan()` and `evaluate()` (see DESIGN.md, "Public contract")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from planner.errors import SpecError
from planner.rules import fp8_recipe_problem
from planner.specs import ClusterSpec, Estimate, ModelSpec, PlanResult, Strategy, TrainSpec

ModelRef = str | Path | ModelSpec | dict
ClusterRef = str | Path | ClusterSpec | dict


def make_inputs(
    model: ModelRef,
    cluster: ClusterRef,
    num_gpus: int,
    global_batch_size: int,
    seq_len: int,
    precision: str = "bf16",
    **train_options: Any,
) -> tuple[ModelSpec, ClusterSpec, TrainSpec]:
    """Load and validate the three inputs; every problem is a SpecError naming the field."""
    from profiles import format_validation_error, load_cluster, load_model

    model_spec = load_model(model)
    cluster_spec = load_cluster(cluster)
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
        raise SpecError(f"num_gpus must be a positive integer (got {num_gpus!r})")
    if cluster_spec.max_gpus is not None and num_gpus > cluster_spec.max_gpus:
        raise SpecError(f"num_gpus ({num_gpus}) exceeds cluster {cluster_spec.name}'s max_gpus ({cluster_spec.max_gpus})")
    try:
        train = TrainSpec(global_batch_size=global_batch_size, seq_len=seq_len, precision=precision, **train_options)
    except ValidationError as exc:
        raise SpecError(f"invalid training settings: {format_validation_error(exc)}") from None
    cluster_spec.gpu.peak(train.precision)  # the GPU must have a rate for this precision
    if (problem := fp8_recipe_problem(train, cluster_spec.gpu)) is not None:
        raise SpecError(problem)
    return model_spec, cluster_spec, train


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

    When nothing fits, `result.plans` is empty and `result.closest` holds the
    valid strategies that came closest (their `estimate.reasons` say by how much),
    with `result.advice` and `result.min_gpus_to_fit`. When no strategy is valid,
    both are empty and `result.rejections` counts the candidates by rule.
    """
    from planner.search import search
    from planner.specs.results import DEFAULT_HEADROOM

    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise SpecError(f"top_k must be a positive integer (got {top_k!r})")
    if headroom is None:
        headroom = DEFAULT_HEADROOM
    if (isinstance(headroom, bool) or not isinstance(headroom, (int, float))
            or not 0 <= headroom < 1):  # NaN fails the range test too
        raise SpecError(f"headroom must be a fraction of GPU memory in [0, 1), e.g. 0.05 (got {headroom!r})")
    if ranking not in ("simple", "fastest"):
        raise SpecError(f"ranking must be 'simple' or 'fastest' (got {ranking!r})")
    model_spec, cluster_spec, train = make_inputs(
        model, cluster, num_gpus, global_batch_size, seq_len, precision, **train_options
    )
    return search(model_spec, cluster_spec, train, num_gpus, constraints or {}, top_k, headroom=float(headroom),
                  ranking=ranking)


def evaluate(
    model: ModelRef,
    cluster: ClusterRef,
    num_gpus: int,
    global_batch_size: int,
    seq_len: int,
    precision: str = "bf16",
    strategy: Strategy | dict | None = None,
    **train_options: Any,
) -> Estimate:
    """Score one strategy. An invalid or non-fitting strategy still gets an
    Estimate, with `fits=False` and its `reasons`; malformed input raises SpecError."""
    from planner.search import evaluate_one

    model_spec, cluster_spec, train = make_inputs(
        model, cluster, num_gpus, global_batch_size, seq_len, precision, **train_options
    )
    strategy = coerce_strategy(strategy)
    return evaluate_one(model_spec, cluster_spec, train, strategy.resolve(num_gpus))


def coerce_strategy(strategy: Strategy | dict | None) -> Strategy:
    from profiles import format_validation_error

    if strategy is None:
        return Strategy()
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, dict):
        try:
            return Strategy(**strategy)
        except ValidationError as exc:
            raise SpecError(f"invalid strategy: {format_validation_error(exc)}") from None
    raise SpecError(f"strategy must be a Strategy or a mapping (got {type(strategy).__name__})")
