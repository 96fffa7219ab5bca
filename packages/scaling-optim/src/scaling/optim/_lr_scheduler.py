"""Learning-rate schedules: warmup delay, linear warmup, constant/linear/cosine/inverse-sqrt decay."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from scaling.optim._config import LearningRateSchedulerConfig

if TYPE_CHECKING:
    from scaling.config import StateDict


class LearningRateScheduler:
    """The LR of a parameter group as a function of the update count.

    Args:
        config: the schedule.

    Example::

        sched = LearningRateScheduler(LearningRateSchedulerConfig(
            learning_rate=1e-3, learning_rate_warmup_steps=10,
            learning_rate_decay_style="cosine", learning_rate_decay_iters=100))
        sched.get_lr(5)  # 5e-4
    """

    def __init__(self, config: LearningRateSchedulerConfig) -> None:
        self.config = config
        self.step_index = 0

    def get_lr(self, step: int) -> float:
        """LR of update ``step`` (1-based; ``step <= 0`` gives the first update's LR)."""
        c = self.config
        step = max(step, 1)
        delay, warmup = c.learning_rate_warmup_delay_steps, c.learning_rate_warmup_steps
        if step <= delay:
            return 0.0
        since_delay = step - delay
        if warmup > 0 and since_delay <= warmup:
            return c.learning_rate * since_delay / warmup
        style = c.learning_rate_decay_style
        if style == "constant":
            return c.learning_rate
        if style == "inverse_sqrt":
            # Continuous at the end of warmup: lr * sqrt(warmup / steps since the delay).
            return max(c.learning_rate_minimum, c.learning_rate * math.sqrt(max(warmup, 1) / since_delay))
        if step > c.learning_rate_decay_iters:
            return c.learning_rate_minimum
        ramp = delay + warmup
        ratio = (step - ramp) / (c.learning_rate_decay_iters - ramp)
        coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return c.learning_rate_minimum + coeff * (c.learning_rate - c.learning_rate_minimum)

    @property
    def current_lr(self) -> float:
        """LR the next update uses."""
        return self.get_lr(self.step_index + 1)

    def step(self) -> None:
        """Count one applied update."""
        self.step_index += 1

    def state_dict(self) -> StateDict:
        return {"step_index": self.step_index}

    def load_state_dict(self, state: StateDict) -> None:
        self.step_index = int(state["step_index"])

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LearningRateScheduler({c.learning_rate_decay_style}, lr={c.learning_rate}, "
            f"min={c.learning_rate_minimum}, step={self.step_index})"
        )
