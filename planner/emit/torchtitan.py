"""torchtitan (0.2.x, TOML job configs): `[parallelism]`, `[training]`, `[activation_checkpoint]`, `[compile]`.

torchtitan 0.3 replaced TOML job files with Python config registries; the
TOML written here is the 0.1/0.2 `--job.config_file` format (JobConfig).

Mapping choices (torchtitan shards data parallelism with FSDP2):
- zero_stage 3: FSDP full shard, `data_parallel_shard_degree = dp`,
  `data_parallel_replicate_degree = 1`.
- zero_stage 1 or 2: FSDP with `fsdp_reshard_after_forward = "never"`
  (ZeRO-2-like: parameters gathered once per step, gradients reduce-scattered);
  for zero_stage 1 the gradients are sharded too, which only saves memory.
- zero_stage 0: DDP (`data_parallel_replicate_degree = dp`) when nothing else is
  parallel; torchtitan has no DDP beside TP/PP/CP, so there it is FSDP without
  resharding (reduce-scatter + all-gather move the same bytes as an all-reduce).
- tp: torchtitan's TP always shards the norms and dropouts along the sequence
  (Megatron sequence parallelism); a plan without it gets it anyway (less
  activation memory, same communication volume). Both cases are written in
  the output's notes.
- pp: `1F1B`, or `Interleaved1F1B` with vpp > 1; an even split is
  `pipeline_parallel_layers_per_stage` with no embedding/output weighting, and
  with the embedding (loss) counted as a layer the same split with
  `pipeline_parallel_first_stage_less_layers` (`..._last_stage_less_layers`) 1:
  torchtitan's `generate_llm_fqn_per_model_part` then gives the first (last)
  virtual stage one layer fewer, as Megatron does. Uneven first/last counts and
  an explicit `stage_layers` split (per pipeline rank or per virtual stage) spell out
  `module_fqns_per_model_part`, one list per virtual stage (model part) in schedule
  order, in torchtitan's Llama module names (`tok_embeddings`, `layers.N`, `norm`,
  `output`); a model part with no module (an empty middle virtual stage, which
  Megatron's layouts allow) is refused: torchtitan builds each stage from its modules.
- Batch: with pp > 1 each data-parallel rank's `local_batch_size` is split into
  `pipeline_parallel_microbatch_size` micro-batches; without pp,
  `local_batch_size` is the micro-batch and torchtitan accumulates gradients
  over `global_batch_size / (local_batch_size·dp)` steps.
- Recompute: selective is op-level selective checkpointing; full of every layer
  is `full`; full of k of n layers per chunk is `selective` with every
  (n/k)-th layer, when n/k is whole and every pipeline chunk has the same n
  (torchtitan counts layers across a rank's chunks with one frequency, so an
  uneven split would recompute more layers than planned on the larger stages:
  refused).
- fp8 is torchao float8 training with tensorwise scaling (torchao has no
  delayed scaling); fp16 is refused (torchtitan trains in bf16 or fp32).
- MoE: `expert_parallel_degree` = ep and `expert_tensor_parallel_degree` = etp.
  torchtitan's ParallelDims takes etp = 1 or etp = tp with ep > 1, and without
  ep it shards experts over the whole tp mesh (etp must be tp); the expert ranks
  come from dp_shard·cp·tp, so ep > 1 always uses FSDP (dp_shard), never DDP
  replication. MoE, latent-attention and window shapes live in torchtitan's
  model flavors (deepseek_v3, llama4, qwen3, gpt_oss); the notes list them.
- compile: the model and the loss run under torch.compile (`[compile] enable`,
  components model and loss) when the plan's `torch_compile` is on (the default),
  because the cost model then times the element-wise work (norms, activation,
  rotary embedding, FP8 casts) as fused kernels; a plan costed with
  torch_compile false (torchtitan's eager operators, its own default) gets
  `[compile] enable = false`.
- offload_optimizer is refused: torchtitan's `enable_cpu_offload` is FSDP's
  CPU offload of parameters, gradients and optimizer states together. So is
  offload_activation_layers: torchtitan has no activation offloading (that same
  switch is its only CPU offload). So is multi-token prediction (no torchtitan
  model has MTP modules).
- An interleaved schedule overlaps its transfers (torch.distributed.pipelining posts
  each receive as soon as its sender has computed); a plan that turns
  overlap_p2p_comm off with vpp > 1 is refused (nothing in torchtitan blocks on them).
"""

from __future__ import annotations

from typing import Any

from planner.emit.base import REGISTRY, EmitOptions, NotExpressibleError, PlanFacts, check_plan, describe
from planner.emit.quoting import comment, toml_key, toml_value
from planner.specs import Plan

FRAMEWORK = "torchtitan"
RUNS = "torchtitan"  # the TrainSpec.framework whose costs describe its run
CONFIG_PATH = "meshplan_torchtitan.toml"

#: meshplan model preset -> torchtitan (model.name, model.flavor)
MODEL_FLAVORS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"), "llama3.1-405b": ("llama3", "405B")}
#: torchtitan llama3's norm epsilon (TransformerModelArgs.norm_eps, fixed in its flavors; the job TOML has no key)
FLAVOR_NORM_EPSILON = 1e-5
FLOAT8_CONVERTER = "quantize.linear.float8"
FLOAT8_RECIPE = "tensorwise"


def job_config(plan: Plan) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(TOML sections, notes). Section and key names are torchtitan's JobConfig fields."""
    f = check_plan(plan, FRAMEWORK)
    t, m = f.train, plan.model
    notes: list[str] = []

    def refuse(reason: str) -> None:
        raise NotExpressibleError(FRAMEWORK, reason)

    if t.precision == "fp16":
        refuse("precision 'fp16'; torchtitan trains in bf16 (FSDP mixed precision) or fp32")
    if t.precision == "nvfp4":
        refuse("precision 'nvfp4'; the plan is costed as Transformer Engine's NVFP4 recipe, which torchtitan does "
               "not run (its low-precision converters are torchao's)")
    s = f.strategy
    if s.offload_optimizer:
        refuse("offload_optimizer; torchtitan's only CPU offload (training.enable_cpu_offload, FSDP's) moves "
               "parameters and gradients to the host too, not the optimizer alone")
    if s.offload_activation_layers:
        refuse(f"offload_activation_layers ({s.offload_activation_layers}); torchtitan has no activation offloading "
               "(training.enable_cpu_offload is FSDP's offload of parameters, gradients and optimizer states)")
    if m.num_mtp_layers:
        refuse(f"num_mtp_layers ({m.num_mtp_layers}); torchtitan's models have no multi-token-prediction module")
    if m.is_moe and s.ep > 1 and s.etp not in (1, s.tp):
        refuse(f"etp ({s.etp}) with ep ({s.ep}) > 1 must be 1 or tp ({s.tp}); torchtitan's ParallelDims supports "
               "ETP=TP or ETP=1 only")
    if m.is_moe and s.ep == 1 and s.etp != s.tp:
        refuse(f"etp ({s.etp}) with ep 1 must equal tp ({s.tp}); without expert parallelism torchtitan shards "
               "experts over the tensor-parallel mesh")
    if t.fp8_param_gather:
        refuse("fp8_param_gather; it is Megatron's --fp8-param-gather, and the emitted torchtitan job keeps bf16 "
               "weights (torchao's FSDP2 float8 all-gather is neither emitted nor costed)")
    if t.cross_entropy_fusion:
        notes.append("cross_entropy_fusion: the plan was costed with a fused cross-entropy, which torchtitan does not "
                     "run (its loss is PyTorch's cross_entropy over fp32 logits); plan with framework torchtitan "
                     "and without --cross-entropy-fusion to cost what this job runs")
    if t.attention_kernel == "flash2":
        notes.append("attention_kernel flash2: the plan is timed with FlashAttention-2, the kernel PyTorch's SDPA "
                     "runs on Hopper when cuDNN is not first in its backend list (torch before 2.11, torchtitan "
                     "before it listed cuDNN first); the torchtitan this job targets lists cuDNN first, so it may "
                     "run faster than planned")
    if t.attention_kernel == "flash1":
        notes.append("attention_kernel flash1: the plan is timed with FlashAttention v1 (or a Triton kernel of its "
                     "era), which PyTorch's SDPA no longer has; this job runs cuDNN or FlashAttention-2 and may run "
                     "faster than planned")
    if t.grad_precision not in ("fp32",):
        notes.append(f"grad_precision {t.grad_precision}: torchtitan reduces gradients in float32 "
                     "(training.mixed_precision_reduce allows only float32)")
    sections: dict[str, dict[str, Any]] = {}
    name_flavor = MODEL_FLAVORS.get(m.name)
    if name_flavor:
        sections["model"] = {"name": name_flavor[0], "flavor": name_flavor[1]}
        if m.norm_epsilon != FLAVOR_NORM_EPSILON:
            notes.append(f"norm epsilon: model {m.name}'s is {m.norm_epsilon:g}, torchtitan's {name_flavor[0]} "
                         f"{name_flavor[1]} uses {FLAVOR_NORM_EPSILON:g} (its model args' norm_eps, which the job "
                         "file cannot set)")
    else:
        notes.append(f"model {m.name}: set [model] name/flavor to a torchtitan model with {m.num_layers} layers, "
                     f"hidden {m.hidden_size}, {m.num_attention_heads} heads, {m.kv_heads} KV heads, "
                     f"norm epsilon {m.norm_epsilon:g}")
        notes += _architecture_notes(m)
    if t.precision == "fp8":
        sections.setdefault("model", {})["converters"] = [FLOAT8_CONVERTER]
        sections["quantize"] = {"linear": {"float8": {"recipe_name": FLOAT8_RECIPE}}}
        notes.append("fp8: torchao float8 with tensorwise (dynamic) scaling; torchao has no delayed scaling")
    sections["training"] = _training(f)
    # fused element-wise work (torch_compile true) or torchtitan's eager operators (false), as costed
    sections["compile"] = ({"enable": True, "components": ["model", "loss"]} if t.torch_compile
                           else {"enable": False})
    sections["parallelism"] = _parallelism(f, notes)
    sections["activation_checkpoint"] = _recompute(f, refuse)
    if f.strategy.overlap_moe_comm:
        refuse("overlap_moe_comm; torchtitan does not overlap the expert all-to-all with another micro-batch")
    if f.strategy.vpp > 1 and not f.strategy.overlap_p2p_comm:
        refuse("overlap_p2p_comm off with vpp > 1; torch.distributed.pipelining's interleaved runtime always posts "
               "receives ahead of the compute that needs them")
    if f.model.is_moe and t.moe_dispatcher != "alltoall":
        refuse(f"moe_dispatcher {t.moe_dispatcher}; the emitted job dispatches MoE tokens with torchtitan's "
               "all-to-all, which the plan does not cost as the flex dispatcher")
    return sections, notes


def _architecture_notes(m) -> list[str]:
    """What the torchtitan model chosen for an MoE, latent-attention, windowed, query/key-normed or non-SwiGLU model
    must have."""
    notes = []
    if m.is_moe:
        dense = m.moe_layer_mask().count(False)
        notes.append(f"MoE: {m.num_experts} routed experts of width {m.expert_ffn}, top-{m.moe_top_k}, "
                     f"{m.num_shared_experts} shared, {dense} dense layers (torchtitan's MoE models: deepseek_v3, "
                     "llama4, qwen3, gpt_oss)")
    if m.is_mla:
        notes.append(f"latent attention: q_lora_rank {m.q_lora_rank}, kv_lora_rank {m.kv_lora_rank} "
                     "(torchtitan's deepseek_v3)")
    if any(m.local_attention_mask()):
        notes.append(f"sliding window {m.sliding_window} on {m.local_attention_mask().count(True)} of "
                     f"{m.num_layers} layers (torchtitan's gpt_oss)")
    if m.qk_norm == "per_head":
        notes.append("query/key norms: an RMSNorm over each head's query and key (torchtitan's qwen3)")
    elif m.qk_norm == "full":
        notes.append("query/key norms over all query heads together and all key heads together (OLMo 2): none of "
                     "torchtitan's models has them, so the chosen model must add them")
    if m.glu_settings():
        clamp = f", both branches clamped at {m.glu_clamp:g}" if m.glu_clamp is not None else ""
        offset = f", the linear branch offset by {m.glu_linear_offset:g}" if m.glu_linear_offset else ""
        notes.append(f"gated MLP: the gate's activation is {m.glu_activation}{offset}{clamp} (torchtitan's llama3 and "
                     "qwen3 gate with SiLU; its gpt_oss has gpt-oss's)")
    return notes


def _training(f: PlanFacts) -> dict[str, Any]:
    s, t = f.strategy, f.train
    local = f.local_batch_size() if s.pp > 1 else s.micro_batch_size
    out: dict[str, Any] = {"local_batch_size": local, "global_batch_size": t.global_batch_size, "seq_len": t.seq_len,
                           "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"}
    return out


def _parallelism(f: PlanFacts, notes: list[str]) -> dict[str, Any]:
    s = f.strategy
    # Expert parallelism draws its ranks from the FSDP (dp_shard), cp and tp ranks, never from
    # dp_replicate (torchtitan's ParallelDims: efsdp = dp_shard·cp·tp / (ep·etp)).
    model_parallel = s.tp > 1 or s.pp > 1 or s.cp > 1 or s.ep > 1
    out: dict[str, Any] = {}
    if s.zero_stage == 0 and not model_parallel:
        out |= {"data_parallel_replicate_degree": f.dp, "data_parallel_shard_degree": 1}
    else:
        out |= {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": f.dp,
                "fsdp_reshard_after_forward": "always" if s.zero_stage == 3 else "never"}
        if s.zero_stage == 0:
            notes.append("zero_stage 0 with tp/pp/cp/ep: torchtitan has no DDP beside model parallelism; FSDP without "
                         "resharding moves the same bytes and shards optimizer states and gradients")
        elif s.zero_stage == 1:
            notes.append("zero_stage 1: FSDP without resharding also shards gradients (ZeRO-2), which only saves memory")
    out |= {"tensor_parallel_degree": s.tp, "context_parallel_degree": s.cp, "pipeline_parallel_degree": s.pp,
            "expert_parallel_degree": s.ep, "expert_tensor_parallel_degree": s.etp}
    if s.tp > 1 and not s.sequence_parallel:
        notes.append("tp without sequence_parallel: torchtitan's tensor parallelism always shards norms along the "
                     "sequence (less activation memory, same communication volume)")
    if s.pp > 1:
        out |= {"pipeline_parallel_schedule": "Interleaved1F1B" if s.vpp > 1 else "1F1B",
                "pipeline_parallel_microbatch_size": s.micro_batch_size}
        if f.uneven or s.stage_layers is not None:
            out["module_fqns_per_model_part"] = _model_parts(f)
        else:
            # Every virtual stage holds the same number of layers once the embedding and the loss
            # count as layers (when they do): the first chunk's layers plus its embedding.
            emb, loss = int(s.embedding_as_layer), int(s.loss_as_layer)
            out |= {"pipeline_parallel_layers_per_stage": f.layers_per_chunk()[0] + emb,
                    "pipeline_parallel_first_stage_less_layers": emb, "pipeline_parallel_last_stage_less_layers": loss}
    return out


def _model_parts(f: PlanFacts) -> list[list[str]]:
    """Module names of each virtual stage, in stage order (embedding first, norm and output last)."""
    parts: list[list[str]] = []
    layer = 0
    for n in f.layers_per_chunk():
        parts.append([f"layers.{i}" for i in range(layer, layer + n)])
        layer += n
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    empty = [j for j, part in enumerate(parts) if not part]
    if empty:
        raise NotExpressibleError(FRAMEWORK, f"stage_layers {f.strategy.stage_layers}: virtual stages {empty} hold no "
                                  "module; torchtitan builds every pipeline stage (model part) from its modules")
    return parts


def _recompute(f: PlanFacts, refuse) -> dict[str, Any]:
    s = f.strategy
    if s.recompute == "none":
        return {"mode": "none"}
    if s.recompute == "selective":
        if s.recompute_modules and s.recompute_modules != ["core_attn"]:
            refuse(f"recompute_modules {s.recompute_modules}; torchtitan's selective checkpointing is per operator "
                   "or per layer, not per Megatron module")
        return {"mode": "selective", "selective_ac_option": "op"}
    if s.recompute_num_layers is None:
        return {"mode": "full"}
    chunks = f.layers_per_chunk()
    if len(set(chunks)) > 1:
        refuse(f"recompute_num_layers ({s.recompute_num_layers}) with pipeline chunks of {min(chunks)} to "
               f"{max(chunks)} layers; torchtitan checkpoints every N-th layer with one N for every stage, so "
               f"stages of different sizes cannot each recompute {s.recompute_num_layers} layers")
    chunk = chunks[0]
    if chunk == 0 or chunk % s.recompute_num_layers:
        refuse(f"recompute_num_layers ({s.recompute_num_layers}) of {chunk} layers per chunk; torchtitan checkpoints "
               "every N-th layer, so the count must divide the layers per chunk")
    every = chunk // s.recompute_num_layers
    return {"mode": "full"} if every == 1 else {"mode": "selective", "selective_ac_option": str(every)}


# ---- TOML ----------------------------------------------------------------------------
def _toml_table(prefix: str, table: dict[str, Any], out: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    if scalars:
        out.append(f"[{prefix}]")
        out += [f"{toml_key(k)} = {toml_value(v)}" for k, v in scalars.items()]
        out.append("")
    for key, sub in table.items():
        if isinstance(sub, dict):
            _toml_table(f"{prefix}.{toml_key(key)}", sub, out)


def to_toml(plan: Plan) -> str:
    sections, notes = job_config(plan)
    out = [comment("# torchtitan ", describe(plan, RUNS)),
           f"# run: torchrun ... -m torchtitan.train --job.config_file {CONFIG_PATH}"]
    out += [comment("# note: ", n) for n in notes]
    out.append("")
    for name, table in sections.items():
        _toml_table(toml_key(name), table, out)
    return "\n".join(out).rstrip("\n") + "\n"


class TorchtitanEmitter:
    name = "torchtitan"
    framework = FRAMEWORK
    runs = RUNS
    syntax = "toml"

    def data(self, plan: Plan, options: EmitOptions) -> dict[str, Any]:
        sections, notes = job_config(plan)
        return {"config": sections, "notes": notes}

    def render(self, plan: Plan, options: EmitOptions) -> str:
        return to_toml(plan)


REGISTRY.register(TorchtitanEmitter())
