"""Which layers multiply in float8 (see ``_float8.py`` for the products): the rule and its checks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from scaling.nn._float8 import Float8Config, Float8Weight, float8_supported


@runtime_checkable
class TensorParallelLinear(Protocol):
    """What float8 needs of a linear layer: its TP split, its weight's ``[out, in]`` shape, and the slot.

    ``ColumnParallelLinear`` and ``RowParallelLinear`` have it, and so do the auto API's
    wrappers of unmodified modules; ``tensor_parallel_split`` is None for a linear that
    stays in high precision whatever the rule says (an LM head that gathers the vocabulary).
    ``float8_weight`` is where ZeRO-3's float8 all-gather puts the gathered float8 weight
    for the products to use (None: they quantise the weight themselves).
    """

    float8: Float8Config | None
    float8_weight: Float8Weight | None

    @property
    def tensor_parallel_split(self) -> str | None: ...  # "column", "row" or None

    @property
    def linear_shape(self) -> tuple[int, int]: ...  # the weight as F.linear takes it: [out, in]


def _chosen(
    model: torch.nn.Module, config: Float8Config, tp: int, setting: str
) -> Iterator[tuple[str, TensorParallelLinear, int, int]]:
    """``(name, linear, out_local, in_local)`` of each linear that ``config`` puts in float8 (at TP size ``tp``).

    A column-parallel linear splits its output over TP, a row-parallel one its input.
    """
    for name, module in model.named_modules():
        if not isinstance(module, TensorParallelLinear) or module.tensor_parallel_split is None:
            continue
        out_size, in_size = module.linear_shape
        if module.tensor_parallel_split == "column":
            out_size //= tp
        else:
            in_size //= tp
        if any(re.search(p, name) for p in config.exclude) or min(out_size, in_size) < config.min_features:
            continue
        if out_size % 16 or in_size % 16:
            raise ValueError(
                f"{setting}: layer {name!r} has local weight shape [{out_size}, {in_size}]; float8 products need "
                f"sizes that are multiples of 16. Keep it in high precision: add the regex "
                f"{re.escape('.'.join(name.split('.')[-2:]))} to {setting}.exclude (or raise {setting}.min_features "
                "above its size)"
            )
        yield name, module, out_size, in_size


def check_float8(
    model: torch.nn.Module,
    config: Float8Config,
    tensor_parallel_size: int,
    device: torch.device,
    *,
    setting: str = "fp8",
) -> None:
    """Refuse a float8 setup that cannot run, before any process group starts.

    Args:
        model: the model (or one of each distinct layer) built unsplit, e.g. on the meta device.
        config: the float8 settings (nothing is checked unless enabled).
        tensor_parallel_size: the TP size the layers will be split over.
        device: where training runs.
        setting: the name of ``config`` in the user's settings, which the errors name
            (the transformer app's ``training.fp8``; the auto API's ``float8``).

    Raises:
        ValueError: float8 (or its ``scaling``) does not run on ``device`` with this torch, or a chosen layer's
            local sizes are not multiples of 16 (named, with its shape and the fix).
    """
    if config.enabled:
        _chosen_checked(model, config, tensor_parallel_size, device, setting)


def _chosen_checked(
    model: torch.nn.Module, config: Float8Config, tp: int, device: torch.device, setting: str
) -> list[tuple[str, TensorParallelLinear, int, int]]:
    """:func:`_chosen` as a list, then the machine's support (the shapes first: they do not depend on it)."""
    chosen = list(_chosen(model, config, tp, setting))
    why = float8_supported(device)
    if why is not None:
        raise ValueError(f"{setting}.enabled=true: {why}; set {setting}.enabled=false to train in bf16")
    if config.scaling != "tensorwise":
        why = float8_supported(device, config.scaling)
        if why is not None:
            raise ValueError(
                f"{setting}.scaling={config.scaling!r}: {why}; set {setting}.scaling='tensorwise' (or "
                f"{setting}.enabled=false to train in bf16)"
            )
    return chosen


def enable_float8(model: torch.nn.Module, config: Float8Config, *, setting: str = "fp8") -> list[str]:
    """Make the column- and row-parallel linears of ``model`` (built, TP-local; any
    :class:`TensorParallelLinear`) multiply in float8.

    Layers matching ``config.exclude`` or with a local size below ``config.min_features``
    keep their precision. A no-op unless ``config.enabled``. Returns the chosen layers' names.
    ``setting`` names ``config`` in the errors, as for :func:`check_float8`.

    Raises:
        ValueError: as :func:`check_float8`.
    """
    if not config.enabled:
        return []
    chosen = _chosen_checked(model, config, 1, next(model.parameters()).device, setting)
    for _, linear, _, _ in chosen:
        linear.float8 = config
    return [name for name, _, _, _ in chosen]
