"""Bucketed gradient and parameter communication over one process group.

Built on ``scaling.collectives`` (recorded collectives, so a hang names the ranks at
fault). Every function takes its group explicitly; a group of size 1 (or None) makes it
a no-op. Averaging is explicit (sum, then divide by the group size).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from scaling.collectives import all_gather_flat, all_reduce, reduce_scatter_flat

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _buckets(tensors: Sequence[torch.Tensor], bucket_size_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors of at most ``bucket_size_bytes`` (a larger tensor alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (t.dtype != bucket[0].dtype or size + nbytes > bucket_size_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def all_reduce_(
    tensors: Sequence[torch.Tensor], group: ProcessGroup | None, bucket_size_bytes: int, average: bool
) -> None:
    """All-reduce ``tensors`` in place in flat buckets; divide by the group size when ``average``."""
    world = group_size(group)
    if world == 1:
        return
    for bucket in _buckets(tensors, bucket_size_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()
        all_reduce(flat, group)
        if average:
            flat.div_(world)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def reduce_scatter_mean(flat_padded: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk of the group average of ``flat_padded`` (numel divisible by the group size)."""
    return reduce_scatter_flat(flat_padded, group, average=True)


def all_gather_chunks(
    chunks: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], group: ProcessGroup | None, bucket_size_bytes: int
) -> None:
    """Fill each flat ``outputs[i]`` with the concatenation over ranks of ``chunks[i]``.

    ``chunks[i]`` is this rank's equal-sized piece of a flat tensor; ``outputs[i]`` is
    that tensor's first ``outputs[i].numel()`` elements (the tail of the last rank's
    chunk is padding). Chunks of one bucket travel in one ``all_gather_into_tensor``.
    """
    world = group_size(group)
    if world == 1:
        for chunk, out in zip(chunks, outputs):
            out.copy_(chunk[: out.numel()])
        return
    pairs = list(zip(chunks, outputs))
    index = 0
    for bucket in _buckets([c for c, _ in pairs], max(bucket_size_bytes // world, 1)):
        send = torch.cat(bucket) if len(bucket) > 1 else bucket[0].contiguous()
        grid = all_gather_flat(send, group).view(world, send.numel())
        offset = 0
        for chunk in bucket:
            out, n = pairs[index][1], chunk.numel()
            # One strided copy per tensor: whole rows first, then the padded last rank's part.
            rows = min(out.numel() // n, world) if n else 0
            out[: rows * n].view(rows, n).copy_(grid[:rows, offset : offset + n])
            if rows < world and out.numel() > rows * n:
                out[rows * n :].copy_(grid[rows, offset : offset + out.numel() - rows * n])
            offset += n
            index += 1
