"""Tensor- and sequence-parallel region functions with Megatron autograd semantics.

Shapes are batch-first ``[b, s, h]``: the model-parallel functions split/gather the
last dim (hidden), the sequence-parallel ones ``dim`` (default 1, the sequence).

Each function is a pair of conjugate collectives: the backward of a forward
all-reduce is the identity, the backward of a split is an all-gather, and so on. The
backward of an identity forward is an all-reduce because every TP rank computes a
*partial* gradient of the replicated input. With ``group`` ``None`` or of one rank,
every function returns its input unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from scaling.collectives import _ops

if TYPE_CHECKING:
    from scaling.collectives._pytree import AutogradContext

ProcessGroup = dist.ProcessGroup


def _reduced_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    # Never reduce in place: the input may be a saved activation or an expanded
    # (stride-0) gradient that other autograd nodes still read.
    return _ops.all_reduce(x.clone(memory_format=torch.contiguous_format), group)


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: AutogradContext, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduced_copy(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: AutogradContext, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _reduced_copy(x, group)

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Split(torch.autograd.Function):
    """Forward: keep this rank's chunk along ``dim``. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx: AutogradContext, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _ops.split(x, group, dim)

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _ops.all_gather(grad, ctx.group, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather along ``dim``. Backward: reduce-scatter (partial grads) or split."""

    @staticmethod
    def forward(
        ctx: AutogradContext, x: torch.Tensor, group: ProcessGroup, dim: int, reduce_grads: bool
    ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce_grads = group, dim, reduce_grads
        return _ops.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grads:
            return _ops.reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return _ops.split(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward: reduce-scatter along ``dim``. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx: AutogradContext, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _ops.reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _ops.all_gather(grad, ctx.group, ctx.dim), None, None


def _is_identity(group: ProcessGroup | None) -> bool:
    # group.size() rather than _ops.group_size: Dynamo reads it as a constant, and _ops is
    # kept out of compiled graphs (scaling.nn.compile_layer), so a call there would break one.
    return group is None or group.size() == 1


def _check_dim(x: torch.Tensor, dim: int, fn: str) -> int:
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{fn}: dim={dim!r} is out of range for a tensor of shape {list(x.shape)}; "
            f"pass an int in [{-x.dim()}, {x.dim() - 1}] (1 is the sequence dim of [b, s, h])"
        )
    return dim % x.dim()


def copy_to_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce backward.

    Args:
        x: the replicated activation, e.g. the input of a column-parallel linear.
        group: the tensor-parallel group; ``None`` or one rank makes this the identity.

    Returns:
        ``x`` (a view); its gradient is summed over ``group`` in backward.
    """
    if _is_identity(group):
        return x
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward.

    Args:
        x: this rank's partial sum, e.g. the output of a row-parallel linear.
        group: the tensor-parallel group; ``None`` or one rank makes this the identity.

    Returns:
        The sum of ``x`` over ``group`` (a new tensor; ``x`` is not modified).
    """
    if _is_identity(group):
        return x
    return _ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim: split forward, all-gather backward.

    Raises:
        ValueError: when the last dim is not divisible by the group size.
    """
    if _is_identity(group):
        return x
    return _Split.apply(x, group, x.dim() - 1)


def gather_from_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's chunk along the last dim: all-gather forward, split backward.

    The output is replicated, so each rank keeps only its chunk of the gradient.
    """
    if _is_identity(group):
        return x
    return _Gather.apply(x, group, x.dim() - 1, False)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """Sum partial results and keep this rank's chunk of ``dim``: reduce-scatter forward,
    all-gather backward.

    Args:
        x: this rank's partial result over the full sequence, ``[b, s, h]``.
        group: the tensor-parallel group; ``None`` or one rank makes this the identity.
        dim: the sequence dim (default 1).

    Raises:
        ValueError: when ``dim`` is out of range or its size is not divisible by the group size.
    """
    if _is_identity(group):
        return x
    return _ReduceScatter.apply(x, group, _check_dim(x, dim, "reduce_scatter_to_sequence_parallel_region"))


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = 1, *, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """Concatenate the sequence chunks along ``dim``: all-gather forward, reduce-scatter backward.

    Args:
        x: this rank's sequence chunk, ``[b, s / tp, h]``.
        group: the tensor-parallel group; ``None`` or one rank makes this the identity.
        dim: the sequence dim (default 1).
        tensor_parallel_output_grad: ``True`` (default) when the output feeds TP-sharded
            computation, so each rank holds a partial gradient that backward sums and
            scatters; ``False`` when the output is used replicated, so backward only splits.

    Raises:
        ValueError: when ``dim`` is out of range.
    """
    if _is_identity(group):
        return x
    dim = _check_dim(x, dim, "gather_from_sequence_parallel_region")
    return _Gather.apply(x, group, dim, bool(tensor_parallel_output_grad))


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """Keep this rank's chunk of ``dim``: split forward, all-gather backward.

    Raises:
        ValueError: when ``dim`` is out of range or its size is not divisible by the group size.
    """
    if _is_identity(group):
        return x
    return _Split.apply(x, group, _check_dim(x, dim, "scatter_to_sequence_parallel_region"))
