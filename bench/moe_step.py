"""Mixture of experts: an MoE block's step at ep 1, 2, 4 against the dense block of the same active size.

Run: python bench/moe_step.py [--hidden 256] [--ffn 512] [--experts 8] [--top-k 2] [--tokens 4096]
     [--eps 1 2 4] [--steps 5] [--device cpu|cuda] [--dtype fp32|bf16]

Every rank trains its own ``tokens`` (a data-parallel batch) through one block, forward
and backward, in the same run:

- dense reference: ``ParallelSwiGLUMLP(hidden, top_k * ffn)``, one process: the same
  active parameters per token as the MoE block;
- MoE: ``ParallelMoE(MoEConfig(hidden, ffn, experts, top_k))`` with auxiliary-loss balancing at
  expert-parallel size 1 (one process), 2 and 4 (gloo ranks, experts split over them,
  tokens exchanged by all-to-all); in bf16 its experts run as grouped matrix multiplies
  (``torch._grouped_mm``, ``grouped_gemm=True``: on any device, though by default only on CUDA);
- MoE, loop (ep 1): the same block with ``grouped_gemm=False``, a loop over the experts, so
  ``grouped / loop`` is their ratio (in bf16; in fp32 both loop).

``--device cuda`` runs the ep 1 rows on one GPU (an NCCL group of one; ``--dtype bf16`` for
the grouped kernel of Hopper GPUs); ep > 1 needs as many GPUs and is skipped there.

It prints tokens/s per rank (median of ``steps`` after a warm-up, the slowest rank), over
all ranks (per rank × ep), and that as a ratio against the dense block, and the all-to-all's share of the MoE step: the four token
exchanges a step makes (dispatch and combine, forward and backward), timed alone on
the same split sizes, over the step time; on CUDA also the peak device memory of the step
(``torch.cuda.max_memory_allocated``: the block, its gradients and what autograd saves). The ranks share this machine's cores (each gets
``cores // ep`` threads, at least 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from scaling.collectives import all_to_all_tokens
from scaling.nn import MoEConfig, ParallelMoE, ParallelSwiGLUMLP
from scaling.testing import make_topology, run_distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _time(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _run(
    kind: str, hidden: int, ffn: int, experts: int, top_k: int, tokens: int, steps: int, device: str, dtype: str
) -> tuple[float, float, float]:
    ep = dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ep))
    topo = make_topology(data_parallel_size=ep, expert_parallel_size=ep, device=device)
    torch.manual_seed(0)
    if kind == "dense":
        block: torch.nn.Module = ParallelSwiGLUMLP(hidden, top_k * ffn, bias=False, dtype=DTYPES[dtype])
    else:
        block = ParallelMoE(
            MoEConfig(hidden, ffn, experts, top_k=top_k, dtype=DTYPES[dtype], grouped_gemm=kind != "moe-loop"),
            topology=topo,
        )
    block.to(device)
    g = torch.Generator().manual_seed(topo.global_rank)
    x = torch.randn(1, tokens, hidden, generator=g).to(device, DTYPES[dtype])

    def step() -> None:
        block.zero_grad(set_to_none=True)
        block(x).pow(2).mean().backward()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_time = _time(step, steps)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else 0.0  # 0: not measured
    comm_time = 0.0
    if kind == "moe" and ep > 1:
        # The exchanges of one step, on this step's split sizes: dispatch + combine, forward + backward.
        top = block._route(x)[1]
        counts = torch.bincount(top.flatten(), minlength=experts)
        local = experts // ep
        recv = all_to_all_tokens(counts, [local] * ep, [local] * ep, topo.axis("ep").group)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = recv.view(ep, local).sum(1).tolist()
        rows = torch.randn(tokens * top_k, hidden)
        back = torch.randn(sum(recv_splits), hidden)

        def exchanges() -> None:
            for _ in range(2):
                all_to_all_tokens(rows, recv_splits, send_splits, topo.axis("ep").group)
                all_to_all_tokens(back, send_splits, recv_splits, topo.axis("ep").group)

        comm_time = _time(exchanges, steps)
    return step_time, comm_time, peak


def _mib(peak: float) -> str:
    return f"{peak:>9.0f}" if peak else f"{'-':>9}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    args = parser.parse_args()
    shape = (args.hidden, args.ffn, args.experts, args.top_k, args.tokens, args.steps, args.device, args.dtype)
    backend = "nccl" if args.device == "cuda" else "gloo"
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{os.cpu_count()} cores shared by the ranks"
    print(
        f"block: hidden {args.hidden}, expert ffn {args.ffn}, {args.experts} experts, top-{args.top_k}, "
        f"{args.tokens} tokens per rank, {args.dtype}; dense reference: SwiGLU ffn {args.top_k * args.ffn}; {where}"
    )
    ((dense, _, dense_peak),) = run_distributed(_run, 1, "dense", *shape, backend=backend, timeout_seconds=1800)
    head = f"{'block':>8} {'ep':>3} {'step s':>8} {'tokens/s/rank':>14} {'all ranks':>10} {'/ dense':>8}"
    print(f"{head} {'all-to-all share':>17} {'peak MiB':>9}")
    row = f"{'dense':>8} {1:>3} {dense:>8.4f} {args.tokens / dense:>14.0f} {args.tokens / dense:>10.0f} {1.0:>8.3f}"
    print(f"{row} {'-':>17} {_mib(dense_peak)}")
    runs = [("moe-loop", 1)] + [("moe", ep) for ep in args.eps if args.device == "cpu" or ep == 1]
    for kind, ep in runs:
        results = run_distributed(_run, ep, kind, *shape, backend=backend, timeout_seconds=1800)
        step, comm, peak = (max(r[i] for r in results) for i in range(3))
        share = f"{comm / step:.3f}" if ep > 1 else "-"
        rate = args.tokens / step
        row = f"{kind:>8} {ep:>3} {step:>8.4f} {rate:>14.0f} {rate * ep:>10.0f} {rate * ep * dense / args.tokens:>8.3f}"
        print(f"{row} {share:>17} {_mib(peak)}", flush=True)
        if kind == "moe-loop":
            loop = step
        elif ep == 1:
            print(f"grouped / loop (ep 1): {step / loop:.3f}", flush=True)


if __name__ == "__main__":
    main()
