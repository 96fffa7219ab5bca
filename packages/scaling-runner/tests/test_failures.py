"""Failure reports: torchelastic's records become one JSON line per rank, read back by the runner."""

from __future__ import annotations

import json
import os
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from scaling.runner._failures import (
    REPORT_PREFIX,
    FailureParser,
    RankFailure,
    RunReport,
    first_failure,
    grouped,
    rank_list,
    worst_exit_code,
)
from scaling.runner._main import _report
from scaling.runner.torchrun import failure_records

MESSAGE = "checkpoint ckpt/step_00000010 failed verification:\n  __1_0.distcp: sha256 differs from commit.json"


class CheckpointError(RuntimeError):
    pass


def _error_file(tmp_path, monkeypatch) -> str:
    # What a worker wrapped by torchelastic's ``record`` writes when it raises.
    path = str(tmp_path / "error.json")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", path)
    try:
        raise CheckpointError(MESSAGE)
    except CheckpointError as exc:
        ErrorHandler().record_exception(exc)
    return path


def test_torchelastic_failures_become_report_lines_and_back(tmp_path, monkeypatch):
    raised = ProcessFailure(local_rank=1, pid=13592, exitcode=1, error_file=_error_file(tmp_path, monkeypatch))
    killed = ProcessFailure(local_rank=0, pid=4711, exitcode=-9, error_file="<N/A>")
    killed.timestamp = raised.timestamp + 2  # seen well after the one that raised
    error = ChildFailedError("train.py", {3: raised, 2: killed})
    lines = [REPORT_PREFIX + json.dumps(r) + "\n" for r in failure_records(error.failures, "node-01")]
    parser = FailureParser()
    for line in ["some output\n", *[f"node-01: {line}" for line in lines]]:  # as pdsh prefixes them
        assert parser.feed(line) == line.startswith("node-01: ")
    root, other = parser.failures[3], parser.failures[2]
    assert (root.rank, root.local_rank, root.host, root.exitcode, root.root_cause) == (3, 1, "node-01", 1, True)
    assert root.describe() == (
        "rank 3 (local_rank 1 on node-01, pid 13592) exited with code 1: CheckpointError: checkpoint "
        "ckpt/step_00000010 failed verification: __1_0.distcp: sha256 differs from commit.json"
    )
    assert other.message is None and not other.root_cause
    assert other.describe() == "rank 2 (local_rank 0 on node-01, pid 4711) was killed by signal 9 (SIGKILL)"
    assert first_failure(list(parser.failures.values())) == root
    assert worst_exit_code(list(parser.failures.values()), [1]) == 1  # the root cause's, not the stopped rank's
    # The root cause carries the worker's traceback, for the runner to print once.
    assert root.traceback is not None and "raise CheckpointError(MESSAGE)" in root.traceback and other.traceback is None


def test_ranks_that_failed_alike_are_one_line():
    assert rank_list([7, 0, 1, 2, 3, 5, 9, 10]) == "0-3, 5, 7, 9, 10"
    raised = [RankFailure(r, r % 4, f"node-0{r // 4}", 1, 100 + r, message="ValueError: bad") for r in range(8)]
    stopped = [RankFailure(r, r % 4, "node-02", -15, 100 + r) for r in range(8, 12)]
    alone = RankFailure(12, 0, "node-03", 1, 7, message="OSError: disk full")
    assert grouped([*stopped, alone, *raised]) == [
        "ranks 0-7 (on node-00, node-01) exited with code 1: ValueError: bad",
        "ranks 8-11 (on node-02) were killed by signal 15 (SIGTERM)",
        "rank 12 (local_rank 0 on node-03, pid 7) exited with code 1: OSError: disk full",
    ]


def test_the_runners_summary_of_identical_errors_is_a_few_lines(capsys):
    # 64 ranks raise the same error; one is the root cause with its traceback, the others come
    # after it (in consequence, as torchrun's agent reports them), and 8 are stopped by the agent.
    tb = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: bad'
    failures = [
        RankFailure(r, r % 8, f"node-{r // 8}", 1, r, root_cause=r == 5, message="ValueError: bad",
                    timestamp=1.0 + (r != 5), traceback=tb if r == 5 else None)
        for r in range(64)
    ] + [RankFailure(r, r % 8, f"node-{r // 8}", -15, r, timestamp=3.0) for r in range(64, 72)]  # fmt: skip
    code = _report([1, 1], RunReport(failures, {}), None)
    err = capsys.readouterr().err.splitlines()
    assert code == 1
    assert err == [
        "scaling-run: traceback of rank 5 (on node-0):",
        "  Traceback (most recent call last):",
        '    File "train.py", line 3, in <module>',
        "  ValueError: bad",
        "scaling-run: first failure: rank 5 (local_rank 5 on node-0, pid 5) exited with code 1: ValueError: bad",
        "scaling-run: the same error on ranks 0-4, 6-63",
        "scaling-run: the run failed with exit code 1",
        "scaling-run: then stopped or failed in consequence: ranks 64-71 (on node-8) were killed by signal 15 "
        "(SIGTERM)",
    ]


def _failure_at(tmp_path, monkeypatch, name: str, mtime_ns: int, local_rank: int) -> ProcessFailure:
    path = tmp_path / name
    path.mkdir()
    failure = ProcessFailure(local_rank, 100 + local_rank, 1, _error_file(path, monkeypatch))
    os.utime(failure.error_file, ns=(mtime_ns, mtime_ns))
    return failure


def test_within_one_second_the_error_file_written_first_is_the_root_cause(tmp_path, monkeypatch):
    """torchelastic's timestamps are whole seconds; a rank that raises and the peer whose
    collective then breaks fail within one. The error files' write times order them, and a rank
    the agent stopped (SIGTERM, no file) in that second comes after both."""
    second = 1_800_000_000
    peer = _failure_at(tmp_path, monkeypatch, "peer", second * 10**9 + 600_000_000, 0)
    origin = _failure_at(tmp_path, monkeypatch, "origin", second * 10**9 + 200_000_000, 1)
    stopped = ProcessFailure(local_rank=2, pid=102, exitcode=-15, error_file="<N/A>")
    for failure in (peer, origin, stopped):
        failure.timestamp = second
    records = failure_records({0: peer, 1: origin, 2: stopped}, "node-01")
    assert [r["root_cause"] for r in records] == [False, True, False]
    assert [r["timestamp"] for r in records] == [second + 0.6, second + 0.2, second + 0.999]
    assert first_failure([RankFailure(**r) for r in records]).rank == 1


def test_a_sigkilled_rank_seen_in_the_next_second_is_still_the_root_cause(tmp_path, monkeypatch):
    """Rank 1 SIGKILLed at .95 s; rank 0's collective broke and it wrote its file at .97 s; the
    agent's poll saw both after the second turned (what CI once met). No peer's failure causes a
    SIGKILL, so the killed rank is the origin."""
    second = 1_800_000_000
    broke = _failure_at(tmp_path, monkeypatch, "broke", second * 10**9 + 970_000_000, 0)
    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file="<N/A>")
    broke.timestamp = second
    killed.timestamp = second + 1
    records = failure_records({0: broke, 1: killed}, "node-01")
    assert [r["root_cause"] for r in records] == [False, True]


def test_seen_in_one_poll_without_error_files_the_killed_rank_is_the_root_cause():
    """The agent saw both go in one poll (one timestamp): a rank SIGKILLed mid-save, and its peer,
    whose collective then broke, exiting 1 without an error file. The worse code is the origin."""
    broke = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file="<N/A>")
    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file="<N/A>")
    broke.timestamp = killed.timestamp = 1_800_000_000
    records = failure_records({0: broke, 1: killed}, "node-01")
    assert [r["root_cause"] for r in records] == [False, True]


def test_first_failure_is_the_earliest_root_cause_across_nodes():
    lost_peer = RankFailure(
        0, 0, "node1", 1, 10, root_cause=True, message="RuntimeError: Connection closed", timestamp=6
    )
    origin = RankFailure(1, 0, "node2", 3, 11, root_cause=True, timestamp=5)
    assert first_failure([lost_peer, origin]) == origin
    assert worst_exit_code([lost_peer, origin], [1, 1]) == 3
    same_second = RankFailure(1, 0, "node2", -9, 11, root_cause=True, timestamp=6)
    assert first_failure([lost_peer, same_second]) == same_second  # within a second: the worse code


@pytest.mark.parametrize("line", [REPORT_PREFIX + '{"rank": 1, "local_ra', REPORT_PREFIX + '{"rank": 1}'])
def test_a_cut_or_foreign_report_line_is_shown_not_read(line):
    parser = FailureParser()
    assert parser.feed(line) is False and not parser.failures


def test_no_report_means_the_launch_codes_decide():
    assert worst_exit_code([], [0, 5, -15]) == 143


def test_threads_per_rank_are_the_cores_over_the_local_ranks_unless_chosen(capsys):
    from scaling.runner.torchrun import threads_per_rank

    cores = len(os.sched_getaffinity(0))
    env: dict[str, str] = {}
    assert threads_per_rank("1", env) == cores and env == {"OMP_NUM_THREADS": str(cores)}
    env = {}
    assert threads_per_rank(str(4 * cores), env) == 1 and env == {"OMP_NUM_THREADS": "1"}  # never 0
    assert "thread(s) on" in capsys.readouterr().err
    chosen = {"OMP_NUM_THREADS": "3"}
    assert threads_per_rank("2", chosen) is None and chosen == {"OMP_NUM_THREADS": "3"}
    assert threads_per_rank("auto", {}) is None  # torchrun picks the count, and the threads with it
    assert capsys.readouterr().err == ""


def _torch_metrics_wrapper_hit_by_sigterm() -> None:
    """What torch's elastic metrics wrapper raises when SIGTERM lands before its first line: the
    handler's SignalException, then, in the wrapper's own cleanup, an UnboundLocalError."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
    except SignalException:
        raise UnboundLocalError("cannot access local variable 'start' where it is not associated with a value")  # noqa: B904 (torch's wrapper raises so)


def test_a_signal_that_torch_turned_into_another_error_still_exits_128_plus_it(monkeypatch, capsys):
    import torch.distributed.run

    from scaling.runner.torchrun import main, signal_exception

    monkeypatch.setattr(torch.distributed.run, "run", lambda args: _torch_metrics_wrapper_hit_by_sigterm())
    assert main(["--nproc-per-node", "1", "train.py"]) == 143
    assert '"signal": 15' in capsys.readouterr().err
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # no signal in the chain: the error stays the error
        main(["--nproc-per-node", "1", "train.py"])
    assert signal_exception(ValueError("x"), KeyError) is None
