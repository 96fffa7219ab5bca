"""A crash during a save, and SIGTERM to the runner: the restart continues bitwise (docs/reliability.md 3, 9b).

Both compare with one uninterrupted reference run of the same config (2 ranks, dp2, dropout,
save every 10 steps), run once per module on pooled gloo ranks.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from reliability_testlib import (
    alive,
    cli_config,
    config,
    launch,
    losses,
    parent_pid,
    pooled,
    reap,
    start_cli,
    steps,
    worker_pids,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 30
STEP_DELAY_S = 0.25  # the SIGTERM run's steps sleep this long (losses unchanged): it is still running when signalled
# The collective timeout. A dead peer is seen at once (its connection closes), so this only bounds how far
# behind a rank may start: 10 s was once too little in CI, where other tests' launches load the 2 cores.
TIMEOUT_S = 30.0


def _cfg(tmp: Path, ckpt: Path, resume: bool = False) -> dict[str, Any]:
    trainer = {
        "save_dir": str(ckpt),
        "save_interval": 10,
        "log_interval": 100,
        **({"load_dir": str(ckpt)} if resume else {}),
    }
    return config(tmp, steps=STEPS, tp=1, dp=2, timeout_s=TIMEOUT_S, trainer=trainer)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    # The uninterrupted run needs no launch of its own: the same training on 2 pooled ranks
    # gives the launched run's losses bitwise (the same code, seeds and collectives), and the
    # tests below compare their launched runs with it.
    tmp = tmp_path_factory.mktemp("reference")
    assert pooled(_cfg(tmp, tmp / "ckpt"), tmp / "out", timeout_seconds=120) == [None, None]
    result = losses(tmp / "out")
    assert sorted(result) == list(range(1, STEPS + 1))
    return result


def _latest(ckpt: Path) -> str:
    return (ckpt / "latest").read_text().strip()


def test_sigkill_during_save_of_step_20_restarts_from_step_10_bitwise(reference, tmp_path, capfd):
    ckpt, crashed, resumed = tmp_path / "ckpt", tmp_path / "crashed", tmp_path / "resumed"
    # Rank 1 SIGKILLs itself while committing step 20: its shards are on disk, commit.json is not.
    faults = [{"kind": "kill_in_save", "rank": 1, "step": 20}]
    assert launch(_cfg(tmp_path, ckpt), crashed, faults) == 128 + signal.SIGKILL
    pids = worker_pids(crashed, 2)
    step20 = ckpt / "step_00000020"
    try:
        assert step20.is_dir() and any(step20.rglob("*.distcp")), "the killed save left no partial folder"
        assert not (step20 / "commit.json").exists()
        assert _latest(ckpt) == "step_00000010"
        assert max(r["step"] for r in steps(crashed, 0)) == 20
        capfd.readouterr()

        restarted_at = time.time()
        assert launch(_cfg(tmp_path, ckpt, resume=True), resumed) == 0
        captured = capfd.readouterr()
        # The incomplete step 20 is ignored: the restart loads step 10 and continues with step 11 ...
        assert "loaded checkpoint step 10 from" in captured.out + captured.err, captured.err[-2000:]
        got = losses(resumed)
        assert min(got) == 11 and max(got) == STEPS
        # ... whose loss, and every later one, equals the uninterrupted run's bitwise.
        assert {s: got[s] for s in range(11, STEPS + 1)} == {s: reference[s] for s in range(11, STEPS + 1)}
        # The incomplete folder was cleaned up: step 20 now holds only the files its commit lists, all new.
        marker = json.loads((step20 / "commit.json").read_text())
        on_disk = {p.relative_to(step20).as_posix() for p in step20.rglob("*") if p.is_file()}
        assert on_disk == set(marker["files"]) | {"commit.json"}
        assert all(p.stat().st_mtime >= restarted_at for p in step20.rglob("*") if p.is_file())
        assert not [p for p in ckpt.iterdir() if p.name.startswith("step_") and not (p / "commit.json").exists()]
    finally:
        reap(pids)


def test_sigterm_to_the_runner_saves_exits_143_and_continues_bitwise(reference, tmp_path):
    ckpt, first, resumed = tmp_path / "ckpt", tmp_path / "first", tmp_path / "resumed"
    cfg = cli_config(tmp_path / "run.json", _cfg(tmp_path, ckpt), first, step_delay_s=STEP_DELAY_S)
    runner = start_cli(cfg, tmp_path / "logs")
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while len(steps(first, 0)) < 3:
            assert runner.poll() is None, (tmp_path / "logs" / "runner.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start within 300 s"
            time.sleep(0.05)
        pids = worker_pids(first, 2)
        agents = {parent_pid(p) for p in pids if alive(p)}  # torchrun's elastic agent
        pids += sorted(agents)
        signalled_at = time.time()
        runner.send_signal(signal.SIGTERM)
        code = runner.wait(timeout=120)
        err = (tmp_path / "logs" / "runner.err").read_text()
        assert code == 128 + signal.SIGTERM, err[-3000:]
        assert "scaling-run: received SIGTERM; forwarding it to the ranks" in err
        assert "scaling-run: stopped by SIGTERM; exit code 143" in err
        # Every rank stopped after the same step, before the end, and that step is committed within 20 s.
        stopped = steps(first, 0)[-1]["step"]
        assert steps(first, 1)[-1]["step"] == stopped < STEPS
        assert _latest(ckpt) == f"step_{stopped:08d}"
        assert (ckpt / f"step_{stopped:08d}" / "commit.json").stat().st_mtime - signalled_at < 20.0
        # No worker and no torchrun agent is left.
        end = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)], "processes left running after the runner returned"

        assert launch(_cfg(tmp_path, ckpt, resume=True), resumed) == 0
        got = losses(resumed)
        assert min(got) == stopped + 1
        assert got == {s: reference[s] for s in range(stopped + 1, STEPS + 1)}
    finally:
        if runner.poll() is None:
            runner.kill()
        reap(pids)
