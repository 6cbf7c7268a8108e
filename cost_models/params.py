"""Parameter counts of a model (elements), read from its cost blocks (`cost_models.blocks`).

The counts are the blocks' own `params()`: one definition of each weight serves the memory model,
the FLOP counts and these totals. The vocabulary is unpadded (padding is a layout choice,
`cost_models.layout`). Symbols: L = layers, h = hidden, v = vocabulary.

    >>> from profiles import load_model
    >>> num_params(load_model("llama3-8b"))                 # Llama 3 8B: 8,030,261,248 (Hugging Face safetensors)
    8030261248
    >>> round(num_params(load_model("deepseek-v3"), include_mtp=False) / 1e9)   # DeepSeek-V3: 671B
    671
"""

from __future__ import annotations

from cost_models.blocks import model_blocks
from planner.specs.model import ModelSpec


def layer_params(model: ModelSpec) -> int:
    """The average transformer layer of the main stack: attention + MLP or MoE + norms."""
    b = model_blocks(model)
    return round(sum(n * layer.params() for layer, n in b.layers) / b.num_layers)


def embedding_params(model: ModelSpec) -> int:
    """Word embedding plus learned position table (input side), unpadded."""
    return model_blocks(model).embedding.params()


def mtp_params(model: ModelSpec) -> int:
    """The multi-token-prediction modules (they share the embedding and the output head)."""
    return sum(m.params() for m in model_blocks(model).mtp)


def num_params(model: ModelSpec, include_mtp: bool = True) -> int:
    """Total unique parameters (elements), vocabulary unpadded; `include_mtp=False` gives the
    main model only (DeepSeek-V3's published 671B excludes its 14B MTP module)."""
    b = model_blocks(model)
    main = sum(n * layer.params() for layer, n in b.layers) + b.embedding.params() + b.head.params()
    return main + (sum(m.params() for m in b.mtp) if include_mtp else 0)


def expert_params(model: ModelSpec) -> int:
    """Routed-expert parameters of the whole model (what expert parallelism shards)."""
    b = model_blocks(model)
    return sum(n * layer.expert_params() for layer, n in b.layers) + sum(m.expert_params() for m in b.mtp)


def num_active_params(model: ModelSpec, include_mtp: bool = False) -> int:
    """Parameters one token uses: everything but the routed experts it is not sent to
    (the published 'active' count: router, shared experts and top-k routed experts)."""
    b = model_blocks(model)
    main = sum(n * layer.active_params() for layer, n in b.layers) + b.embedding.params() + b.head.params()
    return main + (sum(m.active_params() for m in b.mtp) if include_mtp else 0)
