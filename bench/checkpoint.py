"""Checkpoint throughput against plain file I/O of the same bytes, and async blocking time.

Run: python bench/checkpoint.py --mb 256 --repeats 3 [--breakdown]
One process (no process group): DCP save/load of ``--mb`` MiB of fp32 tensors through
``scaling.trainer.checkpoint`` (shards + sha256 commit marker + ``latest``; load verifies
every hash first) versus a plain sequential write (+ fsync) / read of the same bytes in
the same run. Then the time ``save_checkpoint(async_save=True)`` blocks the caller versus
a synchronous save (goal: <= 20%), staging into kept ``StagingBuffers`` as the trainer does
(the first repeat allocates them), and for context with fresh staging buffers per save. Prints medians (and min-max) over ``--repeats``; each
repeat runs the reference and ours back to back, so load on the machine hits both alike.

``--device cuda`` keeps the state in GPU memory, as a GPU run's is: the async save then stages
into kept pinned host buffers (ours) against DCP's default staging into fresh pageable memory
(the "fresh" row), and the plain write/read includes the copy to and from the GPU.

``--breakdown`` also times the parts of the cost in the same repeats: sha256 of the same
bytes in memory (one thread), a bare DCP save (``FileSystemWriter``, fsync, no hashing,
no marker) and a bare DCP load (no verification), so the ratios above can be split into
"integrity" (sha256) and "format" (DCP serialisation) shares.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from scaling.trainer.checkpoint import StagingBuffers, load_checkpoint, save_checkpoint

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def make_state(mib: int, num_tensors: int = 16, device: str = "cpu") -> dict:
    numel = mib * (1 << 20) // 4 // num_tensors
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"layers.{i}.weight": torch.randn(numel, generator=gen).to(device) for i in range(num_tensors)}}


def plain_write(path: Path, state: dict) -> None:
    with open(path, "wb") as f:
        for t in state["model"].values():
            f.write(t.cpu().numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def plain_read(path: Path, state: dict) -> None:
    with open(path, "rb") as f:
        for t in state["model"].values():
            t.copy_(torch.frombuffer(bytearray(f.read(t.numel() * 4)), dtype=torch.float32))
    if any(t.is_cuda for t in state["model"].values()):
        torch.cuda.synchronize()


def sha256_only(state: dict) -> None:
    digest = hashlib.sha256()
    for t in state["model"].values():
        digest.update(memoryview(t.cpu().numpy()))
    digest.hexdigest()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args: argparse.Namespace, root: Path, state: dict, template: dict) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {}
    staging = StagingBuffers()  # kept across saves, as BaseTrainer keeps one

    def add(key: str, seconds: float) -> None:
        rows.setdefault(key, []).append(seconds)

    for r in range(args.repeats):
        add("plain_write", timed(lambda: plain_write(root / "plain.bin", state)))
        add("save", timed(lambda r=r: save_checkpoint(root / "ck", 2 * r, state, None).wait()))
        add("plain_read", timed(lambda: plain_read(root / "plain.bin", template)))
        add("load", timed(lambda r=r: load_checkpoint(root / "ck", template, None, step=2 * r)))
        start = time.perf_counter()
        pending = save_checkpoint(root / "ck", 2 * r + 1, state, None, async_save=True, staging=staging)
        add("async_block", time.perf_counter() - start)
        pending.wait()
        add("async_total", time.perf_counter() - start)
        start = time.perf_counter()
        pending = save_checkpoint(root / "ck_fresh", 2 * r + 1, state, None, async_save=True)
        add("async_block_fresh", time.perf_counter() - start)
        pending.wait()
        for t in template["model"]:
            assert torch.equal(template["model"][t], state["model"][t])
        if args.breakdown:
            bare = root / f"bare{r}"
            add("sha256", timed(lambda: sha256_only(state)))
            add("dcp_save", timed(lambda b=bare: dcp.save(state, storage_writer=dcp.FileSystemWriter(b))))
            add("dcp_load", timed(lambda b=bare: dcp.load(template, storage_reader=dcp.FileSystemReader(b))))
            shutil.rmtree(bare)
        # Keep the disk use flat: only the newest checkpoints stay.
        for folder in ("ck", "ck_fresh"):
            for old in sorted((root / folder).glob("step_*"))[:-2]:
                shutil.rmtree(old)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="MiB of tensors to save")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder on the file system to measure (default: a temp dir)")
    parser.add_argument("--breakdown", action="store_true", help="also time sha256 alone and bare DCP save/load")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    state = make_state(args.mb, device=args.device)
    template = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    nbytes = sum(t.numel() * 4 for t in state["model"].values())
    try:
        rows = run(args, root, state, template)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    spread = {k: f"{min(v):.3f}-{max(v):.3f} s" for k, v in rows.items()}
    gib = nbytes / (1 << 30)
    print(
        f"bytes: {nbytes / (1 << 20):.0f} MiB in {len(state['model'])} tensors on {args.device}, median of "
        f"{args.repeats} (min-max)"
    )
    print(
        f"plain write+fsync {gib / med['plain_write']:.2f} GiB/s ({spread['plain_write']}) | save "
        f"{gib / med['save']:.2f} GiB/s ({spread['save']}) | save/plain time ratio "
        f"{med['save'] / med['plain_write']:.2f}"
    )
    print(
        f"plain read        {gib / med['plain_read']:.2f} GiB/s ({spread['plain_read']}) | load "
        f"{gib / med['load']:.2f} GiB/s ({spread['load']}) | load/plain time ratio "
        f"{med['load'] / med['plain_read']:.2f}"
    )
    print(
        f"async save blocks {med['async_block']:.3f} s vs sync save {med['save']:.3f} s "
        f"= {100 * med['async_block'] / med['save']:.1f}% (goal <= 20%); async total {med['async_total']:.3f} s"
    )
    print(
        f"  with fresh staging buffers per save (DCP's default staging): blocks {med['async_block_fresh']:.3f} s "
        f"= {100 * med['async_block_fresh'] / med['save']:.1f}% of a sync save; kept/fresh "
        f"{med['async_block'] / med['async_block_fresh']:.2f}"
    )
    if args.breakdown:
        print(
            f"sha256 alone (in memory, 1 thread) {med['sha256']:.3f} s = {gib / med['sha256']:.2f} GiB/s "
            f"({spread['sha256']})\n"
            f"bare DCP save (fsync, no hash) {med['dcp_save']:.3f} s ({spread['dcp_save']}) = "
            f"{med['dcp_save'] / med['plain_write']:.2f}x plain write; ours adds {med['save'] - med['dcp_save']:.3f} s\n"
            f"bare DCP load (no verify) {med['dcp_load']:.3f} s ({spread['dcp_load']}) = "
            f"{med['dcp_load'] / med['plain_read']:.2f}x plain read; ours adds {med['load'] - med['dcp_load']:.3f} s"
        )


if __name__ == "__main__":
    main()
