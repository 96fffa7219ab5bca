"""Our data-parallel training step against DistributedDataParallel + torch.optim.AdamW(fused=True), same run.

Run: python bench/dp_step.py [--hidden 512] [--layers 4] [--batch 32] [--steps 40] [--block 4] [--micro-batches 1]

Two gloo ranks hold five identical MLPs: one wrapped in ``DistributedDataParallel``
with ``torch.optim.AdamW(fused=True)`` (the reference, what a DDP user picks; our update
runs the same fused kernel and is bitwise equal to it), one wrapped the same way with the
default ``torch.optim.AdamW`` (its single-tensor update on CPU, shown for context), and
three trained by ``scaling.optim.Optimizer``:
ZeRO 0 (plain DP), ZeRO 1, and ZeRO 1 with ``overlap_param_gather`` (the all-gather of
updated shards finishes in the next forward's pre-hooks, Megatron-LM's
``--overlap-param-gather``). A step is zero_grad, forward, backward and the optimizer
step, on the same local batch. A sample is ``--block`` consecutive steps of one run,
ending with ``finish_parameter_gather()`` for ours, so a gather left in flight is paid
for inside the sample that started it (never hidden in another run's time). Samples
rotate through the five (the reference first and last in each round, so drifting machine
load hits all of them); a sample's time is its slowest rank's, divided by ``--block``. The table shows each one's median step time and
the median over rounds of its time divided by the reference's in the same round, with
the quartiles of that per-round ratio (the spread a loaded machine puts on it).
Goals (issues 5 and 48): ratio <= 1.05 for plain DP and <= 1.15 for ZeRO-1.

With ``--micro-batches M`` each step accumulates M micro-batches of the local batch: DDP
runs the first M - 1 backwards inside ``no_sync()`` (its documented accumulation loop),
ours sets ``set_gradient_accumulation_steps(M)`` (what the trainer's step does), and a
sixth run, "ours ZeRO-0 per-pass", reduces in every backward (before 0.1's change: the
DP traffic of M steps). Last, the raw
gloo collectives a step is made of are timed on a model-sized fp32 buffer (all-reduce:
DDP and ZeRO-0; reduce-scatter + all-gather: ZeRO-1), with the send/receive exchange
of half the buffer that ``scaling.collectives`` posts for either on two CPU ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from scaling.nn import ParameterMeta
from scaling.optim import Optimizer, OptimizerConfig, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.testing import make_topology, run_distributed


def _mlp(hidden: int, layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def _ours(model: torch.nn.Sequential, zero: int, topo, overlap: bool = False, micro: int = 1) -> Optimizer:  # noqa: ANN001
    triples = []
    for name, p in model.named_parameters():
        index, local = name.split(".", 1)
        meta = ParameterMeta(local, tuple(p.shape), layer_index=int(index)).attach(p).parameter_meta
        triples.append((meta.key, p, meta))
    # Default buckets, like DDP's: the first closes at 1 MiB, the next at 25 MB.
    config = OptimizerConfig(zero_stage=zero, overlap_param_gather=overlap)
    group = OptimizerParamGroup(triples, OptimizerParamGroupConfig(name="all", weight_decay=0.01))
    opt = Optimizer(config=config, parameter_groups=[group], topology=topo, model=model)
    opt.set_gradient_accumulation_steps(micro)
    return opt


#: The reference the ratios are taken against: DDP with the fused AdamW kernel our update runs.
REFERENCE = "ddp+fused"


def measure(hidden: int, layers: int, batch: int, steps: int, block: int, micro: int = 1) -> dict[str, float]:
    topo = make_topology()
    x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(topo.axis("dp").rank))
    xs = x.chunk(micro)
    ddp = DistributedDataParallel(_mlp(hidden, layers), process_group=topo.axis("dp").group, bucket_cap_mb=25)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.01)
    ddp_fused = DistributedDataParallel(_mlp(hidden, layers), process_group=topo.axis("dp").group, bucket_cap_mb=25)
    fused_opt = torch.optim.AdamW(ddp_fused.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    plain, zero1, zero1_overlap = _mlp(hidden, layers), _mlp(hidden, layers), _mlp(hidden, layers)
    plain_opt, zero1_opt = _ours(plain, 0, topo, micro=micro), _ours(zero1, 1, topo, micro=micro)
    overlap_opt = _ours(zero1_overlap, 1, topo, overlap=True, micro=micro)
    per_pass = _mlp(hidden, layers)
    per_pass_opt = _ours(per_pass, 0, topo)  # reduces in every backward

    def ref_steps(model: DistributedDataParallel, opt: torch.optim.Optimizer) -> None:
        for _ in range(block):
            opt.zero_grad()
            for i, xm in enumerate(xs):
                with model.no_sync() if i < micro - 1 else contextlib.nullcontext():
                    (model(xm).pow(2).mean() / micro).backward()
            opt.step()

    def our_steps(model: torch.nn.Module, opt: Optimizer) -> None:
        for _ in range(block):
            opt.zero_grad()
            for xm in xs:
                opt.backward(model(xm).pow(2).mean() / micro)
            opt.step()
        opt.finish_parameter_gather()

    runs = {
        "ddp+AdamW": lambda: ref_steps(ddp, ref_opt),
        "ddp+fused": lambda: ref_steps(ddp_fused, fused_opt),
        "ours ZeRO-0": lambda: our_steps(plain, plain_opt),
        "ours ZeRO-1": lambda: our_steps(zero1, zero1_opt),
        "ours ZeRO-1 overlap": lambda: our_steps(zero1_overlap, overlap_opt),
    }
    if micro > 1:
        runs["ours ZeRO-0 per-pass"] = lambda: our_steps(per_pass, per_pass_opt)
    times: dict[str, list[float]] = {k: [] for k in runs}
    ratios: dict[str, list[float]] = {k: [] for k in runs}
    order = [REFERENCE, *[k for k in runs if k.startswith("ours")], "ddp+AdamW"]
    order += order[::-1]
    for i in range(steps + 2):
        spent: dict[str, float] = dict.fromkeys(runs, 0.0)
        for name in order:
            torch.distributed.barrier(group=topo.axis("dp").group)
            start = time.perf_counter()
            runs[name]()
            elapsed = torch.tensor([(time.perf_counter() - start) / block])
            # a step takes as long as its slowest rank
            torch.distributed.all_reduce(elapsed, torch.distributed.ReduceOp.MAX, group=topo.axis("dp").group)
            spent[name] += elapsed.item()
            if i >= 2:  # the first rounds warm up allocators and gloo
                times[name].append(elapsed.item())
        if i >= 2:  # each round's ratio: both samples of a run against the reference's two of the round
            for name in runs:
                ratios[name].append(spent[name] / spent[REFERENCE])
    # the parameters agree (same init, same batches, same update rule up to rounding;
    # bitwise against the fused reference, whose kernel our update runs)
    out: dict[str, float] = {}
    for key, ref in (("max_param_diff", ddp), ("max_param_diff_fused", ddp_fused)):
        out[key] = max((a - b).abs().max().item() for a, b in zip(ref.module.parameters(), plain.parameters()))
    # overlapping the gather changes when values arrive, not what they are
    out["max_param_diff_overlap"] = max(
        (a - b).abs().max().item() for a, b in zip(zero1.parameters(), zero1_overlap.parameters())
    )
    for name in runs:
        q1, _, q3 = statistics.quantiles(ratios[name], n=4)
        out[name] = statistics.median(times[name])
        out[f"{name} ratio"] = statistics.median(ratios[name])
        out[f"{name} q1"], out[f"{name} q3"] = q1, q3
        out[f"{name} median ratio of medians"] = out[name] / statistics.median(times[REFERENCE])
    return out


# torch 2.13 renamed the flat forms; older releases only have the *_tensor names.
_REDUCE_SCATTER = getattr(torch.distributed, "reduce_scatter_single", None) or torch.distributed.reduce_scatter_tensor
_ALL_GATHER = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor


def collectives(numel: int, rounds: int) -> dict[str, float]:
    """Median ms of one model-sized gloo all-reduce, reduce-scatter and all-gather (raw torch calls)."""
    topo = make_topology()
    group, world = topo.axis("dp").group, topo.axis("dp").size
    numel -= numel % world
    full, shard = torch.randn(numel), torch.empty(numel // world)
    peer = 1 - topo.axis("dp").rank

    def exchange() -> None:
        # what scaling.collectives posts for a two-rank reduce-scatter or all-gather
        works = [group.send([full[: shard.numel()]], peer, 1), group.recv([shard], peer, 1)]
        for work in works:
            work.wait()

    calls = {
        "all_reduce": lambda: torch.distributed.all_reduce(full, group=group),
        "reduce_scatter": lambda: _REDUCE_SCATTER(shard, full, group=group),
        "all_gather": lambda: _ALL_GATHER(full, shard, group=group),
        "send/recv exchange": exchange,
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(rounds + 2):
        for name in [*calls, *reversed(calls)]:
            torch.distributed.barrier(group=group)
            start = time.perf_counter()
            calls[name]()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40, help="rounds; each runs every variant twice")
    parser.add_argument("--block", type=int, default=4, help="consecutive steps per timed sample")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches accumulated per step")
    args = parser.parse_args()
    if args.batch % args.micro_batches:
        parser.error(f"--micro-batches={args.micro_batches} must divide --batch={args.batch}")
    results = run_distributed(
        measure,
        2,
        args.hidden,
        args.layers,
        args.batch,
        args.steps,
        args.block,
        args.micro_batches,
        timeout_seconds=900,
    )
    r = results[0]
    psi = args.layers * (args.hidden * args.hidden + args.hidden)
    print(
        f"2 gloo ranks, MLP {args.layers}x{args.hidden} (Ψ = {psi:,}), local batch {args.batch} in "
        f"{args.micro_batches} micro-batch(es), median of "
        f"{2 * args.steps} samples of {args.block} steps each"
    )
    print(
        f"ratio = median over rounds of (run's 2 samples / {REFERENCE}'s 2 samples in the same round); q1-q3 its spread"
    )
    names = [REFERENCE, "ddp+AdamW", "ours ZeRO-0", "ours ZeRO-1", "ours ZeRO-1 overlap"]
    for name in names + (["ours ZeRO-0 per-pass"] if args.micro_batches > 1 else []):
        print(
            f"{name:>20}: {r[name] * 1e3:8.2f} ms/step  ratio {r[f'{name} ratio']:.3f} "
            f"(q1 {r[f'{name} q1']:.3f}, q3 {r[f'{name} q3']:.3f}; ratio of median times "
            f"{r[f'{name} median ratio of medians']:.3f})"
        )
    print(
        f"max |param diff| ours ZeRO-0 after all steps: vs DDP+AdamW {r['max_param_diff']:.2e}, "
        f"vs DDP+AdamW(fused=True) {r['max_param_diff_fused']:.2e}; ZeRO-1 overlap vs ZeRO-1 "
        f"{r['max_param_diff_overlap']:.2e}"
    )
    c = run_distributed(collectives, 2, psi, args.steps, timeout_seconds=600)[0]
    print(f"gloo, {psi * 4 / 2**20:.2f} MiB fp32, median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))


if __name__ == "__main__":
    main()
