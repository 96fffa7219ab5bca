"""ZeRO-3 with CPU offload: scaling.optim against FSDP2 with ``CPUOffloadPolicy``, on one device per rank.

Run: python bench/offload_step.py [--hidden 2048] [--blocks 4] [--batch 4096] [--steps 8] [--rounds 3] [--world 1]

Every rank builds the same MLP (``blocks`` × [Linear(h, 4h), GELU, Linear(4h, h)], the model
of bench/zero3_step.py) on its device (CUDA with NCCL where there is one, else the CPU with
gloo) and trains it three ways in one process, alternating in rounds:

- ours, offloaded: ``Optimizer(zero_stage=3, cpu_offload=True)``: fp32 master shards and Adam
  moments in pinned host memory, the update by the host's fused AdamW in a thread, layer by
  layer, while the next forward runs (``scaling/optim/_offload.py``);
- ours on the device: the same without offload (the cost of offloading);
- reference: ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` on each block and the root,
  ``torch.optim.AdamW(fused=True)`` (its parameters, gradients and moments live on the host;
  the step runs there, after backward).

It prints the median time of a training step (forward, backward, step; timed over a round of
``steps`` steps, so an update still running in a thread at a step's end counts in the next),
the ratio ours / FSDP2 (target: <= 1.00), where each side's optimizer state lives (bytes on
the device and on the host; offloaded: 0 on the device) and the largest relative difference
of the losses (same weights and batches: fp32 rounding). On a machine without CUDA the
"device" is the host, so the figures say only that the code runs; the GPU figures are what
docs/benchmarks.md records.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from zero3_step import BETAS, EPS, LR, WD, _model, _ours

from scaling.optim import Optimizer
from scaling.testing import run_distributed


def _fsdp2_offloaded(model: torch.nn.Sequential, device: torch.device) -> torch.optim.Optimizer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)


def _state_bytes(tensors: list[torch.Tensor], device: torch.device) -> tuple[int, int]:
    """Bytes of ``tensors`` on ``device`` and on the host (the same on a CPU run)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    on_device = sum(t.numel() * t.element_size() for t in local if t.device == device)
    on_host = sum(t.numel() * t.element_size() for t in local if t.device.type == "cpu")
    return on_device, on_host


def measure(hidden: int, blocks: int, batch: int, steps: int, rounds: int) -> dict[str, object]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    base = _model(hidden, blocks)
    models = {name: copy.deepcopy(base).to(device) for name in ("offloaded", "on_device")}
    models["fsdp2"] = copy.deepcopy(base)  # fully_shard moves it: its shards to the host
    opts: dict[str, Optimizer | torch.optim.Optimizer] = {
        "offloaded": _ours(models["offloaded"], None, offload=True, device=device),
        "on_device": _ours(models["on_device"], None, offload=False, device=device),
        "fsdp2": _fsdp2_offloaded(models["fsdp2"], device),
    }
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    data = [torch.randn(batch, hidden, generator=gen).to(device) for _ in range(steps)]

    def stepper(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        model, opt = models[name], opts[name]

        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            if isinstance(opt, Optimizer):
                opt.backward(loss)
            else:
                loss.backward()
            opt.step()
            return loss.detach()

        return step

    steppers = {name: stepper(name) for name in models}

    def sync() -> None:
        for opt in opts.values():
            if isinstance(opt, Optimizer):
                opt.finish_parameter_gather()  # the offloaded update still in its thread
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    out: dict[str, object] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    for name, step in steppers.items():  # warm-up, and the losses to compare
        out[f"loss_{name}"] = [step(x).item() for x in data[:3]]
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, step in steppers.items():
            sync()
            start = time.perf_counter()
            for x in data:
                step(x)
            sync()
            times[name].append((time.perf_counter() - start) / len(data))
    out["times"] = times
    for name, opt in opts.items():
        if isinstance(opt, Optimizer):
            state = [t for s in opt.slots for t in [*s.state.values(), s.master] if t is not None]
        else:
            state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
        out[f"state_{name}"] = _state_bytes(state, device)
    out["psi"] = sum(p.numel() for p in base.parameters())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4096, help="rows of the input per rank and step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world", type=int, default=1, help="ranks (one GPU each under CUDA)")
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    sizes = (args.hidden, args.blocks, args.batch, args.steps, args.rounds)
    r = run_distributed(measure, args.world, *sizes, backend=backend, timeout_seconds=1800)[0]
    psi = int(r["psi"])
    print(f"fp32 AdamW, {psi / 1e6:.1f}M parameters in {args.blocks} blocks, batch {args.batch} per rank")
    print(f"{args.world} rank(s) on {r['device']} ({backend}); medians of {args.rounds} rounds of {args.steps} steps")
    if backend == "gloo":
        print("no CUDA here: the device is the host, so both state columns count the same bytes")
    times: dict[str, list[float]] = r["times"]
    median = {name: statistics.median(t) for name, t in times.items()}
    labels = {"offloaded": "ours, offloaded", "on_device": "ours, on the device", "fsdp2": "FSDP2, offloaded"}
    print(f"{'side':>20} {'ms/step':>9} {'state on device':>16} {'state on host':>14}")
    for name, label in labels.items():
        on_device, on_host = r[f"state_{name}"]
        print(f"{label:>20} {median[name] * 1e3:>9.2f} {on_device / psi:>15.3f}Ψ {on_host / psi:>13.3f}Ψ")
    diff = max(abs(a - b) / abs(b) for a, b in zip(r["loss_offloaded"], r["loss_fsdp2"]))
    print(f"ours offloaded / FSDP2 offloaded: {median['offloaded'] / median['fsdp2']:.3f} (target <= 1.00)")
    print(f"offloaded / on the device (ours): {median['offloaded'] / median['on_device']:.3f}")
    print(f"largest relative loss difference, ours offloaded vs FSDP2: {diff:.1e}")


if __name__ == "__main__":
    main()
