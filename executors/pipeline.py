"""Pipeline parallelism with torch.distributed.pipelining (imports torch).

Each pp rank owns `vpp` chunks of consecutive layers: chunk v on pp rank r is
stage v·pp + r (Megatron's interleaved assignment, which is also the
"looped" order ScheduleInterleaved1F1B expects). How many layers each virtual
stage holds is the plan's `ParallelLayout.layers_per_chunk` (even, uneven
first/last per pipeline rank, explicit `stage_layers` per rank or per virtual
stage, so a rank's chunks may differ in size; embedding/loss counted as layers),
the split the cost model scored. A chunk is the full model with the
layers it does not own deleted (so its weights are the seeded weights of the
full model); the first stage keeps the embedding, the last the final norm and
output head. vpp = 1 runs Schedule1F1B, vpp > 1 ScheduleInterleaved1F1B, with
num_microbatches = global_batch / (mbs·dp).
"""

from __future__ import annotations

import copy

import torch

from cost_models.layout import ParallelLayout
from executors.model import Transformer, loss_fn


def split_stage(full: Transformer, stage: int, num_stages: int, counts: list[int]) -> Transformer:
    """A copy of `full` holding only the layers (and ends) of `stage`."""
    start = sum(counts[:stage])
    keep = {str(i) for i in range(start, start + counts[stage])}
    module = copy.deepcopy(full)
    for name in list(module.layers.keys()):
        if name not in keep:
            del module.layers[name]
    if stage != 0:
        module.embed = None
    if stage != num_stages - 1:
        module.norm = None
        module.output = None
    return module


def build_stage_modules(full: Transformer, pp_rank: int, pp: int, vpp: int, strategy) -> list[tuple[int, Transformer]]:
    """(virtual stage, module) for each chunk pipeline rank `pp_rank` runs, first chunk first.
    `pp` and `vpp` are the strategy's."""
    lay = ParallelLayout.of_strategy(strategy, full.spec.num_layers)
    assert (int(lay.pp[0]), int(lay.vpp[0])) == (pp, vpp), (pp, vpp, strategy)
    counts = lay.layers_per_chunk()
    return [(s, split_stage(full, s, len(counts), counts)) for s in lay.virtual_stages(pp_rank)]


def make_schedule(stage_modules, pp_group, num_stages: int, num_microbatches: int, device, vpp: int):
    """PipelineStages for this rank's chunks and the 1F1B (or interleaved 1F1B) schedule.

    The loss of each micro-batch is its mean token cross entropy; the schedule
    divides gradients by num_microbatches (scale_grads), so the step's gradient
    is that of the replica's mean loss, as in the reference.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    stages = [PipelineStage(module, idx, num_stages, device, group=pp_group) for idx, module in stage_modules]
    if vpp == 1:
        return stages, Schedule1F1B(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn)
    return stages, ScheduleInterleaved1F1B(stages, n_microbatches=num_microbatches, loss_fn=loss_fn)


def run_pipeline_step(schedule, stages, num_stages: int, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """One forward/backward over all micro-batches; returns the replica's mean loss on the
    rank holding the last stage, None elsewhere."""
    has_first = any(s.stage_index == 0 for s in stages)
    has_last = any(s.stage_index == num_stages - 1 for s in stages)
    losses: list[torch.Tensor] = []
    args = (tokens,) if has_first else ()
    kwargs = {"target": targets, "losses": losses} if has_last else {}
    schedule.step(*args, **kwargs)
    if has_last:
        return torch.stack([loss.detach() for loss in losses]).mean()
    return None
