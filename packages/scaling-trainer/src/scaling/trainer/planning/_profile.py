"""Measure a machine's profile for the step-time model: ``python -m scaling.trainer.planning profile``.

Each figure is timed on this machine as a training rank would run it: products of square matrices
per dtype at growing sizes, a large copy (memory bandwidth), tiny transformer blocks forward and
backward (the fixed cost of one operator), and all-reduces of a small and a large tensor among real
processes of the backend (gloo on CPU, NCCL on GPUs), each after a burst of products as in a step,
every group of a size at once among as many processes as a layout runs, from which each (group
size, processes) pair's latency and bandwidth follow by the ring's formula.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.spawn import start_processes
from torch.utils._python_dispatch import TorchDispatchMode

from scaling.trainer.planning._time import Link, MachineProfile

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: All-reduce sizes the links are fitted from (bytes): the small one is mostly latency.
_SMALL, _LARGE = 4 * 1024, 8 * 2**20


def _median_seconds(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def measure_matmul(
    device: torch.device, sizes: Sequence[int], repeats: int = 5
) -> dict[str, tuple[tuple[float, float], ...]]:
    """``(FLOPs, FLOP/s)`` of ``n x n @ n x n`` products per dtype and ``n``."""
    out = {}
    for name, dtype in _DTYPES.items():
        points = []
        for n in sizes:
            a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
            seconds = _median_seconds(functools.partial(torch.matmul, a, b), _sync(device), repeats)
            points.append((2.0 * n**3, 2.0 * n**3 / seconds))
        out[name] = tuple(points)
    return out


def measure_memory_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s a copy of ``nbytes`` reads and writes."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), _sync(device), repeats)


class _TinyBlock(torch.nn.Module):
    """A transformer block at a size where nothing but the operators' fixed costs shows."""

    def __init__(self, h: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(h, 3 * h, bias=False), torch.nn.Linear(h, h, bias=False)
        self.up, self.down = torch.nn.Linear(h, 4 * h, bias=False), torch.nn.Linear(2 * h, h, bias=False)
        self.norm1, self.norm2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class _CountOperators(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self, func: Callable[..., object], types: object, args: tuple[object, ...] = (), kwargs: object = None
    ) -> object:
        self.count += 1
        return func(*args, **(kwargs or {}))  # type: ignore[arg-type]


def measure_operator_overhead(device: torch.device, layers: int = 8, repeats: int = 5) -> float:
    """Seconds per operator of tiny transformer blocks' forward and backward (modules, views and
    autograd included), each operator counted at torch's dispatcher."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_TinyBlock() for _ in range(layers))).to(device)
    x = torch.randn(1, 4, 8, device=device)

    def step() -> None:
        model(x).sum().backward()

    with _CountOperators() as counted:
        step()
    return _median_seconds(step, _sync(device), repeats) / counted.count


def _burst(device: torch.device) -> Callable[[], object]:
    """About 3 ms of products on one CPU thread: what a rank computes between two collectives."""
    a = torch.randn(256, 256, device=device)
    return lambda: [a @ a for _ in range(8)]


def _all_reduce_worker(rank: int, world: int, group_size: int, init: str, backend: str, repeats: int, out: str) -> None:
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        groups = [dist.new_group(list(range(g, g + group_size))) for g in range(0, world, group_size)]
        group = groups[rank // group_size]
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        sync, burst = _sync(device), _burst(device)
        times = []
        for nbytes in (_SMALL, _LARGE):
            tensor = torch.ones(nbytes // 4, device=device)
            dist.barrier()
            extra = []
            for _ in range(repeats):  # a burst alone, then one with the collective: their difference
                start = time.perf_counter()
                burst()
                sync()
                middle = time.perf_counter()
                burst()
                dist.all_reduce(tensor, group=group)
                sync()
                extra.append(time.perf_counter() - middle - (middle - start))
            times.append(max(statistics.median(extra), 1e-7))
        if rank == 0:
            Path(out).write_text(f"{times[0]} {times[1]}")
    finally:
        dist.destroy_process_group()


def measure_all_reduce(group_size: int, backend: str, processes: int | None = None, repeats: int = 40) -> Link:
    """The ring's latency and bandwidth that explain all-reduces of a small and a large tensor in
    groups of ``group_size`` consecutive ranks among ``processes`` (default: one group), every group
    at once, as a layout's groups run: each after a burst of products, timed beyond the burst (a
    rank arrives from computation, so the ranks' skew and a sleeping waiter's wake-up count, which
    back-to-back collectives never show; on gloo they are most of a small collective's time)."""
    world = processes or group_size
    if world % group_size:
        raise ValueError(f"group_size={group_size} does not divide processes={world}")
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "times")
        init = "file://" + os.path.join(folder, "rendezvous")
        start_processes(
            _all_reduce_worker,
            (world, group_size, init, backend, repeats, out),
            nprocs=world,
            start_method="spawn",
        )
        small, large = map(float, Path(out).read_text().split())
    steps, n = 2 * (group_size - 1), group_size
    # t = steps * (latency + B / n / bandwidth) at both sizes
    per_byte = max((large - small) / steps / ((_LARGE - _SMALL) / n), 1e-15)
    latency = max(small / steps - _SMALL / n * per_byte, 0.0)
    return Link(bandwidth=1.0 / per_byte, latency=latency)


def measure_profile(
    name: str,
    device: torch.device,
    group_sizes: Sequence[int] = (2, 4),
    threads: int = 1,
    matmul_sizes: Sequence[int] | None = None,
    devices_per_node: int | None = None,
) -> MachineProfile:
    """This machine's profile; on CPU, with ``threads`` intra-op threads per rank as the ranks use.

    Args:
        group_sizes: the gloo (CPU) or NCCL (GPU) group sizes whose all-reduce is measured, each
            among as many processes as each larger size it divides (a 2-rank group alone, and two
            of them at once among 4 processes: a CPU's crowded cores delay every step).
        devices_per_node: ranks of a node (default: the GPUs on a GPU node; on CPU any number).
    """
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(threads)
    sizes = matmul_sizes or ((1024, 2048, 4096, 8192) if cuda else (64, 128, 256, 512))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    slots = torch.cuda.device_count() if cuda else max(cores // threads, 1)
    backend = "nccl" if cuda else "gloo"
    links = {
        (n, world): measure_all_reduce(n, backend, world)
        for world in group_sizes
        for n in group_sizes
        if n <= world and world % n == 0
    }
    biggest = links[max(links)] if links else Link(bandwidth=1e9, latency=1e-5)
    return MachineProfile(
        name=name,
        device=device.type,
        source=(
            f"measured by `python -m scaling.trainer.planning profile` on {datetime.date.today().isoformat()} "
            f"(torch {torch.__version__}, {threads if not cuda else '-'} thread(s) per rank)"
        ),
        devices_per_node=devices_per_node or (slots if cuda else 1 << 20),
        compute_slots=slots,
        matmul=measure_matmul(device, sizes),
        memory_bandwidth=measure_memory_bandwidth(device),
        operator_overhead=measure_operator_overhead(device),
        intra_node=biggest,
        inter_node=biggest,
        collectives=links,
        overlap=cuda,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scaling.trainer.planning", description="Measure this machine's profile for the planner."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="measure and write a machine profile (JSON)")
    p.add_argument("--out", required=True, help="the profile file to write")
    p.add_argument("--name", default=None, help="the profile's name (default: the file's stem)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--group-sizes", default="2,4", help="all-reduce group sizes to measure, comma-separated")
    p.add_argument("--threads", type=int, default=1, help="CPU: intra-op threads per rank (the test harness uses 1)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(n) for n in args.group_sizes.split(",") if n]
    except ValueError:
        parser.error(f"--group-sizes={args.group_sizes!r}: give whole numbers >= 2 separated by commas, e.g. 2,4")
    if any(n < 2 for n in sizes):
        parser.error(f"--group-sizes={args.group_sizes!r}: each group size must be >= 2")
    out = Path(args.out)
    profile = measure_profile(args.name or out.stem, torch.device(args.device), sizes, args.threads)
    out.write_text(profile.to_json())
    print(f"wrote {out}", file=sys.stderr)
    return 0
