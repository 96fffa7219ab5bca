"""LayerNorm and RMSNorm with parameters replicated over TP.

Under sequence parallelism a norm sees only this rank's sequence shard, so its
gradients are partial sums: the metas say ``reduce_over_tp=True`` and
:func:`reduce_sequence_parallel_gradients` (or the optimizer) all-reduces them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaling.collectives import all_reduce
from scaling.nn._init import check_dtype, sharded_parameter, tp_info
from scaling.nn._meta import get_parameter_meta

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scaling.topology import Axis, Topology


class LayerNorm(torch.nn.Module):
    """``torch.nn.LayerNorm`` over the last dim, TP-replicated.

    Args:
        normalized_shape: size of the last dim.
        eps: added to the variance.
        bias: learn an additive bias.
        topology: a :class:`scaling.topology.Topology` or ``None`` (one device).
        dtype: parameter dtype.
        sequence_parallel: the input is split along the sequence over TP; marks the
            parameters ``reduce_over_tp``.

    ``tp`` and ``device`` (keyword-only): the tensor-parallel axis and the parameters' device,
    instead of ``topology`` (see :class:`ColumnParallelLinear`).
    """

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-5,
        bias: bool = True,
        topology: Topology | None = None,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
        *,
        tp: Axis | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_dtype(dtype, "LayerNorm")
        info = tp_info(topology, tp, device, "LayerNorm")
        self.normalized_shape = (normalized_shape,)
        self.eps = eps
        self.weight = sharded_parameter(
            self.normalized_shape, torch.nn.init.ones_, info, None, dtype, "weight", sequence_parallel
        )
        if bias:
            self.bias: torch.nn.Parameter | None = sharded_parameter(
                self.normalized_shape, None, info, None, dtype, "bias", sequence_parallel
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, bias={self.bias is not None}"


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm ``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, TP-replicated.

    Args: as for :class:`LayerNorm` (no bias).
    """

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-6,
        topology: Topology | None = None,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
        *,
        tp: Axis | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_dtype(dtype, "RMSNorm")
        info = tp_info(topology, tp, device, "RMSNorm")
        self.normalized_shape = (normalized_shape,)
        self.eps = eps
        self.weight = sharded_parameter(
            self.normalized_shape, torch.nn.init.ones_, info, None, dtype, "weight", sequence_parallel
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}"


def reduce_sequence_parallel_gradients(module: torch.nn.Module, group: ProcessGroup | None) -> int:
    """All-reduce (sum) over ``group`` the gradients of the parameters whose meta says
    ``reduce_over_tp`` (replicated parameters used on sequence shards). Call after the
    backward, before the optimizer step; returns how many gradients were reduced.
    """
    grads = [
        p.grad
        for _, p in module.named_parameters()
        if p.grad is not None
        and getattr(p, "parameter_meta", None) is not None
        and get_parameter_meta(p).reduce_over_tp
    ]
    if group is None or dist.get_world_size(group) == 1 or not grads:
        return len(grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(grads)
