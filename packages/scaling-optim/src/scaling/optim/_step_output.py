"""What one optimizer step reports: the same on every rank (its own module: the trainer reads it, not the update)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OptimizerStepOutput:
    """What one :meth:`Optimizer.step` did; identical on every rank.

    Attributes:
        global_grad_norm: L2 norm of the unscaled gradient over all ranks (TP replicas
            and tied copies counted once) before clipping; None when not finite.
        global_grad_norm_clipped: the norm after clipping (equal to the above without
            clipping); None when the step was skipped.
        learning_rates: LR of each group for this step, by group name (for a skipped
            step, the LR the update would have used; the schedule does not advance).
        overflow: a non-finite loss or gradient was seen on some rank.
        skipped: the update was not applied (overflow or the ``skip`` policy).
        no_overflow_steps: consecutive overflow-free steps of the loss scaler.
        current_loss_scale: the loss scale after this step's scaler update.
        step: number of updates applied so far.
    """

    global_grad_norm: float | None
    global_grad_norm_clipped: float | None
    learning_rates: dict[str, float] = field(default_factory=dict)
    overflow: bool = False
    skipped: bool = False
    no_overflow_steps: int = 0
    current_loss_scale: float = 1.0
    step: int = 0
