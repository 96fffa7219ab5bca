"""A lost rank costs a restart from memory, not from disk (#51; docs/reliability.md 28, 29).

fault_train.py through the runner (torchrun, ``runner.max_restarts=1``) with a copy of every
rank's state in memory each step (``trainer.memory_checkpoint_interval=1``) and a disk save
every 10 steps. Rank 1 SIGKILLs itself in step 37, after moving ``save_dir`` aside: torchrun
restarts the workers, which can resume from nothing but the copies in memory. Every rank's
steps 37..40 after the restart equal an uninterrupted run's bitwise: the loss and a sha256 of
its parameters and optimizer state.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from reliability_testlib import config, launch, pooled, steps

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 40
KILL_STEP = 37


def _cfg(tmp: Path, ckpt: Path, memory: Path, tp: int, dp: int) -> dict[str, Any]:
    trainer = {
        "save_dir": str(ckpt),
        "save_interval": 10,
        "log_interval": 100,
        "memory_checkpoint_interval": 1,
        "memory_checkpoint_dir": str(memory),
    }
    return config(tmp, steps=STEPS, tp=tp, dp=dp, timeout_s=20.0, trainer=trainer)


@pytest.fixture
def shm():
    """A folder under /dev/shm for this test's copies (removed by the run itself when it ends)."""
    folder = Path("/dev/shm") / f"scaling-test-{uuid.uuid4().hex[:12]}"
    yield folder
    if folder.exists():
        for path in sorted(folder.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        folder.rmdir()


def _records(out: Path, rank: int, attempt: int) -> dict[int, tuple[float, str]]:
    return {r["step"]: (r["loss"], r["hash"]) for r in steps(out, rank) if r["attempt"] == attempt}


@pytest.mark.parametrize("tp, dp", [(1, 4), (2, 2)], ids=["dp4", "dp2tp2"])
def test_a_rank_killed_at_step_37_resumes_from_memory_bitwise_reading_nothing_from_disk(tmp_path, capfd, shm, tp, dp):
    ckpt = tmp_path / "ckpt"
    reference = tmp_path / "reference"
    assert pooled(_cfg(tmp_path, tmp_path / "ref_ckpt", shm, tp, dp), reference, timeout_seconds=180) == [None] * 4
    faults = [{"kind": "sigkill", "rank": 1, "step": KILL_STEP, "hide_save_dir": True}]
    assert launch(_cfg(tmp_path, ckpt, shm, tp, dp), tmp_path / "out", faults, max_restarts=1) == 0
    captured = capfd.readouterr()
    assert f"resumed from the in-memory checkpoint of step {KILL_STEP - 1}" in captured.out + captured.err
    for rank in range(4):
        first = _records(tmp_path / "out", rank, attempt=0)
        assert max(first) == KILL_STEP - 1  # no rank finished step 37 before the kill ended the attempt
        again = _records(tmp_path / "out", rank, attempt=1)
        assert sorted(again) == list(range(KILL_STEP, STEPS + 1))
        assert again == {s: v for s, v in _records(reference, rank, 0).items() if s >= KILL_STEP}
    # Nothing could be read from save_dir: it was moved aside before the kill, untouched since.
    hidden = tmp_path / "ckpt.hidden"
    assert sorted(p.name for p in hidden.iterdir() if p.name.startswith("step_")) == [
        "step_00000010",
        "step_00000020",
        "step_00000030",
    ]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000040"]
    assert not shm.exists()  # the finished run removed its copies


def test_a_second_failure_during_recovery_ends_the_run_named_and_the_disk_checkpoint_loads(tmp_path, capfd, shm):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    faults = [
        {"kind": "sigkill", "rank": 1, "step": KILL_STEP},
        {"kind": "kill_in_memory_load", "rank": 2, "attempt": 1},
    ]
    code = launch(_cfg(tmp_path, ckpt, shm, 1, 4), out, faults, max_restarts=1)
    captured = capfd.readouterr()
    summary = [line for line in captured.err.splitlines() if line.startswith("scaling-run:")]
    assert code == 128 + signal.SIGKILL, summary
    assert "rank 2" in captured.err and "SIGKILL" in captured.err, captured.err[-3000:]
    assert (ckpt / "latest").read_text().strip() == "step_00000030"
    # The same command again (a new job: its attempt 0 drops the copies) resumes from disk, step 30.
    again = tmp_path / "again"
    assert launch(_cfg(tmp_path, ckpt, shm, 1, 4), again) == 0
    assert "loaded checkpoint step 30 from" in "".join(capfd.readouterr())
    assert sorted(_records(again, 0, 0)) == list(range(31, STEPS + 1))
