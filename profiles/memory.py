"""The runtime-memory table (`profiles/kernels/memory/<set>.yaml`) as a typed object: what a GPU
generation's CUDA context, NCCL connections and caching allocator take beyond the model's tensors
(`cost_models.memory.runtime_memory_bytes` uses it)."""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import SpecError

MIB = 2**20


@dataclass(frozen=True)
class MemoryTable:
    """A GPU generation's runtime memory (profiles/kernels/memory/<name>.yaml), bytes.

    cuda_context_bytes: device memory of the CUDA context with lazy module loading.
    nccl_connection_bytes: NCCL's buffers for one connection (one peer, one channel: the
      SIMPLE, LL and LL128 protocol FIFOs; NCCL_BUFFSIZE is the SIMPLE one, 4 MiB by default).
    nccl_channels: channels NCCL opens per connection on this GPU's intra-node fabric.
    allocator_slack_fraction: memory the caching allocator holds beyond the live tensors at
      the peak (reserved / allocated - 1).
    """

    cuda_context_bytes: float
    nccl_connection_bytes: float
    nccl_channels: int
    allocator_slack_fraction: float


#: YAML keys of a memory table, with their unit factor and the field they fill
_TABLE_KEYS = (("cuda_context_mib", MIB, "cuda_context_bytes"),
               ("nccl_connection_mib", MIB, "nccl_connection_bytes"),
               ("nccl_channels", 1, "nccl_channels"),
               ("allocator_slack_fraction", 1, "allocator_slack_fraction"))


def memory_table_from(data: dict, where: str) -> MemoryTable:
    """Parse a memory table; a SpecError naming `where` and the key on a bad one."""
    values = {}
    for key, factor, field in _TABLE_KEYS:
        value = data.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise SpecError(f"{where}: {key} must be a number >= 0, got {value!r}")
        values[field] = value * factor
    values["nccl_channels"] = int(values["nccl_channels"])
    return MemoryTable(**values)
