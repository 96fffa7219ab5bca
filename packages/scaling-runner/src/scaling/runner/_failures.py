"""Which rank failed, and how: the records ``scaling.runner.torchrun`` reports.

Every node's torchrun agent runs as ``python -m scaling.runner.torchrun``, which writes one
``SCALING_RANK_FAILURE {json}`` line per failed rank from torchelastic's structured failure
records (``ChildFailedError.failures``, filled from the workers' ``TORCHELASTIC_ERROR_FILE``).
The runner finds those lines in the output that reached it (with pdsh's ``node: `` prefix or
none) and never reads torchrun's printed table.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaling.config import JsonDict

REPORT_PREFIX = "SCALING_RANK_FAILURE "
STOP_PREFIX = "SCALING_AGENT_STOPPED "
# Set by the agent for its workers: their errors are reported to the runner (see _payload.py).
REPORTED_ENV = "SCALING_RUN_REPORTS_ERRORS"


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
        timestamp: when it failed (seconds since the epoch; to the nanosecond where the rank
            left an error file, see ``scaling.runner.torchrun.failure_time``).
        traceback: the worker's Python traceback from its error file, when it wrote one.
    """

    rank: int
    local_rank: int
    host: str
    exitcode: int
    pid: int
    root_cause: bool = False
    message: str | None = None
    timestamp: float = 0.0
    traceback: str | None = None

    @property
    def shell_code(self) -> int:
        """The exit code as a shell reports it (128 + signal for a killed process)."""
        return shell_code(self.exitcode)

    def describe(self) -> str:
        """E.g. ``rank 2 (local_rank 2 on node-01, pid 4711) was killed by signal 9 (SIGKILL)``."""
        return f"rank {self.rank} (local_rank {self.local_rank} on {self.host}, pid {self.pid}) {self.outcome()}"

    def outcome(self) -> str:
        """What happened, without saying to whom: ``exited with code 1: CheckpointError: ...``."""
        if self.exitcode < 0:
            return f"was killed by signal {-self.exitcode} ({signal_name(-self.exitcode)})"
        return f"exited with code {self.exitcode}" + (f": {self.message}" if self.message else "")


def rank_list(ranks: list[int]) -> str:
    """``[0, 1, 2, 3, 6]`` as ``0-3, 6``."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def grouped(failures: list[RankFailure]) -> list[str]:
    """One line per distinct outcome: a rank alone as :meth:`RankFailure.describe` says it, ranks that
    failed alike as ``ranks 0-3, 6 (on node-01, node-02) were killed by signal 15 (SIGTERM)``."""
    groups: dict[str, list[RankFailure]] = {}
    for failure in sorted(failures, key=lambda f: f.rank):
        groups.setdefault(failure.outcome(), []).append(failure)
    lines = []
    for outcome, members in groups.items():
        if len(members) == 1:
            lines.append(members[0].describe())
            continue
        hosts = ", ".join(dict.fromkeys(f.host for f in members))
        verb = outcome.replace("was killed", "were killed", 1)
        lines.append(f"ranks {rank_list([f.rank for f in members])} (on {hosts}) {verb}")
    return lines


def shell_code(exitcode: int) -> int:
    """A worker's exit code as a shell reports it: ``128 + N`` for one killed by signal N (negative ``exitcode``)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal <n>`` for numbers Python does not know."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class FailureParser:
    """Feed it the output lines of one launch; collects the :class:`RankFailure` records in them."""

    def __init__(self) -> None:
        self.failures: dict[int, RankFailure] = {}
        self.stopped: dict[str, int] = {}  # host -> the signal that stopped its agent from outside the runner

    def feed(self, line: str) -> bool:
        """Consume one output line (a report may carry a prefix such as pdsh's ``node: ``).

        Returns:
            True when the line was a report (the runner does not echo those).
        """
        for prefix in (REPORT_PREFIX, STOP_PREFIX):
            at = line.find(prefix)
            if at >= 0:
                try:
                    self._read(prefix, json.loads(line[at + len(prefix) :]))
                except (ValueError, TypeError, KeyError):
                    return False  # a line cut short (a killed node's last write): shown, not read
                return True
        return False

    def _read(self, prefix: str, record: JsonDict) -> None:
        if prefix == STOP_PREFIX:
            self.stopped[str(record["host"])] = int(record["signal"])
            return
        failure = RankFailure(**record)  # a TypeError when a field is missing or unknown
        if failure.rank not in self.failures or failure.root_cause:
            self.failures[failure.rank] = failure


@dataclass(frozen=True)
class RunReport:
    """What every launch's agents reported: the failed ranks (by rank) and the agents stopped by a signal."""

    failures: list[RankFailure]
    stopped: dict[str, int]

    @classmethod
    def merge(cls, parsers: list[FailureParser]) -> RunReport:
        failures = sorted((f for p in parsers for f in p.failures.values()), key=lambda f: f.rank)
        return cls(failures, {host: sig for p in parsers for host, sig in p.stopped.items()})


def first_failure(failures: list[RankFailure]) -> RankFailure | None:
    """The failure that came first: the earliest root cause, the worse code first at the same time."""
    roots = [f for f in failures if f.root_cause] or failures
    return min(roots, key=lambda f: (f.timestamp, -f.shell_code), default=None)


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
