"""Communication of context and expert parallelism: the ring shift, the all-to-alls of attention heads and of tokens.

Shape legend: b batch, n heads, s this rank's sequence slice, d head dim, cp group size.

- :func:`ring_shift_async` passes a tensor one step round the group's ring (to group
  rank ``r + 1``, from ``r - 1``), as ring attention moves key/value blocks.
- :func:`scatter_heads_gather_sequence` and its inverse
  :func:`gather_heads_scatter_sequence` are the two all-to-alls of all-to-all
  (DeepSpeed-Ulysses) attention: before attention each rank trades its heads for the
  sequence (``[b, n, s, d] -> [b, n / cp, cp * s, d]``, the sequence slices in group-rank
  order), after it the other way. They are autograd functions: each one's backward is
  the other.
- :func:`all_to_all_tokens` sends each rank the rows routed to it (uneven splits): the
  token dispatch and combine of expert parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from scaling.collectives._ops import PendingCollective, _collective, group_size

if TYPE_CHECKING:
    from scaling.collectives._pytree import AutogradContext

ProcessGroup = dist.ProcessGroup


class _Works:
    """The works of one batched send/receive, waited as one."""

    __slots__ = ("_works",)

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True


def ring_shift_async(outgoing: torch.Tensor, incoming: torch.Tensor, group: ProcessGroup) -> PendingCollective:
    """Send ``outgoing`` to the next group rank and receive the previous one's into ``incoming``.

    Both tensors have the same shape and dtype; neither may be touched until the
    returned handle is waited. Waiting raises the named errors of the other collectives.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prev = dist.get_global_rank(group, (rank - 1) % size)
    ops = [dist.P2POp(dist.isend, outgoing, nxt, group), dist.P2POp(dist.irecv, incoming, prev, group)]
    return _collective(
        "ring_shift", group, (outgoing,), lambda: _Works(list(dist.batch_isend_irecv(ops))), async_op=True
    )


def _all_to_all(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``x`` ``[cp, ...]``: row ``j`` goes to group rank ``j``; row ``j`` of the result came from rank ``j``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _collective("all_to_all", group, (x,), lambda: dist.all_to_all_single(out, x, group=group)).wait()
    return out


def _heads_to_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    cp = group_size(group)
    b, n, s, d = x.shape
    if n % cp:
        raise ValueError(
            f"scatter_heads_gather_sequence: {n} heads do not divide over {cp} ranks; use a head count that "
            f"is a multiple of the context-parallel size, or ring attention"
        )
    chunks = x.reshape(b, cp, n // cp, s, d).transpose(0, 1)  # [cp, b, n/cp, s, d]
    received = _all_to_all(chunks, group)  # row j: rank j's sequence slice of our heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * s, d)


def _sequence_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    cp = group_size(group)
    b, n, total, d = x.shape
    s = total // cp
    chunks = x.reshape(b, n, cp, s, d).permute(2, 0, 1, 3, 4)  # [cp, b, n, s, d]: slice j back to rank j
    received = _all_to_all(chunks, group)  # row j: heads of rank j, our sequence slice
    return received.transpose(0, 1).reshape(b, cp * n, s, d)


class _SwapHeadsAndSequence(torch.autograd.Function):
    """Heads -> sequence (``to_sequence``) or back; each direction's backward is the other."""

    @staticmethod
    def forward(ctx: AutogradContext, x: torch.Tensor, group: ProcessGroup, to_sequence: bool) -> torch.Tensor:
        ctx.group, ctx.to_sequence = group, to_sequence
        return (_heads_to_sequence if to_sequence else _sequence_to_heads)(x, group)

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_sequence_to_heads if ctx.to_sequence else _heads_to_sequence)(grad, ctx.group), None, None


def scatter_heads_gather_sequence(x_bnsd: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[b, n, s, d]`` -> ``[b, n / cp, cp * s, d]``: this rank keeps heads ``[r n / cp, (r + 1) n / cp)``
    of every rank's sequence slice, concatenated in group-rank order. Identity for one rank.

    Raises:
        ValueError: when ``n`` is not a multiple of the group size.
    """
    if group is None or group_size(group) == 1:
        return x_bnsd
    return _SwapHeadsAndSequence.apply(x_bnsd, group, True)


def gather_heads_scatter_sequence(x_bnsd: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The inverse of :func:`scatter_heads_gather_sequence`: ``[b, n, cp * s, d]`` -> ``[b, cp * n, s, d]``."""
    if group is None or group_size(group) == 1:
        return x_bnsd
    return _SwapHeadsAndSequence.apply(x_bnsd, group, False)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    _collective(
        "all_to_all", group, (x,), lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    ).wait()
    return out


class _AllToAllTokens(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: AutogradContext, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all_tokens(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup | None
) -> torch.Tensor:
    """Send rows ``x[sum(input_splits[:j]) : sum(input_splits[:j + 1])]`` to group rank ``j``; receive
    ``output_splits[j]`` rows from each rank ``j``, concatenated in group-rank order (uneven splits).

    The token exchange of expert parallelism; an autograd function whose backward sends the
    gradients back the same way. Identity for one rank.
    """
    if group is None or group_size(group) == 1:
        return x
    return _AllToAllTokens.apply(x, list(output_splits), list(input_splits), group)
