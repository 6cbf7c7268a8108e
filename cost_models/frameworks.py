"""What the training framework that runs a plan does with it, per candidate: its profile
(`profiles.frameworks.Framework`, from the GPU's resolved tables, `GpuSpec.tables.frameworks`) and the
candidates its `cannot_run` rules refuse."""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from cost_models.layout import ParallelLayout
from planner.errors import SpecError
from profiles.frameworks import CannotRun, Framework

_OPS = {"==": np.equal, "!=": np.not_equal, ">=": np.greater_equal, "<=": np.less_equal, ">": np.greater,
        "<": np.less}
#: Words a `cannot_run` condition may compare categorical fields with.
_WORDS = {"none": 0, "selective": 1, "full": 2}


def framework_of(train, tables) -> Framework:
    """The profile of the framework `train` runs on (megatron when the spec has no such field), from the
    resolved `tables` (`GpuSpec.tables`)."""
    return tables.framework(getattr(train, "framework", "megatron"))


def zero3_impl_of(train, tables) -> str:
    """The ZeRO-3 implementation that costs a zero_stage 3 plan: the framework's own, else TrainSpec's."""
    return framework_of(train, tables).zero3_impl or getattr(train, "zero3_impl", "fsdp2")


def _names(model, train, st, lay) -> dict[str, object]:
    """What a `cannot_run` condition may name: the Strategy fields and a few derived facts."""
    out: dict[str, object] = {f.name: getattr(st, f.name) for f in fields(st) if f.name != "stage_layers"}
    is_moe = bool(getattr(model, "num_experts", 0))
    even = ((st.num_layers_in_first_stage == 0) & (st.num_layers_in_last_stage == 0) & ~st.embedding_as_layer
            & ~st.loss_as_layer & ~np.any(st.stage_layers > 0, axis=1))
    n = np.where(st.recompute_num_layers > 0, st.recompute_num_layers, 1)
    chunk = lay.rows.chunk_layers
    divides = np.all((chunk > 0) & (np.mod(chunk, n) == 0), axis=0)
    out |= {"is_moe": np.bool_(is_moe), "is_mla": np.bool_(bool(getattr(model, "is_mla", False))),
            "local_attention": np.bool_(any(model.local_attention_mask()) if hasattr(model, "local_attention_mask")
                                        else False),
            "qk_norm": np.bool_(getattr(model, "qk_norm", "none") != "none"),
            "mtp": np.bool_(bool(getattr(model, "num_mtp_layers", 0))), "even_split": even,
            "recompute_layers_divide_chunks": divides, "chunks_equal": chunk.max(axis=0) == chunk.min(axis=0),
            "ep_divides_dp": st.dp % st.ep == 0,
            "moe_plugin": is_moe & ((st.ep > 1) | (st.tp > 1) | (st.pp > 1)),
            "precision": train.precision, "grad_precision": train.grad_precision,
            "attention_kernel": train.attention_kernel, "fp8_recipe": getattr(train, "fp8_recipe", "delayed"),
            "fp8_param_gather": np.bool_(bool(getattr(train, "fp8_param_gather", False))),
            "moe_dispatcher": getattr(train, "moe_dispatcher", "alltoall")}
    return out


def _value(word: str, names: dict[str, object]):
    if word in names:
        return names[word]
    if word in _WORDS:
        return _WORDS[word]
    try:
        return int(word)
    except ValueError:
        return word  # a precision or kernel name, compared as text


def cannot_run_masks(framework: Framework, model, train, st) -> list[tuple[CannotRun, np.ndarray]]:
    """Each of the framework's `cannot_run` rules with the candidates it refuses (bool (N,) arrays)."""
    if not framework.cannot_run:
        return []
    names = _names(model, train, st, ParallelLayout.of(st, model.num_layers))
    n = len(st.tp)
    out = []
    for rule in framework.cannot_run:
        hit = np.ones(n, dtype=bool)
        for negate, name, op, word in rule.clauses:
            if name not in names:
                raise SpecError(f"framework {framework.name}: cannot_run names unknown {name!r}")
            left = names[name]
            term = np.asarray(left, dtype=bool) if op is None else _OPS[op](left, _value(word, names))
            hit = hit & np.broadcast_to(~term if negate else term, (n,))
        out.append((rule, hit))
    return out
