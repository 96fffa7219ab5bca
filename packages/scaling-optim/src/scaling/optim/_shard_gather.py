"""ZeRO 1/2 write-back: gather the updated shards into the parameters, overlapped with the update.

After the update every DP rank holds the new values of the elements it owns; each
parameter must become whole again on every rank. :class:`ShardGather` plans, once, how:

- a large parameter whose elements split evenly over the ranks (no padding) is gathered
  straight into its own storage (``all_gather_async`` with this rank's owned slice,
  which sits at this rank's offset of the output: the in-place form), so no flat
  buffer is allocated and nothing is copied back on this thread;
- small or padded parameters are packed, in model order (skipping the large ones),
  into buckets of at most ``bucket_size_bytes`` over all ranks, gathered as one flat
  buffer and copied out.

:meth:`ShardGather.launch` starts one entry's gather as soon as its shards are updated,
so it runs while the next entry is being updated; :meth:`ShardGather.finish` waits
for all and copies the bucketed ones out. Entries are ordered by their first parameter
in model order, so the gathers complete roughly in forward order: with
``overlap_param_gather`` the optimizer returns before they finish and a forward pre-hook
waits, with :meth:`ShardGather.wait`, for just the entries a module's parameters are in
(Megatron-LM's ``--overlap-param-gather``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from scaling.collectives import PendingCollective, all_gather_async
from scaling.optim._comm import group_size
from scaling.optim._slots import ParamSlot
from scaling.optim._weak import weak_hook

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.utils.hooks import RemovableHandle

# A parameter of at least this many bytes gets its own gather (in place, no copies);
# smaller ones share a bucket, so a model of many biases does not pay one call each.
DIRECT_MIN_BYTES = 256 * 1024


class ShardGather:
    """Gathers the updated ZeRO shards of ``slots`` over ``group`` into the parameters.

    Args:
        slots: the trainable parameters, in model order (sharded over ``group``).
        group: the data-parallel group (size > 1).
        bucket_size_bytes: the most bytes all ranks' chunks of one bucket may hold.
        direct_min_bytes: a parameter of at least this size that splits evenly is
            gathered on its own, in place.
    """

    def __init__(
        self,
        slots: Sequence[ParamSlot],
        group: ProcessGroup,
        bucket_size_bytes: int,
        direct_min_bytes: int = DIRECT_MIN_BYTES,
    ) -> None:
        self.slots, self.group = list(slots), group
        self.world = group_size(group)
        self.entries: list[list[int]] = []
        self._direct: list[bool] = []
        per_rank_cap = max(bucket_size_bytes // self.world, 1)
        bucket: list[int] = []
        size = 0
        for index, slot in enumerate(self.slots):
            itemsize = slot.param.element_size()
            if slot.numel == slot.chunk * self.world and slot.numel * itemsize >= direct_min_bytes:
                self.entries.append([index])
                self._direct.append(True)
                continue
            # Small parameters share a bucket even when large ones sit between them.
            if bucket and (
                self.slots[bucket[0]].param.dtype != slot.param.dtype or size + slot.chunk * itemsize > per_rank_cap
            ):
                self.entries.append(bucket)
                self._direct.append(False)
                bucket, size = [], 0
            bucket.append(index)
            size += slot.chunk * itemsize
        if bucket:
            self.entries.append(bucket)
            self._direct.append(False)
        # Model order by first parameter: a bucket of small parameters goes before the
        # large ones after its first member, so the first layers' gathers finish first.
        order = sorted(range(len(self.entries)), key=lambda e: self.entries[e][0])
        self.entries = [self.entries[e] for e in order]
        self._direct = [self._direct[e] for e in order]
        self.entry_of = {i: e for e, indices in enumerate(self.entries) for i in indices}
        self._pending: dict[int, tuple[PendingCollective, torch.Tensor | None]] = {}

    @property
    def pending(self) -> bool:
        """Some launched gather has not been waited for."""
        return bool(self._pending)

    def launch(self, entry: int) -> None:
        """Start gathering entry ``entry`` (its shards must be updated already)."""
        indices = self.entries[entry]
        if self._direct[entry]:
            slot = self.slots[indices[0]]
            out = slot.flat_param()
            # In place: the owned slice of the parameter is this rank's part of the output.
            send = out[slot.start : slot.end] if slot.master is None else slot.master.to(out.device, out.dtype)
            self._pending[entry] = (all_gather_async(out, send, self.group), None)
            return
        chunks = [self.slots[i].padded_chunk(self.slots[i].work_param()) for i in indices]
        send = torch.cat(chunks) if len(chunks) > 1 else chunks[0].contiguous()
        grid = send.new_empty(send.numel() * self.world)
        self._pending[entry] = (all_gather_async(grid, send, self.group), grid)

    def wait_hooks(self, model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[RemovableHandle]:
        """A forward pre-hook on each module of ``model`` owning a slot's parameter: wait for its
        gathers (``overlap_param_gather``). Returns the hook handles."""
        index_of = {id(slot.param): i for i, slot in enumerate(self.slots)}
        handles = []
        for root in [model] if isinstance(model, torch.nn.Module) else model:
            for module in root.modules():
                own = [index_of[id(p)] for p in module.parameters(recurse=False) if id(p) in index_of]
                if own:
                    entries = sorted({self.entry_of[i] for i in own})

                    def hook(
                        gather: ShardGather,
                        _module: torch.nn.Module,
                        _args: tuple[object, ...],
                        entries: list[int] = entries,
                    ) -> None:
                        if gather.pending:
                            gather.wait(entries)

                    handles.append(module.register_forward_pre_hook(weak_hook(self, hook)))
        return handles

    def wait(self, entries: Sequence[int]) -> None:
        """Wait for the gathers of ``entries`` (those launched and not yet waited for)."""
        for entry in entries:
            item = self._pending.pop(entry, None)
            if item is not None:
                item[0].wait()
                if item[1] is not None:
                    self._copy_out(self.entries[entry], item[1])

    def finish(self) -> None:
        """Wait for every launched gather and copy bucketed results into the parameters."""
        self.wait(list(self._pending))

    def _copy_out(self, indices: list[int], grid: torch.Tensor) -> None:
        rows_of = grid.view(self.world, -1)
        offset = 0
        for i in indices:
            slot = self.slots[i]
            out, n = slot.flat_param(), slot.chunk
            # One strided copy per tensor: whole rows first, then the padded last rank's part.
            rows = min(out.numel() // n, self.world) if n else 0
            out[: rows * n].view(rows, n).copy_(rows_of[:rows, offset : offset + n])
            if rows < self.world and out.numel() > rows * n:
                out[rows * n :].copy_(rows_of[rows, offset : offset + out.numel() - rows * n])
            offset += n
