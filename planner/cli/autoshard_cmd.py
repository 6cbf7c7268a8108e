"""`meshplan autoshard`: solve the sharding of any PyTorch module's operators (planner.autoshard)."""

from __future__ import annotations

import re
from typing import Annotated, Optional

import typer
from rich.table import Table

from planner.cli.app import app
from planner.cli.common import ClusterOpt, Format, FormatOpt, emit_csv, emit_json, gib, stdout
from planner.cli.text import plain, shown
from planner.errors import SpecError

_MESH = re.compile(r"^\d+(x\d+)?$")
_INDEX = re.compile(r"\.\d+\.")


def parse_mesh(text: str | None) -> tuple[int, ...] | None:
    """``8`` or ``4x2`` (inner axis first)."""
    if text is None:
        return None
    if not _MESH.match(text.strip()):
        raise SpecError(f"--mesh: {text!r} must be N or NxM (inner axis first), e.g. 4x2")
    return tuple(int(a) for a in text.strip().split("x"))


def grouped_params(params: dict[str, list[str]]) -> list[tuple[str, list[str], int]]:
    """Parameters whose names differ only in a block index and share a placement, as one row
    ('blocks.*.attn.q.weight', placement, count)."""
    rows: dict[tuple[str, tuple], int] = {}
    for fqn, placement in params.items():
        key = (_INDEX.sub(".*.", fqn), tuple(placement))
        rows[key] = rows.get(key, 0) + 1
    return [(name, list(placement), count) for (name, placement), count in rows.items()]


@app.command("autoshard")
def autoshard_cmd(
    factory: Annotated[str, typer.Argument(help="The module's factory, package.module:function (imported, then "
                                                "called with the --factory-arg values to build the module on the "
                                                "meta device).")],
    input_shape: Annotated[list[str], typer.Option(
        "--input-shape", "-i", help="One micro-batch's input, in order, repeated per input: SHAPE[:DTYPE[:HIGH]], "
        "e.g. 8,1024:int64:50304 (token ids below 50304) or 8,3,224,224.")],
    cluster: ClusterOpt = "dgx-h100",
    gpus: Annotated[int, typer.Option("--gpus", "-n", help="Devices to shard over.")] = 8,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline stages (gpus / pp devices each).")] = 1,
    micro_batches: Annotated[Optional[int], typer.Option(
        "--micro-batches", help="Micro-batches per step (default 1, or 2 x pp with a pipeline).")] = None,
    mesh: Annotated[Optional[str], typer.Option(
        "--mesh", help="One stage's device mesh, N or NxM with the inner (fastest-linked) axis first "
        "(default: the fastest of 1-D and every 2-D shape).")] = None,
    memory_gib: Annotated[Optional[float], typer.Option(
        "--memory-gib", help="Memory budget per device, GiB (default: the GPU's memory less its reserve).")] = None,
    precision: Annotated[str, typer.Option("--precision", help="bf16, fp16 or fp32.")] = "bf16",
    optimizer: Annotated[str, typer.Option("--optimizer", help="adam or sgd.")] = "adam",
    factory_arg: Annotated[Optional[list[str]], typer.Option(
        "--factory-arg", help="NAME=VALUE passed to the factory (int, float, true/false or text), repeatable.")]
    = None,
    app_dir: Annotated[str, typer.Option("--app-dir", help="Folder the factory's package is imported from "
                                                           "(put first on the import path).")] = ".",
    time_limit: Annotated[float, typer.Option("--time-limit", help="Seconds the integer program may run per "
                                                                   "solve.")] = 30.0,
    fmt: FormatOpt = Format.table,
) -> None:
    """Trace a module's operator graph and choose each operator's sharding (Colossal-AI-style auto-parallel)."""
    from planner.autoshard.api import autoshard
    from planner.autoshard.inputs import load_factory, parse_factory_arg, parse_input

    inputs = tuple(parse_input(text) for text in input_shape)
    kwargs = dict(parse_factory_arg(text) for text in factory_arg or [])
    build = load_factory(factory, app_dir)
    budget = None if memory_gib is None else memory_gib * 2**30
    if memory_gib is not None and not memory_gib > 0:
        raise SpecError(f"--memory-gib: must be positive, got {memory_gib:g}")

    def module():
        try:
            return build(**kwargs)
        except TypeError as err:
            raise SpecError(f"--factory-arg: {factory} does not take these arguments ({err})") from None

    result = autoshard(module, inputs, cluster, gpus, memory_budget_bytes=budget, pp=pp, mesh_shape=parse_mesh(mesh),
                       precision=precision, optimizer=optimizer, micro_batches=micro_batches, time_limit_s=time_limit)
    if fmt == Format.json:
        emit_json(result.model_dump(mode="json"))
        return
    if fmt == Format.csv:
        emit_csv([{"name": n.name, "kind": n.kind, "module": n.module, "strategy": n.strategy,
                   "output": " ".join(n.output), "compute_s": n.compute_s, "comm_s": n.comm_s,
                   "reshard_s": n.reshard_s, "memory_bytes": n.memory_bytes, "stage": n.stage} for n in result.nodes])
        return
    _print(result)


def _print(result) -> None:
    out = stdout
    out.print(f"{shown(result.cluster)} ({shown(result.gpu)}), {result.num_gpus} devices: mesh "
              f"{' x '.join(str(a) for a in result.mesh_shape)} per stage"
              + (f", {result.pp} pipeline stages, {result.micro_batches} micro-batches" if result.pp > 1 else ""))
    for name in result.mesh_axes:
        out.print(f"  axis: {name}")
    out.print(f"predicted step {result.step_time_s * 1e3:.3f} ms, peak memory {gib(result.peak_memory_bytes)} "
              f"of {gib(result.memory_budget_bytes)} GiB per device")
    out.print("time: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in result.time_s.items() if v))
    out.print("memory (GiB): " + ", ".join(f"{k} {gib(v)}" for k, v in result.memory_bytes.items()))
    out.print(f"solver: {result.solver}{' (optimal)' if result.optimal else ' (not proven optimal)'}, "
              f"{result.solve_time_s:.2f} s; trace {result.trace_time_s:.2f} s, {result.num_graph_nodes} ops")
    out.print(f"  {plain(result.solver_note, 2000)}", markup=False, highlight=False)
    table = Table(title="parameter placements (one per mesh axis)")
    table.add_column("parameter")
    table.add_column("placement")
    table.add_column("count", justify="right")
    for name, placement, count in grouped_params(result.params):
        table.add_row(shown(name), ", ".join(placement), str(count))
    out.print(table)
    if result.pp > 1:
        stages = Table(title="pipeline stages")
        for col in ("stage", "ops", "first", "last", "ms / micro-batch", "memory GiB", "sends GiB"):
            stages.add_column(col)
        for s in result.stages:
            stages.add_row(str(s.index), str(s.num_nodes), shown(s.first), shown(s.last), f"{s.time_s * 1e3:.3f}",
                           gib(s.memory_bytes), gib(s.send_bytes))
        out.print(stages)
    if result.unknown_ops:
        out.print("kept replicated (no sharding rule): " + ", ".join(shown(t) for t in result.unknown_ops))
