"""The collective recorder: a bounded ring of recent collectives and byte counters per rank.

Every wrapper in :mod:`scaling.collectives` records the call here before it talks to
the backend: a per-group sequence number, the op, the group's name and ranks, the
shapes and dtypes and the call site. The ring is what ranks compare when a collective
times out or in debug mode (see ``_diagnosis.py``); the counters are what a trainer
logs as communication volume.

The recorder is per process (like torch's flight recorder); it holds no process
group. Group state is keyed weakly by the group object, so a destroyed and re-created
group starts again at sequence number 1; it also caches the group's size and rank, so
the wrappers ask torch nothing per call. Recording costs a few microseconds per call
warm, several times that on a thread that just woke from a collective with cold caches
(``bench/collectives.py`` measures it); nothing is formatted until an error or a
diagnostics file needs it.

:meth:`CollectiveRecorder.write_diagnostics` dumps what this rank did last (recent
records of every group, byte counters, the training step) to a small JSON file per
rank, so a hang leaves evidence on the ranks that hung as well as on those that raised.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from scaling.collectives import _compat
from scaling.collectives._errors import CollectiveDeviceError

if TYPE_CHECKING:
    from scaling.config import JsonDict

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIP_DIRS = (_PACKAGE_DIR, _TORCH_DIR)
DEFAULT_CAPACITY = 256
_UNKNOWN_SITE = ("<unknown>", 0, "<unknown>")
_new_tuple = tuple.__new__
_now = time.time
DIAGNOSTICS_RECORDS = 32  # records per diagnostics file: enough to see the lead-up, small to write
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
    # Cached once per group so a wrapper asks torch nothing on the hot path (both are fixed).
    size: int = 1
    rank: int = 0
    # The group's backend and the device type it communicates on (None: not checked).
    backend: str = ""
    device_type: str | None = None
    # op -> the [bytes, calls] list of ``CollectiveRecorder._counts[(op, name)]``: skips building
    # and hashing that key per call. Cleared on a rename or a counter reset.
    counts: dict[str, list[int]] = field(default_factory=dict)
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
        # Reentrant: the first call on a new group creates its state under the lock that
        # record() or records() already holds.
        self._lock = threading.RLock()
        # id(group) -> (weak ref to the group, state): the hot path pays one dict lookup and
        # one dereference; the ref tells a live group from a new one at a recycled address.
        self._states: dict[int, tuple[weakref.ref[dist.ProcessGroup], _GroupState]] = {}
        self._p2p = self._new_state(P2P_GROUP_NAME, P2P_GROUP_NAME, ())
        self._p2p_world: weakref.ref[dist.ProcessGroup] | None = None
        self._names: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()
        # (op, group name) -> [payload bytes, calls]: one lookup per call for both counters.
        self._counts: dict[tuple[str, str], list[int]] = {}
        # ("send" | "recv", peer) -> calls ever made: numbers the ring's p2p records per pair.
        self._p2p_pairs: collections.Counter[tuple[str, int | None]] = collections.Counter()
        #: The training step being run (set by a trainer each iteration); ``None`` outside training.
        self.step: int | None = None
        self.diagnostics_dir: Path | None = None
        self.rank: int | None = None
        self._reasons: list[JsonDict] = []
        #: Host seconds spent blocked in collectives since the process started, per op (the
        #: wrappers add each call's wait; a trainer's phase timer subtracts it from the phase it
        #: fell in, so a rank waiting for a slow peer does not look slow itself). ``waited``: their sum.
        self.wait_seconds: dict[str, float] = {}
        self.waited = 0.0

    def configure(self, diagnostics_dir: str | os.PathLike[str] | None = None, rank: int | None = None) -> None:
        """Where :meth:`write_diagnostics` writes, and the global rank that names the file.

        Args:
            diagnostics_dir: folder for ``rank_<R>.json``; ``None`` disables the files.
            rank: this process's global rank (default: ``torch.distributed.get_rank()``).
        """
        if rank is not None and (not isinstance(rank, int) or rank < 0):
            raise ValueError(f"rank={rank!r} must be a non-negative int (this process's global rank)")
        self.diagnostics_dir = None if diagnostics_dir is None else Path(diagnostics_dir)
        self.rank = rank
        self._reasons = []

    def add_wait(self, op: str, seconds: float) -> None:
        """Count ``seconds`` of blocking in a collective ``op`` (the wrappers call it per wait)."""
        self.wait_seconds[op] = self.wait_seconds.get(op, 0.0) + seconds
        self.waited += seconds

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
        with self._lock:
            self._names[group] = name
            entry = self._states.get(id(group))
            if entry is not None and entry[0]() is group:
                entry[1].name = name
                entry[1].counts.clear()

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
            # Send/recv ranks are global: a new default group starts the p2p numbering afresh.
            world = dist.group.WORLD
            if world is not (self._p2p_world() if self._p2p_world is not None else None):
                self._p2p = self._new_state(P2P_GROUP_NAME, P2P_GROUP_NAME, ())
                if world is not None:
                    _set_backend(self._p2p, world)
                self._p2p_pairs.clear()
                self._p2p_world = None if world is None else weakref.ref(world)
            return self._p2p
        return self._group_state(group)

    def _group_state(self, group: dist.ProcessGroup) -> _GroupState:
        """The state of a process group (not ``None``): the wrappers' hot-path lookup."""
        entry = self._states.get(id(group))
        if entry is not None and entry[0]() is group:
            return entry[1]
        with self._lock:
            entry = self._states.get(id(group))
            if entry is not None and entry[0]() is group:
                return entry[1]
            ranks = tuple(dist.get_process_group_ranks(group))
            state = self._new_state(self.group_name(group), str(group.group_name), ranks)
            state.size, state.rank = group.size(), group.rank()
            _set_backend(state, group)
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

        ``group=None`` records into the point-to-point ring (``p2p``). The blocking
        wrappers use :meth:`_record_one` instead (the same record, less work per call).
        """
        size = sum(t.nbytes for t in tensors)
        shapes = tuple(t.shape for t in tensors)  # torch.Size is already an immutable tuple
        dtypes = tuple(_dtype_name(t.dtype) for t in tensors)
        site = _call_site(sys._getframe(1))
        with self._lock:
            state = self.state(group)
            for t in tensors:
                check_device(state, op, t)
            state.seq += 1
            # tuple.__new__ skips the Python-level __new__ a NamedTuple class call goes through.
            rec = _new_tuple(
                CollectiveRecord, (state.seq, op, state.name, state.ranks, shapes, dtypes, size, peer, site, _now())
            )
            state.ring.append(rec)
            counts = state.counts.get(op) or self._counter(state, op)
            counts[0] += size
            counts[1] += 1
            if group is None:
                self._p2p_pairs[(op, peer)] += 1
        return state, rec

    def _record_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int]]) -> list[CollectiveRecord]:
        """Record the point-to-point ops of one post (``(kind, tensor, peer)``, one tensor each).

        The same records in the p2p ring, counters and per-pair numbering as one
        :meth:`record` per op, with one lock, one call-site walk and one clock read for
        the whole post (its ops are posted together): the pipeline transport runs this
        for every message.
        """
        site = _call_site(sys._getframe(1))
        now = _now()
        recs = []
        with self._lock:
            state = self.state(None)
            for kind, tensor, _ in ops:
                check_device(state, kind, tensor)
            for kind, tensor, peer in ops:
                dtype = tensor.dtype
                size, seq = tensor.nbytes, state.seq + 1
                state.seq = seq
                name = _DTYPE_NAMES.get(dtype) or _dtype_name(dtype)
                rec = tuple.__new__(
                    CollectiveRecord,
                    (seq, kind, state.name, state.ranks, (tensor.shape,), (name,), size, peer, site, now),
                )
                state.ring.append(rec)
                counts = state.counts.get(kind) or self._counter(state, kind)
                counts[0] += size
                counts[1] += 1
                self._p2p_pairs[(kind, peer)] += 1
                recs.append(rec)
        return recs

    def _record_one(
        self, state: _GroupState, op: str, tensor: torch.Tensor | None, peer: int | None = None
    ) -> CollectiveRecord:
        """:meth:`record` for one tensor (or none) on the group of ``state``: the wrappers' hot path.

        Same record as :meth:`record`, with less work per call: the caller already holds
        the group's state (see :meth:`_group_state`), and every step is inlined. Nothing
        is formatted here; ``describe()`` and ``call_site`` format on demand.
        """
        shapes: tuple[tuple[int, ...], ...]
        dtypes: tuple[str, ...]
        if tensor is None:
            size, shapes, dtypes = 0, (), ()
        else:
            if state.device_type is not None and tensor.device.type != state.device_type:
                check_device(state, op, tensor)
            dtype = tensor.dtype
            name = _DTYPE_NAMES.get(dtype) or _dtype_name(dtype)
            size, shapes, dtypes = tensor.nbytes, (tensor.shape,), (name,)
        # _call_site inlined (one call less per collective). Frame 1 is the wrapper that
        # called us: start at its caller.
        frame: types.FrameType | None = sys._getframe(1).f_back
        site = _UNKNOWN_SITE
        while frame is not None:
            code = frame.f_code
            if not code.co_filename.startswith(_SKIP_DIRS):
                site = (code.co_filename, frame.f_lineno, code.co_name)
                break
            frame = frame.f_back
        del frame
        with self._lock:
            seq = state.seq = state.seq + 1
            rec = _new_tuple(
                CollectiveRecord, (seq, op, state.name, state.ranks, shapes, dtypes, size, peer, site, _now())
            )
            state.ring.append(rec)
            counts = state.counts.get(op) or self._counter(state, op)
            counts[0] += size
            counts[1] += 1
        return rec

    def _counter(self, state: _GroupState, op: str) -> list[int]:
        """The [bytes, calls] counter of ``(op, state.name)``, cached on the state (lock held)."""
        counts = self._counts.get((op, state.name))
        if counts is None:
            counts = self._counts[(op, state.name)] = [0, 0]
        state.counts[op] = counts
        return counts

    def p2p_snapshot(self) -> tuple[list[CollectiveRecord], dict[tuple[str, int | None], int]]:
        """The send/recv ring and the number of calls ever made per ``(op, peer)``."""
        with self._lock:
            return list(self.state(None).ring), dict(self._p2p_pairs)

    # ---------------------------------------------------------------- reading
    def records(self, group: dist.ProcessGroup | None = None) -> list[CollectiveRecord]:
        """Recent records of ``group`` (send/recv for ``None``), oldest first."""
        with self._lock:
            return list(self.state(group).ring)

    def bytes_by_op_and_group(self) -> dict[tuple[str, str], int]:
        """Payload bytes this rank passed to each ``(op, group name)`` since the last reset."""
        with self._lock:
            return {key: counts[0] for key, counts in self._counts.items()}

    def calls_by_op_and_group(self) -> dict[tuple[str, str], int]:
        """Number of calls per ``(op, group name)`` since the last reset."""
        with self._lock:
            return {key: counts[1] for key, counts in self._counts.items()}

    def write_diagnostics(self, reason: str) -> Path | None:
        """Write this rank's recent collectives, step and byte counters to ``<dir>/rank_<R>.json``.

        Called on a failed collective and by a trainer that ends a stuck rank. The file is
        replaced atomically (temporary file, then rename); every call appends ``reason``
        to its ``reasons`` list, so the last file of a rank tells its whole story.

        Returns:
            The file written, or ``None`` when no directory is configured (see :meth:`configure`).

        Raises:
            OSError: when the file cannot be written.
        """
        folder = self.diagnostics_dir
        if folder is None:
            return None
        rank = self.rank if self.rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        # A watchdog thread may call this while the main thread is wedged; never wait long for the lock.
        locked = self._lock.acquire(timeout=1.0)
        try:
            rings = [list(state.ring) for _, state in list(self._states.values())] + [list(self._p2p.ring)]
            counts = {key: tuple(c) for key, c in self._counts.items()}
        finally:
            if locked:
                self._lock.release()
        recent = sorted((rec for ring in rings for rec in ring), key=lambda r: r.start_time)[-DIAGNOSTICS_RECORDS:]
        self._reasons.append({"time": time.time(), "step": self.step, "reason": reason})
        report = {
            "rank": rank,
            "pid": os.getpid(),
            "step": self.step,
            "reason": reason,
            "reasons": self._reasons,
            "last_collectives": [_record_dict(rec) for rec in recent],
            "bytes_by_op_and_group": {f"{op}/{group}": c[0] for (op, group), c in sorted(counts.items())},
            "calls_by_op_and_group": {f"{op}/{group}": c[1] for (op, group), c in sorted(counts.items())},
        }
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank_{rank}.json"
        tmp = folder / f".rank_{rank}.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)
        return path

    def reset_counters(self) -> None:
        """Zero the byte and call counters (the rings and sequence numbers are kept)."""
        with self._lock:
            self._counts.clear()
            for _, state in list(self._states.values()):
                state.counts.clear()
            self._p2p.counts.clear()


def _set_backend(state: _GroupState, group: dist.ProcessGroup) -> None:
    state.backend = _compat.group_backend(group)
    state.device_type = _compat.backend_device_type(state.backend)


def check_device(state: _GroupState, op: str, tensor: torch.Tensor) -> None:
    """Raise :class:`CollectiveDeviceError` when ``tensor`` is not on the group's device type.

    Always on: one attribute comparison per tensor, before the call is recorded or sent.
    """
    if state.device_type is not None and tensor.device.type != state.device_type:
        raise CollectiveDeviceError(op, state.name, state.backend, tensor, state.device_type)


def _record_dict(rec: CollectiveRecord) -> JsonDict:
    return {
        "seq": rec.seq,
        "op": rec.op,
        "group": rec.group,
        "ranks": list(rec.ranks),
        "describe": rec.describe(),
        "shapes": [list(s) for s in rec.shapes],
        "dtypes": list(rec.dtypes),
        "nbytes": rec.nbytes,
        "peer": rec.peer,
        "call_site": rec.call_site,
        "start_time": rec.start_time,
    }


def _call_site(frame: types.FrameType | None) -> tuple[str, int, str]:
    """``(filename, line, function)`` of the first frame from ``frame`` outward outside this package and torch."""
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(_SKIP_DIRS):
            return (code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return _UNKNOWN_SITE


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


_RECORDER = CollectiveRecorder()


def get_recorder() -> CollectiveRecorder:
    """The recorder every wrapper in this process writes to."""
    return _RECORDER
