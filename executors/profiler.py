"""`meshplan profile`: measure this machine and write GPU + cluster profiles (no torch).

Runs `executors.profile_worker` under torchrun, then turns its measurements
into the two YAML files the planner loads (vendor units in the key names, like
every file in profiles/):

gpus/<name>.yaml
    memory_gib            available memory / ranks (CPU: MemAvailable x 0.9 / ranks;
                          CUDA: the device's total memory)
    peak_tflops.<dtype>   the fastest GEMM of the sweep, per dtype
    gemm_efficiency       median over the sweep of (GEMM rate / that peak), for the
                          dtype the ranks train in (fp32 on CPU, bf16 on CUDA)
    hbm_bw_gb_per_s       copy bandwidth per rank, all ranks copying at once
    hbm_efficiency        element-wise mix rate (layer norm, GELU, softmax, add) / copy rate,
                          at most 1: the fraction of the copy bandwidth element-wise kernels get
    kernel_overhead_us    time of a tiny element-wise op that records autograd
    framework_reserve_gib memory a rank holds before the model (runtime, libraries)
clusters/<name>.yaml
    intra_node            bw_gb_per_s: median all-reduce bus bandwidth over messages
                          >= 1 MiB; latency_us: per-hop latency, the median
                          small-message (<= 4 KiB) all-reduce time / (2 log2 n) hops
                          (the cost model's all-reduce latency term); efficiency 1.0
                          (the bandwidth is measured bus bandwidth)
    inter_node            a copy of intra_node: one machine has no second tier
kernels/<topic>/<name>.yaml   (kind: measured; the GPU profile's kernel_tables names them)
    gemm                  the (m, n, k) grid of the GEMM sweep, per dtype
    collectives           bus bandwidth by message size and group size
    attention, elementwise, memory   see executors.profile_tables
The full measurement tables are kept as comments in the files.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from executors.launcher import local_command, locked_dir, remove_stale_dirs, run_process, worker_env
from planner.specs.files import load_path, read_text, write_whole

GIB = 2**30
KIB, MIB = 2**10, 2**20
CPU_MEMORY_SHARE = 0.9  # leave 10% of MemAvailable to the OS and the launcher
TRAIN_DTYPE = {"cpu": "fp32", "cuda": "bf16"}
TEMP_PREFIX = "meshplan-profile-"
"""Name prefix of `meshplan profile`'s temporary measurement folders."""


def profile_command(nproc: int, out_dir: Path, device: str, quick: bool) -> list[str]:
    """The measurement's ranks on this machine (`executors.local_run`: the store on 127.0.0.1 only)."""
    return local_command(nproc, "executors.profile_worker",
                         ["--out", str(out_dir), "--device", device, *(["--quick"] if quick else [])])


PROJECT_PACKAGES = ("planner", "profiles", "executors", "cost_models", "benchmarks")


def _is_meshplan_checkout(path: Path) -> bool:
    """Whether `path` holds meshplan's pyproject.toml (read by the bounded reader: the folders above a
    user's --output are theirs, and a pipe or device there is no checkout)."""
    from planner.errors import SpecError

    if not (path / "pyproject.toml").exists():
        return False
    try:
        text = read_text(path / "pyproject.toml", "pyproject")
    except SpecError:
        return False
    return 'name = "meshplan"' in text


def protected_dir(target: Path) -> Path | None:
    """The installed meshplan package directory or meshplan checkout that `target` lies in, or None.
    Profiles are the user's data: writing them there would overwrite the shipped files (or be
    lost on the next install)."""
    target = target.expanduser().resolve()
    root = Path(__file__).resolve().parent.parent
    for pkg in PROJECT_PACKAGES:
        if (root / pkg).is_dir() and target.is_relative_to(root / pkg):
            return root / pkg
    for d in (target, *target.parents):
        if _is_meshplan_checkout(d):
            return d
    return None


def check_output_dir(target: Path) -> Path:
    """`target`, resolved, or SpecError when it lies inside the package or a checkout, or exists and
    is not a directory (checked before the measuring, which would otherwise be lost)."""
    from planner.errors import SpecError

    inside = protected_dir(target)
    if inside is not None:
        raise SpecError(f"--output ({target}) lies inside meshplan's own files ({inside}); profiles are written "
                        f"to a directory of your own (default: the user profiles directory)")
    resolved = target.expanduser().resolve()
    if resolved.exists() and not resolved.is_dir():
        raise SpecError(f"--output ({target}) is a file, not a directory: it is the profiles root that gpus/, "
                        "clusters/ and kernels/ are written in")
    return resolved


#: The default profile name on CUDA: `local-` and the device's name in lower case, other characters
#: as '-' (e.g. local-nvidia-h100-80gb-hbm3), cut to the longest preset name.
DEFAULT_NAME_PREFIX = "local-"


def default_profile_name(device: str, description: str) -> str:
    """`local-cpu`, or on CUDA `local-<device name>` reduced to a preset name (profiles.PRESET_NAME)."""
    from profiles import MAX_NAME_BYTES, check_preset_name

    if device == "cpu":
        return DEFAULT_NAME_PREFIX + "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", description.lower()).strip("-") or "gpu"
    name = (DEFAULT_NAME_PREFIX + slug)[:MAX_NAME_BYTES - len(".yaml")].rstrip("-")
    check_preset_name("the default profile name", name)
    return name


def profile_targets(name: str, root: Path) -> list[Path]:
    """Every file a profile called `name` may write (or remove, a stale kernel table) under `root`."""
    from profiles.tables import TOPICS

    return [root / "gpus" / f"{name}.yaml", root / "clusters" / f"{name}.yaml",
            *(root / "kernels" / topic / f"{name}.yaml" for topic in TOPICS)]


def check_target(path: Path, root: Path, force: bool = False) -> None:
    """Refuse to write `path` (a file under the profiles root `root`) when it is a symbolic link (it
    would be followed, overwriting what it points to), lies inside meshplan's own files once its
    folder is resolved, is not a regular file, or exists and `force` is False; or when a folder on
    the way to it is not a directory."""
    from planner.errors import SpecError

    if path.is_symlink():
        raise SpecError(f"{path} is a symbolic link; `meshplan profile` replaces only regular files (remove the "
                        "link, or choose another --name or --output)")
    for folder in (path.parent, *path.parent.parents):
        if folder == root:
            break
        if folder.exists() and not folder.is_dir():
            raise SpecError(f"{folder} is a file, not a directory: {path} cannot be written")
    resolved = path.parent.resolve() / path.name
    inside = protected_dir(resolved)
    if inside is not None:
        raise SpecError(f"{path} lies inside meshplan's own files ({inside}); profiles are written to a directory "
                        "of your own")
    if path.exists():
        if not path.is_file():
            raise SpecError(f"{path} exists and is not a regular file; `meshplan profile` does not replace it")
        if not force:
            raise SpecError(f"{path} exists; --force replaces it (and the other files of profile {path.stem!r})")


def check_targets(name: str, root: Path, force: bool = False) -> None:
    """`check_target` of every file of profile `name` under `root`: run before measuring, so that a run
    is never thrown away for a file it may not write."""
    for path in profile_targets(name, root):
        check_target(path, root, force)


def _write_file(path: Path, text: str, root: Path, force: bool) -> None:
    """Write `path` whole or not at all: a temporary file in its folder, then os.replace (which replaces
    a name, never following a link), after `check_target`."""
    check_target(path, root, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, text)


def run_profile(nproc: int, out_dir: Path, device: str = "cpu", quick: bool = False,
                timeout_s: float = 1200.0) -> dict[str, Any]:
    """Run the micro-benchmarks on `nproc` ranks; the raw measurements (see profile_worker).
    `out_dir` is locked while they run; when it is a temporary folder (`TEMP_PREFIX`), the
    folders of that name that killed runs left beside it are removed first."""
    from planner.errors import SpecError

    if out_dir.name.startswith(TEMP_PREFIX):
        remove_stale_dirs(out_dir.parent, TEMP_PREFIX)
    with locked_dir(out_dir, "the measurement folder"):
        proc = run_process(profile_command(nproc, out_dir, device, quick), timeout_s, out_dir, worker_env(device))
    path = out_dir / "profile.json"
    if proc.timed_out or not path.exists():
        why = f"timed out after {timeout_s:.0f} s" if proc.timed_out else f"exited with status {proc.return_code}"
        raise SpecError(f"hardware profile run {why}:\n{proc.stderr_tail}")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"hardware profile run left an unreadable {path}: {exc}") from None


# ---- summaries -------------------------------------------------------------
def gemm_summary(raw: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per dtype: peak FLOP/s (fastest GEMM) and the median fraction of it over the sweep."""
    out = {}
    for dtype in sorted({r["dtype"] for r in raw["gemm"]}):
        rates = [r["flop_per_s"] for r in raw["gemm"] if r["dtype"] == dtype]
        peak = max(rates)
        out[dtype] = {"peak_flop_per_s": peak, "median_fraction": statistics.median(x / peak for x in rates)}
    return out


def collective_summary(raw: dict[str, Any], op: str, group_size: int) -> dict[str, float]:
    rows = [r for r in raw["collectives"] if r["op"] == op and r["group_size"] == group_size]
    small = [r["time_s"] for r in rows if r["bytes"] <= 4 * KIB] or [min(r["time_s"] for r in rows)]
    large = [r["busbw_bytes_per_s"] for r in rows if r["bytes"] >= MIB] or [max(r["busbw_bytes_per_s"] for r in rows)]
    return {"small_message_s": statistics.median(small), "busbw_bytes_per_s": statistics.median(large)}


def all_reduce_hops(n: int) -> int:
    """Latency hops of one all-reduce in the cost model: 2·ceil(log2 n)."""
    return 2 * max(1, math.ceil(math.log2(n)))


# ---- YAML ------------------------------------------------------------------
def _source(raw: dict[str, Any]) -> str:
    return (f"measured by `meshplan profile` on {raw['hostname']} ({raw['description']}), {raw['started_utc']}, "
            f"torch {raw['torch_version']}, backend {raw['backend']}, {raw['world_size']} ranks x "
            f"{raw['threads_per_rank']} threads, all ranks measuring at once")


def gpu_profile(raw: dict[str, Any], name: str) -> dict[str, Any]:
    gemm = gemm_summary(raw)
    train_dtype = TRAIN_DTYPE[raw["device"]] if TRAIN_DTYPE[raw["device"]] in gemm else next(iter(gemm))
    if raw["device"] == "cpu":
        memory = raw["memory_total_bytes"] * CPU_MEMORY_SHARE / raw["local_world_size"]
        memory_rule = f"MemAvailable x {CPU_MEMORY_SHARE} / {raw['local_world_size']} ranks"
    else:
        memory, memory_rule = raw["memory_total_bytes"], "device total memory"
    return {
        "name": name,
        "memory_gib": round(memory / GIB, 3),
        "peak_tflops": {k: round(v["peak_flop_per_s"] / 1e12, 5) for k, v in gemm.items()},
        "hbm_bw_gb_per_s": round(raw["memory"]["bytes_per_s"] / 1e9, 3),
        "gemm_efficiency": round(gemm[train_dtype]["median_fraction"], 4),
        "hbm_efficiency": round(min(1.0, raw["elementwise"]["bytes_per_s"] / raw["memory"]["bytes_per_s"]), 4),
        "kernel_overhead_us": round(raw["op_overhead"]["time_per_op_s"] * 1e6, 3),
        "framework_reserve_gib": round(raw["runtime_baseline_bytes"] / GIB, 4),
        "framework_reserve_source": "measured: resident memory of one rank after torch and the process group "
                                    "are initialised, before the model",
        "calibration": f"from this profile's micro-benchmarks, not from training runs: peak_tflops = fastest GEMM "
                       f"of the sweep; gemm_efficiency = median {train_dtype} GEMM rate / that peak; memory_gib = "
                       f"{memory_rule}; hbm_bw = copy rate; hbm_efficiency = element-wise mix (layer norm, GELU, softmax, "
                       f"add) rate / copy rate",
        "source": _source(raw),
    }


def gemm_table_profile(raw: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The measured GEMM table (profiles/kernels/gemm/<name>.yaml, the format of the public ones:
    `profiles.gemm`): every dtype's rate on the largest full (m, n, k) grid among the
    measured shapes, as b = 1 rows; the peak is the dtype's fastest GEMM of the sweep, so every
    efficiency is at most 1. None when the shapes hold no grid of at least 2 sizes a side."""
    dtypes = sorted({r["dtype"] for r in raw["gemm"]})
    rate = {(r["dtype"], r["m"], r["n"], r["k"]): r["flop_per_s"] for r in raw["gemm"]}
    sizes = sorted({r["m"] for r in raw["gemm"]} | {r["n"] for r in raw["gemm"]} | {r["k"] for r in raw["gemm"]})
    def full(g):
        return all((d, m, n, k) in rate for d in dtypes for m in g for n in g for k in g)

    grid = [s for s in sizes if all((d, s, s, s) in rate for d in dtypes)]
    while len(grid) >= 2 and not full(grid):
        grid = grid[:-1]
    if len(grid) < 2:
        return None
    peaks = gemm_summary(raw)
    rows = [[1, m, n, k, *(round(rate[(d, m, n, k)] / 1e12, 6) for d in dtypes)]
            for m in grid for n in grid for k in grid]
    return {"kind": "measured", "gpu": raw["description"], "source": _source(raw),
            "peak_tflops": {d: round(peaks[d]["peak_flop_per_s"] / 1e12, 6) for d in dtypes},
            "peak_tflops_source": "the fastest GEMM of this profile's sweep, per dtype",
            "columns": ["b", "m", "n", "k", *dtypes], "rows": rows}


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def collectives_table_profile(raw: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The measured collective curves (profiles/kernels/collectives/<name>.yaml, the format of the
    public ones: `cost_models.collectives`): per operation and group size, the message sizes and the
    nccl-tests bus bandwidth measured, as the tier inside one machine. None unless all four
    operations were measured at two sizes or more for some group size."""
    tier: dict[str, list[dict[str, Any]]] = {}
    for op in COLLECTIVE_OPS:
        curves = []
        for n in sorted({r["group_size"] for r in raw["collectives"] if r["op"] == op}):
            rows = sorted((r for r in raw["collectives"] if r["op"] == op and r["group_size"] == n),
                          key=lambda r: r["bytes"])
            if n >= 2 and len(rows) >= 2 and all(r["busbw_bytes_per_s"] > 0 for r in rows):
                curves.append({"group_size": int(n), "bytes": [int(r["bytes"]) for r in rows],
                               "busbw_gb_per_s": [round(r["busbw_bytes_per_s"] / 1e9, 6) for r in rows]})
        if not curves:
            return None
        tier[op] = curves
    return {"kind": "measured", "gpu": raw["description"], "source": _source(raw),
            "convention": "nccl-tests bus bandwidth (doc/PERFORMANCE.md): all-reduce 2(n-1)/n, the others (n-1)/n "
                          "times bytes / time; bytes = the full buffer",
            "tiers": {"nvlink": tier}}


def cluster_profile(raw: dict[str, Any], name: str, gpu_ref: str | dict[str, Any]) -> dict[str, Any]:
    n = raw["world_size"]
    if n < 2:
        tier = {"name": "none", "bw_gb_per_s": 1.0, "latency_us": 0.0, "efficiency": 1.0}
    else:
        ar = collective_summary(raw, "all_reduce", n)
        gs = [collective_summary(raw, op, n)["busbw_bytes_per_s"] for op in ("all_gather", "reduce_scatter")]
        tier = {
            "name": f"{raw['backend']}-local",
            "bw_gb_per_s": round(ar["busbw_bytes_per_s"] / 1e9, 4),
            "latency_us": round(ar["small_message_s"] / all_reduce_hops(n) * 1e6, 2),
            "efficiency": 1.0,
            "gather_scatter_efficiency": round(min(1.0, statistics.median(gs) / ar["busbw_bytes_per_s"]), 4),
        }
    return {
        "name": name,
        "gpu": gpu_ref,
        "gpus_per_node": raw["local_world_size"],
        "max_gpus": n,
        "intra_node": tier,
        "inter_node": dict(tier, name=f"{tier['name']} (single machine: copy of intra_node)"),
        "comm_overlap": round(raw["overlap"]["overlap"], 3) if "overlap" in raw else 1.0,
        "source": _source(raw) + "; bw = median all-reduce bus bandwidth (nccl-tests convention) over messages "
                  ">= 1 MiB; latency = median all-reduce time for messages <= 4 KiB / 2 log2(n) hops; "
                  "gather_scatter_efficiency = median all-gather and reduce-scatter bus bandwidth / all-reduce's; "
                  "comm_overlap = share of a 16 MiB all-reduce hidden behind a concurrent GEMM chain",
    }


def measurement_comments(raw: dict[str, Any]) -> list[str]:
    lines = [f"Measurements ({raw['device']}, {raw['backend']}, {raw['world_size']} ranks, {raw['duration_s']:.0f} s):",
             "GEMM  dtype  m x n x k  TFLOP/s"]
    for r in raw["gemm"]:
        lines.append(f"  {r['dtype']:5s} {r['m']}x{r['n']}x{r['k']}  {r['flop_per_s'] / 1e12:.4f}")
    mem = raw["memory"]
    lines.append(f"copy {mem['bytes'] / MIB:.0f} MiB: {mem['bytes_per_s'] / 1e9:.2f} GB/s (read + write) per rank")
    for name, r in raw["elementwise"]["ops"].items():
        lines.append(f"element-wise {name}: {r['bytes_per_s'] / 1e9:.2f} GB/s")
    lines.append(f"element-wise mix: {raw['elementwise']['bytes_per_s'] / 1e9:.2f} GB/s")
    att = raw["attention"]
    lines.append(f"SDPA ({att['dtype']}, {att['tokens']} tokens per call, hidden {att['hidden']})  direction  mask  "
                 f"head dim  seq_len  TFLOP/s")
    for r in att["rows"]:
        lines.append(f"  {r['direction']} {'causal' if r['causal'] else 'none  '} {r['head_dim']:4d} {r['seq_len']:6d} "
                     f"{r['flop_per_s'] / 1e12:.4g}")
    for r in att["skipped"]:
        lines.append(f"  not run: {r['direction']} causal={r['causal']} d={r['head_dim']} s={r['seq_len']}: {r['reason']}")
    if raw.get("attention_flash2"):
        fa2 = raw["attention_flash2"]
        lines.append(f"SDPA FlashAttention-2: {len(fa2['rows'])} cases measured, {len(fa2['skipped'])} not run")
    lines.append(f"per-op overhead: {raw['op_overhead']['time_per_op_s'] * 1e6:.2f} us")
    lines.append(f"small kernel: {raw['small_kernel']['time_per_kernel_s'] * 1e6:.2f} us ({raw['small_kernel']['method']})")
    opt = raw["optimizer"]
    lines.append(f"{opt['implementation']} step, {opt['params']} fp32 parameters: {opt['time_s'] * 1e3:.3f} ms")
    if raw.get("cuda_context_bytes") is not None:
        lines.append(f"CUDA context: {raw['cuda_context_bytes'] / MIB:.0f} MiB")
    if "overlap" in raw:
        ov = raw["overlap"]
        lines.append(f"overlap: GEMMs {ov['gemm_s'] * 1e3:.1f} ms, all-reduce {ov['comm_s'] * 1e3:.1f} ms, both at once "
                     f"{ov['both_s'] * 1e3:.1f} ms -> comm_overlap {ov['overlap']:.2f}")
    lines.append("collective  ranks  bytes  time (us)  busbw (GB/s)")
    for r in raw["collectives"]:
        lines.append(f"  {r['op']:14s} {r['group_size']} {r['bytes']:>9d} {r['time_s'] * 1e6:10.1f} "
                     f"{r['busbw_bytes_per_s'] / 1e9:9.4f}")
    return lines


def _dump(data: dict[str, Any], comments: list[str]) -> str:
    head = "".join(f"# {line}\n" for line in comments)
    return head + yaml.safe_dump(data, sort_keys=False, width=120)


def _written_by_profile(path: Path) -> bool:
    """Whether `path` is a kernel table `meshplan profile` wrote (kind: measured, its source line); read
    by the bounded reader, so a file that is not one (a pipe, a huge or broken file) is left alone."""
    from planner.errors import SpecError

    try:
        data = load_path(path, "kernel table")
    except SpecError:
        return False
    return isinstance(data, dict) and data.get("kind") == "measured" and str(data.get("source", "")).startswith(
        "measured by `meshplan profile`")


def write_profiles(raw: dict[str, Any], name: str, root: Path, force: bool = False) -> tuple[Path, Path]:
    """Write root/gpus/<name>.yaml, root/clusters/<name>.yaml and the measured kernel tables
    root/kernels/<topic>/<name>.yaml; the cluster names its GPU preset when `root` is on the profile
    search path, and embeds it otherwise. A measured table of an earlier run that this run cannot
    write (e.g. no full GEMM grid) is removed, so that the set holds this run's numbers only.

    Nothing is written unless every file may be (`check_targets`: a name that is not a preset name,
    a symbolic link, meshplan's own files, or an existing file without `force` is refused); each file
    is written whole (`_write_file`)."""
    from executors.profile_tables import attention_table_profile, elementwise_table_profile, memory_table_profile
    from profiles import check_preset_name, search_dirs
    from profiles.tables import TOPICS

    check_preset_name("name", name)
    check_targets(name, root, force)

    gpu = gpu_profile(raw, name)
    source = _source(raw)
    tables = {topic: t for topic, t in (
        ("gemm", gemm_table_profile(raw, name)),
        ("attention", attention_table_profile(raw, source)),
        ("elementwise", elementwise_table_profile(raw, gpu["hbm_bw_gb_per_s"] * 1e9, source)),
        ("collectives", collectives_table_profile(raw, name)),
        ("memory", memory_table_profile(raw, source))) if t is not None}
    if tables:
        gpu["kernel_tables"] = name
        gpu["kernel_tables_source"] = (", ".join(f"kernels/{topic}/{name}.yaml" for topic in tables)
                                       + " beside this file, measured by the same run (fields it does not measure "
                                       "say where they are carried from)")
    on_path = any(root.resolve() == d.resolve() for d in search_dirs())
    cluster = cluster_profile(raw, name, name if on_path else gpu)
    comments = [f"Written by `meshplan profile` on {datetime.now().date().isoformat()}; re-run it to refresh.",
                *measurement_comments(raw)]
    gpu_path, cluster_path = root / "gpus" / f"{name}.yaml", root / "clusters" / f"{name}.yaml"
    _write_file(gpu_path, _dump(gpu, comments), root, force)
    for topic, table in tables.items():
        _write_file(root / "kernels" / topic / f"{name}.yaml", _dump(table, comments), root, force)
    for topic in set(TOPICS) - set(tables):
        stale = root / "kernels" / topic / f"{name}.yaml"
        if stale.is_file() and not stale.is_symlink() and _written_by_profile(stale):
            stale.unlink()
    _write_file(cluster_path, _dump(cluster, comments), root, force)
    return gpu_path, cluster_path
