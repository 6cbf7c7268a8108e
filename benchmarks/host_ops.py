"""Host-issued operations of one Megatron-core transformer layer, counted on the installed code.

    python -m benchmarks.host_ops [--local-experts 4 8 16 32 64] [--ep 2] [--small]

What it counts. It builds one `TransformerLayer` from megatron-core's local spec
(`get_gpt_layer_local_spec`: Megatron's own linear layers, RMSNorm, unfused attention and, for a MoE
layer, `MoELayer` with the `alltoall` token dispatcher (`MoEAlltoAllTokenDispatcher`, dropless) and
`SequentialMLP` experts; Qwen3-30B-A3B's shapes by default), runs a forward and a backward on CPU in
fp32 and counts every ATen operation the dispatcher receives below autograd (a `TorchDispatchMode`):
what the host issues, each one a kernel launch on a GPU unless it is a view (`OpOverload.is_view`:
metadata only) or a bare allocation (not counted). Forward operations go to the section that runs
them (a submodule, a stage of the token dispatcher, or a function Transformer Engine can fuse,
`FUSABLE`); backward operations to the section whose autograd node runs them
(`torch._C._current_autograd_node`, mapped to the sections by walking each section's output graph as
it returns). It also counts the autograd nodes a backward runs and how many of them are Python
`autograd.Function`s, the device-to-host copies the dispatcher makes (`maybe_move_tensor_to_cpu` with
a tensor) and the host's waits on them (`d2h_event.synchronize`), with the section each is in.
MoE layers run twice: in one process (ep 1) and in `--ep` gloo processes (`count_layer_ep`), which
is the multi-rank path of a real run: the all-gather of the token counts, the all-to-alls, their
split sizes copied to the host and the wait for them before the first all-to-all.

The first forward and backward is a warm-up (one-time set-up, such as the aux-loss tracker's
buffer, is not per micro-batch); the second is counted, with fresh gradients (the weight
gradients' accumulation into Megatron's main_grad is the wgrad GEMM's epilogue under Transformer
Engine). Counts are the code's structure: the script checks that two token counts and two seeds
(routings) give the same counts; `--small` layers give the same counts as full-size ones.

What makes it run on a CPU without Transformer Engine (`cpu_shims`, undone on exit): the
dispatcher's CUDA side stream, `torch.cuda.current_stream/stream/current_device` and the D2H event
are no-op stand-ins (CUDA runtime calls, not ATen operations; the copies and waits are logged where
the dispatcher makes them); `maybe_move_tensor_to_cpu` returns what its CUDA branch returns (the
tensor, or its numpy array for the all-to-all split sizes); the CUDA RNG tracker's state swap
(`tensor_parallel.random`) reads and sets a CPU generator state, so its `fork` runs as written; and
`moe_utils.te_general_gemm`, which megatron-core 0.16.1 leaves undefined without Transformer Engine
(a NameError in `RouterGatingLinearFunction.forward`), is set to None, the value its own fallback
branch tests for. Nothing else is changed.

What it cannot count. Transformer Engine's paths (TEGroupedMLP's `GroupedLinear`, the fused router
`moe_router_fusion` and permutation `moe_permute_fusion`, fused RMSNorm + linear, flash attention)
and the DeepEP / HybridEP dispatchers (CUDA-only) are not installed here: the counts are those of
the unfused local path, with the fusable share reported apart. The experts run as `SequentialMLP`
(one MLP per local expert), also reported apart; with TEGroupedMLP the expert block is two grouped
linears and an activation plus Transformer Engine's per-expert set-up, which the elementwise tables
cost as `host_per_expert_*_us`.

What it found (megatron-core 0.16.1, ep 2 and 4, 4 to 64 local experts): the router and dispatcher
issue 45 operations in the forward (36 before the wait, 9 after) plus 5 device-to-host copies, and
24 in the backward, whatever the number of local experts; only views (one slice per expert chunk
in the backward of the sort by local expert) grow with the experts. These are the elementwise
tables' `moe_host_ops`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field

#: Sections of a layer in the order they run; the MoE block's are Megatron's MoELayer stages.
ATTENTION_SECTIONS = ("input_layernorm", "self_attention", "pre_mlp_layernorm")
MOE_SECTIONS = ("router", "dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "experts",
                "combine_preprocess", "token_combine", "combine_postprocess", "moe_glue")
#: The router and token dispatcher: what a MoE layer runs besides its experts ...
ROUTING_SECTIONS = tuple(s for s in MOE_SECTIONS if s != "experts")
#: ... before the host waits for the token counts with ep > 1 (cuda_sync_point "before_ep_alltoall",
#: at the start of token_dispatch), and after.
BEFORE_SYNC = ("router", "dispatch_preprocess")
AFTER_SYNC = tuple(s for s in ROUTING_SECTIONS if s not in BEFORE_SYNC)
DISPATCHER_STAGES = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                     "combine_preprocess", "token_combine", "combine_postprocess")
#: Functions Transformer Engine replaces by fused kernels when Megatron's `moe_router_fusion`
#: (router) or `moe_permute_fusion` (dispatcher) is on: counted as sub-sections "<section>/<name>".
FUSABLE = {"router": ("topk_routing_with_score_function", "compute_routing_scores_for_aux_loss",
                      "switch_load_balancing_loss_func"),
           "token_dispatcher": ("permute", "unpermute", "sort_chunks_by_idxs")}
ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}


@dataclass
class SectionCount:
    """Host operations of one section: ATen ops (non-view, non-allocation) and views, each way."""

    fwd_ops: int = 0
    fwd_views: int = 0
    bwd_ops: int = 0
    bwd_views: int = 0
    bwd_nodes: int = 0  # autograd nodes the backward executes
    py_functions: int = 0  # of them, Python autograd.Function backward nodes


@dataclass
class LayerCount:
    """One layer's counts by section, and where the dispatcher copies to the host and waits."""

    sections: dict[str, SectionCount] = field(default_factory=dict)
    d2h_copies: list[str] = field(default_factory=list)  # section of each device-to-host copy
    host_waits: list[str] = field(default_factory=list)  # section of each host wait on the copies
    sync_point: str = ""  # the dispatcher's cuda_sync_point for this layout

    def total(self, names, attr: str) -> int:
        """`attr` summed over the sections `names` and their sub-sections ("<name>/...")."""
        return sum(getattr(c, attr) for k, c in self.sections.items() if k.split("/")[0] in names)

    def fusable(self, attr: str) -> int:
        """`attr` summed over the sub-sections Transformer Engine's fusions replace."""
        return sum(getattr(c, attr) for k, c in self.sections.items() if "/" in k)


# ---- process group and CPU stand-ins ----------------------------------------------------------

def ensure_model_parallel(ep: int = 1, rank: int = 0, store_path: str | None = None) -> None:
    """A gloo process group of `ep` ranks (this one `rank`, meeting at the FileStore `store_path`)
    and Megatron's parallel state: tp = pp = 1, expert parallel over all ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if store_path is None:
            fd, store_path = tempfile.mkstemp(prefix="host_ops_")
            os.close(fd)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, ep), rank=rank, world_size=ep)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)


def release_model_parallel() -> None:
    """Undo `ensure_model_parallel` (Megatron's parallel state, then the process group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class _Event:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("wait")


class _Stream:
    def __init__(self, log):
        self.log = log

    def wait_stream(self, _other):
        pass

    def record_event(self):
        return _Event(self.log)


@contextlib.contextmanager
def cpu_shims(log: list):
    """The CPU stand-ins of the module docstring; `log` receives "copy" per device-to-host copy the
    dispatcher would make and "wait" per host wait on them."""
    import torch
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    saved_cuda = {n: getattr(torch.cuda, n) for n in ("current_device", "current_stream", "stream")}
    saved_rng = random._get_cuda_rng_state, random._set_cuda_rng_state
    saved_stream = token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    saved_move = token_dispatcher.maybe_move_tensor_to_cpu
    had_gemm = hasattr(moe_utils, "te_general_gemm")

    def move(tensor, as_numpy=False, record_stream=False):  # the CUDA branch, less the copy itself
        if not torch.is_tensor(tensor):
            return tensor
        log.append("copy")
        return tensor.numpy() if as_numpy else tensor

    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random._set_cuda_rng_state = lambda *a, **k: None
    tracker = random.get_cuda_rng_tracker()
    for name in (random._MODEL_PARALLEL_RNG_TRACKER_NAME, random._EXPERT_PARALLEL_RNG_TRACKER_NAME):
        tracker.states_.setdefault(name, torch.get_rng_state())
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: None
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _Stream(log)
    token_dispatcher.maybe_move_tensor_to_cpu = move
    if not had_gemm:
        moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        random._get_cuda_rng_state, random._set_cuda_rng_state = saved_rng
        for n, f in saved_cuda.items():
            setattr(torch.cuda, n, f)
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = saved_stream
        token_dispatcher.maybe_move_tensor_to_cpu = saved_move
        if not had_gemm:
            del moe_utils.te_general_gemm


# ---- counting -----------------------------------------------------------------------------------

def _counter_mode(count: LayerCount, state: dict):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if state["backward"]:
                node = torch._C._current_autograd_node()
                name = state["labels"].get(node, "outside") if node is not None else "engine"
                prefix = "bwd"
            else:
                name, prefix = state["stack"][-1], "fwd"
            kind = "views" if func.is_view else ("allocs" if func._opname in ALLOCATIONS else "ops")
            if state["trace"] is not None:
                state["trace"].append((prefix, name, kind, func._opname))
            if kind != "allocs":
                section = count.sections.setdefault(name, SectionCount())
                setattr(section, f"{prefix}_{kind}", getattr(section, f"{prefix}_{kind}") + 1)
            return func(*args, **(kwargs or {}))

    return Counter()


def _label_graph(outputs, name: str, labels: dict) -> None:
    """Give `name` to every autograd node reachable from `outputs` that no earlier section owns."""
    import torch

    flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    stack = [t.grad_fn for t in flat if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in labels:
            continue
        labels[node] = name
        stack.extend(f for f, _ in node.next_functions if f is not None)


def _wrap(obj, attr: str, name: str | None, state: dict, log: list):
    """Run `obj.attr` as section `name` (None: a sub-section "<enclosing section>/<attr>"): its
    forward ops, autograd nodes and D2H events get the name. Returns the original."""
    inner = getattr(obj, attr)

    def run(*args, **kwargs):
        label = name or f"{state['stack'][-1].split('/')[0]}/{attr}"
        state["stack"].append(label)
        start = len(log)
        try:
            out = inner(*args, **kwargs)
        finally:
            state["stack"].pop()
        state["events"].extend((e, label) for e in log[start:])
        del log[start:]
        _label_graph(out, label, state["labels"])
        return out

    setattr(obj, attr, run)
    return inner


def _config(num_experts, hidden: int, ffn: int, moe_ffn: int, heads: int, groups: int, topk: int):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {} if num_experts is None else dict(
        num_moe_experts=num_experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3, moe_router_dtype="fp32", moe_grouped_gemm=False)
    return TransformerConfig(
        num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=hidden // heads, qk_layernorm=True, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        bias_dropout_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=False, params_dtype=torch.float32, use_cpu_initialization=True, **moe)


def count_layer(num_experts: int | None = None, seq_len: int = 64, batch: int = 2, hidden: int = 2048,
                ffn: int = 6144, moe_ffn: int = 768, heads: int = 32, groups: int = 4, topk: int = 8,
                seed: int = 0, trace: list | None = None) -> LayerCount:
    """Count one forward and backward of a local-spec TransformerLayer: dense (num_experts None)
    or MoE with `num_experts` experts, all local (ep = 1). Defaults: Qwen3-30B-A3B's layer.
    `trace`, if given, receives (direction, section, kind, ATen op name) per operation."""
    import torch

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    ensure_model_parallel()  # a no-op inside count_layer_ep's process group
    torch.manual_seed(seed)
    count, log = LayerCount(), []
    state = {"stack": ["layer_glue"], "labels": {}, "backward": False, "events": [], "trace": trace}
    restore = []
    with cpu_shims(log), contextlib.ExitStack() as undo:
        undo.callback(lambda: [setattr(m, n, f) for m, n, f in restore])
        config = _config(num_experts, hidden, ffn, moe_ffn, heads, groups, topk)
        spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                        qk_layernorm=True, normalization="RMSNorm")
        layer = build_module(spec, config=config, layer_number=1)
        layer.train()
        for name in ATTENTION_SECTIONS:
            _wrap(getattr(layer, name), "forward", name, state, log)
        if num_experts is None:
            _wrap(layer.mlp, "forward", "mlp", state, log)
        else:
            moe = layer.mlp
            _wrap(moe, "forward", "moe_glue", state, log)
            _wrap(moe.router, "forward", "router", state, log)
            _wrap(moe.experts, "forward", "experts", state, log)
            for stage in DISPATCHER_STAGES:
                _wrap(moe.token_dispatcher, stage, stage, state, log)
            for module, names in FUSABLE.items():
                mod = importlib.import_module(f"megatron.core.transformer.moe.{module}")
                restore += [(mod, n, _wrap(mod, n, None, state, log)) for n in names]
        rope = RotaryEmbedding(kv_channels=hidden // heads, rotary_percent=1.0)(seq_len)
        causal = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
        x = torch.randn(seq_len, batch, hidden, requires_grad=True)
        grad = torch.randn(seq_len, batch, hidden)
        out, _ = layer(x, attention_mask=causal, rotary_pos_emb=rope)  # warm-up: one-time set-up
        out.backward(grad)  # (e.g. the aux-loss tracker's buffer) stays out of the count
        for p in (x, *layer.parameters()):  # a fresh micro-batch's gradients: accumulating them
            p.grad = None  # into Megatron's main_grad is the wgrad GEMM's epilogue under TE
        state["labels"].clear()
        state["events"].clear()
        with _counter_mode(count, state):
            out, _ = layer(x, attention_mask=causal, rotary_pos_emb=rope)
            _label_graph(out, "layer_glue", state["labels"])
            state["backward"] = True
            out.backward(grad)
        if num_experts is not None:
            count.sync_point = layer.mlp.token_dispatcher.cuda_sync_point
    for node, name in state["labels"].items():
        section = count.sections.setdefault(name, SectionCount())
        section.bwd_nodes += 1
        section.py_functions += isinstance(node, torch.autograd.function.BackwardCFunction)
    count.d2h_copies = [name for e, name in state["events"] if e == "copy"]
    count.host_waits = [name for e, name in state["events"] if e == "wait"]
    return count


def _ep_worker(rank: int, ep: int, store_path: str, out_path: str, kwargs: dict) -> None:
    import torch.distributed as dist

    ensure_model_parallel(ep, rank, store_path)
    count = count_layer(**kwargs)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(asdict(count), f)
    dist.barrier()
    release_model_parallel()


def count_layer_ep(ep: int, num_experts: int, **kwargs) -> LayerCount:
    """`count_layer` with expert parallelism: `ep` processes (gloo, one CPU rank each) run the layer
    together, every rank `num_experts / ep` local experts; rank 0's counts. This runs the
    dispatcher's multi-rank path: the all-gather of the token counts, the all-to-alls and their
    split sizes on the host."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="host_ops_") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "count.json")
        mp.start_processes(_ep_worker, args=(ep, store, out, dict(num_experts=num_experts, **kwargs)),
                           nprocs=ep, start_method="spawn")
        with open(out) as f:
            raw = json.load(f)
    return LayerCount(sections={k: SectionCount(**v) for k, v in raw["sections"].items()},
                      d2h_copies=raw["d2h_copies"], host_waits=raw["host_waits"], sync_point=raw["sync_point"])


def linear_fit(xs, ys) -> tuple[float, float, int]:
    """(a, b, worst residual) of y = a + b·x through the first and last points (counts are integers:
    a residual of 0 everywhere means the count is exactly affine in x)."""
    b = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
    a = ys[0] - b * xs[0]
    return a, b, max(abs(y - (a + b * x)) for x, y in zip(xs, ys))


# ---- report -------------------------------------------------------------------------------------

COLUMNS = ("fwd_ops", "fwd_views", "bwd_ops", "bwd_views", "bwd_nodes", "py_functions")
HEADER = f"  {'section':<24}" + "".join(f"{h:>9}" for h in ("fwd ops", "fwd view", "bwd ops", "bwd view",
                                                           "bwd node", "py fn"))


def _row(label: str, c: LayerCount, names) -> str:
    return f"  {label:<24}" + "".join(f"{c.total(names, a):>9}" for a in COLUMNS)


def _same(a: LayerCount, b: LayerCount) -> bool:
    return all(a.total(a.sections, f) == b.total(b.sections, f) for f in COLUMNS[:4])


def _moe_table(c: LayerCount) -> None:
    print(f"  sync point {c.sync_point}; D2H copies {len(c.d2h_copies)} in {sorted(set(c.d2h_copies))}; "
          f"host waits in {c.host_waits}")
    print(HEADER)
    for name in (*ATTENTION_SECTIONS, *MOE_SECTIONS, "layer_glue"):
        print(_row(name, c, (name,)))
    print(_row("router + dispatcher", c, ROUTING_SECTIONS))
    print(_row("  before the sync", c, BEFORE_SYNC))
    print(_row("  after the sync", c, AFTER_SYNC))
    print(f"  {'  of them TE-fusable':<24}{c.fusable('fwd_ops'):>9}{c.fusable('fwd_views'):>9}"
          f"{c.fusable('bwd_ops'):>9}{c.fusable('bwd_views'):>9}")
    print(_row("layer", c, c.sections))


def _fits(label: str, counts: dict[int, LayerCount]) -> None:
    local = list(counts)
    print(f"\n{label}: affine in local experts L (a + b*L; residual 0 = exact)")
    for part, names in (("router + dispatcher", ROUTING_SECTIONS), ("  before the sync", BEFORE_SYNC),
                        ("  after the sync", AFTER_SYNC), ("experts (SequentialMLP)", ("experts",)),
                        ("attention part", (*ATTENTION_SECTIONS, "layer_glue"))):
        for attr in COLUMNS[:4]:
            a, b, res = linear_fit(local, [counts[e].total(names, attr) for e in local])
            print(f"  {part:<24} {attr:<10} a = {a:7.1f}  b = {b:6.2f}  residual {res:g}")
    copies = {len(c.d2h_copies) for c in counts.values()}
    print(f"  D2H copies per forward: {sorted(copies)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-experts", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks of the second sweep (processes)")
    parser.add_argument("--small", action="store_true", help="hidden 256, ffn 512, expert ffn 96 (same counts, faster)")
    args = parser.parse_args(argv)
    size = dict(hidden=256, ffn=512, moe_ffn=96) if args.small else {}
    dense = count_layer(None, **size)
    print("Dense layer (local spec: RMSNorm, QK-norm, RoPE, unfused attention, gated MLP), 2 x 64 tokens")
    print(HEADER)
    for name in (*ATTENTION_SECTIONS, "mlp", "layer_glue"):
        print(_row(name, dense, (name,)))
    print(_row("layer", dense, dense.sections))

    one = {args.ep * e: count_layer(args.ep * e, **size) for e in args.local_experts}
    print("\nMoE layer, ep 1 (alltoall dispatcher, SequentialMLP experts, top-8), local experts = experts")
    for e, c in one.items():
        print(f" local experts {e}")
        _moe_table(c)
    first = args.ep * args.local_experts[0]
    print(f"  {first} experts, 2 x 128 tokens and another seed: "
          f"{'same counts' if _same(one[first], count_layer(first, seq_len=128, seed=1, **size)) else 'COUNTS DIFFER'}")
    _fits("ep 1", one)

    multi = {e: count_layer_ep(args.ep, args.ep * e, **size) for e in args.local_experts}
    print(f"\nMoE layer, ep {args.ep} ({args.ep} gloo processes; rank 0's counts)")
    for e, c in multi.items():
        print(f" local experts {e} (experts {args.ep * e})")
        _moe_table(c)
    first = args.local_experts[0]
    check = count_layer_ep(args.ep, args.ep * first, seq_len=128, seed=1, **size)
    print(f"  {first} local experts, 2 x 128 tokens and another seed: "
          f"{'same counts' if _same(multi[first], check) else 'COUNTS DIFFER'}")
    wider, base = count_layer_ep(2 * args.ep, 2 * args.ep * first, **size), multi[first]
    same = all(base.total(base.sections, f) == wider.total(wider.sections, f) for f in ("fwd_ops", "bwd_ops"))
    print(f"  {first} local experts at ep {2 * args.ep} (experts {2 * args.ep * first}): "
          f"{'same ops' if same else 'OPS DIFFER'}; backward views {wider.total(wider.sections, 'bwd_views')} "
          f"against {base.total(base.sections, 'bwd_views')}")
    _fits(f"ep {args.ep}", multi)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
