"""ZeRO-3 training step: scaling.optim against FSDP2 (``fully_shard`` + ``torch.optim.AdamW``), gloo ranks.

Run: python bench/zero3_step.py [--hidden 512] [--blocks 4] [--batch 32] [--steps 10] [--worlds 2 4] [--no-hsdp]

Every rank builds the same MLP (``blocks`` × [Linear(h, 4h), GELU, Linear(4h, h)]) from
one seed and trains it on the same batches two ways in one process, alternating in
rounds so both see the same machine load:

- ours: ``scaling.optim.Optimizer(zero_stage=3)`` with the blocks as units (gather per
  block with prefetch, freed after forward, re-gathered for backward, gradients
  reduce-scattered in backward), fp32 AdamW;
- reference: ``fully_shard`` on each block and on the root (FSDP2's defaults:
  ``reshard_after_forward=True``, prefetch of the next block), ``torch.optim.AdamW``
  (``foreach=True``).

A last row runs both as HSDP on 4 ranks (shard over 2, replicate twice): ours with
``data_parallel_shard_size=2``, FSDP2 on a 2-D ``("replicate", "shard")`` mesh.

It prints the median step time of each and the ratio ours / FSDP2 (target: <= 1.00), and
the largest relative difference of the losses (both start from the same weights, so the
runs must agree to fp32 rounding).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

from scaling.nn import ParameterMeta
from scaling.optim import Optimizer, OptimizerConfig, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.testing import make_topology, run_distributed

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.0


def _model(hidden: int, blocks: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[
            torch.nn.Sequential(
                torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
            )
            for _ in range(blocks)
        ]
    )


def _ours(
    model: torch.nn.Sequential, shard: int | None, offload: bool = False, device: torch.device | None = None
) -> Optimizer:
    """ZeRO-3 AdamW over ``model``'s blocks as units (``offload``: bench/offload_step.py's sides)."""
    triples = []
    for index, block in enumerate(model):
        for name, p in block.named_parameters():
            meta = ParameterMeta(name, tuple(p.shape), layer_index=index).attach(p).parameter_meta
            triples.append((meta.key, p, meta))
    config = OptimizerConfig(zero_stage=3, cpu_offload=offload, method="adamw", beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    group = OptimizerParamGroup(
        triples,
        OptimizerParamGroupConfig(
            name="all", weight_decay=WD, learning_rate_scheduler={"learning_rate": LR, "learning_rate_minimum": 0.0}
        ),
    )
    topology = make_topology(data_parallel_shard_size=shard, device=(device or torch.device("cpu")).type)
    return Optimizer(config, [group], topology, zero3_modules=list(model))


def _fsdp2(model: torch.nn.Sequential, shard: int | None) -> torch.optim.Optimizer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if shard is None:
        mesh = init_device_mesh("cpu", (world,))
    else:  # HSDP: replicate across the first dim, shard along the second
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)


def measure(
    hidden: int, blocks: int, batch: int, steps: int, rounds: int, shard: int | None = None
) -> dict[str, list[float]]:
    ours_model = _model(hidden, blocks)
    ref_model = copy.deepcopy(ours_model)
    ours, ref = _ours(ours_model, shard), _fsdp2(ref_model, shard)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    data = [torch.randn(batch, hidden, generator=gen) for _ in range(steps)]

    def ours_step(x: torch.Tensor) -> float:
        ours.zero_grad()
        loss = ours_model(x).pow(2).mean()
        ours.backward(loss)
        ours.step()
        return loss.item()

    def ref_step(x: torch.Tensor) -> float:
        ref.zero_grad()
        loss = ref_model(x).pow(2).mean()
        loss.backward()
        ref.step()
        return loss.item()

    out: dict[str, list[float]] = {"ours": [], "fsdp2": [], "loss_ours": [], "loss_fsdp2": []}
    for name, step in (("ours", ours_step), ("fsdp2", ref_step)):  # warm-up, and the losses to compare
        out[f"loss_{name}"] = [step(x) for x in data[:3]]
    for _ in range(rounds):
        for name, step in (("ours", ours_step), ("fsdp2", ref_step)):
            dist.barrier()
            start = time.perf_counter()
            for x in data:
                step(x)
            dist.barrier()
            out[name].append((time.perf_counter() - start) / len(data))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-hsdp", action="store_true", help="skip the HSDP (2 x 2) row")
    args = parser.parse_args()
    params = args.blocks * (8 * args.hidden * args.hidden + 5 * args.hidden)
    print(f"fp32 AdamW, {params / 1e6:.1f}M parameters in {args.blocks} blocks, batch {args.batch} per rank")
    print(f"{'ranks':>9} {'ours ms':>9} {'FSDP2 ms':>9} {'ratio':>7} {'loss diff':>10}")
    runs = [(world, None, str(world)) for world in args.worlds] + ([] if args.no_hsdp else [(4, 2, "4 (2x2)")])
    for world, shard, label in runs:
        sizes = (args.hidden, args.blocks, args.batch, args.steps, args.rounds, shard)
        r = run_distributed(measure, world, *sizes, timeout_seconds=900)[0]
        ours, ref = statistics.median(r["ours"]), statistics.median(r["fsdp2"])
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["loss_ours"], r["loss_fsdp2"]))
        print(f"{label:>9} {ours * 1e3:>9.2f} {ref * 1e3:>9.2f} {ours / ref:>7.3f} {diff:>10.1e}")


if __name__ == "__main__":
    main()
