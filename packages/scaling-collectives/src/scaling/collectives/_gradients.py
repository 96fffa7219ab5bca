"""Data-parallel gradient reduction: bucketed all-reduce, and reduce-scatter for ZeRO.

Averaging is explicit: the collectives sum (``ReduceOp.SUM``) and our code divides
by the group size, so the result does not depend on a backend's ``AVG`` support or
its rounding (``AVG`` is NCCL-only and absent on gloo).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from scaling.collectives import _ops

DEFAULT_BUCKET_SIZE_BYTES = 25 * 1024 * 1024


class GradientBucketer:
    """Average the gradients of ``params`` over ``group`` in a few large all-reduces.

    Gradients of one dtype and device are copied into flat buckets of at most
    ``bucket_size_bytes`` (a larger gradient gets a bucket of its own), each bucket is
    summed over the group, divided by the group size, and copied back into ``.grad``.
    Parameters whose ``.grad`` is ``None`` are skipped: every rank must hold the same
    set of gradients (debug mode names the rank whose buckets differ).

    Args:
        params: the parameters (order matters: it must be the same on every rank).
        group: the data-parallel group; ``None`` or one rank makes :meth:`all_reduce` a no-op.
        bucket_size_bytes: the bucket capacity in bytes (> 0).

    Example::

        >>> bucketer = GradientBucketer(model.parameters(), topology.data_parallel_group)
        >>> loss.backward(); bucketer.all_reduce(); optimizer.step()
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter | torch.Tensor],
        group: dist.ProcessGroup | None,
        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
    ) -> None:
        if isinstance(bucket_size_bytes, bool) or not isinstance(bucket_size_bytes, int) or bucket_size_bytes <= 0:
            raise ValueError(
                f"bucket_size_bytes={bucket_size_bytes!r} must be a positive int (bytes per all-reduce), "
                f"e.g. {DEFAULT_BUCKET_SIZE_BYTES} (25 MiB)"
            )
        self.params = list(params)
        self.group = group
        self.bucket_size_bytes = bucket_size_bytes

    def buckets(self) -> list[list[int]]:
        """Indices into ``params`` of each bucket for the gradients present now, ordered by first index."""
        open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
        done: list[list[int]] = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            key = (p.grad.dtype, p.grad.device)
            nbytes = p.grad.numel() * p.grad.element_size()
            members, size = open_buckets.get(key, ([], 0))
            if members and size + nbytes > self.bucket_size_bytes:
                done.append(members)
                members, size = [], 0
            open_buckets[key] = ([*members, i], size + nbytes)
        done.extend(members for members, _ in open_buckets.values() if members)
        return sorted(done, key=lambda members: members[0])

    def all_reduce(self) -> None:
        """Replace every present ``.grad`` with its mean over the group."""
        world = _ops.group_size(self.group)
        if world == 1:
            return
        for bucket in self.buckets():
            grads = [self.params[i].grad for i in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
            _ops.all_reduce(flat, self.group)
            flat.div_(world)
            offset = 0
            for g in grads:
                assert g is not None
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


def all_reduce_gradients(
    params: Iterable[torch.nn.Parameter | torch.Tensor],
    group: dist.ProcessGroup | None,
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
) -> None:
    """Average the ``.grad`` of ``params`` over ``group`` (bucketed; see :class:`GradientBucketer`).

    Args:
        params: parameters in the same order on every rank; ``None`` grads are skipped.
        group: the data-parallel group; ``None`` or one rank does nothing.
        bucket_size_bytes: the bucket capacity in bytes.

    Raises:
        ValueError: when ``bucket_size_bytes`` is not a positive int.
    """
    GradientBucketer(params, group, bucket_size_bytes).all_reduce()


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
