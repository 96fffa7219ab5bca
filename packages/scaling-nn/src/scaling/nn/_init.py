"""Shared helpers: the TP coordinates of a topology and sharded initialisation.

Sharded initialisation draws the FULL tensor from the default torch generator on CPU and
keeps this rank's slice, so every layout (and the one-process model) starts from the same
weights, and a parallel layer at TP=1 is initialised exactly like ``torch.nn.Linear``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from scaling.nn._meta import ParameterMeta

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scaling.topology import Axis, Topology

#: Fills a weight in place (``torch.nn.init``'s functions); what it returns is ignored.
InitMethod = Callable[[torch.Tensor], object]


@dataclass(frozen=True)
class TPInfo:
    """Tensor-parallel size, rank and group (None when there is no TP)."""

    size: int
    rank: int
    group: ProcessGroup | None
    device: torch.device


def tp_info(
    topology: Topology | None,
    tp: Axis | None = None,
    device: torch.device | str | None = None,
    owner: str = "a layer",
) -> TPInfo:
    """The TP coordinates a layer is built with: the tensor-parallel axis ``tp`` and ``device``,
    or, as in the walkthrough, a ``topology`` they are taken from at once (its ``axis("tp")``
    and ``device``). Neither: one device, on CPU.

    Raises:
        ValueError: naming ``owner``, when ``topology`` is given with ``tp`` or ``device``.
    """
    if topology is not None:
        if tp is not None or device is not None:
            given = " and ".join(name for name, value in (("tp", tp), ("device", device)) if value is not None)
            raise ValueError(
                f"{owner}: topology= and {given}= are both given; pass the topology alone (its tp axis and "
                "device are taken from it) or the axis and device without it"
            )
        tp, resolved = topology.axis("tp"), topology.device
    elif device is not None:
        resolved = torch.device(device)
    else:
        resolved = torch.device("cpu") if tp is None else torch.get_default_device()
    if tp is None or tp.size == 1:
        return TPInfo(1, 0, None, resolved)
    return TPInfo(tp.size, tp.rank, tp.group, resolved)


def axis_from(topology: Topology | None, name: str, given: Axis | None, owner: str) -> Axis | None:
    """A layer's axis ``name``: ``given``, or ``topology.axis(name)`` for a layer built from a
    ``topology`` (the walkthrough's ``topology=``). Neither: None (one rank along it).

    Raises:
        ValueError: naming ``owner``, when ``topology`` and the axis are both given.
    """
    if topology is None:
        return given
    if given is not None:
        raise ValueError(
            f"{owner}: topology= and {name}= are both given; pass the topology alone (its axes are taken from it) "
            "or the axes without it"
        )
    return topology.axis(name)


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


class LayerInputError(ValueError):
    """A layer got an input of the wrong shape; the message names the expected and received
    shapes and the fix (``ParallelModule`` adds which layer of the model it was)."""


def check_divisible(name: str, value: int, model_parallel_size: int, owner: str) -> None:
    """Raise a ValueError naming the valid TP sizes when ``model_parallel_size`` does not divide ``value``."""
    if value % model_parallel_size != 0:
        raise ValueError(
            f"{owner}: model_parallel_size={model_parallel_size} does not divide {name}={value}; "
            f"choose model_parallel_size in {divisors(value)} or change {name}"
        )


def default_weight_init(weight: torch.Tensor) -> None:
    """``torch.nn.Linear``'s weight initialisation (kaiming-uniform, a=sqrt(5))."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def default_bias_init(fan_in: int) -> InitMethod:
    """``torch.nn.Linear``'s bias initialisation: uniform in ``±1/sqrt(fan_in)``."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0

    def init(bias: torch.Tensor) -> None:
        torch.nn.init.uniform_(bias, -bound, bound)

    return init


def sharded_parameter(
    logical_shape: Sequence[int],
    init_method: InitMethod | None,
    tp: TPInfo,
    parallel_dim: int | None,
    dtype: torch.dtype,
    local_name: str,
    reduce_over_tp: bool = False,
    padded_size: int | None = None,
) -> torch.nn.Parameter:
    """Draw the full tensor with ``init_method`` (None: zeros), keep this rank's shard, attach a meta.

    ``padded_size`` pads ``parallel_dim`` with zero rows to that size before sharding (vocab
    padding); the meta's logical shape stays unpadded.
    """
    full = torch.zeros(tuple(logical_shape), dtype=torch.float32)
    if init_method is not None:
        with torch.no_grad():
            init_method(full)
    if parallel_dim is not None:
        if padded_size is not None and padded_size > full.shape[parallel_dim]:
            pad_shape = list(full.shape)
            pad_shape[parallel_dim] = padded_size - full.shape[parallel_dim]
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=parallel_dim)
        full = full.chunk(tp.size, dim=parallel_dim)[tp.rank]
    # A storage of its own: a row shard is a view of ``full``, which would otherwise stay alive
    # (tp times the memory) and share its storage (which ZeRO-3 frees between uses).
    # Under ``torch.device("meta")`` (shapes only: deferred init, config checks) it stays on meta.
    device = full.device if full.is_meta else tp.device
    param = torch.nn.Parameter(full.to(dtype=dtype, device=device).clone(memory_format=torch.contiguous_format))
    ParameterMeta(
        local_name=local_name,
        logical_shape=tuple(int(s) for s in logical_shape),
        parallel_dim=parallel_dim,
        model_parallel_size=tp.size,
        reduce_over_tp=reduce_over_tp,
    ).attach(param)
    return param


def check_dtype(dtype: object, owner: str) -> torch.dtype:
    """Reject a non-floating dtype with a clear error."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{owner}: dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
    return dtype
