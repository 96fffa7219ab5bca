"""torch's flight recorder for NCCL groups: what each rank's collectives were when one hung.

On NCCL the host does not wait in a collective, so Scaling's own hang diagnosis (a failed
collective's peers compare their recorded calls, ``scaling.collectives``) never fires there:
a collective that never completes is found by NCCL's watchdog thread after the group's
timeout, which then ends the process. What says which collective, on which rank, never
completed is torch's flight recorder, a ring of each NCCL group's last collectives that the
watchdog dumps on a timeout, one file per rank, read by torch's analyser
(``python -m torch.distributed.flight_recorder.fr_trace <folder>``). It records nothing unless
``TORCH_FR_BUFFER_SIZE`` (``TORCH_NCCL_TRACE_BUFFER_SIZE`` before torch 2.8) is set before the
groups are created, and dumps under
``~/.cache/torch`` unless told otherwise; torchtitan and Megatron-Bridge turn it on in the
same way.

:func:`enable_flight_recorder` (called by ``Topology.initialize_distributed`` before any
group) sets the ring's size and dump-on-timeout for NCCL; :func:`set_flight_recorder_folder`
(called by the trainer with its ``diagnostics_dir``) points the dumps at
``<folder>/flight_recorder_rank_<R>``, beside Scaling's own ``rank_<R>.json``. NCCL reads the
dump location only when it dumps, so setting it after the groups exist is in time. A
variable the user set is never overridden.
Gloo groups are left alone: Scaling's diagnosis covers them, and torch's analyser cannot
read gloo's records (they carry no group table).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

import torch
from torch.torch_version import TorchVersion

BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
DUMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
# The names torch read before 2.8; from 2.8 it reads TORCH_FR_* and takes these with a deprecation
# warning on every rank, so only the name the running torch reads is set (either counts as the user's).
_OLD_NAMES = {BUFFER_SIZE: "TORCH_NCCL_TRACE_BUFFER_SIZE", DUMP_FILE: "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
_NEW_NAMES = TorchVersion(torch.__version__) >= "2.8"
DUMP_PREFIX = "flight_recorder_rank_"
_ours: dict[str, str] = {}  # the dump location this process set last (a later run may move it)


def _unset(name: str, environ: MutableMapping[str, str]) -> bool:
    return name not in environ and _OLD_NAMES.get(name, name) not in environ


def _read(name: str) -> str:
    """``name`` as this torch reads it."""
    return name if _NEW_NAMES else _OLD_NAMES.get(name, name)


def enable_flight_recorder(
    backend: str, entries: int, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Turn on the flight recorder of the NCCL groups about to be created; returns the variables set.

    Args:
        backend: the torch.distributed backend (nothing is set unless it is NCCL's).
        entries: collectives each rank keeps (0: leave the recorder off).
        environ: the environment to change (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    if "nccl" not in backend or entries <= 0:
        return {}
    wanted = {BUFFER_SIZE: str(entries), DUMP_ON_TIMEOUT: "1"}
    changed = {}
    for name, value in wanted.items():
        if _unset(name, environ):
            changed[_read(name)] = value
    environ.update(changed)
    return changed


def set_flight_recorder_folder(
    backend: str, folder: str | os.PathLike[str], environ: MutableMapping[str, str] | None = None
) -> Path | None:
    """Have NCCL's watchdog dump each rank's flight record to ``<folder>/flight_recorder_rank_<R>``.

    Returns the prefix the dumps get, or None where nothing was set (not NCCL, the recorder
    off, or a dump location the user chose; one an earlier run in this process set moves).
    The folder is created, since torch does not.
    """
    environ = os.environ if environ is None else environ
    users = any(environ.get(name, _ours.get(name)) != _ours.get(name) for name in (DUMP_FILE, _OLD_NAMES[DUMP_FILE]))
    if "nccl" not in backend or _unset(BUFFER_SIZE, environ) or users:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    prefix = Path(folder) / DUMP_PREFIX
    _ours.clear()
    _ours[_read(DUMP_FILE)] = str(prefix)
    environ.update(_ours)
    return prefix
