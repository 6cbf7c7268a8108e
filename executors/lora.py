"""LoRA adapters on the executor's model with peft, as `finetune: lora` and `qlora` plans train them (torch,
peft and bitsandbytes lazily).

The plan names its adapters by the Hugging Face Llama module names (`TrainSpec.lora_target_modules`);
`executor_targets` maps them onto this model's module tree (executors.model):

    q_proj -> attn.wq   k_proj -> attn.wk   v_proj -> attn.wv   o_proj -> attn.wo
    gate_proj -> mlp.w1 (gated MLP: w1 is the gate, w3 the linear branch)
    up_proj -> mlp.w3 (gated MLP) or mlp.w1 (plain MLP, which has no gate)
    down_proj -> mlp.w2

`apply_lora` does what a peft fine-tuning run does to a Hugging Face model loaded in 16 bits: the whole
base model in the plan's 16-bit dtype (bf16 or fp16: `torch_dtype` of `from_pretrained`), frozen, and a
`LoraConfig` (r, lora_alpha, target modules, `layers_to_transform`) applied by `get_peft_model`, whose
adapters are kept in fp32 (`autocast_adapter_dtype`, adapter_precision fp32) or in the base dtype
(adapter_precision bf16). peft finds a layer's index by the pattern `.*\\.layers\\.(\\d+)\\.` in the module's
name, which needs a parent name before `layers` (Hugging Face's `model.layers.<i>`); the executor's layers
sit at the top (`layers.<i>`), so the model is handed to peft inside a holder whose only child is `model`,
and `layers_pattern` is "layers". peft replaces the adapted linear layers in place: the executor keeps
running its own model (its `layers` and their modules keep their names, each adapted linear now a
`lora.Linear` holding `base_layer`, `lora_A`, `lora_B`).

QLoRA (`quantize_base`, before the adapters): the transformer layers' linear layers in bitsandbytes' NF4
`Linear4bit`, the rest of the model 16-bit; FSDP2 leaves those 4-bit weights whole (executors.parallelize).

Adapter dropout is off in the executor whatever `lora_dropout` says (parity with the single-process
reference needs a deterministic forward, as the model's own dropout); the run's notes say so.
Adapters are drawn from `seed + ADAPTER_SEED_OFFSET`, so every rank and the reference start alike; lora_B
starts at zero (peft's default), so the first step's loss is the base model's and only the update shows
whether the adapters train alike.
"""

from __future__ import annotations

from planner.specs import ModelSpec, TrainSpec
from planner.specs.adapters import adapted_layers, targets  # the planner's own count of what peft adapts

ADAPTER_SEED_OFFSET = 7919
"""Added to the run's seed before peft draws the adapters (lora_A), so that the adapters do not
repeat the draws of the base weights, which start from the seed itself."""

ATTENTION_TARGETS = {"q_proj": "attn.wq", "k_proj": "attn.wk", "v_proj": "attn.wv", "o_proj": "attn.wo"}
"""Hugging Face Llama attention projections -> this model's modules (executors.model.Attention)."""


def mlp_targets(model: ModelSpec) -> dict[str, str]:
    """Hugging Face MLP projection names -> this model's modules: a gated MLP computes
    w2(act(w1 x) * w3 x) (executors.moe.MLP), so w1 is the gate and w3 the up projection;
    a plain MLP w2(act(w1 x)) has an up projection w1 and no gate."""
    if model.gated_mlp:
        return {"gate_proj": "mlp.w1", "up_proj": "mlp.w3", "down_proj": "mlp.w2"}
    return {"up_proj": "mlp.w1", "down_proj": "mlp.w2"}


def executor_targets(model: ModelSpec, train: TrainSpec) -> list[str]:
    """The plan's adapted modules as this model's module names (peft's target_modules)."""
    known = ATTENTION_TARGETS | mlp_targets(model)
    missing = [name for name in train.lora_target_modules or () if name not in known]
    if missing:
        raise ValueError(f"lora_target_modules {missing}: model {model.name!r} has no such linear layer "
                         f"(it has {sorted(known)})")
    return [known[name] for name in targets(model, train)]


def lora_notes(train: TrainSpec, zero_stage: int) -> list[str]:
    """How the executor's LoRA / QLoRA run differs from the plan, in words (empty when it does not)."""
    notes = []
    if train.adapters and train.lora_dropout > 0:
        notes.append(f"lora_dropout {train.lora_dropout} -> 0 (loss parity needs a deterministic forward)")
    if train.finetune == "qlora" and zero_stage >= 2:
        notes.append("4-bit base weights whole on every rank (FSDP2 ignored_params: a shard of bitsandbytes' "
                     "Params4bit storage loses its quantisation constants); the adapters are sharded")
    if train.finetune == "qlora" and train.paged_optimizer:
        notes.append("paged_optimizer: torch's Adam over the adapters (no paged states)")
    return notes


def apply_lora(module, model: ModelSpec, train: TrainSpec, seed: int):
    """Freeze `module` (an executors.model.Transformer) in the plan's 16-bit dtype and add the plan's
    LoRA adapters in place; returns the PeftModel around it (for peft's own accounting; the executor
    trains `module` itself). Raises ValueError when peft adapted other modules than the plan names."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    base_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[train.precision]
    for param in module.parameters():  # the buffers (rope tables) stay fp32, as Hugging Face keeps inv_freq
        if type(param).__name__ != "Params4bit":  # a QLoRA base's 4-bit storage keeps its dtype
            param.data = param.data.to(base_dtype)
    holder = torch.nn.Module()
    holder.model = module  # names become model.layers.<i>...: peft's layer-index pattern finds <i>
    layers = adapted_layers(model, train)
    config = LoraConfig(r=train.lora_rank, lora_alpha=train.effective_lora_alpha, lora_dropout=0.0,
                        target_modules=executor_targets(model, train), layers_to_transform=layers,
                        layers_pattern="layers", bias="none")
    torch.manual_seed(seed + ADAPTER_SEED_OFFSET)
    peft_model = get_peft_model(holder, config, autocast_adapter_dtype=train.adapter_precision == "fp32")
    adapter_dtype = torch.float32 if train.adapter_precision == "fp32" else torch.bfloat16
    for name, param in module.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(adapter_dtype)
    adapted = sorted(name for name, sub in module.named_modules() if isinstance(sub, LoraLayer))
    expected = sorted(f"layers.{i}.{target}" for i in layers for target in executor_targets(model, train))
    if adapted != expected:
        raise ValueError(f"peft adapted {adapted[:4]}... ({len(adapted)} modules), the plan names "
                         f"{expected[:4]}... ({len(expected)})")
    return peft_model


def quantize_base(module, train: TrainSpec) -> int:
    """QLoRA's base: every linear layer of the transformer layers (attention and MLP projections) replaced
    by bitsandbytes' `Linear4bit` in NF4 with the plan's 16-bit compute dtype and, with qlora_double_quant,
    quantised absmax constants (bitsandbytes' compress_statistics); the embeddings, norms and output layer
    stay 16-bit, as `BitsAndBytesConfig(load_in_4bit=True)` leaves the output layer. The weights are
    quantised when moved to the device (`Params4bit.to`), the same function of the same seeded weights on
    every rank. Returns the number of layers quantised."""
    import bitsandbytes as bnb
    import torch
    from torch import nn

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[train.precision]
    count = 0
    for layer in module.layers.values():
        for parent in (layer.attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=dtype, compress_statistics=train.qlora_double_quant,
                                              quant_type="nf4")
                quantized.weight = bnb.nn.Params4bit(child.weight.data.to(dtype), requires_grad=False,
                                                     compress_statistics=train.qlora_double_quant, quant_type="nf4")
                if child.bias is not None:
                    quantized.bias = nn.Parameter(child.bias.data.to(dtype), requires_grad=False)
                setattr(parent, name, quantized.to("cpu"))  # quantises the weight (Params4bit.to)
                count += 1
    return count


def four_bit_params(module) -> set:
    """The 4-bit base weights (bitsandbytes Params4bit: uint8 storage with a quant_state beside it), which
    FSDP2 must leave whole: a shard of the storage would lose its quantisation constants."""
    return {p for p in module.parameters() if type(p).__name__ == "Params4bit"}


def prepare_adapters(module, model: ModelSpec, train: TrainSpec, seed: int):
    """The base and adapters of a finetune lora / qlora plan on `module` (apply_lora, after quantize_base
    for qlora); the PeftModel around it, or None for other plans."""
    if not train.adapters:
        return None
    if train.finetune == "qlora":
        quantize_base(module, train)
    return apply_lora(module, model, train, seed)


def trainable_numel(module) -> int:
    """Parameter elements of `module` that train (requires_grad): under LoRA, the adapters."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
