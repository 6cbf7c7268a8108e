"""Training settings the planner chooses when the user leaves them free: the knobs vendors' recipes turn.

NVIDIA's Megatron-Bridge performance recipes run more than a parallel layout: gradients reduced in bf16
(`cfg.ddp.grad_reduce_in_fp32 = False`), FP8 weights gathered in FP8 (`fp8_param_gather`), Transformer
Engine's cross-entropy, the router padding the routing map for FP8 GEMMs, the flex token dispatcher
(HybridEP on 32 SMs) and the MoE all-to-all overlapped with another micro-batch's compute
(benchmarks/validation.py `BRIDGE` names the recipe files). A planner that leaves them at the framework's
defaults loses to the recipe by up to half a step on fine-grained MoE models, so every one of them the
user does not set (a `TrainSpec` field not given to `plan()`/`evaluate()`) is chosen here:

- **set to its best-known value** where one value is never worse in the cost model and the framework runs
  it: `grad_precision` bf16 (half the gradient buffer and its reduction; framework megatron, deepspeed and
  colossalai: torchtitan's emitted job reduces in fp32), `cross_entropy_fusion_impl` te (megatron, fused
  loss on), `moe_router_padding_for_quantization` (megatron, fp8, MoE: the padded slots carry zero
  weight), the flex dispatcher's SMs (`FLEX_SMS`: what the recipes run);
- **set per strategy** where it depends on the layout: `fp8_param_gather` (megatron, fp8, not the
  blockwise recipe, whose Bridge recipe keeps bf16 weights) on every plan with the distributed optimizer
  or Megatron-FSDP (zero_stage >= 1) and not with an offloaded optimizer of another recipe than delayed,
  which Megatron refuses; off elsewhere. The candidates fall into disjoint groups, each scored with its
  own settings (`Knobs.assign`), so this costs nothing;
- **searched** where neither holds: the MoE token dispatcher (`moe_dispatcher`: alltoall, and DeepEP and
  HybridEP on GPUs with a measured dispatch table, profiles/kernels/dispatch/) and the all-to-all overlap
  (`Strategy.overlap_moe_comm`). They change only the expert-parallel exchange and what hides it, so a
  strategy is re-scored with them only where removing its whole exposed exchange could bring it within
  `KNOB_MARGIN` of the `top_k`-th best plan (planner.search: dominated settings pruned, nothing sampled).

Settings that change numerics (`NUMERICS_KNOBS`: bf16 gradient reduction, FP8 parameter gather) are
allowed by default, as the recipes allow them, and shown on every plan; `strict_numerics` forbids them:
they stay at the framework's default, and asking for them explicitly is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.errors import SpecError
from planner.specs import TrainSpec

#: The TrainSpec fields the planner chooses when left free.
FREE_KNOBS = ("grad_precision", "fp8_param_gather", "cross_entropy_fusion_impl",
              "moe_router_padding_for_quantization", "moe_dispatcher", "moe_flex_num_sms")
#: Knobs whose non-default value changes the numbers a step computes (not just how fast): bf16 gradient
#: buffers and reduction round the summed gradients to bf16; FP8 parameter gather drops the bf16 weight copy,
#: so the forward reads weights quantised from the fp32 master once per step.
NUMERICS_KNOBS = {"grad_precision": "fp32", "fp8_param_gather": False}
#: The flex dispatcher's SMs where the user does not set them: Megatron-Bridge's performance recipes run
#: HybridEP on 32 (`moe_hybridep_num_sms = 32`, scripts/performance/utils/overrides.py v0.3.0 .. v0.5.0,
#: perf_recipes/_common.py at 067f987d); DeepEP on megatron-core's default 20 (no recipe changes it).
FLEX_SMS = {"hybridep": 32, "deepep": None}
#: Frameworks whose gradient reduction the emitted job can run in bf16 (torchtitan's FSDP2 job reduces in fp32).
BF16_REDUCE_FRAMEWORKS = ("megatron", "deepspeed", "colossalai")
#: A strategy is re-scored with another dispatcher or the all-to-all overlap where its step time less its
#: exposed expert-parallel time is within this fraction of the top_k-th best plan's step time. The slack
#: covers what a dispatcher changes besides the exchange (permute kernels, host waits, padding copies), a
#: few per cent of a step on the measured recipes.
KNOB_MARGIN = 0.05


@dataclass(frozen=True)
class Knobs:
    """The settings variants a search scores: one TrainSpec per (FP8 gather, dispatcher) pair, the base
    variant of each candidate (`assign`), and which knobs the planner chose (`chosen`)."""

    trains: tuple[TrainSpec, ...]
    gathers: tuple[bool, ...]  # the fp8_param_gather values, outer index of `trains`
    dispatchers: tuple[str, ...]  # the moe_dispatcher values, inner index of `trains`
    gather_auto: bool = False
    chosen: tuple[str, ...] = field(default_factory=tuple)  # knobs the planner set (not the user)

    @classmethod
    def fixed(cls, train: TrainSpec) -> "Knobs":
        """Every setting as `train` has it (no choice left to the planner)."""
        return cls((train,), (bool(train.fp8_param_gather),), (train.moe_dispatcher,))

    @property
    def base(self) -> TrainSpec:
        """The settings the rules judge candidates by and the result reports (FP8 gather off where the planner
        chooses it per plan, the first dispatcher)."""
        return self.trains[0]

    def index(self, gather: int, dispatcher: int) -> int:
        return gather * len(self.dispatchers) + dispatcher

    def assign(self, st) -> np.ndarray:
        """Each candidate's base variant: FP8 gather on where its layout allows it (auto), first dispatcher."""
        n = len(st.tp)
        if not self.gather_auto:
            return np.zeros(n, dtype=np.int64)
        ok = (st.zero_stage >= 1) & ~(st.offload_optimizer & (self.base.fp8_recipe != "delayed"))
        return np.where(ok, self.index(1, 0), self.index(0, 0)).astype(np.int64)

    def other_dispatchers(self, variant: np.ndarray) -> list[np.ndarray]:
        """For candidates of `variant` (all on the first dispatcher), the same variants with each other
        dispatcher, one array per dispatcher."""
        k = len(self.dispatchers)
        return [variant - variant % k + j for j in range(1, k)]

    def settings(self, i: int) -> dict[str, Any]:
        """The chosen knobs' values in variant `i`."""
        t = self.trains[i]
        return {k: getattr(t, k) for k in self.chosen}


def choose(train: TrainSpec, model, gpu, strict_numerics: bool = False) -> Knobs:
    """The knobs of `train` that the user did not set, chosen as the module docstring says; `gpu` decides
    which dispatchers exist. With `strict_numerics`, a numerics-changing setting the user asked for is
    refused."""
    given = train.model_fields_set
    if strict_numerics:
        for key, default in NUMERICS_KNOBS.items():
            if key in given and getattr(train, key) != default:
                raise SpecError(f"{key} {getattr(train, key)!r} changes the numerics, which strict_numerics forbids "
                                f"(drop strict_numerics, or {key} {default!r})")
    framework, fp8, moe = train.framework, train.precision == "fp8", model.num_experts > 0
    update: dict[str, Any] = {}
    if "grad_precision" not in given and not strict_numerics and framework in BF16_REDUCE_FRAMEWORKS \
            and train.precision in ("bf16", "fp8", "nvfp4"):
        update["grad_precision"] = "bf16"
    if framework == "megatron":
        if "cross_entropy_fusion_impl" not in given and train.cross_entropy_fusion:
            update["cross_entropy_fusion_impl"] = "te"
        if "moe_router_padding_for_quantization" not in given and fp8 and moe:
            update["moe_router_padding_for_quantization"] = True
    gather_auto = (framework == "megatron" and fp8 and train.fp8_recipe != "blockwise" and not strict_numerics
                   and "fp8_param_gather" not in given)
    dispatchers: tuple[str, ...] = (train.moe_dispatcher,)
    if moe and framework == "megatron" and "moe_dispatcher" not in given and gpu.tables.dispatch is not None:
        dispatchers = ("alltoall", "deepep", "hybridep")
    base = train.model_copy(update=update)
    gathers = (False, True) if gather_auto else (bool(train.fp8_param_gather),)
    trains = []
    for g in gathers:
        for d in dispatchers:
            extra: dict[str, Any] = {"moe_dispatcher": d}
            if gather_auto:
                extra["fp8_param_gather"] = g
            if "moe_flex_num_sms" not in given:
                extra["moe_flex_num_sms"] = FLEX_SMS.get(d)
            trains.append(base.model_copy(update=extra))
    chosen = tuple(k for k in FREE_KNOBS if k not in given and (
        k in update or (k == "fp8_param_gather" and gather_auto)
        or (k in ("moe_dispatcher", "moe_flex_num_sms") and len(dispatchers) > 1)))
    return Knobs(tuple(trains), gathers, dispatchers, gather_auto, chosen)
