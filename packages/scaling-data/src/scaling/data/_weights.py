"""Blend weights: explicit, by dataset size to a power, examples-proportional with cap and temperature."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from scaling.config import BaseConfig


def _normalise(raw: np.ndarray, what: str) -> np.ndarray:
    if raw.ndim != 1 or len(raw) == 0:
        raise ValueError(f"{what}: need one weight per dataset, got shape {raw.shape}")
    if not np.all(np.isfinite(raw)) or np.any(raw < 0):
        raise ValueError(f"{what}: weights must be finite and >= 0, got {raw.tolist()}")
    total = raw.sum()
    if total <= 0:
        raise ValueError(f"{what}: weights sum to {total}; give at least one dataset a positive weight")
    return raw / total


def explicit_weights(weights: Sequence[float]) -> np.ndarray:
    """``weights`` normalised to sum to 1.

    Raises:
        ValueError: for negative, non-finite or all-zero weights.
    """
    return _normalise(np.asarray(weights, dtype=np.float64), "explicit_weights")


def weights_by_size(sizes: Sequence[int], power: float = 1.0) -> np.ndarray:
    """``size_i ** power``, normalised: ``power=1`` samples proportionally to size,
    ``power<1`` up-samples small datasets (``power=0`` is uniform over datasets).

    Raises:
        ValueError: for a negative size or power.
    """
    s = np.asarray(sizes, dtype=np.float64)
    if np.any(s < 0) or power < 0:
        raise ValueError(f"weights_by_size: sizes {s.tolist()} and power={power} must be >= 0")
    return _normalise(np.where(s > 0, s, 0.0) ** power * (s > 0), "weights_by_size")


def examples_proportional_weights(sizes: Sequence[int], cap: int | None = None, temperature: float = 1.0) -> np.ndarray:
    """T5's examples-proportional mixing: ``min(size_i, cap) ** (1 / temperature)``, normalised.

    ``cap`` limits how much a huge dataset dominates; ``temperature > 1`` flattens the mix.

    Raises:
        ValueError: for ``cap < 1`` or ``temperature <= 0``.
    """
    if cap is not None and cap < 1:
        raise ValueError(f"examples_proportional_weights: cap={cap} must be >= 1 (or None for no cap)")
    if temperature <= 0:
        raise ValueError(f"examples_proportional_weights: temperature={temperature} must be > 0")
    s = np.asarray(sizes, dtype=np.float64)
    if cap is not None:
        s = np.minimum(s, cap)
    return _normalise(s ** (1.0 / temperature), "examples_proportional_weights")


class BlendConfig(BaseConfig):
    """How to weight the datasets of a :class:`BlendedDataset`."""

    weighting: Literal["explicit", "by_size", "examples_proportional"] = Field(
        "explicit",
        description="'explicit' uses `weights`; 'by_size' uses len(dataset) ** `power`; "
        "'examples_proportional' uses min(len, `cap`) ** (1 / `temperature`).",
    )
    weights: list[float] | None = Field(
        None, description="One non-negative weight per dataset (normalised); required for 'explicit'."
    )
    power: float = Field(1.0, ge=0, description="Exponent of the size for 'by_size' (>= 0; 0 = uniform).")
    cap: int | None = Field(
        None, ge=1, description="Size cap for 'examples_proportional' in samples (>= 1); None = no cap."
    )
    temperature: float = Field(1.0, gt=0, description="Mixing temperature for 'examples_proportional' (> 0).")

    def resolve(self, sizes: Sequence[int]) -> np.ndarray:
        """The normalised weights for datasets of ``sizes`` samples.

        Raises:
            ValueError: when 'explicit' lacks weights or their count differs from the datasets'.
        """
        if self.weighting == "explicit":
            if self.weights is None or len(self.weights) != len(sizes):
                got = None if self.weights is None else len(self.weights)
                raise ValueError(
                    f"BlendConfig: weighting='explicit' needs one weight per dataset: {len(sizes)} datasets, "
                    f"weights has {got}; set weights or choose weighting='by_size'"
                )
            return explicit_weights(self.weights)
        if self.weighting == "by_size":
            return weights_by_size(sizes, self.power)
        return examples_proportional_weights(sizes, self.cap, self.temperature)
