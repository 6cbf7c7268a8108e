"""`meshplan profile`: measure this machine and write a GPU + cluster profile the planner loads."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from planner.cli.app import app
from planner.cli.common import Format, FormatOpt, emit_json, stderr, stdout
from planner.cli.text import MESSAGE_CHARS, plain, shown


def _arg(path: Path) -> str:
    """A path as one shell word, shown on one line: what the user pastes after `--cluster`."""
    return plain(shlex.quote(str(path)), MESSAGE_CHARS)


def _default_nproc(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    return max(2, os.cpu_count() or 1)


def _device_name(device: str) -> str:
    """The name of the GPU the default profile name is made from ('' on CPU)."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return ""


def print_summary(raw: dict, paths: list[Path]) -> None:
    from executors.profile_tables import ADAM_FP32_BYTES
    from executors.profiler import collective_summary, gemm_summary

    table = Table(title=f"{shown(raw['description'])}: {raw['world_size']} ranks, {raw['backend']}")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    for dtype, g in gemm_summary(raw).items():
        table.add_row(f"GEMM peak {dtype} (TFLOP/s)", f"{g['peak_flop_per_s'] / 1e12:.4f}")
        table.add_row(f"GEMM median / peak {dtype}", f"{g['median_fraction']:.2f}")
    table.add_row("copy bandwidth per rank (GB/s)", f"{raw['memory']['bytes_per_s'] / 1e9:.2f}")
    table.add_row("per-op overhead (us)", f"{raw['op_overhead']['time_per_op_s'] * 1e6:.2f}")
    table.add_row("small-kernel time (us)", f"{raw['small_kernel']['time_per_kernel_s'] * 1e6:.2f}")
    opt = raw["optimizer"]
    table.add_row(f"Adam step (GB/s, fp32, {ADAM_FP32_BYTES} B per parameter)",
                  f"{opt['params'] * ADAM_FP32_BYTES / opt['time_s'] / 1e9:.2f}")
    att = raw["attention"]["rows"]
    for direction in ("fwd", "bwd"):
        rates = [r["flop_per_s"] for r in att if r["direction"] == direction]
        if rates:
            table.add_row(f"attention {direction} best (TFLOP/s)", f"{max(rates) / 1e12:.4g}")
    if raw.get("cuda_context_bytes") is not None:
        table.add_row("CUDA context (MiB)", f"{raw['cuda_context_bytes'] / 2**20:.0f}")
    sizes = sorted({r["group_size"] for r in raw["collectives"]})
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        for n in sizes if op != "send_recv" else [2]:
            if not any(r["op"] == op and r["group_size"] == n for r in raw["collectives"]):
                continue
            s = collective_summary(raw, op, n)
            table.add_row(f"{op} x{n}: busbw (GB/s) / small-message time (us)",
                          f"{s['busbw_bytes_per_s'] / 1e9:.3f} / {s['small_message_s'] * 1e6:.0f}")
    stdout.print(table)
    stdout.print("\n".join(f"wrote {plain(p, MESSAGE_CHARS)}" for p in paths), markup=False, highlight=False)


@app.command("profile")
def profile_cmd(
    nproc: Annotated[Optional[int], typer.Option("--nproc", help="Ranks to measure with (default: all CPU cores, at least 2; or all GPUs).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu (gloo) or cuda (NCCL).")] = "auto",
    name: Annotated[Optional[str], typer.Option("--name", help="Profile name (default: local-cpu, or local-<gpu> on CUDA).")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--output", "--out-dir", "-o", help="Profiles root: writes <dir>/gpus/<name>.yaml, <dir>/clusters/<name>.yaml and <dir>/kernels/. Default: ~/.local/share/meshplan/profiles ($XDG_DATA_HOME), searched by name; another directory needs MESHPLAN_PROFILES. Never inside meshplan's own files.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Fewer shapes and message sizes (seconds instead of a minute).")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Wall-clock limit of the measurement, seconds.")] = 1200.0,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the temporary measurement directory (raw profile.json, logs) and print its path.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace the files of an existing profile of this name (without it, an existing file is refused before measuring).")] = False,
    fmt: FormatOpt = Format.table,
) -> None:
    """Measure GEMM and attention throughput, memory bandwidth, kernel and host overheads, the optimizer
    step and collective bandwidth/latency of this machine, and write a GPU and a cluster profile and
    the kernel tables (kernels/<topic>/<name>.yaml) from them (to your profiles directory, never into
    meshplan's)."""
    import shutil
    import tempfile

    from executors.launcher import Interrupted
    from executors.profiler import check_output_dir, check_targets, default_profile_name, run_profile, write_profiles
    from executors.validate import resolve_device
    from planner.cli.common import ExitWith
    from planner.cli.progress import status
    from planner.errors import SpecError
    from profiles import PROFILES_DIR, check_preset_name, search_dirs, user_profiles_dir
    from profiles.tables import TOPICS

    # Everything that could refuse the files is checked before a minute of measuring.
    if name is not None:  # the files are <name>.yaml
        check_preset_name("--name", name)
    root = check_output_dir(out_dir if out_dir is not None else user_profiles_dir())
    dev = resolve_device(device)
    if dev not in ("cpu", "cuda"):
        raise SpecError(f"--device must be auto, cpu or cuda (got {device!r})")
    ranks = nproc or _default_nproc(dev)
    if ranks < 1:
        raise SpecError(f"--nproc must be >= 1 (got {ranks})")
    if name is None:
        name = default_profile_name(dev, _device_name(dev))
    check_targets(name, root, force)
    work = Path(tempfile.mkdtemp(prefix="meshplan-profile-"))
    try:
        with status(f"measuring {ranks} ranks on {dev}{' (quick)' if quick else ''}..."):
            raw = run_profile(ranks, work, dev, quick, timeout)
    except Interrupted as exc:
        where = f"measurement files kept in {work}" if keep else "temporary files removed"
        raise ExitWith(exc.exit_code, f"{exc}: every process of the measurement stopped; {where}") from None
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    if keep:
        stderr.print(f"measurement files kept in {plain(work, MESSAGE_CHARS)}", markup=False, highlight=False)
    root.mkdir(parents=True, exist_ok=True)  # before writing: a root on the search path is referred to by name
    paths = write_profiles(raw, name, root, force)
    tables = {t: path for t in TOPICS if (path := root / "kernels" / t / f"{name}.yaml").exists()}
    on_path = any(root == d.resolve() for d in search_dirs())
    shadows = (PROFILES_DIR / "clusters" / f"{name}.yaml").exists()
    if not on_path:
        stderr.print(f"load it with --cluster {_arg(paths[1])}, or by name after export MESHPLAN_PROFILES={_arg(root)}",
                     markup=False, highlight=False)
    else:
        stderr.print(f"load it with --cluster {name}" + (" (it now hides the shipped preset of that name)"
                                                          if shadows else ""), markup=False, highlight=False)
    if fmt is Format.json:
        emit_json({"profile": raw, "gpu_yaml": str(paths[0]), "cluster_yaml": str(paths[1]),
                   "kernel_tables": {t: str(p) for t, p in tables.items()}})
    else:
        print_summary(raw, [*paths, *tables.values()])
