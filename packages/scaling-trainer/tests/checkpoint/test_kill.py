"""SIGKILL of one rank in the middle of a save leaves the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from scaling.trainer.checkpoint import committed_steps, load_checkpoint, save_checkpoint

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
SCRIPT = Path(__file__).with_name("kill_during_save.py")


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_mid_save_keeps_previous(tmp_path):
    save_dir, ready = tmp_path / "ck", tmp_path / "ready"
    procs = [
        subprocess.Popen([sys.executable, str(SCRIPT), str(save_dir), str(tmp_path / "rdzv"), str(r), str(ready)])
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + 180  # two fresh interpreters importing torch: slow under load
        while not ready.exists():
            assert time.monotonic() < deadline, "rank 1 never reached the commit of step 2"
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            time.sleep(0.1)
        assert (save_dir / "step_00000002" / "__1_0.distcp").exists()  # the shards are on disk
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait(timeout=30)
    finally:
        for p in procs:  # rank 0 now waits on a dead peer: stop it too
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    assert procs[1].returncode == -signal.SIGKILL
    assert not (save_dir / "step_00000002" / "commit.json").exists()
    assert committed_steps(save_dir) == [1]
    template = {"model": {"w": torch.zeros(16), "only_rank0": torch.zeros(4), "only_rank1": torch.zeros(4)}}
    loaded = load_checkpoint(save_dir, template, None)
    assert loaded.step == 1
    assert torch.equal(template["model"]["w"], torch.arange(16.0) + 1)
    assert torch.equal(template["model"]["only_rank1"], torch.ones(4))
    # the next save cleans the incomplete folder up
    save_checkpoint(save_dir, 3, {"model": {"w": torch.ones(2)}}, None).wait()
    assert not (save_dir / "step_00000002").exists() and committed_steps(save_dir) == [1, 3]
