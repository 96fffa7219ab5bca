"""The collective recorder: a bounded ring of recent collectives and byte counters per rank.

Every wrapper in :mod:`scaling.collectives` records the call here before it talks to
the backend: a per-group sequence number, the op, the group's name and ranks, the
shapes and dtypes and the call site. The ring is what ranks compare when a collective
times out or in debug mode (see ``_diagnosis.py``); the counters are what a trainer
logs as communication volume.

The recorder is per process (like torch's flight recorder); it holds no process
group. Group state is keyed weakly by the group object, so a destroyed and re-created
group starts again at sequence number 1. Recording costs a few microseconds per call
(``bench/collectives.py`` measures it).
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from scaling.collectives import _compat

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIP_DIRS = (_PACKAGE_DIR, _TORCH_DIR)
DEFAULT_CAPACITY = 256
P2P_GROUP_NAME = "p2p"


class CollectiveRecord(NamedTuple):
    """One recorded call: what a rank did as collective number ``seq`` of ``group``.

    ``nbytes`` is this rank's payload (the input tensors' bytes); ``peer`` is the
    source of a broadcast or the other rank of a send/recv (global ranks); ``site`` is
    ``(filename, line, function)`` of the caller outside this package and torch.
    A NamedTuple: the wrappers build one per call, so it must be cheap.
    """

    seq: int
    op: str
    group: str
    ranks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: int
    peer: int | None
    site: tuple[str, int, str]
    start_time: float

    @property
    def call_site(self) -> str:
        """``train.py:42 in step``."""
        filename, line, function = self.site
        return f"{os.path.basename(filename)}:{line} in {function}"

    def signature(self) -> tuple[object, ...]:
        """What must be identical on every rank of the group for the call to match."""
        return (self.op, self.shapes, self.dtypes, self.peer)

    def describe(self) -> str:
        """``all_reduce(shape=[4, 8], dtype=float32)``, as used in error messages."""
        if not self.shapes:
            parts = []
        elif len(self.shapes) == 1:
            parts = [f"shape={list(self.shapes[0])}", f"dtype={self.dtypes[0]}"]
        else:
            parts = [f"shapes={[list(s) for s in self.shapes]}", f"dtypes=[{', '.join(self.dtypes)}]"]
        if self.peer is not None:
            parts.append(f"{'src' if self.op.startswith('broadcast') else 'peer'}={self.peer}")
        return f"{self.op}({', '.join(parts)})"

    def __repr__(self) -> str:
        return f"CollectiveRecord(#{self.seq} {self.describe()} on {self.group} at {self.call_site})"


@dataclass
class _GroupState:
    name: str
    key: str  # torch's group_name: the same on every member, unique per group in the job
    ranks: tuple[int, ...]
    ring: collections.deque[CollectiveRecord]
    seq: int = 0
    # Counters the diagnosis uses to build store keys every rank of the group agrees on.
    checks: int = 0
    incidents: int = 0
    debug_keys: list[str] = field(default_factory=list)


class CollectiveRecorder:
    """Per-process record of recent collectives and bytes sent per op and group.

    Get the process's recorder with :func:`get_recorder`. Set ``debug = True`` to
    compare every collective across the ranks of its group before it runs (slow:
    one store round trip per call; use it to find a hang, not in production).

    Args:
        capacity: records kept per group (the ring size).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1 (records kept per group)")
        self.capacity = capacity
        self.debug = False
        # Upper bound on how long a failed collective waits for its peers' reports.
        self.max_diagnosis_seconds = 60.0
        self._lock = threading.Lock()
        # id(group) -> (weak ref to the group, state): the hot path pays one dict lookup and
        # one dereference; the ref tells a live group from a new one at a recycled address.
        self._states: dict[int, tuple[weakref.ref[dist.ProcessGroup], _GroupState]] = {}
        self._p2p = self._new_state(P2P_GROUP_NAME, P2P_GROUP_NAME, ())
        self._names: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()
        self._bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self._calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def _new_state(self, name: str, key: str, ranks: tuple[int, ...]) -> _GroupState:
        return _GroupState(name=name, key=key, ranks=ranks, ring=collections.deque(maxlen=self.capacity))

    # ------------------------------------------------------------------ naming
    def name_group(self, group: dist.ProcessGroup, name: str) -> None:
        """Call ``group`` ``name`` in records and errors (e.g. ``"mp"``).

        Groups made by a DeviceMesh are named after their mesh dim (``tp``, ``dp``,
        ``pp``) and the default group ``world`` without this.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} must be a non-empty string, e.g. 'tp'")
        self._names[group] = name
        entry = self._states.get(id(group))
        if entry is not None and entry[0]() is group:
            entry[1].name = name

    def group_name(self, group: dist.ProcessGroup | None) -> str:
        """The display name of ``group`` (``p2p`` for ``None``, used by send/recv)."""
        if group is None:
            return P2P_GROUP_NAME
        if group in self._names:
            return self._names[group]
        desc = _compat.group_description(group)
        if desc == "default_pg" or group is dist.group.WORLD:
            return "world"
        if desc is not None:
            return desc[len("mesh_") :] if desc.startswith("mesh_") else desc
        return f"group{list(dist.get_process_group_ranks(group))}"

    def state(self, group: dist.ProcessGroup | None) -> _GroupState:
        if group is None:
            return self._p2p
        entry = self._states.get(id(group))
        if entry is not None and entry[0]() is group:
            return entry[1]
        ranks = tuple(dist.get_process_group_ranks(group))
        state = self._new_state(self.group_name(group), str(group.group_name), ranks)
        self._states[id(group)] = (weakref.ref(group, functools.partial(self._forget, id(group))), state)
        return state

    def _forget(self, key: int, _ref: object) -> None:
        entry = self._states.get(key)
        if entry is not None and entry[0]() is None:
            del self._states[key]

    # --------------------------------------------------------------- recording
    def record(
        self, op: str, group: dist.ProcessGroup | None, tensors: tuple[torch.Tensor, ...], peer: int | None = None
    ) -> tuple[_GroupState, CollectiveRecord]:
        """Append one call to ``group``'s ring and count its bytes; returns (state, record).

        ``group=None`` records into the point-to-point ring (``p2p``).
        """
        shapes: tuple[tuple[int, ...], ...]
        dtypes: tuple[str, ...]
        if len(tensors) == 1:  # the common case, without generator overhead
            t = tensors[0]
            size, shapes, dtypes = t.nbytes, (t.shape,), (_dtype_name(t.dtype),)
        else:
            size = sum(t.nbytes for t in tensors)
            shapes = tuple(t.shape for t in tensors)  # torch.Size is already an immutable tuple
            dtypes = tuple(_dtype_name(t.dtype) for t in tensors)
        site = _call_site()
        with self._lock:
            state = self.state(group)
            state.seq += 1
            rec = CollectiveRecord(
                state.seq, op, state.name, state.ranks, shapes, dtypes, size, peer, site, time.time()
            )
            state.ring.append(rec)
            key = (op, state.name)
            self._bytes[key] += size
            self._calls[key] += 1
        return state, rec

    # ---------------------------------------------------------------- reading
    def records(self, group: dist.ProcessGroup | None = None) -> list[CollectiveRecord]:
        """Recent records of ``group`` (send/recv for ``None``), oldest first."""
        with self._lock:
            return list(self.state(group).ring)

    def bytes_by_op_and_group(self) -> dict[tuple[str, str], int]:
        """Payload bytes this rank passed to each ``(op, group name)`` since the last reset."""
        with self._lock:
            return dict(self._bytes)

    def calls_by_op_and_group(self) -> dict[tuple[str, str], int]:
        """Number of calls per ``(op, group name)`` since the last reset."""
        with self._lock:
            return dict(self._calls)

    def reset_counters(self) -> None:
        """Zero the byte and call counters (the rings and sequence numbers are kept)."""
        with self._lock:
            self._bytes.clear()
            self._calls.clear()


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _call_site() -> tuple[str, int, str]:
    """``(filename, line, function)`` of the first frame outside this package and torch."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(_SKIP_DIRS):
            return (code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back  # type: ignore[assignment]
    return ("<unknown>", 0, "<unknown>")


_RECORDER = CollectiveRecorder()


def get_recorder() -> CollectiveRecorder:
    """The recorder every wrapper in this process writes to."""
    return _RECORDER
