"""Checkpoint throughput against plain file I/O of the same bytes, and async blocking time.

Run: python bench/checkpoint.py --mb 256 --repeats 3
One process (no process group): DCP save/load of ``--mb`` MiB of fp32 tensors through
``scaling.trainer.checkpoint`` (shards + sha256 commit marker + ``latest``; load verifies
every hash first) versus a plain sequential write (+ fsync) / read of the same bytes in
the same run. Then the time ``save_checkpoint(async_save=True)`` blocks the caller versus
a synchronous save (goal: <= 20%). Prints medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from scaling.trainer.checkpoint import load_checkpoint, save_checkpoint

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def make_state(mib: int, num_tensors: int = 16) -> dict:
    numel = mib * (1 << 20) // 4 // num_tensors
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"layers.{i}.weight": torch.randn(numel, generator=gen) for i in range(num_tensors)}}


def plain_write(path: Path, state: dict) -> None:
    with open(path, "wb") as f:
        for t in state["model"].values():
            f.write(t.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def plain_read(path: Path, state: dict) -> None:
    with open(path, "rb") as f:
        for t in state["model"].values():
            t.copy_(torch.frombuffer(bytearray(f.read(t.numel() * 4)), dtype=torch.float32))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="MiB of tensors to save")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder on the file system to measure (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    state = make_state(args.mb)
    template = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    nbytes = sum(t.numel() * 4 for t in state["model"].values())
    rows: dict[str, list[float]] = {
        k: [] for k in ("plain_write", "save", "plain_read", "load", "async_block", "async_total")
    }
    try:
        for r in range(args.repeats):
            rows["plain_write"].append(timed(lambda: plain_write(root / "plain.bin", state)))
            rows["save"].append(timed(lambda r=r: save_checkpoint(root / "ck", 2 * r, state, None).wait()))
            rows["plain_read"].append(timed(lambda: plain_read(root / "plain.bin", template)))
            rows["load"].append(timed(lambda r=r: load_checkpoint(root / "ck", template, None, step=2 * r)))
            start = time.perf_counter()
            pending = save_checkpoint(root / "ck", 2 * r + 1, state, None, async_save=True)
            rows["async_block"].append(time.perf_counter() - start)
            pending.wait()
            rows["async_total"].append(time.perf_counter() - start)
            for t in template["model"]:
                assert torch.equal(template["model"][t], state["model"][t])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    gib = nbytes / (1 << 30)
    print(f"bytes: {nbytes / (1 << 20):.0f} MiB in {len(state['model'])} tensors, median of {args.repeats}")
    print(
        f"plain write+fsync {gib / med['plain_write']:.2f} GiB/s | save {gib / med['save']:.2f} GiB/s "
        f"| save/plain time ratio {med['save'] / med['plain_write']:.2f}"
    )
    print(
        f"plain read        {gib / med['plain_read']:.2f} GiB/s | load {gib / med['load']:.2f} GiB/s "
        f"| load/plain time ratio {med['load'] / med['plain_read']:.2f}"
    )
    print(
        f"async save blocks {med['async_block']:.3f} s vs sync save {med['save']:.3f} s "
        f"= {100 * med['async_block'] / med['save']:.1f}% (goal <= 20%); async total {med['async_total']:.3f} s"
    )


if __name__ == "__main__":
    main()
