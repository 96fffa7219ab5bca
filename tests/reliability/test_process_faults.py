"""A dead rank ends the whole job loudly and leaves no process behind (the hang case: docs/reliability.md)."""

from __future__ import annotations

import re
import signal
import time

import pytest
from reliability_testlib import alive, config, launch, reap, worker_pids

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 8.0  # the collective timeout of these runs


def _first_rank_line(err: str) -> str:
    return next(line for line in err.splitlines() if line.startswith("scaling-run: first failure:"))


def _fault_time(out, rank: int) -> float:
    return float((out / f"fault_rank{rank}.time").read_text())


def _wait_gone(pids: list[int], deadline: float) -> list[int]:
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_sigkill_of_one_rank_mid_step_ends_every_rank_and_the_runner(tmp_path, capfd):
    out = tmp_path / "out"
    # Rank 2 kills itself inside the loss of step 3: its peers are mid-step, inside collectives.
    faults = [{"kind": "signal", "rank": 2, "step": 3, "signum": int(signal.SIGKILL)}]
    code = launch(config(tmp_path, steps=200, tp=2, dp=2, timeout_s=TIMEOUT_S), out, faults)
    returned = time.time()
    err = capfd.readouterr().err
    pids = worker_pids(out, 4)
    try:
        assert code == 128 + signal.SIGKILL
        # The job ends instead of hanging (see docs/reliability.md for the 1.5 × timeout bound).
        assert returned - _fault_time(out, 2) < 1.5 * TIMEOUT_S, returned - _fault_time(out, 2)
        # The runner's first line about a rank names the dead rank, its pid and the signal.
        first = _first_rank_line(err)
        assert re.search(rf"rank 2 \(local_rank 2 on \S+, pid {pids[2]}\) was killed by signal 9 \(SIGKILL\)", first)
        # Every other rank was stopped too (reported as such) and no worker is left running.
        others = err.split("then stopped or failed in consequence:")[-1]
        # (one line per outcome: "rank 0 (...) ..." alone, "ranks 0, 1, 3 (on host) ..." alike)
        assert all(re.search(rf"\brank {r} |\branks [\d, -]*\b{r}\b", others) for r in (0, 1, 3)), err[-2000:]
        assert not _wait_gone(pids, time.monotonic() + 10), "worker processes left running"
    finally:
        reap(pids)
