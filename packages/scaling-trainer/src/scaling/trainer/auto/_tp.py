"""Tensor-parallel replacements for ``nn.Linear``/``Conv1D``/``nn.Embedding`` (Megatron regions).

A replacement keeps the original parameter names (``weight``, ``bias``) and orientation
(``Conv1D`` keeps ``[in, out]``), so parameter paths are the same on every layout. The
math is ``scaling.nn``'s (``column_parallel_linear``, ``row_parallel_linear``,
``vocab_parallel_embedding``), the one implementation behind its LayerSpec layers too;
what is here is only the sharding of an existing module's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from scaling.nn import Float8Config, Float8Weight, column_parallel_linear, row_parallel_linear, vocab_parallel_embedding
from scaling.trainer.auto._plan import ModuleSharding
from scaling.trainer.auto._policy import shard_dim

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_LOCAL = "_scaling_local"


def shard_tensor(full: torch.Tensor, dim: int, rank: int, size: int, chunks: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` split over ``size`` ranks along ``dim``.

    With ``chunks > 1`` each of the ``chunks`` equal parts (e.g. q, k, v) is split
    separately and the pieces concatenated, so every rank holds whole parts of each.
    """
    parts = [c.chunk(size, dim)[rank] for c in full.chunk(chunks, dim)]
    # A copy, never a view: a view (a dim-0 chunk is already contiguous) would keep the
    # full tensor's storage alive on every rank.
    return torch.cat(parts, dim) if chunks > 1 else parts[0].clone(memory_format=torch.contiguous_format)


def unshard_view(local: torch.Tensor, dim: int, chunks: int) -> tuple[torch.Tensor, int]:
    """A view of a ``chunks``-fused shard with the parts as a new dim: ``(view, shard dim)``."""
    if chunks == 1:
        return local, dim
    shape = list(local.shape)
    shape[dim : dim + 1] = [chunks, shape[dim] // chunks]
    return local.view(shape), dim + 1


def _local_param(source: torch.Tensor, dim: int | None, rank: int, size: int, chunks: int) -> torch.nn.Parameter:
    if getattr(source, _LOCAL, False) or dim is None or size == 1:
        param = source if isinstance(source, torch.nn.Parameter) else torch.nn.Parameter(source, source.requires_grad)
    else:
        param = torch.nn.Parameter(shard_tensor(source.detach(), dim, rank, size, chunks), source.requires_grad)
    setattr(param, _LOCAL, True)
    return param


class ShardedLinear(torch.nn.Module):
    """A linear or ``Conv1D`` layer split over TP in the style of its :class:`ModuleSharding`.

    ``column``/``column_fused``: output split, input copied into the TP region;
    ``row``: input split, partial products all-reduced, replicated bias added once;
    ``vocab_head``: ``column`` with the logits all-gathered (full vocabulary out).

    Args:
        source: the module with its full (or already local, when tied) parameters.
        sharding: the plan's entry for it.
        group: the TP process group; rank, size: coordinates in it.
    """

    def __init__(
        self, source: torch.nn.Module, sharding: ModuleSharding, group: ProcessGroup | None, rank: int, size: int
    ) -> None:
        super().__init__()
        self.sharding, self.size = sharding, size
        self.group = group if size > 1 else None
        #: Float8 products (set by ``scaling.nn.enable_float8``); None = the parameter dtype.
        self.float8: Float8Config | None = None
        #: This weight already in float8, set by ZeRO-3's float8 all-gather; None = quantised per product.
        self.float8_weight: Float8Weight | None = None
        chunks = sharding.chunks
        self.weight = _local_param(source.get_parameter("weight"), shard_dim(sharding, "weight"), rank, size, chunks)
        bias = getattr(source, "bias", None)
        self.bias = None if bias is None else _local_param(bias, shard_dim(sharding, "bias"), rank, size, chunks)

    @property
    def tensor_parallel_split(self) -> str | None:
        """For float8's layer rule: ``"row"``, ``"column"``, or None for the LM head, which gathers
        the vocabulary and stays in high precision (as the LayerSpec models' heads do)."""
        return None if self.sharding.style == "vocab_head" else "row" if self.sharding.style == "row" else "column"

    @property
    def linear_shape(self) -> tuple[int, int]:
        """This rank's weight as ``F.linear`` takes it, ``[out, in]`` (``Conv1D`` stores ``[in, out]``)."""
        a, b = self.weight.shape
        return (b, a) if self.sharding.transposed else (a, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        style = self.sharding.style
        weight: torch.Tensor = self.weight
        weight8 = self.float8_weight
        if self.sharding.transposed:
            weight = weight.t()
            weight8 = None if weight8 is None else Float8Weight(weight8.tensor.t(), weight8.inverse)
        if style == "row":
            return row_parallel_linear(x, weight, self.bias, self.group, float8=self.float8, float8_weight=weight8)
        return column_parallel_linear(
            x,
            weight,
            self.bias,
            self.group,
            gather_output=style == "vocab_head",
            float8=self.float8,
            float8_weight=weight8,
        )

    def extra_repr(self) -> str:
        return f"style={self.sharding.style}, transposed={self.sharding.transposed}, model_parallel_size={self.size}"


class ShardedEmbedding(torch.nn.Module):
    """An ``nn.Embedding`` split over TP along the vocabulary (Megatron's VocabParallelEmbedding).

    Ids outside this rank's range look up zeros; the partial results are all-reduced.
    """

    def __init__(self, source: torch.nn.Embedding, group: ProcessGroup | None, rank: int, size: int) -> None:
        super().__init__()
        self.group, self.size = (group if size > 1 else None), size
        self.weight = _local_param(source.weight, 0, rank, size, 1)
        per_rank = source.num_embeddings // size
        self.start, self.end = rank * per_rank, (rank + 1) * per_rank
        pad = source.padding_idx
        self.padding_idx = pad - self.start if pad is not None and self.start <= pad < self.end else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(
            ids, self.weight, self.start, self.end, self.group, padding_idx=self.padding_idx
        )

    def extra_repr(self) -> str:
        return f"vocab_range=[{self.start}, {self.end}), model_parallel_size={self.size}"


def make_shard_fn(
    model: torch.nn.Module, shardings: dict[str, ModuleSharding], group: ProcessGroup | None, rank: int, size: int
) -> Callable[[str, torch.nn.Module], torch.nn.Module | None]:
    """The ``shard_fn`` for :func:`materialize`: replaces each planned module by its TP shard."""

    def shard_fn(path: str, module: torch.nn.Module) -> torch.nn.Module | None:
        sharding = shardings.get(path)
        if sharding is None:
            return None
        parent = model.get_submodule(path.rpartition(".")[0])
        for attr, full in sharding.attributes.items():
            setattr(parent, attr, full // size)
        if sharding.style == "vocab":
            return ShardedEmbedding(module, group, rank, size)  # type: ignore[arg-type]
        return ShardedLinear(module, sharding, group, rank, size)

    return shard_fn
