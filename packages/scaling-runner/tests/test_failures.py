"""Reading torchrun's failure report: which rank failed, how, and with which exception."""

from __future__ import annotations

import pytest

from scaling.runner._failures import FailureParser

REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_10:58:37
  host      : node-01
  rank      : 3 (local_rank: 1)
  exitcode  : 1 (pid: 13592)
  error_file: /tmp/torchelastic_g5/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
    File "/x/errors/__init__.py", line 367, in wrapper
      return f(*args, **kwargs)
    File "/x/train.py", line 5, in main
      raise CheckpointError("...")
  scaling.trainer.checkpoint._errors.CheckpointError: checkpoint ckpt/step_00000010 failed verification:
    ckpt/step_00000010/__1_0.distcp: sha256 differs from commit.json (corrupted or modified)

============================================================
"""


@pytest.mark.parametrize("prefix", ["", "node-01: "])
def test_the_root_cause_carries_its_exception_in_one_line(prefix):
    parser = FailureParser()
    for line in REPORT.splitlines(keepends=True):
        parser.feed(prefix + line)
    parser.close()
    (failure,) = parser.failures.values()
    assert (failure.rank, failure.local_rank, failure.host, failure.exitcode, failure.root_cause) == (
        3, 1, "node-01", 1, True,
    )  # fmt: skip
    assert failure.describe() == (
        "rank 3 (local_rank 1 on node-01, pid 13592) exited with code 1: scaling.trainer.checkpoint._errors."
        "CheckpointError: checkpoint ckpt/step_00000010 failed verification: ckpt/step_00000010/__1_0.distcp: "
        "sha256 differs from commit.json (corrupted or modified)"
    )


def test_a_killed_rank_has_no_message():
    parser = FailureParser()
    for line in [
        "  host      : node-02\n",
        "  rank      : 0 (local_rank: 0)\n",
        "  exitcode  : -9 (pid: 4711) (SIGKILL)\n",
        "  error_file: <N/A>\n",
        "  traceback : Signal 9 (SIGKILL) received by PID 4711\n",
        "============================================================\n",
    ]:
        parser.feed(line)
    parser.close()
    (failure,) = parser.failures.values()
    assert failure.message is None
    assert failure.describe() == "rank 0 (local_rank 0 on node-02, pid 4711) was killed by signal 9 (SIGKILL)"
