"""Hardware micro-benchmarks, run on every rank under torchrun (imports torch).

    torchrun --standalone --nproc_per_node=N -m executors.profile_worker --out DIR [--quick]

All ranks measure at the same time (a barrier before each case), so the
figures are what one rank gets while the others run too — the situation of a
training job (on a CPU the ranks share the memory bus and the cores).

- GEMM: (m, k) x (k, n) matmuls over square and transformer-shaped sizes and
  every dtype the device runs; FLOP/s = 2mnk / time.
- Memory bandwidth: copy of a large tensor; bytes/s = (read + write) / time.
- Element-wise kernels: layer norm, GELU, softmax and add on transformer-shaped
  tensors; bytes/s of the mix (its ratio to the copy rate is hbm_efficiency).
- Attention: torch's scaled_dot_product_attention, forward and backward, with
  and without the causal mask, over a grid of sequence lengths and head dims at a
  fixed number of tokens and hidden size per call (ATTENTION_GRID); FLOP in the
  FlashAttention benchmark convention the attention tables declare: forward
  4·b·s²·heads·d, halved with the causal mask; backward 2.5 x the forward.
- Per-op overhead: a tiny element-wise op whose input requires grad (dispatch,
  allocation and autograd recording): the host's cost of issuing one op.
- Small kernel: a tiny element-wise op without autograd; on CUDA a chain of them
  replayed as one CUDA graph, so the time is the GPU's own per-kernel time, not
  the host's issue cost.
- Optimizer: one step of torch's Adam (fused on CUDA, foreach on CPU) over a few
  fp32 tensors.
- CUDA context: device memory in use outside PyTorch's allocator after the compute
  kernels are loaded and before the process group (NCCL) starts.
- Collectives on the world group and on groups of consecutive ranks of every
  power-of-two size: all-reduce, all-gather, reduce-scatter, all-to-all, and
  send/recv between ranks 0 and 1, over message sizes 4 B to 64 MiB. Bus
  bandwidth follows nccl-tests' convention (PERFORMANCE.md): all-reduce
  2(n-1)/n x bytes / time; all-gather, reduce-scatter, all-to-all
  (n-1)/n x bytes / time with bytes the full buffer; send/recv bytes / time.

Rank 0 writes DIR/profile.json (a `HardwareProfile`, see executors.profiler).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from executors.lifeline import bind_to_parent

if __name__ == "__main__":
    bind_to_parent()  # started by meshplan's torchrun: die with it (before torch's import, seconds long)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cost_models.attention_kernels import BACKWARD_FLOP_RATIO  # noqa: E402  (the tables' backward FLOP convention)

CPU_GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CUDA_GEMM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}
SQUARE_SIZES = (256, 512, 1024, 2048)
HIDDEN_SIZES = (256, 512, 1024)
TOKENS = 2048
#: The (m, n, k) grid written as the measured GEMM table (profiles/kernels/gemm/): every
#: combination of these sizes, per device kind, full and quick.
GEMM_GRID = {("cuda", False): (256, 512, 1024, 2048, 4096), ("cuda", True): (256, 1024, 4096),
             ("cpu", False): (64, 128, 256, 512), ("cpu", True): (128, 256)}
MIN_TIME_S = 0.2
MAX_ITERS = 50
MIB = 2**20
REPEATS = 3  # each GEMM / copy case is timed this many times, interleaved with the others; the median is kept


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, min_time_s: float = MIN_TIME_S, max_iters: int = MAX_ITERS) -> float:
    """Seconds per call: a warm-up call, a probe call, then enough calls for `min_time_s`
    (at most `max_iters`). The count is agreed over all ranks (the slowest probe decides),
    so collectives run the same number of times everywhere."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    probe = _max_over_ranks(time.perf_counter() - start, device)
    iters = int(min(max_iters, max(1, min_time_s / max(probe, 1e-9))))
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def gemm_shapes(quick: bool, device_type: str = "cpu") -> list[tuple[int, int, int]]:
    """(m, n, k): squares, the QKV / MLP-up / MLP-down GEMMs of a TOKENS-token micro-batch, and
    the full grid of GEMM_GRID (the measured GEMM table), each shape once."""
    squares = SQUARE_SIZES[:2] if quick else SQUARE_SIZES
    shapes = [(s, s, s) for s in squares]
    for h in HIDDEN_SIZES[:1] if quick else HIDDEN_SIZES:
        shapes += [(TOKENS, 3 * h, h), (TOKENS, 4 * h, h), (TOKENS, h, 4 * h)]
    grid = GEMM_GRID[("cuda" if device_type == "cuda" else "cpu", quick)]
    shapes += [(m, n, k) for m in grid for n in grid for k in grid]
    return list(dict.fromkeys(shapes))


def bench_gemm(device: torch.device, quick: bool) -> list[dict]:
    dtypes = CUDA_GEMM_DTYPES if device.type == "cuda" else CPU_GEMM_DTYPES
    cases = [(name, dtype, shape) for name, dtype in dtypes.items() for shape in gemm_shapes(quick, device.type)]
    times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    for _ in range(1 if quick else REPEATS):
        for i, (name, dtype, (m, n, k)) in enumerate(cases):
            if device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            a = torch.randn(m, k, device=device).to(dtype)
            b = torch.randn(k, n, device=device).to(dtype)
            dist.barrier()
            times[i].append(timed(lambda: torch.mm(a, b), device))
    rows = []
    for i, (name, _, (m, n, k)) in enumerate(cases):
        t = statistics.median(times[i])
        rows.append({"dtype": name, "m": m, "n": n, "k": k, "time_s": t, "flop_per_s": 2 * m * n * k / t})
    return rows


def bench_memory(device: torch.device, quick: bool) -> dict:
    nbytes = (64 if quick else 256) * 2**20 if device.type == "cpu" else 2**30
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    runs = []
    for _ in range(1 if quick else REPEATS):
        dist.barrier()
        runs.append(timed(lambda: dst.copy_(src), device))
    t = statistics.median(runs)
    return {"bytes": nbytes, "time_s": t, "bytes_per_s": 2 * nbytes / t}


def bench_elementwise(device: torch.device, quick: bool) -> dict:
    """Transformer element-wise kernels on (TOKENS, 1024) tensors: layer norm, tanh-GELU,
    softmax (2 tensors moved each) and add (3). Bytes are the algorithmic traffic (read the
    inputs, write the output); the mix's rate is total bytes / total time."""
    import torch.nn.functional as F

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h = 1024
    x = torch.randn(TOKENS, h, device=device, dtype=dtype)
    w, b = torch.ones(h, device=device, dtype=dtype), torch.zeros(h, device=device, dtype=dtype)
    ops = {"layer_norm": (lambda: F.layer_norm(x, (h,), w, b), 2), "gelu": (lambda: F.gelu(x, approximate="tanh"), 2),
           "softmax": (lambda: torch.softmax(x, dim=-1), 2), "add": (lambda: x + x, 3)}
    rows, total_bytes, total_s = {}, 0, 0.0
    for name, (fn, tensors) in ops.items():
        runs = []
        for _ in range(1 if quick else REPEATS):
            dist.barrier()
            runs.append(timed(fn, device, min_time_s=0.1))
        t = statistics.median(runs)
        nbytes = tensors * x.numel() * x.element_size()
        rows[name] = {"bytes": nbytes, "time_s": t, "bytes_per_s": nbytes / t}
        total_bytes += nbytes
        total_s += t
    return {"ops": rows, "bytes_per_s": total_bytes / total_s}


#: (seq_lens, head_dims, tokens per call, hidden = heads x head_dim) of the attention grid, per device kind,
#: full and quick. CUDA measures as the public tables were measured (16k tokens, hidden 2048 per call:
#: FlashAttention-3 paper Sec. 4.1); a CPU takes fewer tokens so that the grid runs in seconds.
ATTENTION_GRID = {("cuda", False): ((512, 1024, 2048, 4096, 8192, 16384), (64, 128, 256), 16384, 2048),
                  ("cuda", True): ((512, 2048), (64, 128), 16384, 2048),
                  ("cpu", False): ((128, 256, 512), (64, 128), 1024, 512),
                  ("cpu", True): ((64, 128), (64, 128), 256, 256)}

def attention_flop(batch: int, seq_len: int, heads: int, head_dim: int, causal: bool, direction: str) -> float:
    """FLOP of one attention call in the tables' convention: 4·b·s²·heads·d forward, halved with the
    causal mask; the backward 2.5 x that."""
    fwd = 4 * batch * seq_len**2 * heads * head_dim / (2 if causal else 1)
    return fwd * (BACKWARD_FLOP_RATIO if direction == "bwd" else 1.0)


def _runs_everywhere(fn, device: torch.device) -> str | None:
    """Call `fn` once on every rank; None when it ran on all of them, else why not (then no rank times
    it, so every rank still makes the same collective calls)."""
    try:
        fn()
        error = None
    except (RuntimeError, NotImplementedError) as exc:  # an unsupported shape or out of memory
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failed = _max_over_ranks(1.0 if error else 0.0, device)
    return error or ("failed on another rank" if failed else None)


#: SDPA backends measured on CUDA, by the attention_kernel they time: `flash` (the main table) is cuDNN's
#: fused attention, what Transformer Engine prefers on Hopper and newer; `flash2` is SDPA's FLASH_ATTENTION
#: backend, FlashAttention-2 (the table's `flash2:` section). A CPU measures torch's default choice only.
SDPA_BACKENDS = {"flash": "CUDNN_ATTENTION", "flash2": "FLASH_ATTENTION"}


def _attention_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backend: str | None = None):
    """(forward, backward) closures of one attention call (inside `sdpa_kernel(backend)` when a backend is
    named); the backward differentiates a forward graph kept from its first call (autograd.grad with
    retain_graph), so it times the backward alone."""
    import contextlib

    import torch.nn.functional as F

    def forward():
        if backend is None:
            context = contextlib.nullcontext()
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            context = sdpa_kernel([getattr(SDPBackend, backend)])
        with context:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    kept: dict[str, torch.Tensor] = {}

    def backward():
        if not kept:
            kept["out"] = forward()
            kept["grad"] = torch.randn_like(kept["out"])
        return torch.autograd.grad(kept["out"], (q, k, v), kept["grad"], retain_graph=True)

    return forward, backward


def bench_attention(device: torch.device, quick: bool, backend: str | None = None) -> dict:
    """scaled_dot_product_attention forward and backward, unmasked and causal, over ATTENTION_GRID:
    per call `tokens` tokens (batch = tokens / seq_len) and hidden / head_dim heads, with SDPA's `backend`
    (an SDPBackend name; None: the backend torch selects). A case the device cannot run is listed in
    `skipped` with the reason."""
    seq_lens, head_dims, tokens, hidden = ATTENTION_GRID[("cuda" if device.type == "cuda" else "cpu", quick)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, skipped = [], []
    for d in head_dims:
        heads = max(1, hidden // d)
        for s in seq_lens:
            b = max(1, tokens // s)
            qkv = [torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
            for causal in (False, True):
                for direction, fn in zip(("fwd", "bwd"), _attention_calls(*qkv, causal, backend)):
                    case = {"direction": direction, "causal": causal, "head_dim": d, "seq_len": s, "batch": b,
                            "heads": heads}
                    why = _runs_everywhere(fn, device)
                    if why:
                        skipped.append(dict(case, reason=why))
                        continue
                    dist.barrier()
                    t = timed(fn, device, min_time_s=0.02 if quick else 0.1, max_iters=10 if quick else MAX_ITERS)
                    flop = attention_flop(b, s, heads, d, causal, direction)
                    rows.append(dict(case, time_s=t, flop=flop, flop_per_s=flop / t))
    return {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "hidden": hidden,
            "seq_lens": list(seq_lens), "head_dims": list(head_dims), "rows": rows, "skipped": skipped,
            "kernel": "torch.nn.functional.scaled_dot_product_attention, "
                      + (f"backend SDPBackend.{backend}" if backend else "the backend torch selects by default")}


def bench_attention_kernels(device: torch.device, quick: bool) -> dict:
    """The attention measurements of the profile: on CUDA each kernel of SDPA_BACKENDS under its own key
    (`attention`: cuDNN, `attention_flash2`: FlashAttention-2), on a CPU torch's default as `attention`."""
    if device.type != "cuda":
        return {"attention": bench_attention(device, quick)}
    return {("attention" if kernel == "flash" else f"attention_{kernel}"): bench_attention(device, quick, backend)
            for kernel, backend in SDPA_BACKENDS.items()}


def _multiply_chain(x: torch.Tensor, reps: int):
    """A callable running `reps` dependent element-wise multiplies of `x`."""
    def chain():
        y = x
        for _ in range(reps):
            y = y * 1.0001
        return y
    return chain


def bench_op_overhead(device: torch.device) -> dict:
    reps = 200
    chain = _multiply_chain(torch.ones(16, device=device, requires_grad=True), reps)
    dist.barrier()
    t = timed(chain, device)
    return {"time_per_op_s": t / reps}


def bench_small_kernel(device: torch.device) -> dict:
    """Device time of one tiny element-wise kernel in a dependent chain: on CUDA the chain replayed as
    one CUDA graph (the host issues nothing per kernel, so this is the GPU-side launch, ramp-up and
    tail); on a CPU the op without autograd, where the host runs the kernel itself."""
    x = torch.ones(16, device=device)
    reps = 200
    chain = _multiply_chain(x, reps)
    fn, method = chain, f"{reps} dependent 16-element multiplies without autograd, wall clock"
    if device.type == "cuda":
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                chain()  # warm-up outside the capture, as torch.cuda.graph requires
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the process group's watchdog thread may query CUDA events during the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                chain()
            fn, method = graph.replay, f"CUDA graph replay of {reps} dependent 16-element multiplies"
        except RuntimeError as exc:  # graphs unavailable: stream launches, which include the host's issue cost
            method += f" (CUDA graph capture failed: {str(exc).splitlines()[0] if str(exc) else 'RuntimeError'})"
    dist.barrier()
    return {"time_per_kernel_s": timed(fn, device) / reps, "method": method}


def bench_optimizer(device: torch.device, quick: bool) -> dict:
    """One step of torch.optim.Adam over `tensors` fp32 tensors of `numel` elements with gradients set
    (fused=True on CUDA, the single multi-tensor kernel Megatron's fused Adam also is; foreach on a CPU)."""
    tensors, numel = (8, 2**24 if not quick else 2**22) if device.type == "cuda" else (4, 2**20 if not quick else 2**18)
    params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    flags = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.Adam(params, lr=1e-3, **flags)
    dist.barrier()
    t = timed(opt.step, device, min_time_s=0.05 if quick else MIN_TIME_S)
    flag = ", ".join(f"{k}={v}" for k, v in flags.items())
    return {"tensors": tensors, "params": tensors * numel, "time_s": t, "dtype": "fp32",
            "implementation": f"torch.optim.Adam({flag})"}


def cuda_context_bytes(device: torch.device) -> float:
    """Device memory in use outside PyTorch's caching allocator once the GEMM, attention and element-wise
    kernels are loaded (lazy module loading), before NCCL starts: total - free - reserved. Assumes no
    other process uses the device."""
    import torch.nn.functional as F

    a = torch.randn(256, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, 2, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    loss = (a @ a).sum() + F.scaled_dot_product_attention(q, q, q, is_causal=True).float().sum()
    loss = loss + F.layer_norm(a.float(), (256,)).sum()
    loss.backward()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return float(total - free - torch.cuda.memory_reserved(device))


BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


def message_sizes(quick: bool) -> list[int]:
    top = 22 if quick else 26
    return [2**k for k in range(2, top + 1, 2)]


def _collective(op: str, nbytes: int, group, n: int, device: torch.device):
    """A closure that runs one `op` over `nbytes` (the full buffer) in `group` of `n` ranks."""
    elems = max(n, nbytes // 4 // n * n)
    full = torch.ones(elems, device=device)
    shard = torch.ones(elems // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    # Recent torch names them *_single; older releases only have *_into_tensor / *_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "all_gather":
        return lambda: gather(full, shard, group=group)
    if op == "reduce_scatter":
        return lambda: scatter(shard, full, group=group)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    raise ValueError(op)


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def bench_collectives(device: torch.device, quick: bool) -> list[dict]:
    world = dist.get_world_size()
    rank = dist.get_rank()
    rows = []
    sizes = [2**k for k in range(1, world.bit_length()) if 2**k <= world]
    for n in sizes:
        groups = [dist.new_group(list(range(lo, lo + n))) for lo in range(0, world - n + 1, n)]
        mine = next((g for i, g in enumerate(groups) if i * n <= rank < (i + 1) * n), None)
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            for nbytes in message_sizes(quick):
                fn = _collective(op, nbytes, mine, n, device) if mine is not None else (lambda: None)
                dist.barrier()
                t = timed(fn, device, min_time_s=0.05 if quick else 0.2, max_iters=20 if quick else 100)
                t = _max_over_ranks(t, device)
                rows.append(_row(op, n, nbytes, t))
    if world >= 2:
        for nbytes in message_sizes(quick):
            buf = torch.ones(max(1, nbytes // 4), device=device)

            def ping_pong():
                if rank == 0:
                    dist.send(buf, dst=1)
                    dist.recv(buf, src=1)
                elif rank == 1:
                    dist.recv(buf, src=0)
                    dist.send(buf, dst=0)

            dist.barrier()
            t = timed(ping_pong, device, min_time_s=0.05 if quick else 0.1, max_iters=20 if quick else 50) / 2
            rows.append(_row("send_recv", 2, nbytes, _max_over_ranks(t if rank < 2 else 0.0, device)))
    return rows


def bench_overlap(device: torch.device, quick: bool) -> dict:
    """How much of an all-reduce really runs concurrently with a GEMM stream.

    Times a chain of GEMMs alone, a 16 MiB all-reduce alone, and both at once
    (the all-reduce issued asynchronously first); overlap = time saved over
    running them back to back, as a fraction of the shorter one (1 = fully
    concurrent, 0 = serialised, as when the computing cores also move the data).
    """
    world = dist.get_world_size()
    if world < 2:
        return {"overlap": 1.0, "gemm_s": 0.0, "comm_s": 0.0, "both_s": 0.0}
    buf = torch.ones(4 * MIB // 4 * (1 if quick else 4), device=device)
    a = torch.randn(512, 512, device=device)
    gemm_iters = 8

    def gemms():
        x = a
        for _ in range(gemm_iters):
            x = x @ a
        return x

    def comm():
        dist.all_reduce(buf)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        gemms()
        work.wait()

    results = {}
    for name, fn in (("gemm_s", gemms), ("comm_s", comm), ("both_s", both)):
        dist.barrier()
        results[name] = _max_over_ranks(timed(fn, device, min_time_s=0.05 if quick else 0.3, max_iters=50), device)
    # Size the GEMM chain so both legs take about as long, then measure again.
    gemm_iters = max(1, round(gemm_iters * results["comm_s"] / max(results["gemm_s"], 1e-9)))
    for name, fn in (("gemm_s", gemms), ("both_s", both)):
        dist.barrier()
        results[name] = _max_over_ranks(timed(fn, device, min_time_s=0.05 if quick else 0.3, max_iters=50), device)
    saved = results["gemm_s"] + results["comm_s"] - results["both_s"]
    results["overlap"] = min(1.0, max(0.0, saved / min(results["gemm_s"], results["comm_s"])))
    return results


def _row(op: str, n: int, nbytes: int, t: float) -> dict:
    algbw = nbytes / t
    return {"op": op, "group_size": n, "bytes": nbytes, "time_s": t, "algbw_bytes_per_s": algbw,
            "busbw_bytes_per_s": algbw * BUS_FACTORS[op](n)}


def runtime_baseline_bytes() -> float:
    from executors.memory import status_bytes

    return status_bytes("RssAnon")["RssAnon"]


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor() or 'cpu'} ({os.cpu_count()} logical cores)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executors.profile_worker")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and sizes (tests)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    context = None
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        context = cuda_context_bytes(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)
    baseline = runtime_baseline_bytes() if device.type == "cpu" else float(torch.cuda.memory_reserved(device))
    started = datetime.now(timezone.utc)
    result = {
        "device": device.type, "backend": backend, "description": device_description(device),
        "hostname": platform.node(), "world_size": dist.get_world_size(), "local_world_size": local_world,
        "threads_per_rank": torch.get_num_threads(), "torch_version": torch.__version__,
        "started_utc": started.isoformat(timespec="seconds"), "quick": args.quick,
        "runtime_baseline_bytes": _max_over_ranks(baseline, device),
        "memory_total_bytes": _memory_total(device),
        "gemm": bench_gemm(device, args.quick), "memory": bench_memory(device, args.quick),
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "cuda_context_bytes": None if context is None else _max_over_ranks(context, device),
        "elementwise": bench_elementwise(device, args.quick), **bench_attention_kernels(device, args.quick),
        "op_overhead": bench_op_overhead(device), "small_kernel": bench_small_kernel(device),
        "optimizer": bench_optimizer(device, args.quick), "collectives": bench_collectives(device, args.quick),
        "overlap": bench_overlap(device, args.quick),
    }
    result["duration_s"] = (datetime.now(timezone.utc) - started).total_seconds()
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _memory_total(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    return 0.0


if __name__ == "__main__":
    sys.exit(main())
