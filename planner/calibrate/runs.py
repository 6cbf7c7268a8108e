"""Measured training runs as typed input, and the cost model's prediction of each.

A `MeasuredRun` is one end-to-end measurement: the job (model, cluster, GPUs, batch,
sequence, precision, the strategy fields the run fixed) and how long an optimizer step
took. `predict_run` asks the planner the same question the run answered: the fastest
strategy under the run's fixed fields that fits the GPU (no memory margin: the run was
made), with chosen physical parameters (`apply_parameters`) replacing the profile values.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from planner.api import plan
from planner.errors import SpecError
from planner.knobs import FREE_KNOBS
from planner.specs import ClusterSpec, GpuSpec, ModelSpec, TrainSpec
from planner.specs.base import MAX_BATCH, MAX_GPUS, MAX_TOKENS, Spec
from planner.specs.strategy import RANK_ORDERS
from planner.specs.hardware import Precision
from profiles import load_cluster, with_parameters
from profiles.calibration_file import TIER_PARAMETERS

#: ClusterSpec fields that are not physical scalars a fit could set (the tiers' bandwidths are set by their
#: flat names, `profiles.calibration_file.TIER_PARAMETERS`).
NOT_FITTABLE = ("gpu", "name", "intra_node", "inter_node", "host", "source")


class MeasuredRun(Spec):
    """One measured training step: the job, the strategy fields it fixed, and its step time."""

    label: str = Field(min_length=1, description="Names the run in reports and profiles (unique within a fit).")
    source: str = Field(min_length=1, description="Where the measurement comes from (a paper's table, a "
                        "benchmark file, a `meshplan tune` trial).")
    set_name: str | None = Field(None, min_length=1, description="The set or group the run belongs to; "
                                 "leave-one-set-out holds out one set at a time.")
    model: str | ModelSpec = Field(description="Model preset name or ModelSpec.")
    cluster: str | ClusterSpec = Field(description="Cluster preset name or ClusterSpec.")
    num_gpus: int = Field(ge=1, le=MAX_GPUS)
    global_batch_size: int = Field(ge=1, le=MAX_BATCH)
    seq_len: int = Field(ge=1, le=MAX_TOKENS)
    precision: Precision = "bf16"
    strategy: dict[str, Any] = Field(default_factory=dict, description="Strategy fields the run fixed (a value) "
                                     "or restricted (a list); the rest are searched, as the run's authors tuned them.")
    train_options: dict[str, Any] = Field(default_factory=dict, description="Other TrainSpec fields of the run "
                                          "(grad_precision, attention_kernel, framework, ...).")
    measured_step_s: float | None = Field(None, gt=0, description="Measured seconds per optimizer step.")
    tokens_per_s_per_gpu: float | None = Field(None, gt=0, description="Measured throughput, tokens per second "
                                               "per GPU (instead of measured_step_s).")
    weight: float = Field(1.0, gt=0, le=1, description="How much the run counts in a fit: its residual is "
                          "multiplied by sqrt(weight) (less than 1 for a measurement less trusted, e.g. one taken on "
                          "a busy host); reported errors are unweighted.")

    @model_validator(mode="after")
    def _one_measurement(self) -> MeasuredRun:
        if (self.measured_step_s is None) == (self.tokens_per_s_per_gpu is None):
            raise ValueError("measured_step_s: give exactly one of measured_step_s and tokens_per_s_per_gpu "
                             f"(got {self.measured_step_s!r} and {self.tokens_per_s_per_gpu!r})")
        if "precision" in self.train_options:
            raise ValueError("train_options: precision is its own field (got train_options.precision "
                             f"{self.train_options['precision']!r})")
        return self

    @property
    def step_s(self) -> float:
        """Measured seconds per step (from tokens/s per GPU where that is what was measured)."""
        if self.measured_step_s is not None:
            return self.measured_step_s
        return self.global_batch_size * self.seq_len / (self.num_gpus * self.tokens_per_s_per_gpu)


class RunPrediction(Spec):
    """The cost model's step time of a run, with the strategy it chose; `step_s` None: nothing fits."""

    step_s: float | None
    strategy: str
    note: str = ""


def check_parameter(name: str) -> None:
    """Refuse a name that is no numeric GpuSpec or ClusterSpec field nor a link tier's bandwidth
    (`intra_node_bw_bytes_per_s`, `inter_node_bw_bytes_per_s`): SpecError naming it."""
    if name in GpuSpec.model_fields and name not in ("name", "source", "calibration", "kernel_tables",
                                                     "peak_flop_per_s", "step_time_residuals"):
        return
    if name in ClusterSpec.model_fields and name not in NOT_FITTABLE:
        return
    if name in TIER_PARAMETERS:
        return
    raise SpecError(f"parameter {name!r} must be a numeric GpuSpec or ClusterSpec field or a link tier's bandwidth "
                    f"({', '.join(TIER_PARAMETERS)}) (e.g. sustained_compute_fraction, host_time_scale, "
                    "ep_comm_overlap)")


def apply_parameters(cluster: ClusterSpec, params: dict[str, float]) -> ClusterSpec:
    """`cluster` with GPU fields, cluster fields and tier bandwidths replaced by `params`
    (`profiles.with_parameters`; values as given: a fit's bounds keep them in range)."""
    for name in params:
        check_parameter(name)
    return with_parameters(cluster, params)


def resolve_cluster(run: MeasuredRun) -> ClusterSpec:
    """The run's cluster as a spec (a preset name is loaded)."""
    return run.cluster if isinstance(run.cluster, ClusterSpec) else load_cluster(run.cluster)


def run_settings(train_options: dict[str, Any]) -> dict[str, Any]:
    """A measured run's training settings: the ones it states, and for every setting the planner would
    otherwise choose (planner.knobs.FREE_KNOBS) the framework's default, which is what a run that does not
    state it ran. (The rank order and the all-to-all overlap are likewise fixed to the defaults in
    `predict_run`.)"""
    defaults = {k: TrainSpec.model_fields[k].default for k in FREE_KNOBS if k not in train_options}
    return defaults | dict(train_options)


def predict_run(run: MeasuredRun, cluster: ClusterSpec | None = None) -> RunPrediction:
    """The fastest plan of `run` under its fixed strategy fields that fits the GPU, on `cluster`
    (default: the run's own).

    A published interleaving that splits the layers in a way the planner's stage vocabulary
    cannot (a custom pipeline layout) is predicted without interleaving, and the strategy text
    says so. A run that does not state its rank order ran in its framework's default order
    (Megatron's tp-cp-ep-dp-pp; every framework's): the order is fixed to it, not searched."""
    options = run_settings(run.train_options)

    def search(constraints: dict[str, Any]):
        return plan(model=run.model, cluster=cluster or run.cluster, num_gpus=run.num_gpus,
                    global_batch_size=run.global_batch_size, seq_len=run.seq_len, precision=run.precision,
                    constraints=constraints, top_k=1, headroom=0.0, ranking="fastest", **options)

    fixed = {"rank_order": RANK_ORDERS[0], "overlap_moe_comm": False} | dict(run.strategy)
    result, tag = search(fixed), ""
    vp = run.strategy.get("vpp")
    if not result.plans and not result.closest and isinstance(vp, int) and vp > 1 \
            and any(r.rule == "layers" for r in result.rejections):
        result, tag = search(fixed | {"vpp": 1}), f" [published vp{vp} not expressible: vpp 1]"
    if result.plans:
        best = result.plans[0]
        return RunPrediction(step_s=best.estimate.step_time_s, strategy=best.strategy.short() + tag)
    if result.closest:
        near = result.closest[0]
        return RunPrediction(step_s=None, strategy=near.strategy.short(), note="; ".join(near.estimate.reasons))
    rules = ", ".join(f"{r.rule} ({r.count})" for r in result.rejections[:3])
    return RunPrediction(step_s=None, strategy="-", note="no valid strategy under the run's fixed fields"
                         + (f"; rejected by {rules}" if rules else ""))
