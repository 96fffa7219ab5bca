"""destroy_process_group: torch's, after a pause that works round a torch 2.6 gloo deadlock; and
the end of a process that created the groups (:func:`destroy_at_exit`)."""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
import types

import torch.distributed as dist

# How long destroy_process_group() lets go of the GIL before destroying the groups.
_GLOO_SETTLE_SECONDS = 0.01


def destroy_process_group() -> None:
    """Destroy the default process group and every subgroup, if one is initialised.

    ``torch.distributed.destroy_process_group`` after a short pause: on torch 2.6 gloo can
    deadlock there. A gloo thread, holding its work mutex, frees a finished collective
    whose tensors need the GIL to drop their Python objects, while the caller holds the
    GIL and waits for that mutex in ``~ProcessGroupGloo`` (seen under load: ranks hung at
    the end of a run). Letting go of the GIL for 10 ms lets such a thread finish first.
    This narrows the race; it does not close it. Upstream, pytorch/pytorch#154976 (merged
    June 2025) releases the GIL in the process group's destructor; the suite has not hung
    there on torch 2.10 or newer.
    """
    if dist.is_initialized():
        time.sleep(_GLOO_SETTLE_SECONDS)
        dist.destroy_process_group()


_at_exit = {"registered": False, "uncaught": False}


def destroy_at_exit() -> None:
    """Destroy the process groups when the process exits cleanly (registered once per process).

    A script that ends without ``destroy_process_group()`` (the walkthrough's ends with
    ``trainer.run_training()``) left gloo's threads running into the interpreter's
    teardown, which then aborted now and then ("terminate called without an active
    exception", exit code 134 after a run that trained to the end). At exit this destroys the
    groups (as torch asks every program to) and collects the reference cycles still holding
    them, so each group's threads are joined before Python goes.

    After an uncaught exception the groups are left as they are: a peer may still be waiting
    in a collective, and tearing down a group with work in flight can block the exit of a rank
    that is failing anyway. The process then ends at this point with the exit code Python
    gives an uncaught exception (1), skipping the interpreter's own teardown, where the
    groups' live threads aborted it about one time in five when a peer was mid-collective
    (exit 134, and the launcher reported a SIGABRT instead of the rank's error). Handlers
    registered before the groups were made (``logging``'s flush, ``multiprocessing``'s)
    do not run then; standard output and error are flushed. An exception shown by an
    interactive session does not count: the session goes on.
    """
    if _at_exit["registered"]:
        return
    _at_exit["registered"] = True
    previous = sys.excepthook

    def note_uncaught(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        _at_exit["uncaught"] = not hasattr(sys, "ps1")  # a REPL shows the error and goes on
        previous(kind, value, tb)

    sys.excepthook = note_uncaught
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    if not _at_exit["uncaught"]:
        destroy_process_group()
        gc.collect()  # the groups held only by reference cycles go now, their threads joined
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced streams
            pass
    os._exit(1)  # an uncaught exception's exit code, before the interpreter's teardown
