"""Dynamic loss scaler: skip and shrink on overflow, grow after a window of clean steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaling.optim._config import LossScalerConfig

if TYPE_CHECKING:
    from scaling.config import StateDict


class LossScaler:
    """Dynamic loss scale (DeepSpeed/Megatron semantics).

    The loss is multiplied by :attr:`scale` before backward. On an overflow (a
    non-finite gradient seen by any rank) the step is skipped and, once the hysteresis
    budget is spent, the scale is divided by ``factor`` (never below ``min_scale``).
    After ``window`` consecutive overflow-free steps it is multiplied by ``factor``.
    A disabled scaler has scale 1 and never reports overflow handling.

    Args:
        config: the scaler settings.
    """

    def __init__(self, config: LossScalerConfig) -> None:
        self.config = config
        self.scale = float(config.initial_scale) if config.enable else 1.0
        self.no_overflow_steps = 0
        self.hysteresis_left = config.hysteresis

    @property
    def enabled(self) -> bool:
        return self.config.enable

    def update(self, overflow: bool) -> None:
        """Record one step's outcome (the same on every rank)."""
        if not self.enabled:
            return
        c = self.config
        if overflow:
            self.no_overflow_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / c.factor, c.min_scale)
                # The budget stays spent: consecutive overflows keep shrinking until a refill.
                self.hysteresis_left = 1
            return
        self.no_overflow_steps += 1
        if c.consecutive_hysteresis:
            self.hysteresis_left = c.hysteresis
        if self.no_overflow_steps % c.window == 0:
            self.scale *= c.factor
            self.hysteresis_left = c.hysteresis

    def state_dict(self) -> StateDict:
        return {
            "scale": self.scale,
            "no_overflow_steps": self.no_overflow_steps,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: StateDict) -> None:
        self.scale = float(state["scale"])
        self.no_overflow_steps = int(state["no_overflow_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])

    def __repr__(self) -> str:
        return (
            f"LossScaler(enable={self.enabled}, scale={self.scale}, clean_steps={self.no_overflow_steps}, "
            f"hysteresis_left={self.hysteresis_left})"
        )
