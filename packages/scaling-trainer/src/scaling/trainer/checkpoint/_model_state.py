"""Layout-independent model state: one DTensor per parameter, keyed by ``meta.key``.

A TP-split parameter becomes a DTensor on the topology's ``"tp"`` mesh with placement
``Shard(meta.parallel_dim)``, a replicated one ``Replicate()``; both carry the logical
(full) shape. DP replicas hold the same DTensors (DCP writes each chunk once) and pipeline
stages hold different keys, so DCP can load the state into any (dp, tp, pp) layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from scaling.nn import ParameterMeta

if TYPE_CHECKING:
    from scaling.config import StateDict
    from scaling.topology import Topology

NamedParameters = Iterable[tuple[str, torch.Tensor, ParameterMeta]]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _check_local_shape(name: str, param: torch.Tensor, meta: ParameterMeta, tp_size: int) -> None:
    expected = list(meta.logical_shape)
    if meta.is_model_parallel:
        dim = meta.parallel_dim
        assert dim is not None
        if meta.model_parallel_size != tp_size:
            raise ValueError(
                f"parameter {name!r}: meta.model_parallel_size={meta.model_parallel_size} but the topology has "
                f"model_parallel_size={tp_size}; build the model for this topology"
            )
        expected[dim] = meta.local_size(0)[0]  # a padded dimension (a vocabulary) rounds up
    if list(param.shape) != expected:
        raise ValueError(
            f"parameter {name!r}: local shape {list(param.shape)} does not match logical shape "
            f"{list(meta.logical_shape)} split as {meta!r} (expected local shape {expected})"
        )


def _logical_part(param: torch.Tensor, meta: ParameterMeta, tp_rank: int) -> torch.Tensor:
    """``param``'s logical rows: without the padding rows of a dimension that does not divide by TP."""
    if not meta.is_model_parallel or meta.parallel_dim is None:
        return param
    held, logical = meta.local_size(tp_rank)
    return param if logical == held else param.narrow(meta.parallel_dim, 0, logical)


def model_state_dict(named_parameters_with_meta: NamedParameters, topology: Topology | None) -> StateDict:
    """DTensor views of this rank's parameters, keyed by ``meta.key``.

    Args:
        named_parameters_with_meta: ``(name, param, meta)`` triples, e.g. from
            ``ParallelModule.named_parameters_with_meta()``.
        topology: the initialised topology; ``None`` for one process without a process
            group, where the plain (full) parameters are returned.

    Returns:
        ``{meta.key: DTensor}``; the DTensors share storage with the parameters, so DCP
        loads into them in place.

    Raises:
        ValueError: a duplicate key, or a local shape that does not match the meta.
    """
    state: StateDict = {}
    tp_size = 1 if topology is None else topology.axis("tp").size
    tp_rank = 0 if topology is None else topology.axis("tp").rank
    mesh = None if topology is None else topology.device_mesh["tp"]
    for name, param, meta in named_parameters_with_meta:
        key = meta.key
        if key in state:
            raise ValueError(f"parameter {name!r}: key {key!r} appears twice; every ParameterMeta.key must be unique")
        _check_local_shape(name, param, meta, tp_size)
        local = _logical_part(param.detach(), meta, tp_rank)
        if mesh is None:
            state[key] = local
            continue
        dim = meta.parallel_dim
        placement = Shard(dim) if meta.is_model_parallel and dim is not None else Replicate()
        shape = tuple(meta.logical_shape)
        state[key] = DTensor.from_local(
            local, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape)
        )
    return state


def load_model_state_dict(
    named_parameters_with_meta: NamedParameters, state: Mapping[str, torch.Tensor], strict: bool = True
) -> list[str]:
    """Copy loaded values back into the local parameters.

    Args:
        named_parameters_with_meta: the same triples given to :func:`model_state_dict`.
        state: ``{meta.key: DTensor or tensor}`` as filled by :func:`load_checkpoint`.
        strict: raise when a parameter has no entry in ``state``.

    Returns:
        The keys of parameters that had no entry (empty when ``strict``).

    Raises:
        KeyError: a parameter's key is missing and ``strict`` is set.
        ValueError: a value's local shape differs from the parameter's.
    """
    missing = []
    with torch.no_grad():
        for name, param, meta in named_parameters_with_meta:
            if meta.key not in state:
                if strict:
                    raise KeyError(
                        f"parameter {name!r}: key {meta.key!r} is not in the loaded state; keys: {sorted(state)}"
                    )
                missing.append(meta.key)
                continue
            value = state[meta.key]
            local = value.to_local() if isinstance(value, DTensor) else value
            if isinstance(value, DTensor):  # its local part: this TP rank's logical rows
                param = _logical_part(param, meta, value.device_mesh.get_local_rank())
            if local.shape != param.shape:
                raise ValueError(
                    f"parameter {name!r}: loaded local shape {list(local.shape)} != parameter shape {list(param.shape)}"
                )
            if local.data_ptr() != param.data_ptr():
                param.copy_(local)
    return missing
