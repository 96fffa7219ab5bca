"""Split a list of layers into contiguous pipeline (virtual) stages.

The result is one ``range`` of global layer indices per virtual stage, in model order:
virtual stage ``c * num_stages + s`` is chunk ``c`` of stage ``s``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PARTITION_METHODS = ("uniform", "parameters", "cost", "explicit")


def _balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries minimising the heaviest part (dynamic programme over prefix sums)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: smallest max-part weight splitting the first i layers into k parts.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cand = max(best[k - 1][j], prefix[i] - prefix[j])
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def count_parameters(layer_specs: Sequence[object]) -> list[int]:
    """Parameters per layer, counted by building each spec on the meta device (no memory)."""
    counts = []
    for spec in layer_specs:
        with torch.device("meta"):
            module = spec.initialize()  # type: ignore[attr-defined]
        counts.append(sum(p.numel() for p in module.parameters()))
    return counts


def partition_layers(
    num_layers: int,
    num_stages: int,
    method: str = "uniform",
    *,
    num_virtual: int = 1,
    weights: Sequence[float] | None = None,
    boundaries: Sequence[int] | None = None,
) -> list[range]:
    """Assign layers to ``num_stages * num_virtual`` contiguous virtual stages.

    Args:
        num_layers: layers in the model.
        num_stages: pipeline stages ``p``.
        method: ``"uniform"`` (equal counts, earlier stages take the remainder),
            ``"parameters"`` or ``"cost"`` (balance ``weights``: parameter counts or
            per-layer cost estimates such as FLOPs or a measured profile), or
            ``"explicit"`` (use ``boundaries``).
        num_virtual: chunks per stage (interleaved schedules).
        weights: one non-negative weight per layer, for ``"parameters"`` and ``"cost"``.
        boundaries: ``p * v + 1`` increasing layer indices from 0 to ``num_layers``,
            for ``"explicit"``; virtual stage ``i`` gets ``range(boundaries[i], boundaries[i + 1])``.

    Returns:
        One ``range`` per virtual stage, each non-empty.

    Raises:
        ValueError: unknown method; more virtual stages than layers; layers that do not
            split into virtual stages evenly (``uniform`` with ``num_virtual > 1``);
            weights of the wrong length; boundaries that do not cover the layers.

    Example:
        >>> partition_layers(5, 2)
        [range(0, 3), range(3, 5)]
    """
    if method not in PARTITION_METHODS:
        raise ValueError(f"partition_method={method!r} is unknown; choose one of {list(PARTITION_METHODS)}")
    parts = num_stages * num_virtual
    if num_layers < parts:
        raise ValueError(
            f"cannot split num_layers={num_layers} into pipe_parallel_size={num_stages} x num_virtual_stages="
            f"{num_virtual} = {parts} stages of at least one layer each; use fewer stages or more layers"
        )
    if method == "explicit":
        if boundaries is None:
            raise ValueError("partition_method='explicit' needs partition_boundaries=[0, ..., num_layers]")
        b = list(boundaries)
        if len(b) != parts + 1 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(
                f"partition_boundaries={b} must be {parts + 1} strictly increasing layer indices from 0 to "
                f"num_layers={num_layers} (one range per stage x virtual stage), e.g. "
                f"{_uniform_bounds(num_layers, parts)}"
            )
    elif method == "uniform":
        if num_virtual > 1 and num_layers % parts:
            raise ValueError(
                f"num_layers={num_layers} is not divisible into pipe_parallel_size={num_stages} x "
                f"num_virtual_stages={num_virtual} = {parts} equal virtual stages; choose num_layers a multiple "
                f"of {parts}, or use partition_method='explicit'"
            )
        b = _uniform_bounds(num_layers, parts)
    else:
        if weights is None or len(weights) != num_layers:
            got = None if weights is None else len(weights)
            raise ValueError(f"partition_method={method!r} needs one weight per layer: {num_layers}, got {got}")
        if any(w < 0 for w in weights):
            raise ValueError(f"partition weights must be >= 0, got {list(weights)}")
        b = _balanced(weights, parts)
    return [range(b[i], b[i + 1]) for i in range(parts)]


def _uniform_bounds(num_layers: int, parts: int) -> list[int]:
    base, extra = divmod(num_layers, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds
