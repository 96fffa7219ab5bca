"""Two-rank program for test_kill.py: save step 1, then start step 2 and get SIGKILLed.

Usage: python kill_during_save.py SAVE_DIR INIT_FILE RANK READY_FILE
Rank 1 pauses inside the commit (after writing its shards, before its hashes reach
rank 0) and writes READY_FILE, so the parent's SIGKILL lands mid-save every time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scaling.trainer.checkpoint import _save, save_checkpoint


def main() -> None:
    save_dir, init_file, rank, ready = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    small = {"model": {"w": torch.arange(16.0) + 1, f"only_rank{rank}": torch.full((4,), float(rank))}}
    save_checkpoint(save_dir, 1, small, None).wait()
    big = {"model": {"w": torch.randn(1 << 20), f"only_rank{rank}": torch.randn(1 << 20)}}
    if rank == 1:
        # The commit starts by checking the digests taken while writing: stall there.
        real_trusted = _save._trusted

        def stall(step_dir, known):
            ready.write_text("shards written")
            time.sleep(60)
            return real_trusted(step_dir, known)

        _save._trusted = stall
    save_checkpoint(save_dir, 2, big, None).wait()


if __name__ == "__main__":
    main()
