"""torchrun with a machine-readable failure report: ``python -m scaling.runner.torchrun ARGS``.

It takes torchrun's own arguments and runs torchrun's own agent (``torch.distributed.run``).
What it adds is the report: when workers fail, torchrun's agent raises ``ChildFailedError``,
whose ``failures`` are torchelastic's structured records (``ProcessFailure``: local rank, pid,
exit code, and the message and timestamp a worker wrapped by
``torch.distributed.elastic.multiprocessing.errors.record`` wrote to its
``TORCHELASTIC_ERROR_FILE``). Each becomes one line on stderr::

    SCALING_RANK_FAILURE {"rank": 3, "local_rank": 1, "host": "node-01", "pid": 4711, ...}

which the runner reads on the launching machine through whatever carried the output (pdsh
prefixes ``node: ``, srun, docker, a SLURM job's output file) and prints each distinct error
once, with the root cause's traceback (torchrun's table, which repeats every rank's, is not
printed; a worker that wrote its error file prints no traceback of its own, see
``scaling.runner.load_payload``). Before starting the workers the agent sets their threads
(:func:`threads_per_rank`) and has each worker group host its own store, so that a restart
(``--max-restarts``) works (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless set). A SIGTERM or SIGINT to the agent (``scancel``, ``docker stop``, the
runner's forwarding) stops the workers as torchrun does, reports
``SCALING_AGENT_STOPPED {"host": ..., "signal": 15}`` and exits ``128 + signal`` instead of
torchrun's 1, so the cause survives.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, TypeVar

from scaling.runner._failures import REPORT_PREFIX, REPORTED_ENV, STOP_PREFIX, shell_code

E = TypeVar("E", bound=BaseException)

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from scaling.config import JsonDict

_NO_FILE = "<N/A>"


def failure_records(failures: dict[int, ProcessFailure], host: str) -> list[JsonDict]:
    """One JSON-able record per failed rank of a ``ChildFailedError.failures`` mapping.

    The first failure by :func:`failure_time` is the node's root cause (torchrun's rule, to the
    nanosecond where it can be); ``message`` is the worker's exception (``"CheckpointError: ..."``)
    when it wrote an error file, else None.
    """
    times = {rank: failure_time(failure) for rank, failure in failures.items()}
    # At the same time the worse code first, as across nodes (a rank killed by a signal before the
    # one whose collective then broke, when the agent saw both go in one poll).
    first = min(times, key=lambda r: (times[r], -shell_code(failures[r].exitcode))) if failures else None
    records = []
    for rank, failure in sorted(failures.items()):
        message = failure.message if failure.error_file != _NO_FILE else None
        traceback = None
        if isinstance(message, dict):  # the error file's {"message": "...", "extraInfo": {"py_callstack": ...}}
            traceback = (message.get("extraInfo") or {}).get("py_callstack")
            message = message.get("message")
        records.append(
            {
                "rank": int(rank),
                "local_rank": int(failure.local_rank),
                "host": host,
                "pid": int(failure.pid),
                "exitcode": int(failure.exitcode),
                "timestamp": times[rank],
                "root_cause": rank == first,
                "message": " ".join(line.strip() for line in str(message).splitlines()) if message else None,
                # The runner prints one traceback per distinct error; only a root cause's can be the first.
                "traceback": str(traceback) if traceback and rank == first else None,
            }
        )
    return records


def failure_time(failure: ProcessFailure) -> float:
    """When a rank failed, in seconds since the epoch.

    torchelastic keeps whole seconds, and a rank that raises and the peer whose collective then
    breaks usually fail within the same one. So: the write time of the rank's error file, to the
    nanosecond, where it left one; else torchelastic's second (when the agent's poll saw the exit),
    placed by what the exit says: at its end for a rank the agent stopped (SIGTERM: a
    consequence by construction); a second earlier for SIGKILL, which no peer's failure causes
    (the kernel's OOM killer, an operator's ``kill -9``: origins), because the poll that saw it
    may fall in the next second after a peer whose collective then broke wrote its file; at its
    start for any other crash (which rarely leaves a file and is more likely the origin).
    """
    if failure.error_file != _NO_FILE:
        try:
            return os.stat(failure.error_file).st_mtime_ns / 1e9
        except OSError:
            pass
    offset = {-signal.SIGTERM: 0.999, -signal.SIGKILL: -1.0}.get(failure.exitcode, 0.0)
    return failure.timestamp + offset


def threads_per_rank(nproc_per_node: str, environ: dict[str, str] | os._Environ[str]) -> int | None:
    """Set ``OMP_NUM_THREADS`` (torch's intra-op threads) for the workers to the cores this agent may
    use divided by its local ranks (at least 1), unless it is set already; say so in one line.

    torchrun itself sets 1 for more than one local rank (with a banner) and nothing for one,
    where every rank then takes all cores of a machine that may be busy. Returns the number set.
    """
    if "OMP_NUM_THREADS" in environ:
        return None
    try:
        local = int(nproc_per_node)
    except ValueError:  # 'auto', 'gpu', 'cpu': torchrun decides the count, and the threads with it
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // max(local, 1))
    environ["OMP_NUM_THREADS"] = str(threads)
    print(
        f"scaling-run: {socket.gethostname()}: {local} rank(s) x {threads} thread(s) on {cores} core(s) "
        "(OMP_NUM_THREADS; set it to choose)",
        file=sys.stderr,
        flush=True,
    )
    return threads


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; return its exit code (0, 1 for failed workers, 128 + N for signal N)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    threads_per_rank(args.nproc_per_node, os.environ)
    # Its "failed (exitcode: 1) local_rank: ..." and "closing signal" lines, one per rank, say what
    # the reports below say once.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # The workers inherit it: one whose error the agent reports prints no traceback of its own.
    os.environ[REPORTED_ENV] = "1"
    # Workers host their own store instead of sharing the rendezvous one: shared, a restarted
    # worker group reads the keys of the group before it, and its process group connects to the
    # dead workers' ports (pytorch/pytorch#135712; still so under torch 2.13 with gloo).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        run(args)
    except ChildFailedError as exc:
        # The runner reads these and prints each distinct error once (torchrun's table, which
        # repeated every rank's, is not printed).
        for record in failure_records(exc.failures, socket.gethostname()):
            print(REPORT_PREFIX + json.dumps(record, sort_keys=True), file=sys.stderr, flush=True)
        return 1
    except Exception as exc:
        # A signal to the agent. torch's elastic metrics wrapper can turn it into another error:
        # a SIGTERM landing before the wrapper's first line raises, in its own handler, an
        # UnboundLocalError with the SignalException as its context (seen under torch 2.13).
        signalled = signal_exception(exc, SignalException)
        if signalled is None:
            raise
        stop = {"host": socket.gethostname(), "signal": int(signalled.sigval)}
        print(STOP_PREFIX + json.dumps(stop, sort_keys=True), file=sys.stderr, flush=True)
        return 128 + int(signalled.sigval)
    return 0


def signal_exception(exc: BaseException, kind: type[E]) -> E | None:
    """``exc`` or the first exception of type ``kind`` in its chain of causes and contexts, else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
