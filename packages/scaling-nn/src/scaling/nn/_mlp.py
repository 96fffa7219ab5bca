"""Tensor-parallel feed-forward blocks: GELU MLP and SwiGLU MLP.

Column-parallel up projection(s), element-wise activation on the TP shard (no
communication), row-parallel down projection: one all-reduce (or reduce-scatter under
sequence parallelism) per block in the forward.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from scaling.nn._init import InitMethod, check_divisible, tp_info
from scaling.nn._linear import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from scaling.topology import Axis, Topology


def _linears(
    bias: bool,
    topology: Topology | None,
    dtype: torch.dtype,
    sequence_parallel: bool,
    tp: Axis | None,
    device: torch.device | str | None,
) -> tuple[partial[ColumnParallelLinear], partial[RowParallelLinear]]:
    """The column- and row-parallel linears of an MLP, with the settings they share."""
    return tuple(  # type: ignore[return-value]  # the same keywords bound to each class
        partial(
            cls, bias=bias, topology=topology, dtype=dtype, sequence_parallel=sequence_parallel, tp=tp, device=device
        )
        for cls in (ColumnParallelLinear, RowParallelLinear)
    )


class ParallelMLP(torch.nn.Module):
    """``fc2(gelu(fc1(x)))`` with ``fc1`` column- and ``fc2`` row-parallel.

    Args:
        hidden_size: input and output size.
        intermediate_size: inner size; must be divisible by the TP size.
        bias: biases on both projections.
        topology: a :class:`scaling.topology.Topology` or ``None`` (one device).
        dtype: parameter dtype.
        sequence_parallel: input and output split along dim 1 over TP.
        gelu_approximate: ``"none"`` or ``"tanh"``, as in ``torch.nn.functional.gelu``.
        init_method, output_init_method: weight initialisers of ``fc1`` and ``fc2``.

    Raises:
        ValueError: when the TP size does not divide ``intermediate_size``.

    ``tp`` and ``device`` (keyword-only): the tensor-parallel axis and the parameters' device,
    instead of ``topology`` (see :class:`ColumnParallelLinear`).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = True,
        topology: Topology | None = None,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
        gelu_approximate: str = "none",
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        *,
        tp: Axis | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_divisible(
            "intermediate_size", intermediate_size, tp_info(topology, tp, device, "ParallelMLP").size, "ParallelMLP"
        )
        if gelu_approximate not in ("none", "tanh"):
            raise ValueError(f"ParallelMLP: gelu_approximate={gelu_approximate!r}; choose 'none' or 'tanh'")
        self.gelu_approximate = gelu_approximate
        self.hidden_size = hidden_size
        column, row = _linears(bias, topology, dtype, sequence_parallel, tp, device)
        self.fc1 = column(hidden_size, intermediate_size, init_method=init_method)
        self.fc2 = row(intermediate_size, hidden_size, init_method=output_init_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.gelu_approximate))


class ParallelSwiGLUMLP(torch.nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Llama's MLP), tensor-parallel.

    Args: as for :class:`ParallelMLP` (``bias`` defaults to False, as in Llama).

    Raises:
        ValueError: when the TP size does not divide ``intermediate_size``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        topology: Topology | None = None,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        *,
        tp: Axis | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_divisible(
            "intermediate_size",
            intermediate_size,
            tp_info(topology, tp, device, "ParallelSwiGLUMLP").size,
            "ParallelSwiGLUMLP",
        )
        self.hidden_size = hidden_size
        column, row = _linears(bias, topology, dtype, sequence_parallel, tp, device)
        self.gate_proj = column(hidden_size, intermediate_size, init_method=init_method)
        self.up_proj = column(hidden_size, intermediate_size, init_method=init_method)
        self.down_proj = row(intermediate_size, hidden_size, init_method=output_init_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
