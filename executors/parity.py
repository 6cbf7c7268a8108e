"""Loss parity: a parallel run's leading losses against the single-process reference (no torch).

Two checks, both relative: each parity step's loss (`RunConfig.parity_rtol`),
and the loss change from step 1 to each later step (`RunConfig.update_rtol`).
The second isolates the gradients and the optimizer update: with a learning
rate of 1e-3 one step moves the loss by ~1e-3 of itself, so a gradient that is
wrong for a whole weight matrix (an untied copy, a missing reduction) changes
the step-2 loss by ~1e-5 relative — inside any sensible loss tolerance — but
changes the loss *decrease* by percents.
"""

from __future__ import annotations

from executors.results import RunConfig


def parity_errors(measured: list[float], reference: list[float]) -> tuple[float, float]:
    """(largest relative loss error, largest relative error of the loss change since step 1)."""
    loss_err = max(abs(m - r) / max(abs(r), 1e-12) for m, r in zip(measured, reference))
    update_err = 0.0
    for m, r in zip(measured[1:], reference[1:]):
        dm, dr = m - measured[0], r - reference[0]
        update_err = max(update_err, abs(dm - dr) / max(abs(dr), 1e-12))
    return loss_err, update_err


def parity_failure(cfg: RunConfig, losses: list[float]) -> str:
    """Empty when the losses match the reference, else the reason."""
    loss_err, update_err = parity_errors(losses, cfg.reference_losses)
    if loss_err <= cfg.parity_rtol and update_err <= cfg.update_rtol:
        return ""
    return (f"loss parity failed: losses {losses} vs reference {cfg.reference_losses} (relative loss error "
            f"{loss_err:.1e}, rtol {cfg.parity_rtol:.0e}; relative error of the loss change since step 1 "
            f"{update_err:.1e}, rtol {cfg.update_rtol:.0e})")
