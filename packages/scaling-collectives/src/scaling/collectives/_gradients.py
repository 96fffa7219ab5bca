"""Flat reduce-scatter and all-gather for ZeRO's gradient and parameter shards.

The data-parallel gradient average (bucketed, overlapped with backward) is
``scaling.optim.GradientReducer``: one reducer for every path, the auto API's included.

Averaging is explicit: the collectives sum (``ReduceOp.SUM``) and our code divides
by the group size, so the result does not depend on a backend's ``AVG`` support or
its rounding (``AVG`` is NCCL-only and absent on gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scaling.collectives import _ops


def _check_flat(flat: torch.Tensor, world: int, fn: str) -> None:
    if flat.dim() != 1:
        raise ValueError(f"{fn}: expected a flat 1-D buffer, got shape {list(flat.shape)}; pass tensor.reshape(-1)")
    if flat.numel() % world != 0:
        pad = -flat.numel() % world
        raise ValueError(
            f"{fn}: buffer of {flat.numel()} elements is not divisible by the group size {world}; "
            f"pad it with {pad} zeros to {flat.numel() + pad}"
        )


def reduce_scatter_flat(flat: torch.Tensor, group: dist.ProcessGroup | None, *, average: bool = True) -> torch.Tensor:
    """This rank's shard of the sum (or mean) of ``flat`` over ``group`` (ZeRO gradients).

    Shard ``i`` (group rank ``i``) is ``flat[i * n : (i + 1) * n]`` with
    ``n = flat.numel() // group_size``.

    Args:
        flat: a 1-D buffer, the same size on every rank and divisible by the group size.
        group: the data-parallel group; ``None`` or one rank returns ``flat`` (averaged: unchanged).
        average: divide by the group size (explicitly, after a SUM).

    Returns:
        A new 1-D tensor of ``flat.numel() // group_size`` elements.

    Raises:
        ValueError: when ``flat`` is not 1-D or its size is not divisible by the group size.
    """
    world = _ops.group_size(group)
    if world == 1:
        return flat
    _check_flat(flat, world, "reduce_scatter_flat")
    shard = _ops.reduce_scatter(flat, group)
    return shard.div_(world) if average else shard


def all_gather_flat(shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's 1-D ``shard`` in group-rank order (ZeRO parameter gather).

    Raises:
        ValueError: when ``shard`` is not 1-D.
    """
    if _ops.group_size(group) == 1:
        return shard
    if shard.dim() != 1:
        raise ValueError(
            f"all_gather_flat: expected a 1-D shard, got shape {list(shard.shape)}; pass shard.reshape(-1)"
        )
    return _ops.all_gather(shard, group)
