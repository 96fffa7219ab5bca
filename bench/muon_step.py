"""Muon's training step against AdamW's, and against torch.optim.Muon, gloo ranks on CPU.

Run: python bench/muon_step.py [--hidden 512] [--blocks 4] [--batch 32] [--steps 10] [--worlds 1 2] [--zero 1]

Every rank builds the same MLP (``blocks`` × [Linear(h, 4h), GELU, Linear(4h, h)]) and trains it
on the same batches, alternating in rounds so every side sees the same machine load:

- ``adamw``: ``scaling.optim.Optimizer`` with AdamW (the fused kernel) on every parameter;
- ``muon``: the same with ``method="muon"``: Muon (bfloat16 Newton-Schulz, 5 steps) on the
  matrices, AdamW on the biases;
- ``muon_fp32``: the same with float32 Newton-Schulz (on a CPU without bfloat16 matrix units
  far faster than bfloat16);
- ``torch``: one process only: ``torch.optim.Muon`` on the matrices and ``torch.optim.AdamW``
  (``foreach``) on the biases, the reference of the same arithmetic.

It prints the median step time (forward, backward, step) of each, and the ratios muon/adamw
(the price of orthogonalising: on CPU mostly the Newton-Schulz matrix products, 5 × 3 per
matrix) and muon/torch (target: <= 1.05: the gathers and the update routing cost nothing at
one rank). On more ranks with ZeRO each matrix is gathered on one rank of the shard group,
round-robin, which orthogonalises it and scatters the result (DistMuon's division): each rank
runs about 1 / DP of the products.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scaling.nn import ParameterMeta
from scaling.optim import (
    LearningRateSchedulerConfig,
    MuonConfig,
    Optimizer,
    OptimizerConfig,
    OptimizerParamGroup,
    OptimizerParamGroupConfig,
)
from scaling.testing import make_topology, run_distributed

LR = 1e-3


def _model(hidden: int, blocks: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    model = torch.nn.Sequential(*layers)
    for index, layer in enumerate(model):
        for name, p in layer.named_parameters():
            ParameterMeta(name, tuple(p.shape), layer_index=index).attach(p)
    return model


def _ours(method: str, hidden: int, blocks: int, zero: int, ns_dtype: str = "bfloat16"):
    model = _model(hidden, blocks)
    triples = [(p.parameter_meta.key, p, p.parameter_meta) for p in model.parameters()]
    schedule = LearningRateSchedulerConfig(learning_rate=LR)
    group = OptimizerParamGroup(
        triples, OptimizerParamGroupConfig(name="all", weight_decay=0.01, learning_rate_scheduler=schedule)
    )
    config = OptimizerConfig(method=method, zero_stage=zero, muon=MuonConfig(ns_dtype=ns_dtype))
    optimizer = Optimizer(config=config, parameter_groups=[group], topology=make_topology())

    def step(x: torch.Tensor) -> float:
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        optimizer.backward(loss)
        optimizer.step()
        return loss.item()

    return step


def _torch(hidden: int, blocks: int):
    model = _model(hidden, blocks)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(vectors, lr=LR, weight_decay=0.01)

    def step(x: torch.Tensor) -> float:
        muon.zero_grad()
        adamw.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        muon.step()
        adamw.step()
        return loss.item()

    return step


def _worker(hidden: int, blocks: int, batch: int, steps: int, zero: int) -> dict[str, float]:
    topo = make_topology()
    sides = {
        "adamw": _ours("adamw", hidden, blocks, zero),
        "muon": _ours("muon", hidden, blocks, zero),
        "muon_fp32": _ours("muon", hidden, blocks, zero, "float32"),
    }
    if topo.axis("dp").size == 1 and hasattr(torch.optim, "Muon"):
        sides["torch"] = _torch(hidden, blocks)
    g = torch.Generator().manual_seed(topo.axis("dp").rank)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(steps + 2):  # two warm-up rounds
        x = torch.randn(batch, hidden, generator=g)
        for name, step in sides.items():
            start = time.perf_counter()
            step(x)
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--zero", type=int, default=1, help="ZeRO stage of the runs on more than one rank")
    args = parser.parse_args()
    params = args.blocks * (8 * args.hidden**2 + 5 * args.hidden)
    print(f"MLP {args.blocks} blocks, hidden {args.hidden} ({params / 1e6:.1f}M parameters), batch {args.batch}")
    for world in args.worlds:
        zero = args.zero if world > 1 else 0
        result = run_distributed(
            _worker, world, args.hidden, args.blocks, args.batch, args.steps, zero, timeout_seconds=600
        )[0]
        row = ", ".join(f"{name} {ms:.1f} ms" for name, ms in result.items())
        ratios = f"muon/adamw = {result['muon'] / result['adamw']:.2f}, muon_fp32/adamw = "
        ratios += f"{result['muon_fp32'] / result['adamw']:.2f}"
        if "torch" in result:
            ratios += f", muon/torch = {result['muon'] / result['torch']:.2f}"
        print(f"{world} rank(s), ZeRO-{zero}: {row}; {ratios}")


if __name__ == "__main__":
    main()
