"""Tensor-parallel blocks: scaling.nn's linears against torch's ``parallelize_module``, gloo ranks.

Run: python bench/tp_step.py [--hidden 512] [--heads 8] [--batch 4] [--seq 256] [--iters 10] [--worlds 2 4]

Every rank builds the same two blocks from one seed, and splits them two ways over all
ranks (TP = world size):

- MLP: ``Linear(h, 4h) -> GELU -> Linear(4h, h)``;
- attention: ``q, k, v = Linear(h, h) x 3 -> causal SDPA over the local heads -> Linear(h, h)``.

ours: ``ColumnParallelLinear`` for the first linears, ``RowParallelLinear`` for the last
(weights copied in through ``init_method``); reference: ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` on a 1-D ``DeviceMesh`` (DTensor parameters,
local outputs). With ``--sp`` rows (on by default) both also run sequence parallel: ours
with ``sequence_parallel=True``, torch with ``ColwiseParallel(input_layouts=Shard(1))`` and
``RowwiseParallel(output_layouts=Shard(1))``; the input is then this rank's sequence slice.

It times forward + backward of each block in fp32 (the two sides alternate in rounds so
they see the same machine load), prints the median per iteration and the ratio ours / torch
(target: <= 1.00), and checks parity on the same weights in float64, so that the check is
of the math and not of fp32's summation order: outputs and every local weight and bias
gradient agree within 1e-6 of the largest magnitude of the output or of the layer's weight
gradient, or the script exits 1 (fp32 runs agree to about 1e-6 as well: summation order).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaling.nn import ColumnParallelLinear, RowParallelLinear, reduce_sequence_parallel_gradients
from scaling.testing import make_topology, run_distributed

TOLERANCE = 1e-6


class Mlp(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Attention(torch.nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.head_dim = h // heads
        self.q, self.k, self.v, self.out = (torch.nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, s = q.shape[:2]  # the whole sequence: sequence parallelism gathers it in the column linears

        def heads(t: torch.Tensor) -> torch.Tensor:  # -1: the heads this rank holds
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


COLUMN = {"mlp": ["up"], "attention": ["q", "k", "v"]}
ROW = {"mlp": ["down"], "attention": ["out"]}


def _full(kind: str, h: int, heads: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return (Mlp(h) if kind == "mlp" else Attention(h, heads)).to(dtype)


def _ours(kind: str, h: int, heads: int, sp: bool, dtype: torch.dtype) -> torch.nn.Module:
    model, topology = _full(kind, h, heads, dtype), make_topology(model_parallel_size=dist.get_world_size())
    for name in COLUMN[kind] + ROW[kind]:
        full = model.get_submodule(name)
        cls = ColumnParallelLinear if name in COLUMN[kind] else RowParallelLinear
        linear = cls(
            full.in_features,
            full.out_features,
            topology=topology,
            sequence_parallel=sp,
            dtype=dtype,
            init_method=lambda w, full=full: w.copy_(full.weight.detach()),
            bias_init_method=lambda b, full=full: b.copy_(full.bias.detach()),
        )
        setattr(model, name, linear)
    return model


def _torch(kind: str, h: int, heads: int, sp: bool, dtype: torch.dtype) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _full(kind, h, heads, dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    col = ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel()
    row = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    plan = {**{n: col for n in COLUMN[kind]}, **{n: row for n in ROW[kind]}}
    return parallelize_module(model, mesh, plan)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _worst(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    """Largest difference of ``a`` and ``b`` relative to the largest magnitude in ``scale``."""
    return float((a - b).abs().max() / scale.abs().max().clamp_min(1e-30))


def _step(model: torch.nn.Module, x: torch.Tensor, reduce_sp_grads: bool) -> torch.Tensor:
    y = model(x)
    y.pow(2).mean().backward()
    if reduce_sp_grads:
        # The row linear's replicated bias saw this rank's sequence slice only: its gradient
        # is summed over TP (what the optimizer does; DTensor does it inside backward).
        reduce_sequence_parallel_gradients(model, dist.group.WORLD)
    return y.detach()


def _input(batch: int, seq: int, h: int, sp: bool, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(batch, seq, h, generator=torch.Generator().manual_seed(7), dtype=dtype)
    return x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous() if sp else x


def parity(kind: str, h: int, heads: int, batch: int, seq: int, sp: bool) -> float:
    """Largest difference of outputs and local gradients, in float64 (the math, not fp32 rounding)."""
    dtype = torch.float64
    ours, ref = _ours(kind, h, heads, sp, dtype), _torch(kind, h, heads, sp, dtype)
    x = _input(batch, seq, h, sp, dtype)
    out_ours, out_ref = _step(ours, x, sp), _step(ref, x, False)
    worst = _worst(out_ours, out_ref, out_ref)
    for name in COLUMN[kind] + ROW[kind]:
        # Relative to the layer's largest weight gradient: some entries are zero in exact
        # arithmetic (a key bias does not change the softmax) and only rounding is left there.
        scale = _local(ref.get_submodule(name).weight.grad)
        for p in ("weight", "bias"):
            mine = ours.get_submodule(name).get_parameter(p).grad
            theirs = _local(ref.get_submodule(name).get_parameter(p).grad)
            worst = max(worst, _worst(mine, theirs, scale))
    return worst


def measure(kind: str, h: int, heads: int, batch: int, seq: int, iters: int, rounds: int, sp: bool) -> dict[str, Any]:
    worst = parity(kind, h, heads, batch, seq, sp)
    dtype = torch.float32
    ours, ref = _ours(kind, h, heads, sp, dtype), _torch(kind, h, heads, sp, dtype)
    x = _input(batch, seq, h, sp, dtype)
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for model in (ours, ref):  # warm-up
        _step(model, x, sp and model is ours)
    for _ in range(rounds):
        for name, model in (("ours", ours), ("torch", ref)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                model.zero_grad(set_to_none=True)
                _step(model, x, sp and model is ours)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / iters)
    return {"ours": statistics.median(times["ours"]), "torch": statistics.median(times["torch"]), "worst": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-sp", action="store_true", help="skip the sequence-parallel rows")
    args = parser.parse_args()
    print(
        f"fp32 timings, float64 parity; hidden {args.hidden}, {args.heads} heads, batch {args.batch} x seq {args.seq}; forward + backward"
    )
    print(f"{'block':>10} {'sp':>3} {'ranks':>5} {'ours ms':>9} {'torch ms':>9} {'ratio':>7} {'max rel diff':>13}")
    failed = False
    for world in args.worlds:
        for kind in ("mlp", "attention"):
            for sp in (False,) if args.no_sp else (False, True):
                sizes = (kind, args.hidden, args.heads, args.batch, args.seq, args.iters, args.rounds, sp)
                r = run_distributed(measure, world, *sizes, timeout_seconds=900)[0]
                failed |= r["worst"] > TOLERANCE
                print(
                    f"{kind:>10} {'yes' if sp else 'no':>3} {world:>5} {r['ours'] * 1e3:>9.2f} "
                    f"{r['torch'] * 1e3:>9.2f} {r['ours'] / r['torch']:>7.3f} {r['worst']:>13.1e}"
                )
    if failed:
        print(f"parity FAILED: a difference above {TOLERANCE:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
