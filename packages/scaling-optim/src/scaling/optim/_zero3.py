"""ZeRO-3: parameters live as DP shards and are gathered per layer, with prefetch, then freed.

Why our own and not FSDP2 (``fully_shard``): FSDP2 replaces every parameter with a new
DTensor parameter, which drops the :class:`~scaling.nn.ParameterMeta` the optimizer,
clipping and checkpoints read, changes the parameter objects the pipeline and the
param groups already hold, and needs the TP layers to be DTensor-aware. Here the
parameter objects stay; only their storage is freed (``untyped_storage().resize_(0)``)
and refilled, as FSDP1 does, so the rest of Scaling sees ordinary parameters.

Lifecycle per layer (``modules`` in forward order):

- forward pre-hook: wait for / run the all-gather of the layer, start the async
  all-gather of the next layer (prefetch);
- forward post-hook: free the layer; when grad is enabled, hook the outputs so the first
  gradient reaching them re-gathers the layer (and prefetches the previous one);
- post-accumulate-grad hook (in the optimizer): reduce-scatter the gradient into the
  owned shard and free the parameter again.

Refilling goes through ``param.data`` so autograd's version counter is untouched: the
tensors saved for backward see the same values they were computed with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from scaling.optim._comm import group_size
from scaling.optim._compat import all_gather_single
from scaling.optim._slots import ParamSlot
from scaling.optim._weak import weak_hook

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def free_storage(slot: ParamSlot) -> None:
    slot.param.untyped_storage().resize_(0)


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a layer's output: tensors, sequences, mappings and dataclasses (LayerIO)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _iter_tensors(getattr(obj, f.name))


class ParameterGatherer:
    """Gathers and frees the ZeRO-3 parameters of each layer around its forward and backward.

    Args:
        modules: the layers, in forward order; each parameter of a layer that the
            optimizer trains is gathered for that layer.
        slots: the optimizer's slots (with ``param_shard`` set).
        group: the data-parallel group the shards are spread over.
    """

    def __init__(self, modules: Sequence[torch.nn.Module], slots: Sequence[ParamSlot], group: ProcessGroup) -> None:
        by_param = {id(s.param): s for s in slots}
        self.group = group
        self.layers: list[list[ParamSlot]] = [
            [by_param[id(p)] for p in m.parameters() if id(p) in by_param] for m in modules
        ]
        covered = {id(s) for layer in self.layers for s in layer}
        missing = [s.name for s in slots if id(s) not in covered]
        if missing:
            raise ValueError(
                f"zero_stage=3: parameters {missing} belong to none of the modules passed as zero3_modules; "
                "pass every layer that uses a trained parameter"
            )
        self._pending: dict[int, tuple[Any, torch.Tensor, int]] = {}
        self.handles: list[Any] = []
        for index, module in enumerate(modules):
            self.handles.append(module.register_forward_pre_hook(self._pre_forward(index)))
            self.handles.append(module.register_forward_hook(self._post_forward(index)))

    # ------------------------------------------------------------- gathering
    def _start(self, index: int) -> None:
        if index in self._pending or not 0 <= index < len(self.layers) or not self.layers[index]:
            return
        slots = self.layers[index]
        send = torch.cat([s.padded_chunk(s.param_shard) for s in slots])  # type: ignore[arg-type]
        world = group_size(self.group)
        recv = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
        work = all_gather_single(recv, send, group=self.group, async_op=True)
        self._pending[index] = (work, recv, send.numel())

    def gather(self, index: int) -> None:
        """Make layer ``index``'s parameters whole (waiting for a prefetch if one is running)."""
        self._start(index)
        if index not in self._pending:
            return
        work, recv, width = self._pending.pop(index)
        work.wait()
        grid = recv.view(-1, width)
        offset = 0
        for slot in self.layers[index]:
            storage = slot.param.untyped_storage()
            nbytes = slot.numel * slot.param.element_size()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
            full = grid[:, offset : offset + slot.chunk].reshape(-1)[: slot.numel]
            slot.param.data.view(-1).copy_(full)
            offset += slot.chunk

    def discard_pending(self) -> None:
        """Finish and drop prefetches not consumed (their shards are about to change)."""
        for work, _, _ in self._pending.values():
            work.wait()
        self._pending.clear()

    def free(self, index: int) -> None:
        for slot in self.layers[index]:
            free_storage(slot)

    def gather_all(self) -> None:
        for index in range(len(self.layers)):
            self.gather(index)

    def free_all(self) -> None:
        for index in range(len(self.layers)):
            self.free(index)

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Every parameter whole inside the block (read-only: edits are not written back)."""
        self.gather_all()
        try:
            yield
        finally:
            self.free_all()

    # ----------------------------------------------------------------- hooks
    # The hooks hold the gatherer weakly (see weak_hook).
    def _pre_forward(self, index: int) -> Any:
        def hook(gatherer: ParameterGatherer, module: torch.nn.Module, args: Any) -> None:
            gatherer.gather(index)
            gatherer._start(index + 1)  # prefetch: overlaps the next layer's gather with this layer

        return weak_hook(self, hook)

    def _post_forward(self, index: int) -> Any:
        def hook(gatherer: ParameterGatherer, module: torch.nn.Module, args: Any, output: Any) -> None:
            gatherer.free(index)
            if not torch.is_grad_enabled():
                return
            fired = [False]

            def regather(gatherer: ParameterGatherer, grad: torch.Tensor) -> None:
                if not fired[0]:
                    fired[0] = True
                    gatherer.gather(index)
                    gatherer._start(index - 1)  # backward runs layers in reverse

            once = weak_hook(gatherer, regather)
            for tensor in _iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(once)

        return weak_hook(self, hook)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def check_zero3(zero_stage: int, pipe_parallel_size: int, modules: Sequence[torch.nn.Module] | None) -> None:
    """Refuse ZeRO-3 layouts and arguments that do not work."""
    if zero_stage != 3:
        if modules is not None:
            raise ValueError(f"zero3_modules is only used with zero_stage=3, got zero_stage={zero_stage}")
        return
    if pipe_parallel_size > 1:
        raise ValueError(
            f"zero_stage=3 with pipe_parallel_size={pipe_parallel_size} is not supported: per-layer "
            "gathering is not validated against interleaved pipeline micro-batches; use zero_stage 1 or 2 with "
            "pipeline parallelism, or pipe_parallel_size=1 with zero_stage 3"
        )
    if not modules:
        raise ValueError(
            "zero_stage=3 needs zero3_modules=[layer, ...] (the layers in forward order) so that parameters can "
            "be gathered per layer around forward and backward"
        )


def check_own_storage(slot: ParamSlot) -> None:
    if slot.param.untyped_storage().nbytes() != slot.numel * slot.param.element_size():
        raise ValueError(
            f"zero_stage=3: parameter {slot.name!r} shares its storage with other tensors; ZeRO-3 frees each "
            "parameter's storage between uses, so every parameter needs its own (clone it)"
        )
