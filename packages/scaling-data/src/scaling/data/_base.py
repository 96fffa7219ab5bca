"""The dataset contract: BaseDataset, BaseDatasetItem, BaseDatasetBatch.

A dataset yields items; ``collate`` turns a list of items into a batch; a batch can
drop what a pipeline stage does not need (``only_inputs`` on the first stage,
``only_targets`` on the last). Only tensor-parallel rank 0 reads data: the batch
reaches the other TP ranks through ``sync_batch_to_model_parallel``.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from torch.utils.data import Dataset

from scaling.collectives import broadcast_pytree

if TYPE_CHECKING:
    from scaling.topology import Topology

ItemT = TypeVar("ItemT", bound="BaseDatasetItem")
BatchT = TypeVar("BatchT", bound="BaseDatasetBatch")
_B = TypeVar("_B", bound="BaseDatasetBatch")


class BaseDatasetItem(ABC):  # noqa: B024  (a marker base: items need no shared method)
    """Base class of one sample, as returned by :meth:`BaseDataset.__getitem__`.

    Subclasses are usually dataclasses of tensors or numpy arrays.
    """


class BaseDatasetBatch(ABC):
    """Base class of a collated batch.

    Subclasses are usually dataclasses of tensors (their fields may be ``None`` after
    :meth:`only_inputs` / :meth:`only_targets`). Dataclass batches, and plain classes
    that hold their tensors as attributes, get :meth:`to` and :meth:`pin_memory` for free.
    """

    @abstractmethod
    def only_inputs(self: _B) -> _B:
        """Return the batch with only what the first pipeline stage reads (drop targets)."""

    @abstractmethod
    def only_targets(self: _B) -> _B:
        """Return the batch with only what the loss on the last stage reads (drop inputs)."""

    def to(self: _B, device: torch.device | str, non_blocking: bool = False) -> _B:
        """The batch with every tensor field on ``device`` (a copy; the batch itself is unchanged).

        Works for dataclass batches and for plain classes that keep their tensors as
        instance attributes; override it for anything else (tensors inside containers).
        """
        return _map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))

    def context_parallel_split(self: _B, rank: int, size: int) -> _B:
        """The batch as context-parallel rank ``rank`` of ``size`` sees it: its slice of every sequence.

        The trainer's step calls it after the TP sync when ``context_parallel_size > 1``.
        Batches whose tensors have a sequence dimension implement it with
        ``scaling.topology.split_sequence`` (the zigzag split, ``LMPackingBatch`` does);
        the default refuses, since only the batch knows which dimension is the sequence.

        Raises:
            ValueError: always, naming the batch type and the fix.
        """
        raise ValueError(
            f"context_parallel_size={size}: batches of type {type(self).__name__} do not say how to split their "
            "sequences over the context-parallel ranks; implement context_parallel_split(rank, size) (e.g. with "
            "scaling.topology.split_sequence) or train with context_parallel_size=1"
        )

    def pin_memory(self: _B) -> _B:
        """The batch with every CPU tensor field in pinned (page-locked) host memory.

        ``torch.utils.data.DataLoader(pin_memory=True)`` calls it in its pinning thread, so
        the trainer's copy to the GPU can be non-blocking.
        """
        return _map_tensors(self, lambda t: t.pin_memory() if t.device.type == "cpu" else t)


def _map_tensors(batch: _B, fn: Callable[[torch.Tensor], torch.Tensor]) -> _B:
    """``batch`` with ``fn`` applied to each tensor field (dataclass fields or instance attributes)."""
    if dataclasses.is_dataclass(batch):
        changes = {
            f.name: fn(getattr(batch, f.name))
            for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)
        }
        return dataclasses.replace(batch, **changes)
    moved = copy.copy(batch)
    moved.__dict__.update({k: fn(v) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)})
    return moved


class BaseDataset(Dataset[ItemT], Generic[ItemT, BatchT], ABC):
    """Base class of every Scaling dataset (a ``torch.utils.data.Dataset``).

    Subclasses implement :meth:`ident`, :meth:`__len__`, :meth:`__getitem__` and
    :meth:`collate`. The sample order is owned by :class:`scaling.data.DataLoader`
    (seeded per-epoch permutation in global-sample space); :meth:`set_seed` seeds any
    randomness *inside* the dataset (augmentation, a blend's per-source order) and the
    loader calls it with its own seed.

    Example::

        @dataclass
        class Item(BaseDatasetItem):
            x: torch.Tensor
            y: torch.Tensor

        class Squares(BaseDataset[Item, Batch]):
            def ident(self): return "squares"
            def __len__(self): return 100
            def __getitem__(self, i): return Item(torch.tensor([float(i)]), torch.tensor([float(i * i)]))
            def collate(self, items): return Batch(torch.stack([i.x for i in items]), ...)
    """

    seed: int = 0
    shuffle: bool = True

    @abstractmethod
    def ident(self) -> str:
        """A stable name of the dataset and its content (used in cache keys and logs)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def __getitem__(self, index: int) -> ItemT:
        """The sample at ``index`` in ``[0, len(self))``."""

    @abstractmethod
    def collate(self, items: list[ItemT]) -> BatchT:
        """Turn a list of items (one micro-batch) into a batch."""

    def set_seed(self, seed: int, shuffle: bool = True) -> None:
        """Seed the dataset's own randomness; ``shuffle=False`` asks for a fixed order.

        The default records both values; override (and call ``super()``) when the
        dataset has internal randomness that must follow the seed.
        """
        self.seed = int(seed)
        self.shuffle = bool(shuffle)

    def sync_batch_to_model_parallel(self, topology: Topology, batch: BatchT | None) -> BatchT:
        """Broadcast the batch from tensor-parallel rank 0 to the rest of its TP group.

        Only TP rank 0 needs to have read data: the other ranks may pass ``None``. With
        ``model_parallel_size == 1`` the batch is returned unchanged.

        Args:
            topology: this rank's initialised :class:`~scaling.topology.Topology`.
            batch: the batch on TP rank 0; anything (usually ``None``) elsewhere.

        Returns:
            The TP rank 0 batch on every rank of the TP group (dtypes preserved).

        Raises:
            ValueError: when TP rank 0 has no batch.
        """
        if topology.axis("tp").size == 1:
            if batch is None:
                raise ValueError(
                    f"sync_batch_to_model_parallel on rank {topology.global_rank}: batch is None but this rank "
                    "is the only model-parallel rank and must have read it; iterate the DataLoader on every rank"
                )
            return batch
        if topology.axis("tp").rank == 0 and batch is None:
            raise ValueError(
                f"sync_batch_to_model_parallel on rank {topology.global_rank}: batch is None on model-parallel "
                "rank 0, which is the rank that reads data and broadcasts it; pass the loader's batch there"
            )
        src = topology.axis("tp").ranks[0]
        out = broadcast_pytree(batch, src=src, group=topology.axis("tp").group)
        assert out is not None  # model-parallel rank 0 sent its batch (checked above)
        return out
