"""The optimizer of an executor run: plain SGD for the parity steps, the plan's optimizer after (imports torch).

One optimizer object does both, so that every wrapper around it — torch's
`ZeroRedundancyOptimizer` (ZeRO-1), DeepSpeed's ZeRO optimizers — shards,
reduces and broadcasts the parity steps exactly as it does the timed ones:
the first `parity_steps` calls of `step()` apply w -= lr_p·g (lr_p =
`RunConfig.parity_learning_rate`; no momentum, no weight decay, no state),
every later call is the plan's optimizer (`TrainSpec.optimizer`): fused Adam
without weight decay, as Megatron's fused Adam whose traffic the cost model
counts, or SGD with momentum 0.9. The plan's optimizer allocates its states in
its own first step, after the parity steps.

The single-process reference (`executors.runner.reference`) takes the same
plain-SGD update with `torch.optim.SGD(momentum=0)`.
"""

from __future__ import annotations

import torch
from torch import nn

from executors.results import GRADIENT_FAULTS, RunConfig

PLAN_SGD_MOMENTUM = 0.9
"""Momentum of the plan's SGD (TrainSpec.optimizer == "sgd"), as Megatron's default `--sgd-momentum`."""


class PlainSgdFirst:
    """Mixin for a torch optimizer class: the first `parity_steps` calls of step() are plain SGD.

    `parity_lr`: their step size. `parity_grad_factor`: factor applied to every
    gradient this optimizer is handed before each plain-SGD update (1.0; other
    values only as a test fault, `RunConfig.fault`). Later calls go to the
    optimizer class this is mixed into; its states are created on its first call.
    (The names carry a prefix because torch's optimizers read attributes such as
    `grad_scale` of their own.)
    """

    def __init__(self, params, *, parity_steps: int, parity_lr: float, parity_grad_factor: float = 1.0, **kwargs):
        super().__init__(params, **kwargs)
        self.parity_steps_left = parity_steps
        self.parity_lr = parity_lr
        self.parity_grad_factor = parity_grad_factor

    @torch.no_grad()
    def step(self, closure=None):
        if self.parity_steps_left == 0:
            return super().step(closure)
        self.parity_steps_left -= 1
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.parity_grad_factor != 1.0:
                    p.grad.mul_(self.parity_grad_factor)
                p.add_(p.grad, alpha=-self.parity_lr)
        return loss


class ParityThenAdam(PlainSgdFirst, torch.optim.Adam):
    """Plain SGD for the parity steps, then Adam."""


class ParityThenSGD(PlainSgdFirst, torch.optim.SGD):
    """Plain SGD for the parity steps, then SGD with momentum."""


def make_optimizer(cfg: RunConfig, params: list[nn.Parameter], zero1_group=None) -> torch.optim.Optimizer:
    """The run's optimizer over `params`; with `zero1_group`, ZeRO-1 sharded over that group."""
    parity = {"parity_steps": cfg.parity_steps, "parity_lr": cfg.parity_learning_rate or cfg.learning_rate,
              "parity_grad_factor": GRADIENT_FAULTS.get(cfg.fault, 1.0)}
    if cfg.train.optimizer == "adam":
        cls, kwargs = ParityThenAdam, {"lr": cfg.learning_rate, "fused": True}
    else:
        cls, kwargs = ParityThenSGD, {"lr": cfg.learning_rate, "momentum": PLAN_SGD_MOMENTUM}
    if zero1_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=zero1_group, **parity, **kwargs)
    # A fused step takes all tensors of a group at once, and DTensors do not mix with
    # plain tensors (tensor parallel leaves the norms plain without sequence parallel).
    dtensors = [p for p in params if hasattr(p, "to_local")]
    plain = [p for p in params if not hasattr(p, "to_local")]
    return cls([g for g in ({"params": dtensors}, {"params": plain}) if g["params"]], **parity, **kwargs)
