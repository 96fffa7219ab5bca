"""Ring attention's block kernels on one device: the fused kernel each ring step calls, against
the same block written out (what CUDA ran before 2026-11-27) and against
``F.scaled_dot_product_attention`` on the same block (the reference), in one run.

Run: python bench/ring_block_kernels.py [--seqs 2048 4096 8192] [--heads 16] [--head-dim 128]
     [--device cuda|cpu] [--dtype bf16|fp32] [--iters 5]

For each block length ``s`` (the tokens a CP rank holds) and each block shape a zigzag
ring computes (``causal``: a rank's own block, ``s x s`` under the causal mask; ``full``:
a block of earlier tokens, ``s x s`` all visible) it times forward + backward of
``block_attention_forward`` / ``block_attention_backward`` (fused: on CUDA the flash kernel
for fp16/bf16, the memory-efficient one for fp32; on CPU torch's flash kernel) and of the
written-out fp32 block (``math_attention_*``), and forward + backward of SDPA through
autograd. It prints milliseconds (median of ``iters`` after one warm-up), the ratios
fused / SDPA (target: about 1) and written-out / fused, the peak memory of each side above
what the inputs hold (CUDA only), and the largest difference of the fused side's output and
gradients from the written-out side's (both see the same inputs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from scaling.nn._attention_kernels import (
    _kernel,
    block_attention_backward,
    block_attention_forward,
    math_attention_backward,
    math_attention_forward,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _time(fn: Callable[[], object], iters: int, device: torch.device) -> tuple[float, int]:
    """Median ms of ``fn`` over ``iters`` calls after one warm-up, and its peak bytes (CUDA) above the start."""
    fn()
    times, peak = [], 0
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), peak


def _measure(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, causal: bool, iters: int
) -> tuple[list[tuple[float, int]], float]:
    """(ms, peak bytes) of fused, written-out and SDPA forward + backward; the fused side's largest difference."""
    scale = q.shape[-1] ** -0.5
    results: dict[str, tuple[torch.Tensor, ...]] = {}

    def fused() -> None:
        out, lse = block_attention_forward(q, k, v, None, causal, scale)
        results["fused"] = (out, *block_attention_backward(grad, q, k, v, out, lse, None, causal, scale))

    def written_out() -> None:
        out, lse = math_attention_forward(q, k, v, None, causal, scale)
        results["math"] = (out, *math_attention_backward(grad, q, k, v, out, lse, None, causal, scale))

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def sdpa() -> None:
        for leaf in leaves:
            leaf.grad = None
        F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale).backward(grad)

    figures = [_time(fn, iters, q.device) for fn in (fused, written_out, sdpa)]
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(results["fused"], results["math"]))
    return figures, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192] if cuda else [1024, 2048])
    parser.add_argument("--heads", type=int, default=16 if cuda else 8)
    parser.add_argument("--head-dim", type=int, default=128 if cuda else 64)
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16" if cuda else "fp32")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(1)  # one thread, as the other CPU benches: steadier figures
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{args.dtype}, torch {torch.__version__}, batch 1, {args.heads} heads of {args.head_dim}")  # fmt: skip
    header = "| s | block | kernel | fused ms | written-out ms | SDPA ms | fused / SDPA | written-out / fused |"
    print(header + (" peak MiB fused / written-out / SDPA |" if device.type == "cuda" else "") + " max diff |")
    print("|" + "---|" * (header.count("|") - 1 + (1 if device.type == "cuda" else 0) + 1))
    for s in args.seqs:
        g = torch.Generator(device=device).manual_seed(s)
        q, k, v, grad = (
            torch.randn(1, args.heads, s, args.head_dim, generator=g, device=device, dtype=dtype) for _ in range(4)
        )
        for block, causal in (("causal", True), ("full", False)):
            ((t_fused, m_fused), (t_math, m_math), (t_sdpa, m_sdpa)), diff = _measure(q, k, v, grad, causal, args.iters)
            row = (
                f"| {s} | {block} | {_kernel(q, None)} | {t_fused:.2f} | {t_math:.2f} | {t_sdpa:.2f} | "
                f"{t_fused / t_sdpa:.3f} | {t_math / t_fused:.2f} |"
            )
            if device.type == "cuda":
                row += f" {m_fused / 2**20:.0f} / {m_math / 2**20:.0f} / {m_sdpa / 2**20:.0f} |"
            print(row + f" {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
