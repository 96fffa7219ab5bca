"""Float8 per linear layer of a transformer block: where it pays and where it costs (issue 55).

Run: python bench/float8_layers.py [--hidden 2048] [--ffn 5632] [--heads 16] [--kv-heads 16]
     [--tokens 8192] [--device cuda|cpu] [--dtype bf16] [--scaling tensorwise|rowwise] [--iters 10]
     [--compile]

For each linear of one Llama-style block (the fused QKV projection, the attention output,
the MLP's gate, up and down projections) at ``--tokens`` tokens, it times forward + backward
of the layer in ``--dtype`` (``F.linear`` through autograd: the reference) and in float8
(``scaling.nn.float8_linear``, the product the transformer app's float8 linears run), in
one run, alternating the two. It prints each layer's milliseconds, the ratio float8 /
reference (below 1: float8 pays), the share of the float8 time spent outside the three
products (the casts, amax and scales: the same layer timed with its products only, through
``torch._scaled_mm`` on operands cast once), and the layer's FLOPs. ``--compile`` compiles both
sides' layer (``torch.compile``, inductor), as the app's compiled float8 step runs it: eager, the
casts and amax are a dozen unfused elementwise kernels around each product. On CPU torch's float8
products are slow reference kernels, so read the CPU table as the bench working, not as
figures; the figures are a card's (``scripts/gpu_check``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from scaling.nn import Float8Config, float8_linear
from scaling.nn._float8 import E4M3

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def layers(hidden: int, ffn: int, heads: int, kv_heads: int) -> dict[str, tuple[int, int]]:
    """``name -> (in_features, out_features)`` of one block's linears."""
    head_dim = hidden // heads
    return {
        "attention.qkv": (hidden, (heads + 2 * kv_heads) * head_dim),
        "attention.dense": (hidden, hidden),
        "mlp.gate_proj": (hidden, ffn),
        "mlp.up_proj": (hidden, ffn),
        "mlp.down_proj": (ffn, hidden),
    }


def measure(
    shape: tuple[int, int],
    tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    scaling: str,
    iters: int,
    compile: bool = False,
) -> dict[str, float]:
    """Median seconds of forward + backward: reference, float8, float8's products alone."""
    in_f, out_f = shape
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, in_f, dtype=dtype, device=device, generator=generator, requires_grad=True)
    w = (torch.randn(out_f, in_f, dtype=dtype, device=device, generator=generator) / in_f**0.5).requires_grad_()
    grad = torch.randn(tokens, out_f, dtype=dtype, device=device, generator=generator)
    config = Float8Config(enabled=True, scaling=scaling)  # type: ignore[arg-type]
    # The three products alone, on operands cast to float8 once (what the products cost
    # without the casts, amax and scales around them; tensorwise, unit scales).
    x8, w8, g8 = (t.detach().to(E4M3) for t in (x, w, grad))
    one = torch.ones((), device=device)

    def products() -> None:
        torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=dtype)  # forward
        torch._scaled_mm(g8, w8.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=dtype)  # input grad
        torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=dtype)

    def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.linear(a, b)

    def low(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return float8_linear(a, b, None, config)

    ref_fn, fp8_fn = (torch.compile(reference), torch.compile(low)) if compile else (reference, low)
    sides: dict[str, Callable[[], object]] = {
        "reference": lambda: torch.autograd.backward(ref_fn(x, w), grad),
        "float8": lambda: torch.autograd.backward(fp8_fn(x, w), grad),
        "products": products,
    }
    for fn in sides.values():  # warm-up (and, with compile, the compilation)
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(iters):
        for name in sides if i % 2 == 0 else list(sides)[::-1]:
            x.grad = w.grad = None
            times[name].append(_time(sides[name], device))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (multi-head attention)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch (a multiple of 16)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--scaling", choices=("tensorwise", "rowwise"), default="tensorwise")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="compile each side's layer (inductor), as the app does")
    a = p.parse_args()
    if a.tokens % 16:
        p.error(f"--tokens={a.tokens} must be a multiple of 16 (float8 products take no other)")
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    print(
        f"one block: hidden {a.hidden}, ffn {a.ffn}, heads {a.heads}/{a.kv_heads or a.heads} kv, {a.tokens} tokens, "
        f"{a.dtype} reference, float8 {a.scaling}, {device}; forward + backward{', compiled' if a.compile else ''}, "
        f"median of {a.iters}"
    )
    print(
        f"{'layer':16s} {'in x out':>13s} {'GFLOP':>7s} {'ref ms':>9s} {'fp8 ms':>9s} {'fp8/ref':>8s} {'outside products':>17s}"
    )
    total = {"reference": 0.0, "float8": 0.0}
    for name, (in_f, out_f) in layers(a.hidden, a.ffn, a.heads, a.kv_heads or a.heads).items():
        t = measure((in_f, out_f), a.tokens, dtype, device, a.scaling, a.iters, a.compile)
        total["reference"] += t["reference"]
        total["float8"] += t["float8"]
        outside = max(0.0, 1 - t["products"] / t["float8"])
        gflop = 6 * a.tokens * in_f * out_f / 1e9
        print(
            f"{name:16s} {f'{in_f}x{out_f}':>13s} {gflop:7.2f} {t['reference'] * 1e3:9.3f} {t['float8'] * 1e3:9.3f} "
            f"{t['float8'] / t['reference']:8.3f} {outside:16.0%}"
        )
    print(f"{'block linears':16s} {'':>13s} {'':>7s} {total['reference'] * 1e3:9.3f} {total['float8'] * 1e3:9.3f} "
          f"{total['float8'] / total['reference']:8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
