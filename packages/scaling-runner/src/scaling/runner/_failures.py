"""Read which rank died, and how, from torchrun's failure report.

When a worker fails, torchrun's elastic agent stops the others and raises
``ChildFailedError``, whose message lists every failed rank in a fixed layout
(``torch/distributed/elastic/multiprocessing/errors/__init__.py``)::

      host      : node-01
      rank      : 2 (local_rank: 2)
      exitcode  : -9 (pid: 4711) (SIGKILL)
      error_file: <N/A>
      traceback : Signal 9 (SIGKILL) received by PID 4711

pdsh prefixes each line with ``node: ``; the patterns below ignore any prefix. A worker whose
entry point torchrun's ``record`` wraps (both apps' do) reports its exception's traceback
there; its last lines, ``SomeError: message``, become the failure's ``message``.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, replace

_HOST = re.compile(r"\bhost\s+:\s*(\S+)")
_RANK = re.compile(r"\brank\s+:\s*(\d+)\s+\(local_rank:\s*(\d+)\)")
_EXIT = re.compile(r"\bexitcode\s+:\s*(-?\d+)\s+\(pid:\s*(\d+)\)")
_TRACEBACK = re.compile(r"\btraceback\s+:\s?(.*)$")
_EXCEPTION = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)):\s?(.*)$")
_BLOCK_END = re.compile(r"={10,}|-{10,}|\[\d+\]:\s*$")


@dataclass(frozen=True)
class RankFailure:
    """One failed worker as torchrun reported it.

    Attributes:
        rank: global rank.
        local_rank: rank on its node.
        host: node name torchrun reported.
        exitcode: the worker's exit code; negative: killed by signal ``-exitcode``.
        pid: the worker's process id.
        root_cause: torchrun's "first observed failure" of its node; the agent then stops the
            other ranks of that node, which are reported with SIGTERM and ``root_cause=False``.
        message: the worker's exception, ``"CheckpointError: ..."`` on one line, when its
            entry point is wrapped by ``torch.distributed.elastic``'s ``record``; else None.
    """

    rank: int
    local_rank: int
    host: str
    exitcode: int
    pid: int
    root_cause: bool = False
    message: str | None = None

    @property
    def shell_code(self) -> int:
        """The exit code as a shell reports it (128 + signal for a killed process)."""
        return 128 - self.exitcode if self.exitcode < 0 else self.exitcode

    def describe(self) -> str:
        """E.g. ``rank 2 (local_rank 2 on node-01, pid 4711) was killed by signal 9 (SIGKILL)``."""
        where = f"rank {self.rank} (local_rank {self.local_rank} on {self.host}, pid {self.pid})"
        if self.exitcode < 0:
            return f"{where} was killed by signal {-self.exitcode} ({signal_name(-self.exitcode)})"
        return f"{where} exited with code {self.exitcode}" + (f": {self.message}" if self.message else "")


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal <n>`` for numbers Python does not know."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class FailureParser:
    """Feed it the output lines of one torchrun (or pdsh) command; collects :class:`RankFailure`."""

    def __init__(self) -> None:
        self.failures: dict[int, RankFailure] = {}
        self._host = "?"
        self._rank: tuple[int, int] | None = None
        self._in_root = False
        self._last: int | None = None  # the rank of the last failure read
        self._traceback: list[str] | None = None  # its traceback's lines while they come
        self._prefix = ""

    def feed(self, line: str) -> None:
        """Consume one output line."""
        if self._traceback is not None:
            if not _BLOCK_END.search(line) and not _HOST.search(line):
                self._traceback.append(line[len(self._prefix) :] if line.startswith(self._prefix) else line)
                return
            self._end_traceback()
        if (m := _TRACEBACK.search(line)) and self._last is not None:
            self._traceback, self._prefix = [m.group(1)], line[: m.start()].rstrip()  # pdsh's "node:"
        elif "Root Cause (first observed failure)" in line:
            self._in_root = True
        elif m := _HOST.search(line):
            self._host, self._rank = m.group(1), None
        elif m := _RANK.search(line):
            self._rank = (int(m.group(1)), int(m.group(2)))
        elif (m := _EXIT.search(line)) and self._rank is not None:
            rank, local_rank = self._rank
            failure = RankFailure(rank, local_rank, self._host, int(m.group(1)), int(m.group(2)), self._in_root)
            if rank not in self.failures or failure.root_cause:
                self.failures[rank] = failure
            self._rank, self._in_root, self._last = None, False, rank

    def close(self) -> None:
        """The output ended (a traceback may have run to its last line)."""
        if self._traceback is not None:
            self._end_traceback()

    def _end_traceback(self) -> None:
        lines, self._traceback = self._traceback or [], None
        starts = [i for i, line in enumerate(lines) if _EXCEPTION.search(line)]
        if self._last is None or not starts:
            return
        first = _EXCEPTION.search(lines[starts[-1]])
        assert first is not None
        message = first.group(2).strip()
        parts = [f"{first.group(1)}: {message}" if message else first.group(1)]
        parts += [line.strip() for line in lines[starts[-1] + 1 :]]
        failure = self.failures.get(self._last)
        if failure is not None:
            self.failures[self._last] = replace(failure, message=" ".join(p for p in parts if p))


def worst_exit_code(failures: list[RankFailure], returncodes: list[int]) -> int:
    """The worst (largest, shell-style) exit code of the ranks that failed on their own.

    Ranks that torchrun's agent stopped because another rank failed (SIGTERM, not a root
    cause) do not count: their code says nothing about what went wrong. Without any rank
    report the commands' own exit codes decide.
    """
    roots = [f for f in failures if f.root_cause] or failures
    if roots:
        return max(f.shell_code for f in roots)
    codes = [128 - c if c < 0 else c for c in returncodes]
    return max(codes, default=0)
