"""ZeRO-3's float8 all-gathers (see ``_zero3.py``): which weights travel in float8, their scales,
and the gathered float8 weights the products use.

The weights of float8 linears whose config asks for it (``Float8Config.all_gather``) travel
as e4m3 bytes, each scaled by its amax over all its shards, so every rank quantises its part
as the whole weight would be. The amaxes of all of them are taken in one all-reduce at the
first float8 gather after the shards changed (torchao's
``precompute_float8_dynamic_scale_for_fsdp``). Each such weight has a :class:`Float8Weight`
(on its slot and on its linear, the same tensors) that a gather fills and freeing the
parameter frees: the linear hands it to its products, which then do not quantise the
weight again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from scaling.collectives import all_reduce
from scaling.nn import Float8Weight, TensorParallelLinear, float8_quantize
from scaling.optim._slots import ParamSlot

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

WIRE_FLOAT8 = torch.float8_e4m3fn  # the format of float8 all-gathers (a forward operand's)


def fill_float8(slot: ParamSlot, data: torch.Tensor, inverse: torch.Tensor) -> None:
    """Put the whole weight in float8 (``data``, flat) and its inverse scale where the products read them."""
    held = slot.float8_weight
    assert held is not None
    storage = held.tensor.untyped_storage()
    if storage.nbytes() != slot.numel:
        storage.resize_(slot.numel)
    held.tensor.data.view(-1).copy_(data)  # through .data, as the parameters: version counters untouched
    held.inverse.data.copy_(inverse)


class Float8Gathers:
    """The float8 weights among a gatherer's layers.

    Args:
        modules: the gatherer's layers.
        by_param: its slots by parameter id.
        group: the group the shards are spread over (None: one rank).
    """

    def __init__(
        self, modules: Sequence[torch.nn.Module], by_param: Mapping[int, ParamSlot], group: ProcessGroup | None
    ) -> None:
        self.group = group
        self.slots: dict[int, ParamSlot] = {}  # slot id -> slot
        self._linears: list[TensorParallelLinear] = []
        for module in modules:
            for sub in module.modules():
                config = getattr(sub, "float8", None)
                slot = by_param.get(id(getattr(sub, "weight", None)))
                if (
                    isinstance(sub, TensorParallelLinear)
                    and config is not None
                    and config.all_gather
                    and slot is not None
                ):
                    self.slots[id(slot)] = slot
                    param = slot.param
                    held = torch.empty(param.shape, dtype=WIRE_FLOAT8, device=param.device)
                    held.untyped_storage().resize_(0)  # filled at each gather, as the parameter is
                    slot.float8_weight = sub.float8_weight = Float8Weight(held, torch.ones((), device=param.device))
                    self._linears.append(sub)
        self._amax: dict[int, torch.Tensor] | None = None  # slot id -> amax over the shards; None: not taken
        #: How many amax all-reduces ran (one per step with float8 all-gathers).
        self.amax_reductions = 0

    def __contains__(self, slot: ParamSlot) -> bool:
        return id(slot) in self.slots

    def amax(self, before_gather: Callable[[int | None], None] | None) -> dict[int, torch.Tensor]:
        """Every float8 weight's amax over its shards: one all-reduce for all of them while the
        shards stay as they are (every rank asks at the same gather: the first float8 one)."""
        if self._amax is None:
            if before_gather is not None:
                before_gather(None)  # reads every float8 weight's shard
            float8 = list(self.slots.values())
            device = float8[0].param.device
            amax = torch.stack(
                [
                    s.param_shard.detach().abs().max().float() if s.length else torch.zeros((), device=device)  # type: ignore[union-attr]
                    for s in float8
                ]
            )
            all_reduce(amax, self.group, op=dist.ReduceOp.MAX)
            self.amax_reductions += 1
            self._amax = {id(s): amax[i] for i, s in enumerate(float8)}
        return self._amax

    def forget_amax(self) -> None:
        """The shards are about to change."""
        self._amax = None

    def pack(
        self, slots: Iterable[ParamSlot], before_gather: Callable[[int | None], None] | None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """This rank's shards of ``slots`` as one byte buffer, the float8 weights quantised and the rest
        as they are; and each float8 weight's inverse scale (slot id -> scale)."""
        amax_of = self.amax(before_gather)
        parts, inverse = [], {}
        for s in slots:
            chunk = s.padded_chunk(s.param_shard)  # type: ignore[arg-type]
            if s in self:
                chunk, inverse[id(s)] = float8_quantize(chunk, amax_of[id(s)], WIRE_FLOAT8)
            parts.append(chunk.view(torch.uint8))
        return torch.cat(parts), inverse

    def fill_from_whole(self, slots: Iterable[ParamSlot], before_gather: Callable[[int | None], None] | None) -> None:
        """A layer whole from an exact gather (a checkpoint's, say) runs a forward: quantise its float8
        weights whose float8 copy is not filled, with their all-gather's scale (the bytes it would send)."""
        if not self.slots:  # no float8 all-gathers: the common case, on every forward of a whole layer
            return
        missing = [
            s for s in slots if s.float8_weight is not None and s.float8_weight.tensor.untyped_storage().nbytes() == 0
        ]
        if missing:
            amax_of = self.amax(before_gather)
            for slot in missing:
                data, inverse = float8_quantize(slot.param.detach(), amax_of[id(slot)], WIRE_FLOAT8)
                fill_float8(slot, data.view(-1), inverse)

    def detach(self) -> None:
        """The linears' products quantise their weights again (the gatherer is removed)."""
        for linear in self._linears:
            linear.float8_weight = None
        self._linears.clear()
