"""The commit marker is the last write of a checkpoint: SIGKILL at random moments of a save loop."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _save_forever(rank: int, init_file: str, save_dir: str) -> None:
    """Two gloo ranks saving ever-new checkpoints (keep the last 2) until killed."""
    import torch.distributed as dist

    from scaling.trainer.checkpoint import save_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    step = 0
    while True:
        step += 1
        gen = torch.Generator().manual_seed(step * 10 + rank)
        state = {"model": {"w": torch.randn(1 << 16, generator=gen), f"r{rank}": torch.randn(4096, generator=gen)}}
        save_checkpoint(save_dir, step, state, None, extra={"step": step}, keep_last=2).wait()


def _check_invariants(save_dir: Path) -> int | None:
    """Every committed folder is complete; ``latest`` is whole and points to one. Returns latest's step."""
    for marker in save_dir.glob("step_*/commit.json"):
        listed = json.loads(marker.read_text())["files"]  # never empty or partial JSON
        assert listed, marker
        for name, want in listed.items():
            path = marker.parent / name
            assert path.is_file(), f"{path} listed in {marker} but missing"
            data = path.read_bytes()
            assert len(data) == want["size"] and hashlib.sha256(data).hexdigest() == want["sha256"], path
    latest = save_dir / "latest"
    if not latest.exists():
        return None
    text = latest.read_text()
    m = re.fullmatch(r"step_(\d{8})\n", text)
    assert m, f"latest is empty or partial: {text!r}"
    assert (save_dir / text.strip() / "commit.json").is_file(), f"latest points to uncommitted {text!r}"
    return int(m.group(1))


@pytest.mark.slow
@pytest.mark.distributed
def test_commit_marker_is_the_last_durable_write_under_random_kills(tmp_path):
    from scaling.trainer.checkpoint import committed_steps, load_checkpoint, save_checkpoint

    ctx = mp.get_context("fork")
    rng = random.Random(13)
    checked = 0
    for trial in range(6):
        save_dir = tmp_path / f"t{trial}"
        init = tmp_path / f"rdzv{trial}"
        procs = [ctx.Process(target=_save_forever, args=(r, str(init), str(save_dir)), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + 60
            while len(committed_steps(save_dir)) < 1:  # the kill lands after at least one commit
                assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "no commit within 60 s"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 1.5))
            victim = rng.choice([0, 1, None])  # one rank, or both at once
            for r in [0, 1] if victim is None else [victim, 1 - victim]:
                os.kill(procs[r].pid, signal.SIGKILL)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=30)
        step = _check_invariants(save_dir)
        # A kill between a commit marker and the `latest` rewrite leaves `latest` on the previous
        # committed step: still a good checkpoint. It never lags by more than that one commit.
        committed = committed_steps(save_dir)
        assert step is not None and step in committed[-2:], (step, committed)
        # what latest names loads, bitwise, and the next save cleans up any half-written folder
        template = {"model": {"w": torch.zeros(1 << 16), "r0": torch.zeros(4096), "r1": torch.zeros(4096)}}
        loaded = load_checkpoint(save_dir, template, None)
        want = torch.randn(1 << 16, generator=torch.Generator().manual_seed(step * 10))
        assert loaded.step == step and torch.equal(template["model"]["w"], want)
        save_checkpoint(save_dir, step + 1000, {"model": {"w": torch.ones(2)}}, None).wait()
        assert all((p / "commit.json").is_file() for p in save_dir.glob("step_*"))
        checked += 1
    assert checked == 6
