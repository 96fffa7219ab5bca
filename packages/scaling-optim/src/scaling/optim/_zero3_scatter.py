"""ZeRO-3's backward half: each layer's gradients reduce-scattered into the owned shards (see ``_zero3.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from scaling.collectives import PendingCollective, all_reduce, reduce_scatter_async
from scaling.optim._comm import group_size
from scaling.optim._reducer import widened
from scaling.optim._slots import ParamSlot

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class GradientScatter:
    """ZeRO-3: a layer's gradients reduce-scattered together, asynchronously, once all have accumulated.

    Each trained parameter is reduced with the first layer holding it; frozen ones have
    no gradient, and pipeline-tied parameters (``meta.tied_key``) are left out (their
    ``.grad`` is summed over stages first). As in FSDP, one collective per layer and
    backward moves the layer's gradients laid out rank-major (chunk ``r`` of every
    parameter, then chunk ``r + 1``, ...), so each rank receives exactly its owned chunks. At most two collectives are in flight: the full
    gradients they send are the only ones alive, as in FSDP's reduce-scatter stream.

    Under HSDP each completed shard is then all-reduced over the replicas of its shard
    group, so every replica holds the average over the whole DP group.

    Args:
        layers: the slots of each layer (the gatherer's ``layers``).
        group: the group the shards are spread over (DP, or its shard group under HSDP).
        replicate_group: HSDP: the replicas of this rank's shard; None without HSDP.
        divisor: the average over the shard and replicate groups is divided by this too
            (the expert-parallel size for experts: their mean is over all of DP × CP).
        reduce_dtype: bf16/fp16 gradients travel in this dtype (None: their own; see
            ``GradientReducer``).
    """

    MAX_IN_FLIGHT = 2

    def __init__(
        self,
        layers: Sequence[Sequence[ParamSlot]],
        group: ProcessGroup | None,
        replicate_group: ProcessGroup | None = None,
        divisor: int = 1,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.group, self.world, self.reduce_dtype = group, group_size(group), reduce_dtype
        self.replicate_group = replicate_group
        self.average_over = self.world * group_size(replicate_group) * divisor
        seen: set[int] = set()
        self.units: list[list[ParamSlot]] = []
        for layer in layers:
            self.units.append(
                [s for s in layer if id(s) not in seen and s.meta.tied_key is None and s.param.requires_grad]
            )
            seen |= {id(s) for s in layer}
        self.unit_of = {id(s): i for i, unit in enumerate(self.units) for s in unit}
        self.ready: list[int] = [0] * len(self.units)
        self.pending: list[tuple[PendingCollective, torch.Tensor, list[ParamSlot]]] = []

    def grad_ready(self, slot: ParamSlot) -> bool:
        """Note that ``slot``'s gradient has accumulated; False for a slot this class does not reduce."""
        index = self.unit_of.get(id(slot))
        if index is None:
            return False
        self.ready[index] += 1
        if self.ready[index] == len(self.units[index]):
            self._launch(index)
        return True

    def _launch(self, index: int) -> None:
        self.ready[index] = 0
        self._launch_slots([s for s in self.units[index] if s.param.grad is not None])

    def _launch_slots(self, slots: list[ParamSlot]) -> None:
        if not slots:
            return
        if self.world == 1 and self.replicate_group is None:  # one rank: each gradient is its own shard
            for slot in slots:
                grad = slot.param.grad.reshape(-1)  # type: ignore[union-attr]
                slot.param.grad = None
                self._accumulate(slot, grad / self.average_over if self.average_over != 1 else grad)
            return
        grads = [s.padded_flat(s.param.grad).view(self.world, s.chunk) for s in slots]  # type: ignore[arg-type]
        send = torch.cat(grads, dim=1).reshape(-1) if len(grads) > 1 else grads[0].reshape(-1).clone()
        send = widened(send, self.reduce_dtype)
        out = torch.empty(send.numel() // self.world, dtype=send.dtype, device=send.device)
        work = reduce_scatter_async(out, send, self.group)
        for slot in slots:
            slot.param.grad = None
        self.pending.append((work, out, slots))
        while len(self.pending) > self.MAX_IN_FLIGHT:
            self._complete(self.pending.pop(0))

    def _complete(self, entry: tuple[PendingCollective, torch.Tensor, list[ParamSlot]]) -> None:
        work, out, slots = entry
        work.wait()
        if self.replicate_group is not None:
            all_reduce(out, self.replicate_group)
        out.div_(self.average_over)
        offset = 0
        for slot in slots:
            self._accumulate(slot, out[offset : offset + slot.length])
            offset += slot.chunk

    @staticmethod
    def _accumulate(slot: ParamSlot, reduced: torch.Tensor) -> None:
        shard = reduced.to(slot.compute_dtype)
        slot.grad_shard = shard if slot.grad_shard is None else slot.grad_shard.add_(shard)

    def finish(self) -> None:
        """Reduce layers left incomplete (a parameter without a gradient) and wait for every collective."""
        for index, count in enumerate(self.ready):
            if count:  # the same on every rank: every rank ran the same backward
                self._launch(index)
        while self.pending:
            self._complete(self.pending.pop(0))

    def reduce_now(self, slots: list[ParamSlot]) -> None:
        """Reduce the ``.grad`` of ``slots`` (tied weights after their stage sum) into their shards, and wait."""
        self._launch_slots(slots)
        while self.pending:
            self._complete(self.pending.pop(0))

    def discard(self) -> None:
        """Wait for and drop collectives in flight and readiness (``zero_grad``)."""
        for work, _, _ in self.pending:
            work.wait()
        self.pending.clear()
        self.ready = [0] * len(self.units)
