"""LoRA adapters' shapes and parameter counts from a ModelSpec and a TrainSpec (pure arithmetic, no cost model):
what peft's LoraConfig(r, target_modules, layers_to_transform) adds to a Hugging Face Llama-style model. The cost
model (cost_models.finetune) and the labels both read them."""

from __future__ import annotations


def module_shapes(model) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one transformer layer, by its Hugging Face Llama name."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q, k = model.q_width, model.kv_width
    shapes = {"q_proj": (h, q), "k_proj": (h, k), "v_proj": (h, k), "o_proj": (q, h),
              "up_proj": (h, f), "down_proj": (f, h)}
    if model.gated_mlp:
        shapes["gate_proj"] = (h, f)
    return shapes


def targets(model, train) -> tuple[str, ...]:
    """The adapted modules of each adapted layer: lora_target_modules, or every linear layer the model has."""
    shapes = module_shapes(model)
    given = train.lora_target_modules
    return tuple(t for t in shapes if given is None or t in given)


def adapted_layers(model, train) -> list[int]:
    """The transformer layers (0-based) that get adapters."""
    return sorted(train.lora_layers) if train.lora_layers is not None else list(range(model.num_layers))


def adapter_params_per_layer(model, train) -> int:
    """Trainable parameters of one adapted layer: r·(in + out) for each adapted module."""
    shapes = module_shapes(model)
    return sum(train.lora_rank * (shapes[t][0] + shapes[t][1]) for t in targets(model, train))


def adapter_params(model, train) -> int:
    """Trainable parameters of the whole model (what peft's get_nb_trainable_parameters reports), 0 without
    adapters."""
    if not train.adapters:
        return 0
    return adapter_params_per_layer(model, train) * len(adapted_layers(model, train))


