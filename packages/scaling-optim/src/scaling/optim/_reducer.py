"""Gradient all-reduce over DP overlapped with backward (ZeRO 0 and 1), as DDP does.

Parameters are put into buckets of at most ``bucket_size_bytes`` in reverse order (the
order backward produces their gradients). When the last gradient of a bucket has been
accumulated, the bucket is copied into a flat buffer, the gradients are zeroed and an
asynchronous all-reduce starts while backward goes on. :meth:`finish` waits and adds
each bucket's average back into ``.grad``.

Zeroing at launch and adding the average back keeps gradient accumulation exact: a
gradient accumulated while its bucket is in flight stays in ``.grad``; before a bucket
launches again the previous result is added first, and an average that is already the
same on every rank passes through the next average unchanged, so after several
micro-batches ``.grad`` holds the sum of their averages.

Every rank must produce gradients for the same parameters in a backward (as with
DDP without ``find_unused_parameters``); buckets still incomplete at :meth:`finish`
are reduced there, with zeros for missing gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaling.optim._comm import group_size
from scaling.optim._slots import ParamSlot

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class GradientReducer:
    """Bucketed, backward-overlapped DP gradient averaging for ``slots``.

    Args:
        slots: the trainable parameters, in model order.
        group: the data-parallel group.
        bucket_size_bytes: bucket capacity (a larger gradient gets its own bucket).
    """

    def __init__(self, slots: Sequence[ParamSlot], group: ProcessGroup, bucket_size_bytes: int) -> None:
        self.group = group
        self.world = group_size(group)
        self.buckets: list[list[ParamSlot]] = []
        size = 0
        for slot in reversed(slots):
            nbytes = slot.numel * slot.param.element_size()
            last = self.buckets[-1] if self.buckets else None
            if last is None or last[0].param.dtype != slot.param.dtype or size + nbytes > bucket_size_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(slot)
            size += nbytes
        self._bucket_of = {id(s): i for i, b in enumerate(self.buckets) for s in b}
        self._ready = [0] * len(self.buckets)
        self._pending: dict[int, tuple[Any, torch.Tensor]] = {}
        self.handles = [s.param.register_post_accumulate_grad_hook(self._hook(s)) for s in slots]

    def _hook(self, slot: ParamSlot) -> Any:
        index = self._bucket_of[id(slot)]

        def hook(param: torch.Tensor) -> None:
            self._ready[index] += 1
            if self._ready[index] == len(self.buckets[index]):
                self._launch(index)

        return hook

    def _launch(self, index: int) -> None:
        self._complete(index)
        self._ready[index] = 0
        slots = self.buckets[index]
        for s in slots:
            if s.param.grad is None:
                s.param.grad = torch.zeros_like(s.param)
        flat = torch.cat([s.param.grad.reshape(-1) for s in slots])  # type: ignore[union-attr]
        for s in slots:
            s.param.grad.zero_()  # type: ignore[union-attr]
        # Direct async call: scaling.collectives has no async all-reduce; the overlap is the point.
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._pending[index] = (work, flat)

    def _complete(self, index: int) -> None:
        if index not in self._pending:
            return
        work, flat = self._pending.pop(index)
        work.wait()
        flat.div_(self.world)
        offset = 0
        for s in self.buckets[index]:
            grad = s.param.grad
            assert grad is not None
            grad.add_(flat[offset : offset + s.numel].view_as(grad))
            offset += s.numel

    def finish(self) -> None:
        """Reduce what backward left incomplete and add every average into ``.grad``."""
        for index in range(len(self.buckets)):
            if self._ready[index] or index not in self._pending:
                # Incomplete (or never launched) buckets: every rank reaches here in the same order.
                if self._ready[index] or any(s.param.grad is not None for s in self.buckets[index]):
                    self._launch(index)
        for index in range(len(self.buckets)):
            self._complete(index)

    def discard(self) -> None:
        """Drop in-flight results and readiness (``zero_grad``)."""
        for work, _ in self._pending.values():
            work.wait()
        self._pending.clear()
        self._ready = [0] * len(self.buckets)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
