"""Errors raised when ranks disagree about, or do not arrive at, a collective."""

from __future__ import annotations

from collections.abc import Sequence


class CollectiveError(RuntimeError):
    """A collective failed; the message says which group, op and ranks.

    Attributes:
        group: display name of the group (``tp``, ``dp``, ``world``, ...).
        op: the op this rank was running (``all_reduce``, ``send``, ...).
        seq: its sequence number within the group.
        divergent_ranks: global ranks that called something different (named first).
        missing_ranks: global ranks that did not arrive.
    """

    def __init__(
        self,
        message: str,
        group: str,
        op: str,
        seq: int,
        *,
        divergent: Sequence[int] = (),
        missing: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.group = group
        self.op = op
        self.seq = seq
        self.divergent_ranks = list(divergent)
        self.missing_ranks = list(missing)


class CollectiveMismatchError(CollectiveError):
    """Ranks of one group called different collectives as the same sequence number."""


class CollectiveTimeoutError(CollectiveError):
    """A collective (or a p2p transfer) did not complete within the group's timeout."""


class CollectiveDeviceError(ValueError):
    """A tensor handed to a collective is on a device its group's backend cannot use.

    Raised before anything is sent (NCCL takes only CUDA tensors, gloo groups here only
    CPU ones), so every rank of the group still agrees on the sequence of collectives.

    Attributes:
        op: the collective (``all_reduce``, ``send``, ...).
        group: display name of the group.
        tensor_device: where the tensor is (``cpu``, ``cuda:0``, ...).
        group_device: the device type the group's backend communicates on.
    """

    def __init__(self, op: str, group: str, backend: str, tensor: object, group_device: str) -> None:
        shape = list(getattr(tensor, "shape", ()))
        dtype = str(getattr(tensor, "dtype", "?")).replace("torch.", "")
        device = str(getattr(tensor, "device", "?"))
        super().__init__(
            f"{op} on group {group!r} ({backend}) got a tensor of shape {shape} ({dtype}) on device {device}, "
            f"but the group communicates on {group_device}; move the tensor there first "
            f"(e.g. tensor.to(topology.device)), or make the group on a backend for {device.split(':')[0]}"
        )
        self.op, self.group, self.backend = op, group, backend
        self.tensor_device, self.group_device = device, group_device
