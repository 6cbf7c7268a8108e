"""MaxText emitter: a plan as a MaxText config (YAML) with its JAX device mesh.

MaxText (github.com/AI-Hypercomputer/maxtext) takes its parallelism as mesh-axis degrees, one per axis
inside a slice (`ici_*_parallelism`) and one across slices (`dcn_*_parallelism`); the mesh is the
product of the two per axis, its axes in MaxText's `mesh_axes` order (outermost first). The keys
written here are checked against the `configs/base.yml` of MaxText `MAXTEXT_VERSION` (tests/emit/
test_emit_maxtext.py opens the released wheel, which scripts/test.sh downloads: MaxText needs Python
3.12 and is not installed).

Mapping (planner vocabulary -> MaxText):

- dp -> `data` (zero_stage 0, and 1 with `shard_optimizer_over_data`, MaxText's ZeRO-1) or `fsdp`
  (zero_stage 3); zero_stage 2 is refused (MaxText shards gradients only together with parameters);
- tp -> `tensor`, cp -> `context`, pp -> `stage` (`ici_pipeline_parallelism`), ep -> `expert` (its
  ranks taken from dp: MaxText's expert axis also splits the batch of the dense layers);
- each degree splits into its part inside a slice and its part across slices by the plan's rank
  order: a dimension whose ranks lie `stride` apart with `stride` at least the ranks of one slice is all
  DCN (the outermost dimensions), one inside a slice all ICI, and the one that straddles the slice
  boundary splits at it (`ici_dcn_split`). A TPU slice is the cluster's torus slice; on a GPU cluster the
  NVLink domain plays its part (MaxText's GPU convention: ICI within a node, DCN across);
- micro-batches: per_device_batch_size = global batch / (chips · gradient_accumulation_steps) with
  gradient_accumulation_steps = num_microbatches (pp 1), or num_pipeline_microbatches =
  num_microbatches and no accumulation (pp > 1; MaxText requires a multiple of pp);
- vpp -> `num_layers_per_pipeline_stage` = layers / (pp · vpp) (MaxText's circular pipeline repeats
  the stages vpp times); an uneven or explicit split is refused;
- recompute none -> remat_policy `none`, selective (core attention) -> `minimal` (the projections'
  and MLP matmuls' outputs saved, attention and the element-wise work recomputed), full -> `full`;
  recompute_num_layers and other recompute_modules are refused (one policy for every layer);
- the model's shape as MaxText's `base_*` keys and the `decoder_block` of its family.

Refused with NotExpressibleError (one line, the reason): what MaxText has no key for (zero_stage 2,
offload_optimizer, offload_activation_layers, overlap switches turned off, etp other than tp, fp16 and
fp8 precision, a non-all-to-all MoE dispatcher, fp8_param_gather), and what its sharding rules would
run differently from the plan: cp > 1 or ep > 1 without zero_stage 3 (MaxText's logical axis rules
shard the weights over the `context` and `expert` axes too, as FSDP does), ep with cp > 1, and a
per-device batch MaxText's float cannot hold exactly.

The plan's costs are torchtitan's (`RUNS`): the cost model has no MaxText profile, and torchtitan is the
nearest one it has (FSDP-style sharding reduce-scattered per micro-batch, fused element-wise work as
XLA fuses it); the output says so.
"""

from __future__ import annotations

from typing import Any

import yaml

from planner.emit.base import REGISTRY, EmitOptions, NotExpressibleError, PlanFacts, check_plan, describe
from planner.emit.quoting import comment
from planner.specs import Plan

FRAMEWORK = "MaxText"
RUNS = "torchtitan"  # the TrainSpec.framework whose costs describe its run (the nearest the cost model has)
CONFIG_PATH = "meshplan_maxtext.yml"
#: The MaxText release whose configs/base.yml every emitted key is checked against (the newest on PyPI).
MAXTEXT_VERSION = "0.2.5"

#: The key by which a MaxText config file inherits another (maxtext/configs/pyconfig.py `_BASE_CONFIG_ATTR`; a
#: relative path not beside the file is looked up in MaxText's configs folder), and the file it inherits.
BASE_CONFIG_KEY = "base_config"
BASE_CONFIG = "base.yml"
#: MaxText's mesh_axes (configs/base.yml), outermost first: the JAX mesh's axis names and order.
MESH_AXES = ("diloco", "data", "stage", "fsdp", "fsdp_transpose", "context", "context_usp_ulysses",
             "context_autoregressive", "tensor", "tensor_sequence", "expert", "autoregressive")
#: remat_policy by the plan's recompute setting.
REMAT_POLICY = {"none": "none", "selective": "minimal", "full": "full"}
#: dtype by precision (the activations' and matmuls' type; the master weights stay float32, MaxText's
#: weight_dtype default, as the cost model assumes).
DTYPE = {"bf16": "bfloat16", "fp32": "float32"}
GRAD_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
#: MaxText's opt_type by the plan's optimizer (AdamW holds the same two moments as Adam).
OPT_TYPE = {"adam": "adamw", "sgd": "sgd"}
#: MaxText activation names of a gated MLP's gate.
GLU_ACTIVATION = {"silu": "silu", "gelu": "gelu"}


def _refuse(reason: str) -> None:
    raise NotExpressibleError(FRAMEWORK, reason)


def slice_ranks(plan: Plan) -> int:
    """Ranks of one slice: the chips of one torus slice of a TPU cluster, the NVLink domain elsewhere."""
    spec = plan.cluster.topology
    if spec is not None and spec.kind == "torus" and spec.torus is not None:
        return spec.torus.chips_per_slice
    return plan.cluster.domain_size


def ici_dcn_split(size: int, stride: int, per_slice: int) -> tuple[int, int] | None:
    """(inside a slice, across slices) of a dimension of `size` ranks `stride` apart, slices of `per_slice`
    ranks; None when the dimension does not split at a slice boundary."""
    if size == 1 or stride * size <= per_slice:
        return size, 1
    if stride >= per_slice:
        return (1, size) if stride % per_slice == 0 else None
    inside = per_slice // stride
    if per_slice % stride or size % inside:
        return None
    return inside, size // inside


def mesh_degrees(f: PlanFacts, plan: Plan) -> tuple[dict[str, int], dict[str, int], int]:
    """(ICI degree, DCN degree) by MaxText mesh axis (only the axes the plan uses), and num_slices."""
    s, n = f.strategy, plan.num_gpus
    per_slice = min(slice_ranks(plan), n)
    if n % per_slice:
        _refuse(f"num_gpus ({n}) is not a whole number of slices of {per_slice} chips; MaxText runs on whole "
                "slices (num_slices)")
    lay = f.layout
    split: dict[str, tuple[int, int]] = {}
    for dim in ("tp", "cp", "dp", "pp"):
        size, stride = int(getattr(s, dim) if dim != "dp" else f.dp), int(lay.stride(dim)[0])
        parts = ici_dcn_split(size, stride, per_slice)
        if parts is None:
            _refuse(f"{dim} ({size}) at rank stride {stride} does not split at the boundary of slices of {per_slice} "
                    "chips: MaxText's degrees are a part inside a slice times a part across slices")
        split[dim] = parts
    ici: dict[str, int] = {}
    dcn: dict[str, int] = {}
    data_axis = "fsdp" if s.zero_stage == 3 else "data"
    dp_ici, dp_dcn = split["dp"]
    if s.ep > 1:  # the expert ranks are the innermost of dp's (with etp = tp and cp = 1)
        if dp_ici % s.ep == 0:
            ep_ici, ep_dcn = s.ep, 1
        elif s.ep % dp_ici == 0 and dp_dcn % (s.ep // dp_ici) == 0:
            ep_ici, ep_dcn = dp_ici, s.ep // dp_ici
        else:
            _refuse(f"ep ({s.ep}) does not divide the data-parallel ranks inside a slice ({dp_ici}) nor span whole "
                    "slices of them")
        ici["expert"], dcn["expert"] = ep_ici, ep_dcn
        dp_ici, dp_dcn = dp_ici // ep_ici, dp_dcn // ep_dcn
    ici[data_axis], dcn[data_axis] = dp_ici, dp_dcn
    for dim, axis in (("tp", "tensor"), ("cp", "context"), ("pp", "stage")):
        ici[axis], dcn[axis] = split[dim]
    return ici, dcn, n // per_slice


def jax_mesh(plan: Plan) -> dict[str, int]:
    """The JAX device mesh of the emitted config: {axis name: size} in MaxText's mesh_axes order (outermost
    first), the axes of size 1 left out (MaxText keeps them, of size 1)."""
    f = check_plan(plan, FRAMEWORK)
    _check_strategy(f, plan)
    ici, dcn, _ = mesh_degrees(f, plan)
    sizes = {a: ici.get(a, 1) * dcn.get(a, 1) for a in MESH_AXES}
    return {a: v for a, v in sizes.items() if v > 1}


def _check_strategy(f: PlanFacts, plan: Plan) -> None:
    s, t, m = f.strategy, f.train, plan.model
    if t.precision not in DTYPE:
        _refuse(f"precision {t.precision!r}; the emitted config trains in bf16 or fp32 (MaxText's quantization "
                "modes are not what the plan costs)")
    if t.grad_precision not in GRAD_DTYPE:
        _refuse(f"grad_precision {t.grad_precision!r}; MaxText's grad_dtype is float32 or bfloat16 here")
    if t.optimizer not in OPT_TYPE:
        _refuse(f"optimizer {t.optimizer!r}; MaxText's opt_type has no such optimizer")
    if s.zero_stage == 2:
        _refuse("zero_stage 2; MaxText shards the optimizer states alone over the data axis "
                "(shard_optimizer_over_data, ZeRO-1) or the parameters, gradients and states over the fsdp axis "
                "(ZeRO-3), never gradients without parameters")
    if s.zero_stage != 3 and (s.cp > 1 or s.ep > 1):
        dims = " and ".join(f"{d} ({v})" for d, v in (("cp", s.cp), ("ep", s.ep)) if v > 1)
        _refuse(f"{dims} > 1 with zero_stage {s.zero_stage}; MaxText's logical axis rules shard the weights over the "
                "context and expert axes too (as FSDP does), which the plan does not cost")
    if s.ep > 1 and s.cp > 1:
        _refuse(f"ep ({s.ep}) with cp ({s.cp}) > 1; the plan's expert ranks run over its context ranks, MaxText's "
                "expert axis is apart from its context axis")
    if m.is_moe and s.etp != s.tp:
        _refuse(f"etp ({s.etp}) must equal tp ({s.tp}); MaxText shards each expert's MLP over the tensor axis as it "
                "does the dense MLP")
    if s.offload_optimizer:
        _refuse("offload_optimizer; MaxText's optimizer_memory_host_offload keeps the optimizer step on the device, "
                "not the CPU step ZeRO-Offload the plan costs")
    if s.offload_activation_layers:
        _refuse(f"offload_activation_layers ({s.offload_activation_layers}); MaxText offloads by remat policy for "
                "every layer, not the activations of the first layers")
    for knob in ("overlap_grad_reduce", "overlap_param_gather"):
        if not getattr(s, knob):
            _refuse(f"{knob} off; MaxText has no key that keeps XLA from overlapping that communication")
    if s.overlap_moe_comm:
        _refuse("overlap_moe_comm; MaxText does not overlap the expert all-to-all with another micro-batch")
    if s.pp > 1 and not s.overlap_p2p_comm:
        _refuse("overlap_p2p_comm off with pp > 1; MaxText has no key for blocking pipeline transfers")
    if t.fp8_param_gather:
        _refuse("fp8_param_gather; the emitted config gathers bf16 weights")
    if m.is_moe and t.moe_dispatcher != "alltoall":
        _refuse(f"moe_dispatcher {t.moe_dispatcher}; MaxText dispatches tokens with its own all-to-all or "
                "dropless kernels, not DeepEP")
    if s.recompute == "selective" and s.recompute_modules and s.recompute_modules != ["core_attn"]:
        _refuse(f"recompute_modules {s.recompute_modules}; MaxText's remat policies save or recompute by tensor "
                "name for every layer, not per Megatron module")
    if s.recompute == "full" and s.recompute_num_layers is not None:
        _refuse(f"recompute_num_layers ({s.recompute_num_layers}); MaxText applies one remat policy to every layer")
    if s.pp > 1:
        if not f.even_split:
            _refuse(f"{f.split_fields()} with pp ({s.pp}) > 1; MaxText's pipeline holds the same number of layers in "
                    "every stage")
        if f.num_microbatches % s.pp:
            _refuse(f"num_microbatches ({f.num_microbatches}) must be a multiple of pp ({s.pp}) for MaxText's "
                    "pipeline (num_pipeline_microbatches)")


def _batch(f: PlanFacts, plan: Plan) -> dict[str, Any]:
    s, t, n = f.strategy, f.train, plan.num_gpus
    steps = 1 if s.pp > 1 else f.num_microbatches
    per_device = t.global_batch_size / (n * steps)
    if int(n * per_device) != t.global_batch_size // steps:
        _refuse(f"per_device_batch_size {t.global_batch_size}/({n}·{steps}) is not exact as a float; MaxText "
                "rounds the batch it derives from it")
    out: dict[str, Any] = {"per_device_batch_size": int(per_device) if per_device.is_integer() else per_device,
                           "gradient_accumulation_steps": steps}
    if s.pp > 1:
        out |= {"num_pipeline_microbatches": f.num_microbatches,
                "num_layers_per_pipeline_stage": f.layers_per_chunk()[0]}
    return out


def _model(plan: Plan, t, notes: list[str]) -> dict[str, Any]:
    m = plan.model
    out: dict[str, Any] = {
        "base_emb_dim": m.hidden_size, "base_num_query_heads": m.num_attention_heads,
        "base_num_kv_heads": m.kv_heads, "head_dim": m.head_dim or m.hidden_size // m.num_attention_heads,
        "base_mlp_dim": m.ffn_hidden_size, "base_num_decoder_layers": m.num_layers, "vocab_size": m.vocab_size,
        "max_target_length": t.seq_len, "normalization_layer_epsilon": m.norm_epsilon,
        "logits_via_embedding": m.tie_embeddings}
    if m.gated_mlp:
        act = GLU_ACTIVATION.get(m.glu_activation)
        if act is None:
            notes.append(f"gated MLP with {m.glu_activation}: no MaxText activation name is mapped; set "
                         "mlp_activations")
        else:
            out["mlp_activations"] = [act, "linear"]
    else:
        out["mlp_activations"] = ["gelu"]
    if m.position_embedding == "rope" and m.rope_theta is not None:
        out["rope_max_timescale"] = int(m.rope_theta) if float(m.rope_theta).is_integer() else m.rope_theta
    if m.is_moe:
        out |= {"num_experts": m.num_experts, "num_experts_per_tok": m.moe_top_k, "base_moe_mlp_dim": m.expert_ffn,
                "shared_experts": m.num_shared_experts, "first_num_dense_layers": m.moe_first_k_dense}
    if m.is_mla:
        out |= {"attention_type": "mla", "q_lora_rank": m.q_lora_rank or 0, "kv_lora_rank": m.kv_lora_rank,
                "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
                "v_head_dim": m.v_head_dim}
    if m.num_mtp_layers:
        out["mtp_num_layers"] = m.num_mtp_layers
    if m.qk_norm == "per_head":
        out["use_qk_norm"] = True
    out["decoder_block"] = _decoder_block(m, notes)
    return out


def _decoder_block(m, notes: list[str]) -> str:
    """MaxText's decoder block of the model's family; a note where the model has what none of them is chosen
    for here."""
    if m.is_moe:
        block = "deepseek" if (m.is_mla or m.num_shared_experts or m.moe_first_k_dense) else "mixtral"
    else:
        block = "qwen3" if m.qk_norm == "per_head" else "llama2"
    extra = []
    if m.sliding_window:
        extra.append(f"sliding-window attention ({m.sliding_window} tokens)")
    if m.qk_norm == "full":
        extra.append("query/key norms over all heads together")
    if m.norm != "rmsnorm" or m.linear_bias or m.position_embedding != "rope":
        extra.append(f"{m.norm}, {'biases, ' if m.linear_bias else ''}{m.position_embedding} positions")
    if m.moe_layer_freq > 1 or m.moe_dense_layers:
        extra.append("MoE layers interleaved with dense ones")
    if m.dropout:
        extra.append("dropout (set dropout_rate)")
    if extra:
        notes.append(f"model {m.name}: decoder_block {block} is written; the model also has " + "; ".join(extra)
                     + ": choose the MaxText decoder_block that has them")
    return block


def config(plan: Plan) -> tuple[dict[str, Any], dict[str, int], list[str]]:
    """(MaxText config keys, the JAX mesh {axis: size}, notes); NotExpressibleError for what MaxText cannot run
    as planned."""
    f = check_plan(plan, FRAMEWORK)
    _check_strategy(f, plan)
    s, t = f.strategy, f.train
    notes: list[str] = []
    ici, dcn, num_slices = mesh_degrees(f, plan)
    torus = plan.cluster.topology is not None and plan.cluster.topology.kind == "torus"
    out: dict[str, Any] = {"hardware": "tpu" if torus else "gpu", "num_slices": num_slices}
    for axis in ("data", "fsdp", "stage", "context", "tensor", "expert"):
        out[f"ici_{'pipeline' if axis == 'stage' else axis}_parallelism"] = ici.get(axis, 1)
    for axis in ("data", "fsdp", "stage", "context", "tensor", "expert"):
        out[f"dcn_{'pipeline' if axis == 'stage' else axis}_parallelism"] = dcn.get(axis, 1)
    out["shard_optimizer_over_data"] = s.zero_stage == 1 and f.dp > 1
    out |= _batch(f, plan)
    out["remat_policy"] = REMAT_POLICY[s.recompute]
    out |= {"dtype": DTYPE[t.precision], "weight_dtype": "float32", "grad_dtype": GRAD_DTYPE[t.grad_precision],
            "opt_type": OPT_TYPE[t.optimizer]}
    out |= _model(plan, t, notes)
    notes.append(f"costed as {t.framework} runs it: the cost model has no MaxText profile ({RUNS}, the nearest it "
                 "has, with FSDP-style sharding and fused element-wise work, is what `meshplan emit --backend maxtext` "
                 "searches with)")
    notes.append("MaxText places the mesh axes on the slice itself (its create_device_mesh); the plan's rank "
                 f"order ({f.layout.rank_order}, innermost first) is not a MaxText key")
    if s.tp > 1 and not s.sequence_parallel:
        notes.append("tp without sequence_parallel: MaxText shards the activations between layers over the tensor "
                     "axis anyway (less activation memory than planned, the same communication)")
    if s.recompute == "selective":
        notes.append("remat_policy minimal saves the projections' and MLP matmuls' outputs and recomputes attention "
                     "and the element-wise work, a little more than the plan's core-attention recompute")
    if s.pp > 1:
        notes.append("MaxText's pipeline differentiates a scan over all micro-batches: without remat it keeps every "
                     "micro-batch's stage activations (GPipe), more than the plan's 1F1B schedule holds")
    sizes = {a: ici.get(a, 1) * dcn.get(a, 1) for a in MESH_AXES}
    mesh = {a: v for a, v in sizes.items() if v > 1}
    return out, mesh, notes


def _mesh_text(mesh: dict[str, int]) -> str:
    names = tuple(mesh) or ("data",)
    shape = tuple(mesh.values()) or (1,)
    return f"jax.sharding.Mesh(devices.reshape({shape}), axis_names={names})"


def to_yaml(plan: Plan) -> str:
    keys, mesh, notes = config(plan)
    out = [comment("# MaxText ", describe(plan, RUNS)),
           f"# MaxText {MAXTEXT_VERSION}: python3 -m maxtext.trainers.pre_train.train {CONFIG_PATH} run_name=... "
           "base_output_directory=... (base_config: MaxText's own base.yml, which these keys override)",
           comment("# JAX mesh (MaxText mesh_axes order, outermost first; size-1 axes left out): ", _mesh_text(mesh))]
    out += [comment("# note: ", n) for n in notes]
    body = {BASE_CONFIG_KEY: BASE_CONFIG} | keys
    out.append(yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=1000).rstrip("\n"))
    return "\n".join(out) + "\n"


class MaxTextEmitter:
    name = "maxtext"
    framework = FRAMEWORK
    runs = RUNS
    syntax = "yaml"

    def data(self, plan: Plan, options: EmitOptions) -> dict[str, Any]:
        keys, mesh, notes = config(plan)
        return {"config": {BASE_CONFIG_KEY: BASE_CONFIG} | keys,
                "mesh": {"axis_names": list(mesh), "shape": list(mesh.values())},
                "maxtext_version": MAXTEXT_VERSION, "notes": notes}

    def render(self, plan: Plan, options: EmitOptions) -> str:
        return to_yaml(plan)


REGISTRY.register(MaxTextEmitter())
