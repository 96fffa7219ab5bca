"""One pipeline hand-off, ours against torch's, in a two-rank ping-pong (the transport alone).

Run: python bench/pipe_transport.py [--iterations 500] [--repeats 9]

Two gloo ranks exchange an activation and a gradient (8 x 64 fp32, the size
``bench/pipeline_bubble.py`` sends) as a 1F1B steady state does: rank 0 sends the
activation while receiving a gradient, rank 1 the reverse, both at once, leaving sends
in flight. Three ways, alternating per repetition:

- ``scaling``: ``PipeTransport.exchange`` (pytree in, pytree out; cached metadata, one
  frame per message, recorded for hang diagnosis);
- ``torch``: what ``torch.distributed.pipelining`` does per hand-off: ``P2POp`` lists
  through ``batch_isend_irecv`` into a preallocated buffer, then ``detach().requires_grad_()``;
- ``c10d``: the bare ``ProcessGroup.send`` / ``recv`` pair into a fixed buffer (the floor).

Prints, per way, the median over repetitions of the wall time per exchange (the slower
rank's) and each rank's CPU time per exchange (``time.thread_time``). Every exchange is
on the critical path here, so this isolates what the transport's Python costs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from scaling.collectives import PipeTransport
from scaling.testing import make_topology, run_distributed


@dataclass
class Activation:
    x: torch.Tensor


def worker(iterations: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    topo = make_topology(pipe_parallel_size=2)
    rank, peer = topo.axis("pp").rank, 1 - topo.axis("pp").rank
    transport = PipeTransport(topo.axis("pp").previous, topo.axis("pp").next, topo.device)
    activation = torch.randn(8, 64, requires_grad=True)
    grad = torch.randn(8, 64)
    outgoing = activation.detach() if rank == 0 else grad
    buffer = torch.empty(8, 64)
    group = dist.group.WORLD
    in_flight: list[dist.Work] = []

    def scaling_exchange() -> None:
        if rank == 0:
            transport.exchange(send_forward=Activation(activation), recv_backward=True, wait_sends=False)
        else:
            transport.exchange(send_backward=[grad], recv_forward=True, wait_sends=False)

    def torch_exchange() -> None:
        ops = [dist.P2POp(dist.isend, outgoing, peer), dist.P2POp(dist.irecv, buffer, peer)]
        works = dist.batch_isend_irecv(ops)
        works[1].wait()
        in_flight.append(works[0])
        buffer.detach().requires_grad_(rank == 1)

    def c10d_exchange() -> None:
        in_flight.append(group.send([outgoing], peer, 0))
        group.recv([buffer], peer, 0).wait()

    ways = {"scaling": scaling_exchange, "torch": torch_exchange, "c10d": c10d_exchange}
    for way in ways.values():  # warm-up: the handshake, allocations
        for _ in range(20):
            way()
    transport.wait_sends()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            dist.barrier()
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(iterations):
                way()
            transport.wait_sends()
            for work in in_flight:
                work.wait()
            in_flight.clear()
            wall_us = (time.perf_counter() - start) / iterations * 1e6
            results[name].append((wall_us, (time.thread_time() - cpu) / iterations * 1e6))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    per_rank = run_distributed(worker, 2, args.iterations, args.repeats, timeout_seconds=900)
    print(f"2 ranks, {args.iterations} exchanges x {args.repeats} repetitions; median per exchange")
    print(f"{'way':8s} {'wall us':>8s} {'cpu r0 us':>10s} {'cpu r1 us':>10s} {'wall / torch':>13s}")
    walls = {
        name: statistics.median(max(a[0], b[0]) for a, b in zip(per_rank[0][name], per_rank[1][name]))
        for name in per_rank[0]
    }
    for name in per_rank[0]:
        cpu = [statistics.median(s[1] for s in per_rank[r][name]) for r in (0, 1)]
        print(f"{name:8s} {walls[name]:8.1f} {cpu[0]:10.1f} {cpu[1]:10.1f} {walls[name] / walls['torch']:13.2f}")


if __name__ == "__main__":
    main()
