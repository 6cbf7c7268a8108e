"""Training settings the planner chooses when the user leaves them free: the knobs vendors' recipes turn.

NVIDIA's Megatron-Bridge performance recipes run more than a parallel layout: gradients reduced in bf16
(`cfg.ddp.grad_reduce_in_fp32 = False`), FP8 weights gathered in FP8 (`fp8_param_gather`), Transformer
Engine's cross-entropy, the router padding the routing map for FP8 GEMMs, the flex token dispatcher
(HybridEP on 32 SMs), the MoE all-to-all overlapped with another micro-batch's compute and CUDA graphs over
the attention and the router (benchmarks/validation.py `BRIDGE` and src/megatron/bridge/perf_recipes/ at
067f987d). A planner that leaves them at the framework's defaults loses to the recipe by up to half a step on
fine-grained MoE models, so every one of them the user does not set (a `TrainSpec` field not given to
`plan()`/`evaluate()`) is chosen here:

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
  HybridEP on GPUs with a measured dispatch table, profiles/kernels/dispatch/), the all-to-all overlap
  (`Strategy.overlap_moe_comm`) and CUDA graphs (`cuda_graph_impl`/`cuda_graph_scope`: Transformer
  Engine's graphs over the scopes `graph_scope` picks, which take the captured kernels' launches off the
  host and hold static buffers). Each acts on one part of the step (the expert exchange; the host's issue
  time), so a strategy is re-scored with them only where removing that whole part could bring it within
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
from planner.rules import fp8_gather_allowed, graphs_capturable
from planner.specs import TrainSpec

#: The TrainSpec fields the planner chooses when left free.
FREE_KNOBS = ("grad_precision", "fp8_param_gather", "cross_entropy_fusion_impl",
              "moe_router_padding_for_quantization", "moe_dispatcher", "moe_flex_num_sms", "cuda_graph_impl",
              "cuda_graph_scope")
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
#: The largest share of a step CUDA graphs can take off: the host's issue time above the GPU's. With the host
#: time of every kernel set to zero the Megatron-Bridge 26.04 recipes' predicted steps shorten by 0 to 19.8 %
#: (Qwen3-30B-A3B on 8 GB200s the most); a strategy is re-scored with graphs only where this share of its step
#: could bring it within `KNOB_MARGIN` of the top_k-th best plan.
MAX_GRAPH_GAIN = 0.25


def graph_scope(model, dispatcher: str, router_padding: bool) -> list[str]:
    """The CUDA graph scopes the planner turns on (Transformer Engine's implementation): the attention, a dense
    layer's MLP, and an MoE layer's router and dispatcher preprocessing, as Megatron-Bridge's DeepSeek-V3 and
    gpt-oss recipes capture them (`["attn", "moe_router", "moe_preprocess"]`); without the preprocessing where
    megatron-core refuses it (the alltoall dispatcher with the router's FP8 padding). A dropless MoE layer's
    experts are never captured."""
    if model.num_experts == 0:
        return ["attn", "mlp"]
    scope = ["attn"] + (["mlp"] if model.moe_first_k_dense or model.moe_layer_freq > 1 else []) + ["moe_router"]
    if not (dispatcher == "alltoall" and router_padding):
        scope.append("moe_preprocess")
    return scope


@dataclass(frozen=True)
class Knobs:
    """The settings variants a search scores: one TrainSpec per (FP8 gather, CUDA graphs, dispatcher) triple,
    in that nesting (`index`), each candidate's base variant (`assign`), and which knobs the planner chose
    (`chosen`)."""

    trains: tuple[TrainSpec, ...]
    gathers: tuple[bool, ...]  # the fp8_param_gather values, outermost
    graphs: tuple[bool, ...]  # CUDA graphs off / on, middle
    dispatchers: tuple[str, ...]  # the moe_dispatcher values, innermost
    gather_auto: bool = False
    chosen: tuple[str, ...] = field(default_factory=tuple)  # knobs the planner set (not the user)

    @classmethod
    def fixed(cls, train: TrainSpec) -> "Knobs":
        """Every setting as `train` has it (no choice left to the planner)."""
        return cls((train,), (bool(train.fp8_param_gather),), (train.cuda_graph_impl != "none",),
                   (train.moe_dispatcher,))

    @property
    def base(self) -> TrainSpec:
        """The settings the rules judge candidates by and the result reports (FP8 gather off where the planner
        chooses it per plan, graphs off where it searches them, the first dispatcher)."""
        return self.trains[0]

    def index(self, gather: int, graph: int, dispatcher: int) -> int:
        return (gather * len(self.graphs) + graph) * len(self.dispatchers) + dispatcher

    def parts(self, variant: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k, g = len(self.dispatchers), len(self.graphs)
        return variant // (k * g), (variant // k) % g, variant % k

    def assign(self, st) -> np.ndarray:
        """Each candidate's base variant: FP8 gather on where its layout allows it (auto), graphs off where
        searched, the first dispatcher."""
        n = len(st.tp)
        if not self.gather_auto:
            return np.zeros(n, dtype=np.int64)
        ok = fp8_gather_allowed(st, self.base.fp8_recipe)
        return np.where(ok, self.index(1, 0, 0), self.index(0, 0, 0)).astype(np.int64)

    def other_dispatchers(self, variant: np.ndarray) -> list[np.ndarray]:
        """For candidates of `variant` (all on the first dispatcher), the same variants with each other
        dispatcher, one array per dispatcher."""
        k = len(self.dispatchers)
        return [variant - variant % k + j for j in range(1, k)]

    @property
    def graphs_searched(self) -> bool:
        return len(self.graphs) > 1

    def with_graphs(self, variant: np.ndarray) -> np.ndarray:
        """The same variants with CUDA graphs on (graphs searched)."""
        gather, _, dispatcher = self.parts(variant)
        return self.index(gather, 1, dispatcher)

    def graph_ok(self, st) -> np.ndarray:
        """Candidates megatron-core captures the planner's graphs for (the `cuda_graph` rule's test,
        planner.rules.graphs_capturable); graphs searched only."""
        on = self.trains[self.index(0, 1, 0)]
        return graphs_capturable(st, on.cuda_graph_impl, on.cuda_graph_scope)

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
            and train.precision in ("bf16", "fp8", "nvfp4") and not train.adapters:  # adapters: adapter_precision
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
    graphs_auto = (framework == "megatron" and not {"cuda_graph_impl", "cuda_graph_scope"} & given
                   and not getattr(model, "is_hybrid", False) and gpu.tables.elementwise is not None)
    base = train.model_copy(update=update)
    gathers = (False, True) if gather_auto else (bool(train.fp8_param_gather),)
    graphs = (False, True) if graphs_auto else (train.cuda_graph_impl != "none",)
    trains = []
    for g in gathers:
        for on in graphs:
            for d in dispatchers:
                extra: dict[str, Any] = {"moe_dispatcher": d}
                if gather_auto:
                    extra["fp8_param_gather"] = g
                if "moe_flex_num_sms" not in given:
                    extra["moe_flex_num_sms"] = FLEX_SMS.get(d)
                if graphs_auto:
                    padding = update.get("moe_router_padding_for_quantization",
                                         train.moe_router_padding_for_quantization)
                    extra |= ({"cuda_graph_impl": "transformer_engine",
                               "cuda_graph_scope": graph_scope(model, d, padding)} if on
                              else {"cuda_graph_impl": "none", "cuda_graph_scope": None})
                trains.append(base.model_copy(update=extra))
    chosen = tuple(k for k in FREE_KNOBS if k not in given and (
        k in update or (k == "fp8_param_gather" and gather_auto)
        or (k in ("moe_dispatcher", "moe_flex_num_sms") and len(dispatchers) > 1)
        or (k in ("cuda_graph_impl", "cuda_graph_scope") and graphs_auto)))
    return Knobs(tuple(trains), gathers, graphs, dispatchers, gather_auto, chosen)
