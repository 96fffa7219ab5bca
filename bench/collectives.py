"""scaling.collectives wrappers against raw torch.distributed calls, in the same run.

Run: python bench/collectives.py [--world-size 2] [--max-mib 64] [--min-pairs 48] [--target-se 0.01]
     [--budget-s 60] [--cpu-split CALLS]
Spawns ``--world-size`` gloo ranks on this machine (``file://`` rendezvous in a temp
dir) and times fp32 all_reduce and all_gather from 1 KiB to ``--max-mib`` MiB. Raw and
wrapper calls alternate one by one (ABBA), so both see the same interference from
other processes. The wall ratio is the median over pairs of ``ours_i / raw_i``, where
pair ``i`` is one raw and one wrapper call made back to back: a burst of load from
another process inflates both calls of a pair, so per-pair ratios cancel most of it
(the 25th-75th percentile of those ratios is printed as the spread). Sizes >= 1 MiB get
at least ``--min-pairs`` pairs, then twice as many at a time until the standard error of
that median is at most ``--target-se`` or the calls of that size have taken
``--budget-s`` seconds (per-call noise from the scheduler is large on a small machine, so
a fixed count leaves the median a few percent off either way); the table prints the
error as ``2 SE``. The table also shows the median wall time of each, the
extra CPU time the wrapper spends in the calling thread (median difference of
``time.thread_time``: immune to other processes taking the cores) and the ratio that
extra time implies (``(raw + cpu) / raw``), and the bus bandwidth of the wrapper.

Raw baselines are what a user writes for the same result: ``dist.all_reduce(x)``, and
for all_gather an output allocation plus ``all_gather_into_tensor`` (the wrapper
allocates its output too). Bus bandwidth follows nccl-tests: all_reduce
``bytes / t * 2 (n - 1) / n``, all_gather ``n * bytes / t * (n - 1) / n``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaling.collectives import all_gather, all_reduce, get_recorder

_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _raw_all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> None:
    dist.all_reduce(x, group=group)


def _ours_all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> None:
    all_reduce(x, group)


def _raw_all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> None:
    out = torch.empty(dist.get_world_size(group) * x.numel(), dtype=x.dtype)
    _gather_single(out, x, group=group)


def _ours_all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> None:
    all_gather(x, group)


OPS = {
    "all_reduce": (_raw_all_reduce, _ours_all_reduce, lambda n: 2 * (n - 1) / n),
    "all_gather": (_raw_all_gather, _ours_all_gather, lambda n: float(n - 1)),
}


def _interleaved(raw, ours, x: torch.Tensor, group: dist.ProcessGroup, pairs: int) -> torch.Tensor:
    """Time ``pairs`` raw and wrapper calls alternately (ABBA...), one by one.

    Returns ``[2 (raw, ours), 2 (wall, cpu), pairs]`` seconds. Alternating call by call
    exposes both to the same interference; a call's wall time is the slowest rank's (a
    collective is as slow as its last rank). CPU time is the calling thread's: gloo runs
    the transfer on its own threads, so the difference is what the wrapper adds, and
    other processes competing for the cores do not inflate it.
    """
    times = torch.zeros(2, 2, pairs, dtype=torch.float64)
    dist.barrier(group=group)
    for i in range(pairs):
        for j in (0, 1) if i % 2 == 0 else (1, 0):
            fn = raw if j == 0 else ours
            wall, cpu = time.perf_counter(), time.thread_time()
            fn(x, group)
            times[j, 1, i] = time.thread_time() - cpu
            times[j, 0, i] = time.perf_counter() - wall
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times


def _median_se(values: torch.Tensor) -> float:
    """Standard error of the median of ``values``: 1.2533 sigma / sqrt(n), sigma from the IQR."""
    q25, q75 = values.quantile(0.25).item(), values.quantile(0.75).item()
    return 1.2533 * (q75 - q25) / 1.349 / values.numel() ** 0.5


def _sample(raw, ours, x: torch.Tensor, group: dist.ProcessGroup, pairs: int, target_se: float, budget_s: float):
    """:func:`_interleaved` until the median pair ratio's standard error is <= ``target_se``.

    Doubles the pairs each round; stops early once the calls took ``budget_s`` seconds.
    Every rank holds the same (all-reduced) times, so every rank stops at the same round.
    """
    times = _interleaved(raw, ours, x, group, pairs)
    while _median_se(times[1, 0] / times[0, 0]) > target_se and times[:, 0].sum().item() < budget_s:
        times = torch.cat([times, _interleaved(raw, ours, x, group, times.shape[2])], dim=2)
    return times


def _recorder_overhead(x: torch.Tensor, group: dist.ProcessGroup, n: int = 20000) -> float:
    """Seconds per call the recorder adds (ring append, counters, call site), measured alone.

    The wrappers' path: the group's cached state, then ``_record_one``. In a tight loop
    the caches stay warm, so this is a floor; after a real collective the calling thread
    wakes with cold caches and the same work costs several times more (the "wrapper CPU"
    column). Calling-thread CPU time, like that column.
    """
    recorder = get_recorder()
    start = time.thread_time()  # CPU of this thread: other processes on the cores do not inflate it
    for _ in range(n):
        recorder._record_one(recorder._group_state(group), "bench", x)
    return (time.thread_time() - start) / n


def _cpu_split(group: dist.ProcessGroup, calls: int) -> list[tuple[str, int, float, float]]:
    """Median calling-thread CPU per call spent outside the ``torch.distributed`` function.

    A shim around that function (``dist.all_reduce``; the all_gather entry the raw call and
    the wrapper both use) times the CPU spent inside it on the same call; subtracting it
    leaves what runs around it (the wrapper's Python, the raw call's output allocation),
    without the backend's wait, whose CPU cost varies from call to call. Raw and wrapper
    calls alternate one by one. Returns ``(op, bytes, raw_us, ours_us)`` rows.
    """
    global _gather_single
    from scaling.collectives import _compat  # the name the wrapper calls all_gather_single through

    inside = [0.0]

    def shim(fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = time.thread_time() - start

        return timed

    saved = dist.all_reduce, _compat.all_gather_single, _gather_single
    dist.all_reduce, _compat.all_gather_single, _gather_single = shim(saved[0]), shim(saved[1]), shim(saved[2])
    rows = []
    try:
        for op, (raw, ours, _) in OPS.items():
            for nbytes in (1 << 10, 1 << 20):
                x = torch.zeros(nbytes // 4)
                raw(x, group), ours(x, group)
                spent: tuple[list[float], list[float]] = ([], [])
                for i in range(calls):
                    for j in (0, 1) if i % 2 == 0 else (1, 0):
                        start = time.thread_time()
                        (raw if j == 0 else ours)(x, group)
                        spent[j].append(time.thread_time() - start - inside[0])
                med = [torch.tensor(v).median().item() * 1e6 for v in spent]
                rows.append((op, nbytes, med[0], med[1]))
    finally:
        dist.all_reduce, _compat.all_gather_single, _gather_single = saved
    return rows


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _worker(rank: int, world_size: int, init_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    if args.cpu_split:
        split = _cpu_split(group, args.cpu_split)
        if rank == 0:
            print(f"calling-thread CPU outside the torch.distributed call, median of {args.cpu_split} calls each")
            print("| op | size | raw (us) | scaling (us) | wrapper extra (us) |\n|---|---|---|---|---|")
            for op, nbytes, raw_us, ours_us in split:
                print(f"| {op} | {_human(nbytes)} | {raw_us:.1f} | {ours_us:.1f} | {ours_us - raw_us:.1f} |")
        dist.destroy_process_group()
        return
    sizes = [1 << e for e in range(10, 21 + (args.max_mib.bit_length() - 1) + 1, 2)]
    rows = []
    for op, (raw, ours, bus_factor) in OPS.items():
        for nbytes in sizes:
            x = torch.zeros(nbytes // 4)  # zeros: repeated in-place sums stay finite
            raw(x, group), ours(x, group)  # warm up connections and allocator
            if nbytes >= 1 << 20:
                times = _sample(raw, ours, x, group, args.min_pairs, args.target_se, args.budget_s)
            else:
                times = _interleaved(raw, ours, x, group, min(400, (512 << 20) // nbytes))
            pairs = times.shape[2]
            t_raw, t_ours = times[0, 0].median().item(), times[1, 0].median().item()
            pair_ratios = times[1, 0] / times[0, 0]
            q25, ratio, q75 = (pair_ratios.quantile(q).item() for q in (0.25, 0.5, 0.75))
            cpu_extra = times[1, 1].median().item() - times[0, 1].median().item()
            busbw = nbytes / t_ours * bus_factor(world_size) / 1e9
            se = _median_se(pair_ratios)
            rows.append((op, nbytes, pairs, t_raw, t_ours, ratio, se, q25, q75, cpu_extra, busbw))
    overhead = _recorder_overhead(torch.zeros(4), group)
    if rank == 0:
        print(f"torch {torch.__version__}, gloo, {world_size} ranks on one host, fp32, medians of interleaved calls")
        print(
            "| op | size | pairs | raw median (us) | scaling median (us) | wall ratio (median of pairs) | 2 SE | "
            "spread (p25-p75) | wrapper CPU (us/call) | ratio from CPU | busbw (GB/s) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for op, nbytes, pairs, t_raw, t_ours, ratio, se, q25, q75, cpu_extra, busbw in rows:
            print(
                f"| {op} | {_human(nbytes)} | {pairs} | {t_raw * 1e6:,.1f} | {t_ours * 1e6:,.1f} | {ratio:.3f} | "
                f"{2 * se:.3f} | {q25:.3f}-{q75:.3f} | {cpu_extra * 1e6:.1f} | {(t_raw + cpu_extra) / t_raw:.3f} | "
                f"{busbw:.2f} |"
            )
        big = [(r[5], r[6], (r[3] + r[9]) / r[3]) for r in rows if r[1] >= 1 << 20]
        worst = max(big)
        print(
            f"sizes >= 1 MiB (goal <= 1.05): max wall ratio {worst[0]:.3f} (2 SE {2 * worst[1]:.3f}), "
            f"max ratio from the wrapper's CPU time {max(c for _, _, c in big):.3f}"
        )
        print(f"recorder cost per call, measured alone (warm loop, calling-thread CPU): {overhead * 1e6:.1f} us")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--max-mib", type=int, default=64, help="largest size in MiB (a power of 4: 1, 4, 16, 64)")
    parser.add_argument("--min-pairs", type=int, default=48, help="raw/wrapper pairs at least, for sizes >= 1 MiB")
    parser.add_argument(
        "--target-se", type=float, default=0.01, help="sizes >= 1 MiB: sample until the ratio's standard error is this"
    )
    parser.add_argument(
        "--budget-s", type=float, default=60.0, help="sizes >= 1 MiB: stop sampling a size after this many seconds"
    )
    parser.add_argument(
        "--cpu-split",
        type=int,
        default=0,
        metavar="CALLS",
        help="instead of the table: CPU per call outside the torch.distributed function, at 1 KiB and 1 MiB",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="scaling-bench-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_worker, args=(args.world_size, init_file, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
