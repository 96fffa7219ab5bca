"""Batch placement: the one place a batch reaches ``topology.device`` (the trainer's step:
:func:`to_device`; the auto API's ``model(batch)``: :func:`on_device`).

The loader yields batches in host memory (pinned when the device is CUDA, see
``BaseDatasetBatch.pin_memory``); the trainer's step moves each micro-batch here before
anything reads it, so layers, the TP batch sync (NCCL takes only CUDA tensors) and the
loss all see device tensors. On CUDA the copy is non-blocking: it is queued on the
current stream, which the forward pass uses too, so no synchronisation is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

import torch

B = TypeVar("B", bound="MovableBatch")


class MovableBatch(Protocol):
    """A batch that can copy itself to a device (``BaseDatasetBatch`` and tensors are)."""

    def to(self: B, device: torch.device, non_blocking: bool = False) -> B: ...


def to_device(batch: B | None, device: torch.device) -> B | None:
    """``batch`` on ``device``: a tensor, ``None`` (a rank that reads no data), or anything with ``.to``.

    Raises:
        TypeError: when ``batch`` is neither; give its class a ``to(device, non_blocking)``
            method (``BaseDatasetBatch`` subclasses have one).
    """
    if batch is None:
        return None
    to = getattr(batch, "to", None)
    if to is None:
        raise TypeError(
            f"a batch of type {type(batch).__name__} cannot be moved to {device}: it has no "
            "to(device, non_blocking=...) method; derive it from scaling.data.BaseDatasetBatch or add one"
        )
    return to(device, non_blocking=device.type == "cuda")


def on_device(batch: object, device: torch.device) -> object:
    """The auto API's plain-loop batch (a tensor, or a mapping, list or tuple of them) with its
    tensors on ``device``. From the loader's pinned memory the copies are non-blocking (queued on
    the stream the forward uses); on the CPU ``.to`` returns the tensor itself."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: on_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [on_device(v, device) for v in batch]
        if hasattr(batch, "_fields"):  # a namedtuple takes its fields one by one
            make: Callable[..., object] = type(batch)
            return make(*moved)
        return type(batch)(moved)
    return batch
