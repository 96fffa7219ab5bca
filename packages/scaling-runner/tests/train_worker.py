"""Training script the runner tests launch: gloo process group from the torchrun environment,
one all-reduce, then data-parallel training of y = w * x + b for a few steps.

Every rank writes ``rank<R>.json`` (its ranks, parent pid, trained parameters, selected
environment variables) into ``payload["out_dir"]``. With ``payload["hang"]`` the ranks then
keep all-reducing until killed, and ``payload["raise_rank"]`` raises there, for the failure tests.
"""

from __future__ import annotations

# ruff: noqa: E402 (the imports follow gc.disable())
# Start-up and exit cost most of this short-lived rank's CPU, and the suite launches it dozens
# of times: no cyclic garbage collection while torch imports, what the imports made frozen out
# of the collector's sight (else the first passes after gc.enable() walk it all: ~0.3 s a
# process), and no interpreter teardown after a clean run (below; ~0.7 s: torch unregisters
# every operator it registered from Python). None of it changes what the tests check.
import gc

gc.disable()

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scaling.runner import load_payload

gc.freeze()
gc.enable()


def make_data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(-1.0, 1.0, 4 * world_size)
    return x, 3.0 * x + 1.0


def train(x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, group: bool) -> tuple[float, float]:
    """Plain SGD on mean squared error; with ``group`` the gradients are averaged over ranks."""
    w = torch.zeros((), requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    for _ in range(steps):
        loss = ((w * x + b - y) ** 2).mean()
        gw, gb = torch.autograd.grad(loss, [w, b])
        if group:
            grads = torch.stack([gw, gb])
            dist.all_reduce(grads)
            gw, gb = grads / dist.get_world_size()
        with torch.no_grad():
            w -= lr * gw
            b -= lr * gb
    return float(w.detach()), float(b.detach())


def ancestors_cmdlines() -> list[str]:
    lines, pid = [], os.getpid()
    while pid > 1:
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return lines


def main() -> None:
    torch.set_num_threads(1)
    payload = load_payload()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    x, y = make_data(world_size)
    w, b = train(x[rank::world_size], y[rank::world_size], payload["steps"], payload["lr"], group=True)
    record = {
        "rank": rank,
        "world_size": world_size,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "ppid": os.getppid(),
        "pid": os.getpid(),
        "allreduce": float(total),
        "w": w,
        "b": b,
        "env": {name: os.environ.get(name) for name in payload.get("echo_env", [])},
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        # Command lines of this worker and of every process above it (torchrun's agent, the
        # shell pdsh started, pdsh, the runner), as `ps` shows them: secrets must not be in them.
        "cmdlines": ancestors_cmdlines(),
    }
    # One line per rank on stdout: under pdsh it carries the node's name as prefix.
    print(
        f"scaling-test-rank rank={rank} group_rank={record['group_rank']} local_rank={record['local_rank']}", flush=True
    )
    out = Path(payload["out_dir"])
    (out / f"rank{rank}.json.tmp").write_text(json.dumps(record))
    os.replace(out / f"rank{rank}.json.tmp", out / f"rank{rank}.json")
    if payload.get("raise_rank") == "all":
        dist.barrier()  # every rank has written its record before the first one fails
        raise RuntimeError(payload["raise_message"])  # the same error on every rank
    if payload.get("raise_rank") == rank:
        raise RuntimeError(f"rank {rank} gave up: {payload['raise_message']}")
    if payload.get("hang"):
        beat = torch.ones(1)
        while True:  # real collectives until a rank is killed; then gloo errors out on the peers
            dist.all_reduce(beat)
            time.sleep(0.2)
    # scaling.topology.destroy_process_group does this pause too; this script runs with the
    # runner alone installed (torch 2.6 gloo teardown deadlock, see there).
    time.sleep(0.01)
    dist.destroy_process_group()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        record(main)()  # an exception lands in TORCHELASTIC_ERROR_FILE, which the runner reports
    except Exception:  # noqa: BLE001 (any error of the rank: Python's exit code 1, as below)
        # Exit 1 before the interpreter's teardown, where gloo's live threads can abort a rank
        # that failed while its peer was mid-collective (exit 134 instead of 1); scripts that
        # make their groups through scaling.topology get the same from its exit handler.
        sys.excepthook(*sys.exc_info())  # as Python would show it (the runner's hook may keep it quiet)
        sys.stderr.flush()
        os._exit(1)
    # Everything this rank writes is closed by now: skip the interpreter's teardown (see the top).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
