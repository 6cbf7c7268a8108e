"""Loss parity: a parallel run's leading losses against the single-process reference (no torch).

The parity steps are plain SGD (no momentum, no weight decay) on one batch
(batch 0, repeated), not the plan's optimizer on fresh batches:

- Adam's first update is lr·g/(|g| + eps) ≈ lr·sign(g) per element, the same for
  a gradient wrong by any positive factor (a sum instead of a mean over dp, a
  missing 1/num_microbatches), so such a run would pass bit-identically. Plain
  SGD moves the weights by lr·g, and to first order the loss by -lr·|g|², so a
  gradient c times too large changes the loss c times as much.
- With a fresh batch per step the loss change from step 1 to step 2 is mostly
  the difference between the batches, which hides an update of similar size:
  on the test model (random tokens) the batches' losses differ by 3e-4 of the
  loss, twice an SGD step's change at lr 1e-3, and a doubled gradient changed
  the step-2 loss change by 3% only. On one batch the change is the update's
  alone (doubled gradient: 94%).

Two checks, both relative: each parity step's loss (`RunConfig.parity_rtol`),
and the loss change from step 1 to each later step (`RunConfig.update_rtol`).
The first checks the forward pass, the second the gradients and the update: a
gradient that is wrong for one weight matrix changes the step-2 loss by ~1e-5
relative — inside any loss tolerance — but the loss *change* by percents.

Gradient norms per parameter group (MoE runs): the loss change sees an update only
through its projection on the gradient, -lr·g·Δ, so it misses a gradient error
that is orthogonal to g, and one confined to a small group. Both happen to the
routed experts: reducing their gradients over the whole dp group like the dense
ones (expert e on one ep rank plus expert e + E/ep on the other) leaves g·Δ
unchanged to first order (the experts' gradients are nearly orthogonal), and the
experts hold 0.4% of |g|² in the test MoE, so even doubling every expert gradient
moves the loss change by only 3.6e-3 (executors.validate.GRAD_NORM_TOLERANCES). So a run that can (`Runner.grad_sq_norms`)
also reports the squared norm of its reduced step-1 gradient per group
(`GRAD_GROUPS`) and each must equal the reference's within `RunConfig.grad_rtol`:
the mixed reduction gives the experts' |g|² ~2x, the doubled one 4x.

The step size: `parity_learning_rate` makes the first-order decrease lr·|g|² a
fixed fraction (`PARITY_LOSS_DECREASE`) of the step-1 loss, from the
reference's own step-1 gradient. A fixed step size does not work across
models: on the test model (4 layers, hidden 64) lr = 0.01 moves the loss by
only 0.15% (7x closer to rounding than at 1%), while on the 4-layer hidden-512
benchmark model lr = 0.1 overshoots (loss change 12%, and a 2x gradient changes
it by only 8% more). The parallel run takes the reference's step size (`RunConfig.
parity_learning_rate`), never one from its own gradient, which would cancel a
gradient-scale error.
"""

from __future__ import annotations

from executors.results import RunConfig

PARITY_LOSS_DECREASE = 0.01
"""First-order loss decrease lr·|g|² of one parity step, as a fraction of the step-1 loss.

Large enough that the loss change stands above rounding (its relative error is
~1/PARITY_LOSS_DECREASE = 100 times the loss's: bf16 on CPU, 1.3e-3 vs 1.1e-5,
executors.validate.PARITY_TOLERANCES), small enough that the change stays linear
in the gradient: with a doubled gradient the change differs from the right one
by 0.94 (test model) and 0.98 (benchmarks/validate_cpu.py's hidden-512 model),
first order 1 (`benchmarks/parity_tolerance.py`); three times that step (the
loss falls by 2.7-2.9%) gives only 0.61 and 0.85."""


def parity_learning_rate(loss: float, grad_sq_norm: float) -> float:
    """SGD step size whose first-order loss decrease is PARITY_LOSS_DECREASE of `loss`.

    lr = f·L / |g|², with L the step-1 loss (nats), |g|² the squared L2 norm of the
    full step-1 gradient (sum over every parameter element), f = PARITY_LOSS_DECREASE.
    One SGD step w -= lr·g changes the loss by -lr·|g|² + O(lr²) = -f·L + O(lr²).
    """
    if not grad_sq_norm > 0:
        raise ValueError(f"the reference's step-1 gradient norm² ({grad_sq_norm}) must be > 0 to size the "
                         "parity step (a zero or NaN gradient cannot check the gradients)")
    return PARITY_LOSS_DECREASE * abs(loss) / grad_sq_norm


def batch_index(cfg: RunConfig, step: int) -> int:
    """Synthetic batch of optimizer step `step`: batch 0 for every parity step, the step's own after."""
    return 0 if step < cfg.parity_steps else step


def parity_errors(measured: list[float], reference: list[float]) -> tuple[float, float]:
    """(largest relative loss error, largest relative error of the loss change since step 1)."""
    loss_err = max(abs(m - r) / max(abs(r), 1e-12) for m, r in zip(measured, reference))
    update_err = 0.0
    for m, r in zip(measured[1:], reference[1:]):
        dm, dr = m - measured[0], r - reference[0]
        update_err = max(update_err, abs(dm - dr) / max(abs(dr), 1e-12))
    return loss_err, update_err


GRAD_GROUPS = ("dense", "experts")
"""Parameter groups of the step-1 gradient-norm check: the routed experts
(`executors.moe.expert_parameters`, reduced over the expert-data-parallel group) and
everything else (reduced over the data parallel group)."""


def grad_norm_error(measured: dict[str, float] | None, reference: dict[str, float] | None) -> float | None:
    """Largest relative error of a group's squared gradient norm; None when either side has none."""
    if not measured or not reference:
        return None
    return max(abs(measured.get(k, 0.0) - r) / max(abs(r), 1e-30) for k, r in reference.items())


def parity_failure(cfg: RunConfig, losses: list[float], grad_sq_norms: dict[str, float] | None = None) -> str:
    """Empty when the losses (and, when both sides have them, the step-1 gradient norms per
    group) match the reference, else the reason."""
    loss_err, update_err = parity_errors(losses, cfg.reference_losses)
    grad_err = grad_norm_error(grad_sq_norms, cfg.reference_grad_sq_norms)
    grad_ok = grad_err is None or grad_err <= cfg.grad_rtol
    if loss_err <= cfg.parity_rtol and update_err <= cfg.update_rtol and grad_ok:
        return ""
    reason = (f"loss parity failed: losses {losses} vs reference {cfg.reference_losses} (relative loss error "
              f"{loss_err:.1e}, rtol {cfg.parity_rtol:.0e}; relative error of the loss change since step 1 "
              f"{update_err:.1e}, rtol {cfg.update_rtol:.0e})")
    if grad_err is not None:
        reason += (f"; step-1 squared gradient norms {grad_sq_norms} vs reference {cfg.reference_grad_sq_norms} "
                   f"(largest relative error {grad_err:.1e}, rtol {cfg.grad_rtol:.0e})")
    return reason
