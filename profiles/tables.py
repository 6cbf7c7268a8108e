"""Kernel-level performance tables: `kernels/<topic>/<name>.yaml` under each profiles root.

A GPU profile names its table set with `kernel_tables:` (default: the GPU preset's own file
name); each topic is one file, so a GPU can take its GEMM table from public measurements and its
collective curves from `meshplan profile`. Topics:

  gemm          achieved FLOP/s by GEMM shape and dtype (`profiles.gemm`)
  attention     flash-attention forward/backward throughput by sequence length and head size
  elementwise   achieved bandwidth of element-wise, norm and optimizer kernels, launch and host overhead
  collectives   bus bandwidth by message size, group size and tier
  memory        allocator, communication-buffer and context memory
  dispatch      MoE token dispatchers (DeepEP, HybridEP): dispatch and combine bandwidth by group size

A file may instead say `same_as: <other set>` with a `source:` giving the reason (the H200 runs the
H100's GEMM kernels on the same die); the other set's table is then used, its source appended.

Every table file is a mapping with `kind:` — `public` (measured by others, `source:` says where:
document, table, commit) or `measured` (written by `meshplan profile` on the machine itself, `source:`
says which run) — and `gpu:`, the GPU it was measured on. Files are parsed once (`read_yaml` caches by
path and modification time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.errors import SpecError
from profiles.files import find_file, read_yaml

TOPICS = ("gemm", "attention", "elementwise", "collectives", "memory", "dispatch")
KINDS = ("public", "measured")


def table_path(topic: str, name: str | None) -> Path | None:
    """The file of `topic` for table set `name`, searching the profiles roots in order; None if absent."""
    if topic not in TOPICS:
        raise SpecError(f"unknown kernel-table topic {topic!r}; known: {', '.join(TOPICS)}")
    if not name:
        return None
    return find_file(f"kernels/{topic}", name)


def kernel_table(topic: str, name: str | None) -> dict[str, Any] | None:
    """The parsed table of `topic` for table set `name` (a fresh copy), or None when there is none.
    A file without a `source:` or with an unknown `kind:` is refused, naming the file."""
    path = table_path(topic, name)
    if path is None:
        return None
    data = read_yaml(path, f"{topic} kernel table")
    if not isinstance(data, dict):
        raise SpecError(f"kernel table {path} must be a mapping")
    if data.get("kind") not in KINDS:
        raise SpecError(f"kernel table {path}: kind must be one of {', '.join(KINDS)}, got {data.get('kind')!r}")
    if not str(data.get("source", "")).strip():
        raise SpecError(f"kernel table {path} has no source: every table names where its numbers come from")
    alias = data.get("same_as")
    if alias is not None:
        if alias == name:
            raise SpecError(f"kernel table {path}: same_as names the file itself")
        target = kernel_table(topic, str(alias))
        if target is None:
            raise SpecError(f"kernel table {path}: same_as {alias!r} has no {topic} table")
        if target.get("same_as") is not None:
            raise SpecError(f"kernel table {path}: same_as {alias!r} is itself an alias; name the measured table")
        target["source"] = f"{data['source']} [{topic} table {alias}: {target['source']}]"
        target["alias_of"] = str(alias)
        return target
    return data


def provenance(name: str | None) -> dict[str, str]:
    """Per topic, where table set `name`'s numbers come from: 'measured (<gpu>)', 'public (<gpu>)', or
    'none' (the cost model then uses the GPU profile's calibrated constants for that part)."""
    out = {}
    for topic in TOPICS:
        table = kernel_table(topic, name)
        out[topic] = "none" if table is None else f"{table['kind']} ({table.get('gpu', '?')})"
    return out
