"""ZeRO-3 / FSDP: the parameter gathers and gradient reduce-scatters of fully sharded data
parallelism, and how much of them the layers' compute hides.

Every micro-batch, each layer's weights are all-gathered before its forward and again before
its backward (the forward's copy was freed: FSDP2's `reshard_after_forward`, DeepSpeed's
default), and its gradients are reduce-scattered after its backward (Rajbhandari et al. SC'20
Sec. 5.3; Zhao et al. VLDB 2023 Sec. 3). Both frameworks prefetch: the gather of the next layer
runs on a side stream while the current layer computes (FSDP2: one module ahead, implicit in
forward and explicit in backward; DeepSpeed: parameters in trace order up to
`stage3_prefetch_bucket_size`). In steady state the prefetch depth does not change what sticks
out, only the ratio of the traffic to the compute does, so per layer and micro-batch:

    forward   max(0, G - F)           G: one layer's gather, F: its forward
    backward  max(0, G + R - B)       R: its reduce-scatter, B: its backward (+ recompute);
                                      the next layer's gather and the previous layer's
                                      reduce-scatter share the links during this layer's backward

(each through `exposed_s`, so the cluster's `overlap_efficiency` applies: `comm_overlap` less the
compute slowdown while NCCL shares the SMs, as for every other overlapped collective), plus what nothing hides:
the first layer's gather and the embedding/head gathers at the start of every micro-batch's
forward, and the last reduce-scatters after the step's final backward. The tier a group crosses
is the comm model's: a group inside an NVLink domain runs at NVLink rate, one that spans NVLink
domains (servers on DGX/HGX systems, racks on NVL72) at the NICs its members reach.

The implementations differ (profiles/frameworks/zero3.yaml):
- FSDP2 copies the gathered buffer into the unsharded parameters on the compute stream
  (`split_with_sizes_copy`): a read and a write of the gathered bytes at HBM speed, per gather.
- DeepSpeed ZeRO-3 (as measured in 2021, SC'21 Table 2) moved its traffic across nodes far
  slower than NCCL rings allow: a fitted fraction of one NIC per rank, applied to a group that
  spans NVLink domains (`collective_s`; the measured nodes were each one domain).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import yaml

if TYPE_CHECKING:  # read by attribute only
    from cost_models.step import PerLayerTimes, Setup

ZERO3_IMPLS = ("fsdp2", "deepspeed")
#: Bytes an element copy moves: one read and one write.
READ_PLUS_WRITE = 2


@dataclass(frozen=True)
class Zero3Impl:
    """What one ZeRO-3 implementation costs beyond the collectives themselves."""

    name: str
    copy_out: bool  # the gathered buffer is copied into the parameters on the compute stream
    cross_node_nic_fraction: float | None  # None: collectives at the comm model's rate


@lru_cache(maxsize=1)
def zero3_impls() -> dict[str, Zero3Impl]:
    """The implementations of profiles/frameworks/zero3.yaml, parsed once; every number there
    must name its source (`<field>_source`)."""
    from profiles import PROFILES_DIR

    path = PROFILES_DIR / "frameworks" / "zero3.yaml"
    doc = yaml.safe_load(path.read_text())
    out = {}
    for name in ZERO3_IMPLS:
        entry = doc[name]
        for key, value in entry.items():
            if not key.endswith("_source") and not str(entry.get(f"{key}_source", "")).strip():
                raise ValueError(f"{path}: {name}.{key} ({value!r}) names no source ({key}_source)")
        fraction = entry.get("cross_node_nic_fraction")
        out[name] = Zero3Impl(name, bool(entry["copy_out"]), None if fraction is None else float(fraction))
    return out


def collective_s(s: Setup, impl: Zero3Impl, nbytes, size, stride) -> np.ndarray:
    """One ZeRO-3 all-gather or reduce-scatter of `nbytes` (full size) over `size` ranks
    `stride` apart, seconds, as `impl` runs it."""
    t = s.comm.gather_scatter_s(nbytes, size, stride)
    if impl.cross_node_nic_fraction is None:
        return t
    domain = s.cluster.domain_size
    crosses = np.asarray(size) * np.asarray(stride) > domain
    # stride >= domain: one member per domain, so the comm model's rate is one NIC per rank
    per_nic = s.comm.gather_scatter_s(nbytes, size, np.maximum(stride, domain)) / impl.cross_node_nic_fraction
    return np.where(crosses, np.maximum(t, per_nic), t)


def per_layer_exposed_s(gather_s, reduce_s, fwd_s, bwd_s, overlap_gather, overlap_reduce, overlap: float):
    """Exposed ZeRO-3 communication of one layer and micro-batch (forward + backward), seconds.

    Never negative and never more than the layer's whole traffic 2·G + R:

    >>> float(per_layer_exposed_s(1.0, 2.0, 0.5, 4.0, True, True, 1.0))  # forward 0.5 out, backward hidden
    0.5
    >>> float(per_layer_exposed_s(1.0, 2.0, 0.5, 4.0, False, True, 1.0))  # no prefetch: both gathers out
    2.0
    """
    from cost_models.step import exposed_s

    fwd = np.where(overlap_gather, exposed_s(gather_s, fwd_s, overlap), gather_s)
    hide = np.where(overlap_gather, gather_s, 0.0) + np.where(overlap_reduce, reduce_s, 0.0)
    bwd = exposed_s(hide, bwd_s, overlap) + (gather_s + reduce_s - hide)
    return fwd + bwd


def zero3_comm_s(s: Setup, pl: PerLayerTimes, recompute_share: np.ndarray, impl_name: str = "fsdp2"
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, raw) ZeRO-3 time of one step on each stage row (S, N), seconds.

    `recompute_share` (S, N): share of each row's layers whose backward repeats the forward
    (a longer window for the backward's traffic). Exposed includes FSDP2's copy-out, which is
    compute-stream work caused by the sharding; raw is the traffic before any overlap.
    """
    from cost_models.memory import kind_expert_params_per_rank, kind_params_per_rank, param_gather_saving_per_element
    from cost_models.step import spread
    from cost_models.units import DTYPE_BYTES, WEIGHT_BYTES

    impl = zero3_impls()[impl_name]
    st, lay, train, gpu = s.st, s.lay, s.train, s.gpu
    rows, m = lay.rows, s.num_microbatches
    shard, shard_stride = lay.group("cp", "dp")
    grad_b, weight_b = DTYPE_BYTES[train.grad_precision], WEIGHT_BYTES[train.precision]
    z3 = st.zero_stage == 3  # only those candidates' traffic is used: the others' is zero

    classes = s.layout_zero_classes

    def timed(nbytes, size, stride):  # the bytes (ZeRO-3 candidates' only) and groups: per (layout, ZeRO stage)
        return spread(classes, len(st), lambda b, n, d: collective_s(s, impl, b, n, d), nbytes * z3, size, stride)

    dense_k = kind_params_per_rank(s.blocks, lay.tp)
    fp8_saving = param_gather_saving_per_element(train)  # FP8 parameters (fp8_param_gather) gather fewer bytes
    gathered = dense_k * weight_b  # one layer's weights, bytes, (K, N)
    if fp8_saving:
        gathered = gathered - fp8_saving * s.quantised_kinds[0]
    gather = timed(gathered, shard, shard_stride)
    reduce = timed(dense_k * grad_b, shard, shard_stride)
    if s.has_experts:
        edp, edp_stride = lay.expert_group("edp")
        expert_k = kind_expert_params_per_rank(s.blocks, lay.ep, lay.etp)
        expert_gathered = expert_k * weight_b - (fp8_saving * s.quantised_kinds[1] if fp8_saving else 0.0)
        gathered = gathered + expert_gathered
        gather = gather + np.where(expert_k > 0, timed(expert_gathered, edp, edp_stride), 0.0)
        reduce = reduce + np.where(expert_k > 0, timed(expert_k * grad_b, edp, edp_stride), 0.0)
    end_params = s.params - s.per_row(dense_k)  # embedding, final norm and output layer of each stage row
    dense_k, gathered = dense_k * z3, gathered * z3  # the copy-out: ZeRO-3 candidates only
    sharded = shard > 1  # a shard group of one rank gathers nothing, and copies nothing out
    copy_out = np.where(impl.copy_out & sharded,
                        READ_PLUS_WRITE * gathered / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency), 0.0)
    bwd_plain = pl.bwd_s - pl.recompute_s

    def layer(bwd_window):
        exposed = per_layer_exposed_s(gather, reduce, pl.fwd_s, bwd_window, st.overlap_param_gather,
                                      st.overlap_grad_reduce, s.cluster.overlap_efficiency)
        return exposed + 2 * copy_out  # a copy-out after the forward's gather and the backward's

    per_mb = recompute_share * s.per_row(layer(pl.bwd_s)) + (1 - recompute_share) * s.per_row(layer(bwd_plain))
    # Embedding, final norm and output layer: gathered at every micro-batch's start (with the
    # first layer), reduce-scattered after the last backward.
    ends = rows.has_embedding | rows.has_head
    end_gather = np.where(ends, timed(end_params * weight_b, shard, shard_stride), 0.0)
    end_reduce = np.where(ends, timed(end_params * grad_b, shard, shard_stride), 0.0)
    end_params = end_params * z3
    end_copy = np.where(ends & impl.copy_out & sharded, READ_PLUS_WRITE * end_params * weight_b
                        / (gpu.hbm_bw_bytes_per_s * gpu.hbm_efficiency), 0.0)
    has_layers = rows.layers > 0
    # The first layer's gather has no earlier layer to hide behind (every micro-batch); the
    # last reduce-scatter none after it (the step's final backward; earlier micro-batches'
    # hide behind the next forward).
    fwd_exposed = np.where(st.overlap_param_gather, gather - np.minimum(gather, pl.fwd_s) * s.cluster.overlap_efficiency, gather)
    first_extra = np.where(has_layers, (gather - fwd_exposed).max(axis=0), 0.0)
    last_reduce = np.where(has_layers, reduce.max(axis=0), 0.0)
    exposed = m * (per_mb + first_extra + end_gather + end_copy) + last_reduce + end_reduce
    raw = m * (s.per_row(2 * gather + reduce + 2 * copy_out) + end_gather + end_copy) + end_reduce
    # The step's last reduce-scatter is counted whole; it cannot add more than the traffic itself.
    return np.minimum(exposed, raw), raw


# ---- frameworks: what the framework that runs a plan does per micro-batch -----------------
FRAMEWORKS = ("megatron", "torchtitan", "deepspeed", "colossalai")
#: When a framework repeats a data parallel collective every micro-batch (profiles/frameworks/<name>.yaml).
EACH_MICROBATCH = ("always", "never", "without_pp")
SELECTIVE_POLICIES = ("megatron_modules", "op_sac", "none")
#: How a framework's loss holds the logits (cost_models.memory.cross_entropy_bytes_per_logit).
CROSS_ENTROPY_MEMORY = ("megatron", "pytorch")
_OPS = {"==": np.equal, "!=": np.not_equal, ">=": np.greater_equal, "<=": np.less_equal, ">": np.greater,
        "<": np.less}
#: Words a `cannot_run` condition may compare categorical fields with.
_WORDS = {"none": 0, "selective": 1, "full": 2}


@dataclass(frozen=True)
class CannotRun:
    """One `cannot_run` entry: a condition over a candidate (clauses joined by `and`) and why."""

    when: str
    reason: str


@dataclass(frozen=True)
class Framework:
    """What one training framework does with a plan, as profiles/frameworks/<name>.yaml says."""

    name: str
    zero3_impl: str | None  # None: TrainSpec.zero3_impl
    grad_reduce_each_microbatch: dict[int, str]  # zero_stage 0-2 -> EACH_MICROBATCH
    param_gather_each_microbatch: dict[int, str]  # zero_stage 1-2 -> EACH_MICROBATCH
    selective_recompute: str  # SELECTIVE_POLICIES
    cannot_run: tuple[CannotRun, ...]
    fp8_weight_cache: bool  # FP8 copies of the weights kept across micro-batches (cost_models.memory)
    cross_entropy_memory: str = "megatron"  # CROSS_ENTROPY_MEMORY
    zero3_param_is_master: bool = False  # ZeRO-3 keeps one fp32 shard that is both parameter and master weight
    tp_head_saves_gathered_input: bool = False  # the sequence-parallel output layer saves its all-gathered input
    zero3_head_unsharded: bool = False  # ZeRO-3 keeps the output layer gathered across the loss
    cross_entropy_fusion: bool | None = None  # the loss the framework runs when the plan does not say; None: TrainSpec's
    p2p_overlap: bool = False  # its interleaved schedule overlaps steady-state p2p transfers (Strategy.overlap_p2p_comm)

    def _each(self, table: dict[int, str], zero_stage, pp) -> np.ndarray:
        zero_stage, pp = np.asarray(zero_stage), np.asarray(pp)
        out = np.zeros(np.broadcast(zero_stage, pp).shape, dtype=bool)
        for stage, when in table.items():
            on = (when == "always") | ((when == "without_pp") & (pp == 1))
            out = out | ((zero_stage == stage) & on)
        return out

    def reduces_each_microbatch(self, zero_stage, pp) -> np.ndarray:
        """Whether the gradients of a zero_stage 0-2 candidate are reduced after every micro-batch's
        backward (True) or once per step (False)."""
        return self._each(self.grad_reduce_each_microbatch, zero_stage, pp)

    def gathers_each_microbatch(self, zero_stage, pp) -> np.ndarray:
        """Whether a zero_stage 1-2 candidate all-gathers its parameters before every micro-batch's
        forward (True) or once per step after the optimizer (False)."""
        return self._each(self.param_gather_each_microbatch, zero_stage, pp)


@lru_cache(maxsize=None)
def framework_profile(name: str) -> Framework:
    """profiles/frameworks/<name>.yaml, parsed once; like zero3.yaml, every setting names its
    source (`<field>_source`)."""
    from profiles import PROFILES_DIR

    if name not in FRAMEWORKS:
        raise ValueError(f"framework {name!r} is not one of {', '.join(FRAMEWORKS)}")
    path = PROFILES_DIR / "frameworks" / f"{name}.yaml"
    doc = yaml.safe_load(path.read_text())
    for key, value in doc.items():
        if not key.endswith("_source") and key != "source" and not str(doc.get(f"{key}_source", "")).strip():
            raise ValueError(f"{path}: {key} ({value!r}) names no source ({key}_source)")
    each = {k: {int(z): str(w) for z, w in doc[k].items()} for k in ("grad_reduce_each_microbatch",
                                                                    "param_gather_each_microbatch")}
    for key, table in each.items():
        if bad := {w for w in table.values() if w not in EACH_MICROBATCH}:
            raise ValueError(f"{path}: {key} values must be {', '.join(EACH_MICROBATCH)} (got {sorted(bad)})")
    if doc["selective_recompute"] not in SELECTIVE_POLICIES:
        raise ValueError(f"{path}: selective_recompute must be one of {', '.join(SELECTIVE_POLICIES)}")
    rules = tuple(CannotRun(str(r["when"]), str(r["reason"])) for r in doc.get("cannot_run") or ())
    for rule in rules:
        _clauses(rule.when)  # parse now: a typo fails on load, not in a search
    if doc.get("cross_entropy_memory", "megatron") not in CROSS_ENTROPY_MEMORY:
        raise ValueError(f"{path}: cross_entropy_memory must be one of {', '.join(CROSS_ENTROPY_MEMORY)}")
    impl = doc.get("zero3_impl")
    if impl is not None and impl not in ZERO3_IMPLS:
        raise ValueError(f"{path}: zero3_impl {impl!r} is not one of {', '.join(ZERO3_IMPLS)}")
    return Framework(name, impl, each["grad_reduce_each_microbatch"], each["param_gather_each_microbatch"],
                     doc["selective_recompute"], rules, bool(doc["fp8_weight_cache"]),
                     str(doc.get("cross_entropy_memory", "megatron")), bool(doc.get("zero3_param_is_master", False)),
                     bool(doc.get("tp_head_saves_gathered_input", False)), bool(doc.get("zero3_head_unsharded", False)),
                     None if doc.get("cross_entropy_fusion") is None else bool(doc["cross_entropy_fusion"]),
                     bool(doc.get("p2p_overlap", False)))


def framework_of(train) -> Framework:
    """The profile of the framework `train` runs on (megatron when the spec has no such field)."""
    return framework_profile(getattr(train, "framework", "megatron"))


def zero3_impl_of(train) -> str:
    """The ZeRO-3 implementation that costs a zero_stage 3 plan: the framework's own, else TrainSpec's."""
    return framework_of(train).zero3_impl or getattr(train, "zero3_impl", "fsdp2")


def _clauses(when: str) -> list[tuple[bool, str, str | None, str | None]]:
    """`a > 1 and not b` -> [(False, "a", ">", "1"), (True, "b", None, None)]."""
    out = []
    for clause in when.split(" and "):
        words = clause.split()
        negate = words[:1] == ["not"]
        words = words[1:] if negate else words
        if len(words) == 1:
            out.append((negate, words[0], None, None))
        elif len(words) == 3 and words[1] in _OPS and not negate:
            out.append((False, words[0], words[1], words[2]))
        else:
            raise ValueError(f"cannot_run condition {when!r}: clause {clause!r} is not `name`, `not name` or "
                             "`name op value`")
    return out


def _names(model, train, st, lay) -> dict[str, object]:
    """What a `cannot_run` condition may name: the Strategy fields and a few derived facts."""
    from dataclasses import fields

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
    from cost_models.layout import ParallelLayout

    if not framework.cannot_run:
        return []
    names = _names(model, train, st, ParallelLayout.of(st, model.num_layers))
    n = len(st.tp)
    out = []
    for rule in framework.cannot_run:
        hit = np.ones(n, dtype=bool)
        for negate, name, op, word in _clauses(rule.when):
            if name not in names:
                raise ValueError(f"framework {framework.name}: cannot_run names unknown {name!r}")
            left = names[name]
            term = np.asarray(left, dtype=bool) if op is None else _OPS[op](left, _value(word, names))
            hit = hit & np.broadcast_to(~term if negate else term, (n,))
        out.append((rule, hit))
    return out
