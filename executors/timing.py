"""The warm-up and timed-step loop every executor runs after loss parity."""

from __future__ import annotations

import time
from typing import Callable


def run_timed_steps(step: Callable[[int], object], first_index: int, warmup_steps: int, timed_steps: int,
                    sync: Callable[[], None], after_warmup: Callable[[], None] | None = None,
                    on_step: Callable[[int], None] | None = None) -> list[float]:
    """Run `warmup_steps` untimed steps, then `timed_steps` steps each started after a
    barrier and bracketed by `sync` (device synchronisation); returns their wall times, seconds.
    `step(i)` runs optimizer step i (the index picks the batch); `on_step(i)` is called after
    step i, outside its timed interval."""
    import torch.distributed as dist

    index = first_index
    for _ in range(warmup_steps):
        step(index)
        if on_step is not None:
            on_step(index)
        index += 1
    if after_warmup is not None:
        after_warmup()
    times = []
    for _ in range(timed_steps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        step(index)
        sync()
        times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(index)
        index += 1
    return times
