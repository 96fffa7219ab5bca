"""The layout-independent frame: a slot's logical tensor from every rank's owned elements, and back.

A slot's owned elements are its ZeRO chunk (over its shard space's group) of its TP piece (split
along ``meta.parallel_dim``). Muon's update (``_update.muon_updates``) takes whole matrices
through these calls (``DataParallel.whole_matrices()``): a sharded matrix is gathered on one rank
of its shard group, chosen round-robin, which orthogonalises it and scatters each rank its
elements back (DistMuon's division of the work).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from scaling.collectives import all_gather_flat

if TYPE_CHECKING:
    from scaling.optim._slots import ParamSlot
    from scaling.optim._spaces import ShardSpace
    from scaling.topology import Axis


class LogicalFrame:
    """Between the slots' owned elements and their logical tensors.

    Args:
        slots: the sharding component's slots.
        space_of: each slot's shard space.
        tp: the tensor-parallel axis the slots' TP pieces are split over.
    """

    def __init__(self, slots: Sequence[ParamSlot], space_of: Sequence[ShardSpace], tp: Axis) -> None:
        self.slots, self.space_of, self.tp = slots, space_of, tp

    def logical_shape(self, index: int) -> tuple[int, ...]:
        return self.slots[index].meta.logical_shape

    def orthogonaliser(self, index: int, k: int) -> int | None:
        """Which rank of slot ``index``'s shard group takes whole matrix ``k`` of an update (round-robin,
        so the ranks share the work); None when the slot is not sharded (every rank holds it)."""
        world = self.space_of[index].world
        return k % world if world > 1 else None

    def gather_whole(self, index: int, owned: torch.Tensor, to: int | None = None) -> torch.Tensor | None:
        """Slot ``index``'s logical tensor from every rank's owned elements (``owned``: this rank's),
        gathered over its shard group, then over TP along the split dimension: on every rank
        (``to=None``) or on shard rank ``to`` alone (None elsewhere; its TP peers get it too).
        Collectives: every rank holding a piece of the slot calls it alike."""
        slot, space = self.slots[index], self.space_of[index]
        padded = torch.cat([owned, owned.new_zeros(slot.chunk - slot.length)])
        group = space.shard_group if space.world > 1 else None
        if group is None:
            flat = padded
        elif to is None:
            flat = all_gather_flat(padded, group)
        else:
            chunks = [torch.empty_like(padded) for _ in range(space.world)] if space.rank == to else None
            dist.gather(padded, chunks, dst=dist.get_global_rank(group, to), group=group)
            if chunks is None:
                return None
            flat = torch.cat(chunks)
        whole = flat[: slot.numel].view(slot.param.shape)
        meta, tp = slot.meta, self.tp
        if meta.is_model_parallel and meta.parallel_dim is not None:
            pieces = all_gather_flat(whole.contiguous().view(-1), tp.group).view(tp.size, *whole.shape)
            whole = torch.cat(pieces.unbind(0), dim=meta.parallel_dim)
        return whole

    def owned_part(self, index: int, whole: torch.Tensor | None, source: int | None = None) -> torch.Tensor:
        """This rank's owned elements (flat) of slot ``index``'s logical tensor ``whole``, held by every
        rank (``source=None``) or by shard rank ``source`` alone, which scatters them (``whole`` None
        elsewhere)."""
        slot, space = self.slots[index], self.space_of[index]
        local = None
        if whole is not None:
            meta = slot.meta
            if meta.is_model_parallel and meta.parallel_dim is not None:
                whole = whole.chunk(meta.model_parallel_size, dim=meta.parallel_dim)[self.tp.rank]
            local = whole.reshape(-1)
        if source is None or space.world == 1:
            assert local is not None
            return local[slot.start : slot.end]
        out = torch.empty(slot.chunk, dtype=slot.compute_dtype, device=slot.param.device)
        chunks = None
        if local is not None:
            chunks = list(slot.padded_flat(local.to(out.dtype)).split(slot.chunk))
        group = space.shard_group
        assert group is not None
        dist.scatter(out, chunks, src=dist.get_global_rank(group, source), group=group)
        return out[: slot.length]
