"""The tables the cost model reads, resolved once: `ProfileTables`, attached to a GPU (`GpuSpec.tables`).

The cost model (`cost_models`) reads no file: everything it takes from the profile roots comes with
the GPU it prices, as typed objects built here from

- the GPU's kernel-table set (`GpuSpec.kernel_tables`; `profiles.tables`): its GEMM, attention,
  element-wise, collectives, memory and dispatch tables, each None (or empty) where the set has none;
- the framework profiles (`frameworks/<name>.yaml`) and the ZeRO-3 implementations (`frameworks/zero3.yaml`).

Each file is looked up in the profile roots in order (`profiles.files.search_dirs`: MESHPLAN_PROFILES,
the user's own directory, the shipped files), so a user's copy of any of them applies. A table is built
once per file version (path, modification time and size, of the file and of the file a `same_as` names):
two clusters loaded from different roots, or before and after a file changed, get different objects,
and loading the same files again gives the same ones (which the cost model's own caches key by).

`resolve_gpu` / `resolve_cluster` attach the tables to a GPU that has none, or whose tables were
resolved for another `kernel_tables` (a copy with that field changed); `profiles.load_gpu`,
`profiles.load_cluster` and so `planner.api.plan` / `evaluate` call them. A GPU keeps the tables it
was resolved with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from planner.errors import SpecError
from planner.specs import ClusterSpec, GpuSpec
from profiles.topology import with_fabric
from profiles.attention import AttentionTable, attention_tables_from
from profiles.collectives import Curves, curves_from_table
from profiles.dispatch import DispatchMeasurements, dispatch_measurements_from
from profiles.elementwise import ElementwiseTable, elementwise_table_from
from profiles.files import file_stamp, find_file, parsed_yaml
from profiles.frameworks import FRAMEWORKS, Framework, Zero3Impl, framework_from, zero3_impls_from
from profiles.gemm import GemmTable, build_gemm_table
from profiles.memory import MemoryTable, memory_table_from
from profiles.tables import TOPICS, kernel_table, table_path

Stamp = tuple[str, int, int]


@dataclass(frozen=True, eq=False)
class ProfileTables:
    """Everything the cost model reads from the profile roots for one GPU (see the module docstring).
    Compared by identity: the same files give the same object."""

    kernel_set: str | None  # the GPU's `kernel_tables` these were resolved for
    frameworks: dict[str, Framework]
    zero3: dict[str, Zero3Impl]
    gemm: GemmTable | None = None
    attention: dict[str, AttentionTable] = field(default_factory=dict)  # kernel -> table ('flash': the file)
    elementwise: ElementwiseTable | None = None
    collectives: dict[str, dict[str, Curves]] | None = None  # tier -> operation -> curves
    memory: MemoryTable | None = None
    dispatch: DispatchMeasurements | None = None

    def framework(self, name: str) -> Framework:
        """The profile of framework `name` (SpecError naming the known ones for another name)."""
        try:
            return self.frameworks[name]
        except KeyError:
            raise SpecError(f"framework {name!r} is not one of {', '.join(self.frameworks)}") from None


def _stamps(topic: str, name: str | None) -> tuple[Stamp, ...]:
    """The file versions topic `topic` of set `name` reads: its file and the file its `same_as` names
    (none when the set has no such table)."""
    path = table_path(topic, name)
    if path is None:
        return ()
    out = [file_stamp(path, f"{topic} kernel table")]
    alias = parsed_yaml(path, f"{topic} kernel table").get("same_as")
    target = table_path(topic, str(alias)) if alias is not None and alias != name else None
    if target is not None:
        out.append(file_stamp(target, f"{topic} kernel table"))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _topic(topic: str, name: str, stamps: tuple[Stamp, ...]):
    """Topic `topic` of set `name` as a typed table, built once per file version (`stamps`)."""
    data = kernel_table(topic, name)
    if data is None:
        return None
    measured = str(data.get("alias_of", name))  # the set that measured it (a `same_as` file's target)
    if measured != name and topic in ("collectives", "dispatch"):  # the measured set's own object, shared
        return _topic(topic, measured, _stamps(topic, measured))
    if topic == "gemm":
        return build_gemm_table(data, f"GEMM table {name}")
    if topic == "attention":
        return attention_tables_from(name, data, measured)
    if topic == "elementwise":
        return elementwise_table_from(data, f"elementwise kernel table {table_path(topic, name)}")
    if topic == "collectives":
        return curves_from_table(data, measured)
    if topic == "memory":
        return memory_table_from(data, f"memory table {table_path(topic, name)}")
    return dispatch_measurements_from(data, measured)


@functools.lru_cache(maxsize=64)
def _framework_file(name: str, stamp: Stamp):
    """frameworks/<name>.yaml (`zero3`: the ZeRO-3 implementations) as typed objects, once per file version."""
    doc = parsed_yaml(stamp[0], "framework profile")
    if name == "zero3":
        return zero3_impls_from(doc, stamp[0])
    return framework_from(doc, name, stamp[0])


def _framework_stamp(name: str) -> Stamp:
    path = find_file("frameworks", name)
    if path is None:
        raise SpecError(f"framework profile {name!r}: no frameworks/{name}.yaml in any profile root")
    return file_stamp(path, "framework profile")


def load_tables(kernel_set: str | None) -> ProfileTables:
    """The tables of kernel-table set `kernel_set` (None: no kernel tables) and the framework profiles,
    from the profile roots as they are now (see the module docstring).

    >>> load_tables("h100-sxm") is load_tables("h100-sxm"), load_tables(None).gemm is None
    (True, True)
    """
    kernels = tuple(_stamps(topic, kernel_set) for topic in TOPICS)
    return _bundle(kernel_set, kernels, tuple(_framework_stamp(name) for name in (*FRAMEWORKS, "zero3")))


@functools.lru_cache(maxsize=64)
def _bundle(kernel_set: str | None, kernels: tuple[tuple[Stamp, ...], ...], frameworks: tuple[Stamp, ...]
            ) -> ProfileTables:
    """The tables of these file versions (one object per versions, so the same files give the same object)."""
    topic = {t: _topic(t, str(kernel_set), stamps) if stamps else None for t, stamps in zip(TOPICS, kernels)}
    return ProfileTables(kernel_set, {name: _framework_file(name, stamp) for name, stamp in zip(FRAMEWORKS, frameworks)},
                         _framework_file("zero3", frameworks[-1]), gemm=topic["gemm"],
                         attention=topic["attention"] or {}, elementwise=topic["elementwise"],
                         collectives=topic["collectives"], memory=topic["memory"], dispatch=topic["dispatch"])


def resolve_gpu(gpu: GpuSpec) -> GpuSpec:
    """`gpu` with its tables (`load_tables` of its `kernel_tables`); a GPU that already carries tables for
    its `kernel_tables` is returned as it is."""
    return gpu if gpu.has_tables else gpu.with_tables(load_tables(gpu.kernel_tables))


def resolve_cluster(cluster: ClusterSpec) -> ClusterSpec:
    """`cluster` with its GPU's tables resolved (`resolve_gpu`) and its fabric derived from its topology
    graph (`profiles.topology.with_fabric`; a graph file's relative path is read from the working directory)."""
    gpu = resolve_gpu(cluster.gpu)
    cluster = with_fabric(cluster)
    return cluster if gpu is cluster.gpu else cluster.model_copy(update={"gpu": gpu})
