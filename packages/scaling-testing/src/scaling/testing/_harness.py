"""Run a function on N gloo ranks: pooled workers, file:// rendezvous, timeouts, rank-named errors.

Workers start once and are reused across tests (importing torch costs seconds per
process on a small machine). Each call gets a fresh ``file://`` rendezvous file, so no TCP
port is ever fixed. The files live in a temporary directory that lasts as long as the
pool's workers: a rank may drop its last reference to a store (a process group kept in a
reference cycle, freed by a collection after the task reported) and the store's
destructor then writes to its file; had the file's directory gone meanwhile, it would
throw from a destructor and abort the worker (``DistStoreError``, SIGABRT). The directory
goes at pool shutdown (``atexit`` too); a test process killed outright leaves it. After any
failure the whole pool is killed and restarted on the next call, so no rank outlives a
failed test.

Workers are forked from multiprocessing's forkserver with torch, torch.distributed, DCP
and scaling.topology (and whatever :func:`preload` names) already imported in it
(``set_forkserver_preload``), so a worker, and a pool restarted after a failure, costs a
fork rather than a fresh interpreter importing torch (2-3 s of CPU each on two cores).
The forkserver is a clean process that imported and ran nothing else, so forking it is
safe where forking the test process (threads, CUDA) is not. Where the platform has no
forkserver (Windows) workers are spawned.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

from scaling.testing._worker import Reply, Task, worker_main

if TYPE_CHECKING:
    import multiprocessing.context
    import multiprocessing.process
    import multiprocessing.queues

R = TypeVar("R")

DEFAULT_TIMEOUT_SECONDS = 120.0
# Imported once in the forkserver; every worker is forked with them loaded (preload() adds more).
_PRELOAD = [
    "scaling.testing._gc_off",  # first: the rest import without cyclic collection
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "scaling.testing._worker",
]
_forkserver_started = False  # once it has, its imports are fixed for this process
# Grace period given to the other ranks after one rank has failed, before they are
# killed: long enough for them to report their own error if they hit one too.
_FAILURE_GRACE_SECONDS = 3.0


class DistributedTestError(AssertionError):
    """One or more ranks raised, died or hung. ``failed_ranks`` lists them."""

    def __init__(self, message: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


class DistributedTimeoutError(DistributedTestError):
    """Some ranks did not return within the timeout (``hung_ranks``)."""

    def __init__(self, message: str, failed_ranks: list[int], hung_ranks: list[int]) -> None:
        super().__init__(message, failed_ranks)
        self.hung_ranks = hung_ranks


class WorkerPool:
    """A reusable set of worker processes, one per rank."""

    def __init__(self) -> None:
        self._ctx: multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext
        if "forkserver" in mp.get_all_start_methods():
            self._ctx = mp.get_context("forkserver")
            self._ctx.set_forkserver_preload(_PRELOAD)
        else:
            self._ctx = mp.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._task_queues: list[multiprocessing.queues.Queue[Task | None]] = []
        self._results: multiprocessing.queues.Queue[Reply] | None = None
        self._task_ids = itertools.count()
        self._rendezvous_dir: str | None = None  # while workers live; see the module docstring

    def _ensure(self, n: int) -> None:
        global _forkserver_started
        if self._results is None:
            self._results = self._ctx.Queue()
        results = self._results
        while len(self._procs) < n:
            idx = len(self._procs)
            tq = self._ctx.Queue()
            proc = self._ctx.Process(target=worker_main, args=(idx, tq, results), name=f"scaling-rank-worker-{idx}")
            _forkserver_started = _forkserver_started or self._ctx.get_start_method() == "forkserver"
            proc.start()
            self._procs.append(proc)
            self._task_queues.append(tq)

    def shutdown(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL), forget them and remove their rendezvous files."""
        for tq in self._task_queues:
            try:
                tq.put_nowait(None)
            except (ValueError, OSError):  # queue already closed
                pass
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for q in [*self._task_queues, self._results]:
            if q is not None:
                q.close()
                q.cancel_join_thread()
        self._procs, self._task_queues, self._results = [], [], None
        if self._rendezvous_dir is not None:  # only now: no worker is left to touch it
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None

    @property
    def rendezvous_dir(self) -> str | None:
        """The directory of the live workers' rendezvous files (``None`` without workers)."""
        return self._rendezvous_dir

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def run(
        self,
        fn: Callable[..., R],
        world_size: int,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        timeout_seconds: float,
        backend: str,
        env: dict[str, str] | None,
    ) -> list[R]:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        module = sys.modules.get(fn.__module__)
        self._ensure(world_size)
        if self._rendezvous_dir is None:
            self._rendezvous_dir = tempfile.mkdtemp(prefix="scaling-rdzv-")
        task_id = next(self._task_ids)
        task: Task = {
            "module": fn.__module__,
            "module_file": getattr(module, "__file__", None),
            "qualname": fn.__qualname__,
            "sys_path": list(sys.path),
            "payload": pickle.dumps((args, kwargs)),
            "world_size": world_size,
            "backend": backend,
            # Collectives time out before the harness does, so ranks stuck waiting for a
            # hung peer raise and report, and the peer that never answers is the one named.
            "pg_timeout": max(1.0, timeout_seconds * 0.6),
            "env": dict(env or {}),
            # The ranks' last store removes the file; the directory goes with the workers.
            "init_method": "file://" + os.path.join(self._rendezvous_dir, f"rendezvous-{task_id}"),
            "task_id": task_id,
            "rank": 0,
        }
        for rank in range(world_size):
            self._task_queues[rank].put({**task, "rank": rank})
        # Each rank's result is what ``fn`` returned there, unpickled.
        return cast("list[R]", self._collect(task_id, world_size, timeout_seconds, fn.__qualname__))

    def _collect(self, task_id: int, world_size: int, timeout_seconds: float, name: str) -> list[object]:
        assert self._results is not None  # _ensure made it
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_seconds
        first_failure: float | None = None
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline or (first_failure is not None and now > first_failure + _FAILURE_GRACE_SECONDS):
                break
            try:
                msg = self._results.get(timeout=0.1)
            except queue.Empty:
                for rank in range(world_size):
                    if rank not in results and rank not in errors and not self._procs[rank].is_alive():
                        code = self._procs[rank].exitcode
                        errors[rank] = f"rank {rank} died (exit code {code}{_signal_name(code)})"
                        first_failure = first_failure or time.monotonic()
                continue
            if msg["task_id"] != task_id:
                continue
            if isinstance(msg["payload"], bytes):
                results[msg["rank"]] = pickle.loads(msg["payload"])
            else:
                errors[msg["rank"]] = msg["payload"]
                first_failure = first_failure or time.monotonic()
        if not errors and len(results) == world_size:
            return [results[r] for r in range(world_size)]
        self.shutdown()
        hung = [r for r in range(world_size) if r not in results and r not in errors]
        parts = []
        if hung:
            parts.append(
                f"{name}: rank(s) {hung} did not return within {timeout_seconds:.0f}s (hung); killed"
                if not errors
                else f"{name}: rank(s) {hung} did not return (hung) after other ranks failed; killed"
            )
        for rank in sorted(errors):
            parts.append(f"--- rank {rank} failed ---\n{errors[rank]}")
        message = "\n".join(parts)
        failed = sorted([*errors, *hung])
        if hung:
            raise DistributedTimeoutError(message, failed, hung)
        raise DistributedTestError(message, failed)


def _signal_name(code: int | None) -> str:
    if code is None or code >= 0:
        return ""
    import signal

    try:
        return f", killed by {signal.Signals(-code).name}"
    except ValueError:
        return f", killed by signal {-code}"


def preload(*modules: str) -> None:
    """Import ``modules`` once in the forkserver, so that every worker starts with them imported.

    For heavy libraries the ranks' functions import: otherwise each worker imports them on
    its first call (Hugging Face ``transformers``' model classes: ~2 s of CPU a process,
    paid by every rank of every pool). Call it before this process's first
    :func:`run_distributed`, e.g. at the top of ``conftest.py``. A module that is not
    installed is skipped, so one ``conftest.py`` serves environments with and without it.
    Where workers are spawned (no forkserver) it has no effect.

    Raises:
        RuntimeError: when the forkserver has started (its imports are fixed by then).
    """
    if _forkserver_started:
        raise RuntimeError(
            f"scaling.testing.preload{modules!r}: the workers' forkserver has already started with its imports; "
            "call preload before the first run_distributed of this process (e.g. at the top of conftest.py)"
        )
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


_POOL: WorkerPool | None = None


def _pool() -> WorkerPool:
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool()
        atexit.register(_POOL.shutdown)
    return _POOL


def run_distributed(
    fn: Callable[..., R],
    world_size: int,
    *args: object,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    **kwargs: object,
) -> list[R]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return each rank's result.

    ``fn`` must be a module-level function (it is sent by module and name; test modules
    are imported by file path in the workers). A default process group is initialised
    in each worker before ``fn`` runs (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are
    set in its environment) and destroyed after.

    Args:
        fn: the function each rank runs.
        world_size: number of ranks.
        timeout_seconds: the whole call's limit; collectives inside time out at 60% of it.
        backend: process-group backend (``gloo`` for CPU).
        env: extra environment variables for the workers during the call.

    Returns:
        ``[result_of_rank_0, result_of_rank_1, ...]`` (results must pickle).

    Raises:
        DistributedTestError: a rank raised or died; the message names it and carries its traceback.
        DistributedTimeoutError: a rank did not return in time; ``hung_ranks`` names it.
    """
    return _pool().run(fn, world_size, args, kwargs, timeout_seconds, backend, env)


def shutdown_workers() -> None:
    """Stop the pooled workers (they restart on the next :func:`run_distributed`)."""
    if _POOL is not None:
        _POOL.shutdown()


def worker_pids() -> list[int]:
    """PIDs of the live pooled workers (for tests that check nothing is left behind)."""
    return [] if _POOL is None else _POOL.pids
