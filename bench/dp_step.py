"""Our data-parallel training step against DistributedDataParallel + torch.optim.AdamW, same run.

Run: python bench/dp_step.py [--hidden 512] [--layers 4] [--batch 32] [--steps 20]

Two gloo ranks hold three identical MLPs: one wrapped in ``DistributedDataParallel``
with ``torch.optim.AdamW`` (the reference), one trained by ``scaling.optim.Optimizer``
with ZeRO 0 (plain DP) and one with ZeRO 1. A step is zero_grad, forward, backward
and the optimizer step, on the same local batch. Steps rotate through the three
(reference first and last in each round, so drifting machine load hits all of them);
the table shows each one's median step time and its ratio to the reference.
Goals from issue 5: ratio <= 1.05 for plain DP and <= 1.15 for ZeRO-1.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from scaling.nn import ParameterMeta
from scaling.optim import Optimizer, OptimizerConfig, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.testing import make_topology, run_distributed

BUCKET_BYTES = 1024 * 1024  # 1 MiB: several buckets, so reduction overlaps backward (DDP: 1 MiB first bucket, then 25)


def _mlp(hidden: int, layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def _ours(model: torch.nn.Sequential, zero: int, topo) -> Optimizer:  # noqa: ANN001
    triples = []
    for name, p in model.named_parameters():
        index, local = name.split(".", 1)
        meta = ParameterMeta(local, tuple(p.shape), layer_index=int(index)).attach(p).parameter_meta
        triples.append((meta.key, p, meta))
    config = OptimizerConfig(zero_stage=zero, allreduce_bucket_size=BUCKET_BYTES)
    group = OptimizerParamGroup(triples, OptimizerParamGroupConfig(name="all", weight_decay=0.01))
    return Optimizer(config=config, parameter_groups=[group], topology=topo)


def measure(hidden: int, layers: int, batch: int, steps: int) -> dict[str, float]:
    topo = make_topology()
    x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(topo.data_parallel_rank))
    ddp = DistributedDataParallel(_mlp(hidden, layers), process_group=topo.data_parallel_group, bucket_cap_mb=25)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.01)
    plain, zero1 = _mlp(hidden, layers), _mlp(hidden, layers)
    plain_opt, zero1_opt = _ours(plain, 0, topo), _ours(zero1, 1, topo)

    def ref_step() -> None:
        ref_opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        ref_opt.step()

    def our_step(model: torch.nn.Module, opt: Optimizer) -> None:
        opt.zero_grad()
        opt.backward(model(x).pow(2).mean())
        opt.step()

    runs = {
        "ddp+AdamW": ref_step,
        "ours ZeRO-0": lambda: our_step(plain, plain_opt),
        "ours ZeRO-1": lambda: our_step(zero1, zero1_opt),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = ["ddp+AdamW", "ours ZeRO-0", "ours ZeRO-1", "ours ZeRO-1", "ours ZeRO-0", "ddp+AdamW"]
    for i in range(steps + 2):
        for name in order:
            torch.distributed.barrier(group=topo.data_parallel_group)
            start = time.perf_counter()
            runs[name]()
            if i >= 2:  # the first rounds warm up allocators and gloo
                times[name].append(time.perf_counter() - start)
    # the parameters agree (same init, same batches, same update rule up to rounding)
    diff = max((a - b).abs().max().item() for a, b in zip(ddp.module.parameters(), plain.parameters()))
    return {**{k: statistics.median(v) for k, v in times.items()}, "max_param_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    results = run_distributed(measure, 2, args.hidden, args.layers, args.batch, args.steps, timeout_seconds=600)
    r = results[0]
    psi = args.layers * (args.hidden * args.hidden + args.hidden)
    print(
        f"2 gloo ranks, MLP {args.layers}x{args.hidden} (Ψ = {psi:,}), local batch {args.batch}, median of "
        f"{2 * args.steps} steps each"
    )
    for name in ("ddp+AdamW", "ours ZeRO-0", "ours ZeRO-1"):
        print(f"{name:>12}: {r[name] * 1e3:8.2f} ms/step  ratio {r[name] / r['ddp+AdamW']:.3f}")
    print(f"max |param diff| ours ZeRO-0 vs DDP after all steps: {r['max_param_diff']:.2e}")


if __name__ == "__main__":
    main()
