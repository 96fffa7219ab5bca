"""The one place this package touches private or version-dependent torch APIs.

Scaling supports torch >= 2.6; names that moved or were deprecated since then are
resolved here so a torch upgrade breaks in one file.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# torch 2.13 deprecates the *_into_tensor / *_tensor names in favour of *_single; 2.6
# only has the former. Both take (output, input, ..., group=..., async_op=...). Any: the
# two names' signatures differ in their typing across those versions.
all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def default_store() -> c10d.Store:
    """The key-value store of the default process group (the rendezvous store).

    It lives outside every process group's collective machinery, so ranks can still
    exchange diagnostics through it after a collective timed out.
    """
    return c10d._get_default_store()


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta:
    """The timeout a process group was created with (default group when ``None``)."""
    pg = group if group is not None else c10d._get_default_group()
    for device_type in ("cpu", "cuda"):
        try:
            timeout = pg._get_backend(torch.device(device_type)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return c10d.default_pg_timeout


def group_description(group: dist.ProcessGroup) -> str | None:
    """The ``group_desc`` torch gives a group (DeviceMesh sets ``mesh_<dim>``), if any."""
    desc = getattr(group, "group_desc", None)
    if not desc or desc == "undefined":
        return None
    return str(desc)


# The device type each backend communicates on, as Topology pairs them (gloo with CPU
# tensors, NCCL with CUDA ones). Other backends, and a mixed "cpu:gloo,cuda:nccl" default
# group, map to None: no device check.
_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


def group_backend(group: dist.ProcessGroup | None) -> str:
    """The backend name of ``group`` (the default group when ``None``), ``""`` if unknown."""
    try:
        return str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError, AttributeError):
        return ""


def backend_device_type(backend: str) -> str | None:
    """``"cpu"`` for gloo, ``"cuda"`` for nccl, None for any other or mixed backend."""
    return _BACKEND_DEVICE.get(backend)
