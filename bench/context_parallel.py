"""Context parallelism: activation memory and step time per rank at cp 1, 2, 4 over growing sequences.

Run: python bench/context_parallel.py [--seqs 2048 4096 8192 16384] [--cps 1 2 4]
     [--methods ring all_to_all] [--hidden 256] [--heads 8] [--layers 2] [--steps 2]

A fixed model (``layers`` pre-norm blocks: RMSNorm, ``ParallelSelfAttention`` with causal
RoPE attention, RMSNorm, SwiGLU MLP; batch 1) runs forward and backward on one sequence
of each length. At cp 1 it is one process with torch's fused attention; at cp > 1 each
of ``cp`` gloo ranks holds its zigzag slice and attention runs by ring or by all-to-all.

Activation memory is what autograd keeps for the backward at the end of the forward:
the bytes of every distinct storage that a ``saved_tensors_hooks`` pack hook sees
(inputs of every layer, attention's q/k/v/output/log-sum-exp, the MLP's hidden states;
not the weights, which some layers save too).
It is deterministic and the quantity context parallelism divides; transient buffers of
one kernel are not in it. Printed per rank against the 1/cp theory (target at the
longest sequence: cp4 <= 0.30 of cp1).

Step time is the median wall time of ``steps`` forward+backward steps after one warm-up,
as a ratio against cp 1 measured in the same run. On CPU the cp ranks share the
machine's cores (two on the project's machines), so time ratios there show the
communication and bookkeeping cost, not a speed-up; on a GPU per rank they would.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from scaling.nn import AttentionConfig, ParallelSelfAttention, ParallelSwiGLUMLP, RMSNorm
from scaling.testing import make_topology, run_distributed
from scaling.topology import split_sequence


class _Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, topology: object, method: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.attention = ParallelSelfAttention(
            AttentionConfig(hidden, heads, bias=False, context_parallel_method=method), topology=topology
        )
        self.mlp = ParallelSwiGLUMLP(hidden, 4 * hidden, bias=False, topology=topology)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _run(seq: int, method: str, hidden: int, heads: int, layers: int, steps: int) -> tuple[int, float]:
    cp = dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))  # the ranks share the machine's cores
    topo = make_topology(context_parallel_size=cp)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(hidden, heads, topo, method) for _ in range(layers)])
    x_full = torch.randn(1, seq, hidden, generator=torch.Generator().manual_seed(1))
    x = split_sequence(x_full, 1, topo.axis("cp").rank, cp).requires_grad_(True)

    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:  # saved weights are not activations
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    activation_bytes = sum(storages.values())
    y.pow(2).mean().backward()

    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return activation_bytes, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--methods", nargs="+", default=["ring", "all_to_all"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    model = (args.hidden, args.heads, args.layers, args.steps)
    print(
        f"model: {args.layers} blocks, hidden {args.hidden}, {args.heads} heads, batch 1, fp32, causal; "
        f"{os.cpu_count()} cores shared by the cp ranks"
    )
    print(
        f"{'seq':>6} {'method':>10} {'cp':>3} {'act MiB/rank':>13} {'act/cp1':>8} {'1/cp':>6} {'step s':>8} {'t/cp1':>6}"
    )
    for seq in args.seqs:
        base_bytes, base_time = run_distributed(_run, 1, seq, "ring", *model, timeout_seconds=3600)[0]
        print(
            f"{seq:>6} {'-':>10} {1:>3} {base_bytes / 2**20:>13.1f} {1.0:>8.3f} {1.0:>6.3f} {base_time:>8.3f} {1.0:>6.2f}"
        )
        for method in args.methods:
            for cp in (c for c in args.cps if c > 1):
                results = run_distributed(_run, cp, seq, method, *model, timeout_seconds=3600)
                act = max(r[0] for r in results)
                step = max(r[1] for r in results)
                print(
                    f"{seq:>6} {method:>10} {cp:>3} {act / 2**20:>13.1f} {act / base_bytes:>8.3f} {1 / cp:>6.3f} "
                    f"{step:>8.3f} {step / base_time:>6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
