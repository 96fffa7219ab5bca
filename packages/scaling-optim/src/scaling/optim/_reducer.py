"""DP gradient reduction overlapped with backward, as DDP does: all-reduce (ZeRO 0) or reduce-scatter (ZeRO 1, 2).

Parameters are put into buckets in reverse order (the order backward produces their
gradients); as in DDP a bucket is closed once it holds ``bucket_size_bytes`` (the first
one: 1 MiB, so communication starts early), so a bucket exceeds the size by at most
its last parameter. When the last gradient of a bucket has been
accumulated, the bucket's gradients are copied into a flat buffer and an asynchronous
collective (``scaling.collectives``, recorded and diagnosed) starts while backward goes
on. :meth:`GradientReducer.finish` waits for every bucket.

Modes:

- ``"all_reduce"`` (ZeRO 0): the flat bucket is all-reduced; each bucket's average is
  added back into ``.grad``, so ``.grad`` holds the DP average of the whole parameter.
- ``"shard"`` (ZeRO 1): the bucket is reduce-scattered; each rank receives only the
  elements it owns and adds them into the owned slice of ``.grad`` (the rest of
  ``.grad`` stays zero). A ZeRO-1 step then moves two model-sized payloads over DP, the
  reduce-scatter and the all-gather of updated shards, as DDP's all-reduce does.
- ``"shard_free"`` (ZeRO 2): as ``"shard"``, but the reduced elements go to
  ``slot.grad_shard`` and ``.grad`` is dropped at launch, so a full gradient lives only
  until its bucket is complete. Pipeline-tied parameters (``meta.tied_key``) are the
  exception: they keep ``.grad`` as in ``"shard"``, because the pipeline sums their
  ``.grad`` over stages after :meth:`GradientReducer.finish`.

Bucket layout for reduce-scatter: ownership is per parameter (``_slots.py``: a parameter
is padded to ``chunk * world`` elements and rank ``r`` owns chunk ``r``). A bucket's flat
buffer is laid out rank-major, ``[rank 0: chunk 0 of each parameter | rank 1: chunk 1 of
each parameter | ...]``, so one reduce-scatter hands every rank exactly its chunks, in
bucket order; no state, checkpoint or ZeRO-3 code depends on the bucket layout.

Gradient accumulation stays exact. All-reduce mode leaves ``.grad`` as it is at launch
and overwrites it with the average on completion; a gradient tensor hook completes a
bucket still in flight before the next backward accumulates into it, so that gradient
lands on the average (an average already the same on every rank passes through the
next average unchanged). Reduce-scatter modes zero ``.grad`` at launch and add the
*sum* over ranks into the owned elements and divide by the DP size once, in
:meth:`finish`: an owned element already holding the previous sum is sent again by its
owner only (other ranks zeroed that element at launch), so the next sum adds exactly
the new micro-batch's gradients.

Reducing once per step: with :meth:`GradientReducer.accumulate` (``n`` backward passes
per step) a bucket launches when its gradients have accumulated ``n`` times, in the last
pass, so the DP traffic of a step with ``n`` micro-batches is one bucket set, not ``n``
(Megatron-LM reduces in the last micro-batch's backward the same way).
:meth:`GradientReducer.no_sync` is DDP's: passes inside it are not counted, and the first
pass after it (or :meth:`finish`) reduces the sum.

Every rank must produce gradients for the same parameters in a backward (as with
DDP without ``find_unused_parameters``); buckets still incomplete at :meth:`finish`
are reduced there, with zeros for missing gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from scaling.collectives import PendingCollective, all_reduce_async, reduce_scatter_async
from scaling.nn import ParameterMeta
from scaling.optim._comm import group_size
from scaling.optim._slots import ParamSlot
from scaling.optim._weak import weak_hook

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

MODES = ("all_reduce", "shard", "shard_free")
DEFAULT_BUCKET_SIZE_BYTES = 25_000_000  # OptimizerConfig.allreduce_bucket_size's default
# DDP's policy: a small first bucket (the last layers) so the first reduction starts early.
FIRST_BUCKET_BYTES = 1024 * 1024


SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def widened(flat: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """``flat`` in ``reduce_dtype`` when it is a 16-bit float (bf16, fp16) and one is given; else itself."""
    if reduce_dtype is None or flat.dtype not in SIXTEEN_BIT:
        return flat
    return flat.to(reduce_dtype)


def check_backward_passes(passes: int, name: str) -> None:
    """Refuse a count of backward passes per step that is not a positive int (``name``: the caller's argument)."""
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"{name}={passes!r} must be a positive int (backward passes per step)")


class GradientReducer:
    """Bucketed, backward-overlapped DP gradient averaging for ``slots``.

    Args:
        slots: the trainable parameters, in model order.
        group: the data-parallel group.
        bucket_size_bytes: a bucket is closed once it holds this many bytes (of the parameters' dtype).
        mode: ``"all_reduce"``, ``"shard"`` or ``"shard_free"`` (see the module docstring).
        reduce_dtype: bf16/fp16 gradients travel in this dtype (fp32: the sum over ranks is
            rounded once, into ``.grad``, or not at all into an fp32 ``grad_shard``); None:
            in their own.
    """

    def __init__(
        self,
        slots: Sequence[ParamSlot],
        group: ProcessGroup,
        bucket_size_bytes: int,
        mode: str = "all_reduce",
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"GradientReducer mode must be one of {MODES}, got {mode!r}")
        if isinstance(bucket_size_bytes, bool) or not isinstance(bucket_size_bytes, int) or bucket_size_bytes <= 0:
            raise ValueError(
                f"bucket_size_bytes={bucket_size_bytes!r} must be a positive int (bytes per bucket), "
                f"e.g. {DEFAULT_BUCKET_SIZE_BYTES}"
            )
        self.group, self.mode, self.reduce_dtype = group, mode, reduce_dtype
        self.world = group_size(group)
        self.buckets: list[list[ParamSlot]] = []
        size, cap = 0, min(bucket_size_bytes, FIRST_BUCKET_BYTES)
        for slot in reversed(slots):
            last = self.buckets[-1] if self.buckets else None
            if last is None or last[0].param.dtype != slot.param.dtype or size >= cap:
                if last is not None:
                    cap = bucket_size_bytes
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(slot)
            size += slot.numel * slot.param.element_size()
        self._bucket_of = {id(s): i for i, b in enumerate(self.buckets) for s in b}
        # Parameters whose reduced elements stay in .grad: all in "shard" mode; in
        # "shard_free" mode the pipeline-tied ones, whose .grad is summed over stages after
        # finish (the owned elements line up on every stage).
        self._keep_grad = {id(s) for s in slots if mode == "shard" or s.meta.tied_key is not None}
        self._ready = [0] * len(self.buckets)
        # A bucket launches once its gradients have accumulated this many times (accumulate).
        self._launch_at = [len(b) for b in self.buckets]
        self._sync = True  # False inside no_sync
        self._pending: dict[int, tuple[PendingCollective, torch.Tensor]] = {}
        self.handles = [s.param.register_post_accumulate_grad_hook(self._hook(s)) for s in slots]
        if mode == "all_reduce":
            self.handles += [s.param.register_hook(self._pre_hook(s)) for s in slots]

    @classmethod
    def over_parameters(
        cls,
        params: Sequence[torch.nn.Parameter],
        group: ProcessGroup,
        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
    ) -> GradientReducer:
        """All-reduce mode over plain parameters, for an update that is not ours (a torch optimizer's).

        Each parameter gets a bare slot (no master copy, no state): the reducer needs only
        its flat gradient. Every rank must pass the same parameters in the same order.

        Example::

            reducer = GradientReducer.over_parameters(list(model.parameters()), dp_group)
            loss.backward()  # buckets are all-reduced while backward goes on
            reducer.finish(); torch_optimizer.step(); torch_optimizer.zero_grad(); reducer.discard()
        """
        slots = [
            ParamSlot(str(i), p, ParameterMeta(str(i), tuple(p.shape)), 0, 1, 0, False, ())
            for i, p in enumerate(params)
        ]
        return cls(slots, group, bucket_size_bytes, "all_reduce")

    # The hooks hold the reducer weakly (see weak_hook).
    def _hook(self, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        index = self._bucket_of[id(slot)]

        def hook(reducer: GradientReducer, param: torch.Tensor) -> None:
            if not reducer._sync:
                return
            reducer._ready[index] += 1
            if reducer._ready[index] == reducer._launch_at[index]:
                reducer._launch(index)

        return weak_hook(self, hook)

    def _pre_hook(self, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        index = self._bucket_of[id(slot)]

        def hook(reducer: GradientReducer, grad: torch.Tensor) -> None:
            # All-reduce mode leaves the local gradients in .grad while in flight; a new
            # gradient for the bucket must land on the average, so it completes first.
            if index in reducer._pending:
                reducer._complete(index)

        return weak_hook(self, hook)

    def accumulate(self, backwards: int) -> None:
        """Launch each bucket in the ``backwards``-th backward pass that accumulates into it (from now on).

        A step that accumulates ``backwards`` micro-batches then reduces once, overlapped
        with its last backward. ``1`` (the default): every pass reduces.

        Raises:
            ValueError: ``backwards`` is not a positive int.
        """
        check_backward_passes(backwards, "backwards")
        self._launch_at = [len(b) * backwards for b in self.buckets]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate ``.grad`` locally, as in DDP's ``no_sync``; the first
        pass after it (or :meth:`finish`) reduces what accumulated."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _launch(self, index: int) -> None:
        self._complete(index)
        self._ready[index] = 0
        slots = self.buckets[index]
        grads = []
        for s in slots:
            if s.param.grad is None:
                s.param.grad = torch.zeros_like(s.param)
            grads.append(s.param.grad)
        if self.mode == "all_reduce":
            flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
            flat = widened(flat, self.reduce_dtype)
            pending = all_reduce_async(flat, self.group)
        else:
            # Rank-major: row r of each (world, chunk) view is rank r's chunk of that parameter.
            flat = torch.cat([s.padded_flat(g).view(self.world, s.chunk) for s, g in zip(slots, grads)], dim=1)
            flat = widened(flat.view(-1), self.reduce_dtype)
            out = flat.new_empty(flat.numel() // self.world)
            pending = reduce_scatter_async(out, flat, self.group)
            flat = out
        for s in slots:
            if self.mode == "all_reduce":
                continue
            if id(s) in self._keep_grad:
                s.param.grad.zero_()  # type: ignore[union-attr]
            else:
                s.param.grad = None
        self._pending[index] = (pending, flat)

    def _complete(self, index: int) -> None:
        if index not in self._pending:
            return
        work, flat = self._pending.pop(index)
        work.wait()
        if self.mode == "all_reduce":
            offset = 0
            for s in self.buckets[index]:
                grad = s.param.grad
                assert grad is not None
                # .grad still holds this rank's gradients (nothing accumulated since launch,
                # see _pre_hook): overwrite them with the average in one pass.
                torch.div(flat[offset : offset + s.numel].view_as(grad), self.world, out=grad)
                offset += s.numel
            return
        offset = 0
        for s in self.buckets[index]:
            part = flat[offset : offset + s.length]
            offset += s.chunk
            if id(s) in self._keep_grad:
                if s.param.grad is None:
                    s.param.grad = torch.zeros_like(s.param)
                s.param.grad.view(-1)[s.start : s.end].add_(part)
            elif s.grad_shard is None:
                s.grad_shard = part.to(s.compute_dtype, copy=True)
            else:
                s.grad_shard.add_(part)

    def finish(self) -> None:
        """Reduce what backward left incomplete and wait for every bucket.

        Afterwards ``.grad`` holds the DP average (``"all_reduce"``), the owned
        elements of ``.grad`` do (``"shard"`` and tied parameters, others zero), or
        ``slot.grad_shard`` does (``"shard_free"``).
        """
        for index in range(len(self.buckets)):
            if self._ready[index] or index not in self._pending:
                # Incomplete (or never launched) buckets: every rank reaches here in the same order.
                if self._ready[index] or any(s.param.grad is not None for s in self.buckets[index]):
                    self._launch(index)
        for index in range(len(self.buckets)):
            self._complete(index)
        if self.mode == "all_reduce":
            return
        for slot in (s for b in self.buckets for s in b):
            if id(slot) in self._keep_grad and slot.param.grad is not None:
                slot.param.grad.view(-1)[slot.start : slot.end].div_(self.world)
            elif slot.grad_shard is not None:
                slot.grad_shard.div_(self.world)

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
