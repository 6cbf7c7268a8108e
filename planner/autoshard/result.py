"""What an auto-parallel solve returns: DTensor placements per parameter and activation, the per-node choices,
the pipeline stages, the cost breakdown and how the solve went. The JSON (`--format json`) is this model's dump.

Placements are written as DTensor writes them, one per mesh axis: ``"Replicate()"``, ``"Shard(d)"`` and
``"Partial()"`` (a partial sum, reduced by the consumer's resharding).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeChoice(_Model):
    """The strategy chosen for one operator."""

    name: str = Field(description="The traced node's name.")
    kind: str = Field(description="Its kind (planner.autoshard.ops.KINDS).")
    target: str = Field(description="The traced op.")
    module: str = Field(description="The innermost module that ran it ('' for the root).")
    strategy: str = Field(description="The strategy's name, one part per mesh axis (e.g. 'batch|column').")
    inputs: list[list[str]] = Field(description="Placements the op reads each activation input in, per mesh axis.")
    output: list[str] = Field(description="Placements of its output, per mesh axis.")
    params: dict[str, list[str]] = Field(default_factory=dict, description="Placements of the parameters it reads.")
    compute_s: float = Field(description="Forward plus backward kernel seconds on one device.")
    comm_s: float = Field(description="Seconds of its own communication: gradient reduction and in-op exchanges.")
    reshard_s: float = Field(description="Seconds resharding its inputs (forward) and their gradients (backward).")
    memory_bytes: float = Field(description="Bytes per device: its parameters' share with gradients and optimizer "
                                            "state, and the activations it keeps for the backward.")
    stage: int = Field(0, description="The pipeline stage it runs in.")


class Stage(_Model):
    """One pipeline stage: a contiguous run of the topological order."""

    index: int
    first: str = Field(description="Its first node.")
    last: str = Field(description="Its last node.")
    num_nodes: int
    modules: list[str] = Field(description="Top-level modules whose operators it runs, in order.")
    time_s: float = Field(description="Forward plus backward seconds of one micro-batch on this stage.")
    memory_bytes: float = Field(description="Peak bytes per device, counting the micro-batches in flight.")
    send_bytes: int = Field(description="Activation bytes it sends to the next stage per micro-batch.")


class AutoshardResult(_Model):
    """A solved auto-parallel plan for one module on `num_gpus` devices."""

    cluster: str
    gpu: str
    num_gpus: int
    mesh_shape: list[int] = Field(description="Devices per mesh axis of one pipeline stage, innermost first.")
    mesh_axes: list[str] = Field(description="Each axis's name and the links it spans.")
    pp: int = Field(description="Pipeline stages.")
    micro_batches: int = Field(description="Micro-batches per step (pipeline only; 1 without).")
    memory_budget_bytes: float
    params: dict[str, list[str]] = Field(description="Placement per parameter (fully qualified name), per mesh axis.")
    inputs: list[list[str]] = Field(description="Placement of each example input, per mesh axis.")
    activations: dict[str, list[str]] = Field(description="Placement of each module's output (qualified name), "
                                                          "per mesh axis, for the modules whose output is one "
                                                          "tensor.")
    nodes: list[NodeChoice]
    stages: list[Stage]
    step_time_s: float = Field(description="Predicted seconds of one training step (forward, backward, "
                                           "gradient reduction, optimizer).")
    time_s: dict[str, float] = Field(description="Breakdown: compute, comm, reshard, grad_sync, optimizer, "
                                                 "pp_bubble, pp_comm.")
    memory_bytes: dict[str, float] = Field(description="Breakdown per device of the most loaded stage: params, "
                                                       "grads, optimizer, activations.")
    peak_memory_bytes: float
    unknown_ops: list[str] = Field(description="Ops the strategies do not know; kept replicated.")
    solver: str = Field(description="'milp', 'milp (repeated blocks)' or 'heuristic'.")
    solver_note: str = Field(description="How the solve went: size, reuse, time limit, gap.")
    optimal: bool = Field(description="Whether the solver proved the plan optimal for the cost model.")
    num_graph_nodes: int
    trace_time_s: float
    solve_time_s: float
