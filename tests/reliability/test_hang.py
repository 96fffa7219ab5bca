"""A hung rank ends the job with a timeout that names it, and every rank leaves diagnostics (docs/reliability.md)."""

from __future__ import annotations

import json
import signal
import time

import pytest
from reliability_testlib import config, launch, reap, worker_pids

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.waits]

TIMEOUT_S = 5.0  # the collective timeout of this run
SLEEPER, STEP = 1, 2


def test_sleeping_rank_is_named_and_every_rank_writes_diagnostics(tmp_path, capfd):
    out, diag = tmp_path / "out", tmp_path / "diagnostics"
    # Rank 1 sleeps inside the loss of step 2, far longer than the timeout: its peer reaches the
    # DP gradient all-reduce (issued from backward hooks) and waits there alone.
    faults = [{"kind": "sleep", "rank": SLEEPER, "step": STEP, "seconds": 600}]
    cfg = config(tmp_path, steps=6, tp=1, dp=2, timeout_s=TIMEOUT_S, trainer={"diagnostics_dir": str(diag)})
    code = launch(cfg, out, faults)
    returned = time.time()
    err = capfd.readouterr().err
    pids = worker_pids(out, 2)
    try:
        assert code != 0
        # Three timeouts: the peer's gloo timeout, its bounded wait for the sleeper's report, and
        # the sleeper's watchdog after torchrun's SIGTERM; plus process exit and teardown, which
        # took up to ~14 s on the loaded 2-core dev box (28.8 s in all there).
        slept = out / f"fault_rank{SLEEPER}.time"
        # The run must end because of the sleeper, not earlier (a rank slower than the timeout to start).
        assert slept.exists(), f"rank {SLEEPER} never reached step {STEP}'s sleep; the run's stderr:\n{err[-4000:]}"
        elapsed = returned - float(slept.read_text())
        assert elapsed < 3 * TIMEOUT_S + 25, elapsed
        # The peer's error names the collective, its group and the rank that did not arrive.
        error = next(line for line in err.splitlines() if "CollectiveTimeoutError: all_reduce(" in line)
        assert "of the dp group (ranks [0, 1]) failed on rank 0" in error, error
        assert f"rank {SLEEPER} did not arrive: no report within {TIMEOUT_S:.1f}s" in err, err[-3000:]
        # Every rank left its file: the step it was in and what it last called.
        reports = {rank: json.loads((diag / f"rank_{rank}.json").read_text()) for rank in (0, 1)}
        for rank, report in reports.items():
            assert (report["rank"], report["step"]) == (rank, STEP)
            assert report["bytes_by_op_and_group"]["all_reduce/dp"] > 0  # step 1's gradient reduction
        # The peer's last call is the all-reduce it timed out in, and its reason is the error above.
        last = reports[0]["last_collectives"][-1]
        assert (last["op"], last["group"], last["ranks"]) == ("all_reduce", "dp", [0, 1])
        assert error.split("CollectiveTimeoutError: ", 1)[1] == reports[0]["reason"].splitlines()[0]
        # The sleeper never issued it: its own dp record stops before the peer's failed call.
        dp_seqs = [r["seq"] for r in reports[SLEEPER]["last_collectives"] if r["group"] == "dp"]
        assert max(dp_seqs) < last["seq"], (dp_seqs, last)
        assert reports[SLEEPER]["reason"].startswith(f"signal {int(signal.SIGTERM)} received but the ranks did not")
    finally:
        reap(pids)
