"""SIGTERM / SIGINT to the runner reach torchrun's workers; the runner waits and exits 128 + signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_RUNNER = """
import sys
from scaling.runner import RunnerConfig, runner_main
cfg = RunnerConfig(script=sys.argv[1], nproc_per_node=2)
sys.exit(runner_main(cfg, {"out_dir": sys.argv[2], "steps": 2, "lr": 0.3, "hang": True}))
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# SIGINT here, to workers stuck in a step; SIGTERM through the same forwarding path is
# tested end to end with trainer workers in tests/reliability/test_restart_faults.py.
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT], ids=["SIGINT"])
def test_signal_to_the_runner_is_forwarded_and_nothing_is_left(worker_script, tmp_path, signum):
    runner = subprocess.Popen(
        [sys.executable, "-c", _RUNNER, worker_script, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}.json").exists() for r in range(2)):
            assert runner.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        pids = [r["pid"] for r in ranks] + [ranks[0]["ppid"]]  # the workers and torchrun's agent
        runner.send_signal(signum)
        _, err = runner.communicate(timeout=90)
        text = err.decode(errors="replace")
        # Before the fix the runner died at once (exit -15) and torchrun and its workers kept running.
        assert runner.returncode == 128 + signum, text[-3000:]
        assert f"scaling-run: received {signal.Signals(signum).name}; forwarding it to the ranks" in text
        assert f"scaling-run: stopped by {signal.Signals(signum).name}; exit code {128 + signum}" in text
        end = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "torchrun or a worker outlived the runner"
    finally:
        if runner.poll() is None:
            runner.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
