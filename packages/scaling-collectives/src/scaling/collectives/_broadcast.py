"""Broadcast a pytree of tensors (a batch) from one rank to its group, dtypes preserved."""

from __future__ import annotations

from typing import TypeVar, cast

import torch
import torch.distributed as dist

from scaling.collectives import _ops, _pytree

T = TypeVar("T")


# What the source sends first: the pytree's spec, its tensors' metas and their device type.
_Header = tuple[_pytree.Spec, tuple[_pytree.TensorMeta, ...], str]


def broadcast_pytree(obj: T, src: int, group: dist.ProcessGroup | None, *, device: torch.device | None = None) -> T:
    """Send ``obj`` from global rank ``src`` to every rank of ``group``.

    Two collectives whatever the pytree: the structure, the non-tensor leaves and each
    tensor's shape and dtype go first (``broadcast_object_list``), then every tensor in
    one byte buffer, so bool, integer and low-precision tensors arrive bit-exact.

    Args:
        obj: the pytree on ``src`` (dataclasses, tuples, namedtuples, lists, dicts of
            tensors, ``None``, bools, ints, floats, strings); ignored on other ranks
            (pass ``None``).
        src: global rank that holds ``obj``, e.g. ``topology.axis("tp").ranks[0]``.
        group: the group to broadcast to; ``None`` or one rank returns ``obj`` as is.
        device: where receivers' tensors land; default ``cpu`` for CPU sources and
            the current CUDA device for CUDA sources. The bytes themselves travel on the
            group's device (CUDA on NCCL, CPU on gloo), whatever the source's.

    Returns:
        ``obj`` itself on ``src``; an equal pytree elsewhere. Received tensors share one
        buffer and do not require grad.

    Raises:
        ValueError: when ``src`` is not a rank of ``group``.
        TypeError: on ``src``, when ``obj`` holds an unsupported type (the path is named).

    Example::

        >>> batch = broadcast_pytree(batch if topology.axis("tp").rank == 0 else None,
        ...                          topology.axis("tp").ranks[0], topology.axis("tp").group)
    """
    if _ops.group_size(group) == 1:
        return obj
    assert group is not None
    ranks = dist.get_process_group_ranks(group)
    if src not in ranks:
        raise ValueError(
            f"broadcast_pytree: src={src} is not a rank of the group (global ranks {ranks}); "
            f"pass the global rank of the sender, e.g. topology.axis('tp').ranks[0]"
        )
    is_src = dist.get_rank() == src
    # The bytes travel on the group's device (NCCL takes only CUDA tensors); received
    # tensors land on ``device``, by default where the source's were.
    wire = _ops.group_device(group)
    header: _Header | None = None
    if is_src:
        spec, tensors = _pytree.flatten(obj)
        metas = _pytree.tensor_metas(tensors)
        src_device = tensors[0].device if tensors else torch.device("cpu")
        header = (spec, metas, src_device.type)
    spec, metas, device_type = cast(_Header, _ops.broadcast_object(header, src, group))
    if not metas:
        return obj if is_src else _pytree.unflatten(spec, [])
    if is_src:
        _ops.broadcast(_pytree.pack(tensors, metas, wire or src_device), src, group)
        return obj
    target = device if device is not None else _default_device(device_type)
    _, total = _pytree.offsets(metas)
    buffer = _ops.broadcast(torch.empty(total, dtype=torch.uint8, device=wire or target), src, group)
    return _pytree.unflatten(spec, _pytree.unpack(buffer.to(target), metas))


def _default_device(device_type: str) -> torch.device:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
