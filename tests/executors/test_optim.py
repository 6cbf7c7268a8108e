"""The run's optimizer: plain SGD for the parity steps, then the plan's (single process, imports torch)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from executor_fixtures import TINY, TRAIN  # noqa: E402

from executors.optim import make_optimizer  # noqa: E402
from executors.results import RunConfig  # noqa: E402
from planner.specs import Strategy  # noqa: E402

LR_PARITY, LR_PLAN = 0.05, 1e-3


def _cfg(**kw) -> RunConfig:
    return RunConfig(label="one", model=TINY, train=TRAIN, strategy=Strategy(dp=1), num_gpus=1, parity_steps=2,
                     learning_rate=LR_PLAN, parity_learning_rate=LR_PARITY, reference_losses=[1.0, 0.9], **kw)


def _run(cfg: RunConfig, steps: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """(weight before, its gradient, weight after, Adam states held) of each step."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    opt = make_optimizer(cfg, [w])
    out = []
    for _ in range(steps):
        before = w.detach().clone()
        w.grad = torch.randn(5)
        grad = w.grad.clone()
        opt.step()
        out.append((before, grad, w.detach().clone(), len(opt.state)))
    return out


def _reference_sgd_step(before: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The reference's update (executors.runner.reference): torch.optim.SGD without momentum."""
    w = torch.nn.Parameter(before.clone())
    w.grad = grad.clone()
    torch.optim.SGD([w], lr=LR_PARITY).step()
    return w.detach()


def test_parity_steps_are_the_references_plain_sgd_then_the_plans_adam_starts():
    steps = _run(_cfg(), 3)
    for before, grad, after, states in steps[:2]:
        assert torch.equal(after, _reference_sgd_step(before, grad))
        assert states == 0  # no optimizer state yet
    before, grad, after, states = steps[2]
    # Adam's first update: lr·g/(|g| + eps) = lr·sign(g)
    assert torch.allclose(before - after, LR_PLAN * grad.sign(), rtol=1e-4)
    assert states == 1


def test_the_gradient_fault_doubles_the_parity_updates_only():
    doubled = _run(_cfg(fault="grad_x2"), 3)
    for before, grad, after, _ in doubled[:2]:
        assert torch.allclose(before - after, 2 * LR_PARITY * grad, rtol=1e-6)
    before, grad, after, _ = doubled[2]
    assert torch.allclose(before - after, LR_PLAN * grad.sign(), rtol=1e-4)
