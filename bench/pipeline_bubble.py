"""Pipeline bubble on real 2-stage pipelines, and our 1F1B against torch's Schedule1F1B.

Each stage is one layer whose forward sleeps ``--forward-ms`` and whose backward sleeps
``--backward-ms`` (a fixed cost that does not compete for the CPU), around a small
Linear, so the busy time per stage is known exactly: ``m * (forward + backward)``.
The measured bubble is ``1 - busy / step wall time``; theory is ``(p - 1) / (m + p - 1)``.
On a loaded machine a sleep overshoots (the woken process waits for a core), which
shows up as bubble; the ``busy`` columns also measure the time each stage actually
spent in its forward/backward sleeps and give ``1 - measured busy / wall`` (mean over
the stages), for ours and for torch's schedule alike: that isolates what the schedule
and the transport add from what the load adds to the stages' own cost.

The reference is ``torch.distributed.pipelining.Schedule1F1B`` on the same layers, the
same micro-batches and the same two gloo ranks, timed in the same run: each repetition
runs our GPipe, our 1F1B and torch's 1F1B in turn (so load from other processes hits
all alike); a repetition's wall is the slowest rank's, and the table shows medians.
The ratio is ours / torch per repetition (below 1.0: we are faster); the table gives its
median and a distribution-free 95 % confidence interval for that median (order statistics
of the per-repetition ratios, no assumption about their spread), so a run says whether
"ours <= torch's" holds beyond the noise: the interval's top below 1.0 is faster, an
interval around 1.0 is a tie at this many repetitions.

``--transport`` swaps what carries the hand-offs inside our executor, to split our cost
from torch's: ``scaling`` (default, ``PipeTransport``), ``frame`` (one header + payload
byte frame per message, as ``PipeTransport`` sends, without its pytrees, metadata cache
or recording) and ``bare`` (the activation tensor itself, received into a fresh tensor:
what torch's schedule sends). Both floors know this bench's message type and nothing else.

    python bench/pipeline_bubble.py
    python bench/pipeline_bubble.py --forward-ms 40 --backward-ms 80
    python bench/pipeline_bubble.py --transport bare
    python bench/pipeline_bubble.py --static-shapes

``--static-shapes`` builds our modules with ``ParallelModule(static_shapes=True)``: after
each channel's first message the hand-offs carry no header, as torch's schedule (whose
shapes are fixed once) sends them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from scaling.collectives import PipeTransport
from scaling.nn import BaseLayer, LayerSpec
from scaling.pipeline import ParallelModule
from scaling.testing import make_topology, run_distributed
from scaling.trainer import train_step

WIDTH, BATCH = 64, 8


_BUSY = [0.0]  # seconds this rank spent in the fixed-cost sleeps since the last reset


def _sleep(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    _BUSY[0] += time.perf_counter() - start


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.backward_s = backward_s
        _sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        _sleep(ctx.backward_s)
        return grad, None, None


class FixedCostLinear(torch.nn.Module):
    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.linear(x), self.forward_s, self.backward_s)


@dataclass
class IO:
    x: torch.Tensor


class Layer(BaseLayer[IO, IO]):
    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.inner = FixedCostLinear(forward_s, backward_s)

    def forward(self, x: IO) -> IO:
        return IO(self.inner(x.x))


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor

    def only_inputs(self) -> IO:
        return IO(self.x)

    def only_targets(self) -> Batch:
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(self.x.to(device, non_blocking=non_blocking), self.y.to(device, non_blocking=non_blocking))


class _NoUpdate:
    """The methods train_step calls on an Optimizer, without an update: the step times the schedule and its results."""

    loss_scaler = SimpleNamespace(scale=1.0)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.data_parallel = self  # train_step reaches the DP reduction through it: nothing to reduce

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        pass  # one stage, no DP: nothing to reduce

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finish_gradient_reduction(self) -> None:
        pass

    def step(self) -> SimpleNamespace:
        return SimpleNamespace(global_grad_norm=None, learning_rates={}, current_loss_scale=1.0)


def _loss(out: IO, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    return torch.nn.functional.mse_loss(out.x, batch.y), {}


_NONE: Any = object()
_HEADER = torch.tensor([0, 0, BATCH * WIDTH * 4, 0], dtype=torch.int64).view(torch.uint8)


def _floor_transfer(framed: bool):
    """A ``PipeTransport.transfer`` for this bench's ``IO`` messages only: bare tensors or one frame each."""

    def send(tensor: torch.Tensor, peer: int) -> Any:
        payload = tensor.detach()
        if framed:
            payload = torch.cat([_HEADER, payload.reshape(-1).view(torch.uint8)])
        return dist.group.WORLD.send([payload], peer, 0)

    def recv(peer: int) -> torch.Tensor:
        if not framed:
            out = torch.empty(BATCH, WIDTH)
            dist.group.WORLD.recv([out], peer, 0).wait()
            return out
        frame = np.empty(_HEADER.numel() + BATCH * WIDTH * 4, dtype=np.uint8)
        dist.group.WORLD.recv([torch.from_numpy(frame)], peer, 0).wait()
        if frame[:32].view(np.int64)[0]:
            raise RuntimeError("unexpected metadata change")
        return torch.from_numpy(frame[32:].view(np.float32).reshape(BATCH, WIDTH))

    def transfer(self, sends=(), receives=(), **_):
        for channel, peer, obj in sends:
            self._in_flight.append((send(obj.x if channel == "forward" else obj[0], peer), None))
        return [IO(recv(peer).requires_grad_()) if channel == "forward" else [recv(peer)] for channel, peer in receives]

    return transfer


def worker(
    schedules: list[str],
    ms: list[int],
    forward_s: float,
    backward_s: float,
    repeats: int,
    transport: str,
    static_shapes: bool,
) -> dict:
    """Per (schedule, m): this rank's (wall, busy) seconds of each repetition, ours and torch alternating."""
    if transport != "scaling":
        PipeTransport.transfer = _floor_transfer(framed=transport == "frame")  # type: ignore[method-assign]
    topo = make_topology(pipe_parallel_size=2)
    results: dict = {}
    for m in ms:
        batches = [Batch(torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)) for _ in range(m)]
        steps = {}
        for name in schedules:
            layers = [LayerSpec(Layer, forward_s, backward_s) for _ in range(2)]
            module = ParallelModule(layers, topo, schedule=name, static_shapes=static_shapes)
            opt = _NoUpdate(module)
            steps[name] = lambda module=module, opt=opt, batches=batches: (
                train_step(module, batches, opt, _loss).step_duration
            )
        steps["torch_1f1b"] = _torch_1f1b(topo, batches, forward_s, backward_s)
        for step in steps.values():
            step()  # warm-up: handshakes, allocations
        for name in steps:
            results[(name, m)] = []
        for _ in range(repeats):  # alternate so that load changes hit every candidate alike
            for name, step in steps.items():
                torch.distributed.barrier()
                _BUSY[0] = 0.0
                wall = step()
                results[(name, m)].append((wall, _BUSY[0]))
    return results


def _torch_1f1b(topo, batches: list[Batch], forward_s: float, backward_s: float):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage_index = topo.axis("pp").rank
    layer = FixedCostLinear(forward_s, backward_s)
    stage = PipelineStage(layer, stage_index, 2, topo.device, group=topo.axis("pp").group)
    schedule = Schedule1F1B(stage, len(batches), loss_fn=torch.nn.functional.mse_loss)
    x = torch.cat([b.x for b in batches])
    y = torch.cat([b.y for b in batches])

    def step() -> float:
        start = time.perf_counter()
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        return time.perf_counter() - start

    return step


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval for the median: order statistics ``(x_(j), x_(n-j+1))``.

    ``j`` is the largest rank with ``P(Binomial(n, 1/2) < j) <= (1 - level) / 2``; with
    fewer than 6 values no such ``j`` exists and the interval is the whole range.
    """
    xs, n = sorted(values), len(values)
    tail, j, below = (1 - level) / 2, 0, 0.0
    while below + math.comb(n, j) / 2**n <= tail:
        below += math.comb(n, j) / 2**n
        j += 1
    return (xs[0], xs[-1]) if j == 0 else (xs[j - 1], xs[n - j])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--transport", choices=["scaling", "frame", "bare"], default="scaling")
    parser.add_argument("--static-shapes", action="store_true", help="ParallelModule(static_shapes=True)")
    args = parser.parse_args()
    f, b = args.forward_ms / 1e3, args.backward_ms / 1e3
    schedules = ["gpipe", "1f1b"]
    per_rank = run_distributed(
        worker,
        2,
        schedules,
        args.micro_batches,
        f,
        b,
        args.repeats,
        args.transport,
        args.static_shapes,
        timeout_seconds=1200,
    )
    print(f"2 stages, forward {args.forward_ms} ms, backward {args.backward_ms} ms per stage and micro-batch")
    print(f"our hand-offs: {args.transport}" + (", static shapes" if args.static_shapes else ""))
    print(f"median of {args.repeats} repetitions (slowest rank each), ours and torch alternating")
    print("bubble: 1 - m (F + B) / wall; busy: 1 - measured sleep time / wall (mean over stages)")
    names = [*schedules, "torch_1f1b"]
    print(
        f"{'m':>3} {'theory':>7} {'gpipe':>7} {'1f1b':>7} {'torch':>7} {'busy:':>6} {'gpipe':>6} {'1f1b':>6} "
        f"{'torch':>6} {'ours 1f1b s':>12} {'torch 1f1b s':>13} {'ratio':>6} {'95% CI':>13} {'ratio min-max':>14}"
    )
    for m in args.micro_batches:
        nominal = m * (f + b)
        # One wall per repetition: the slowest rank's; busy: the stages' mean.
        walls = {k: [max(r[(k, m)][i][0] for r in per_rank) for i in range(args.repeats)] for k in names}
        busy = {k: [statistics.mean(r[(k, m)][i][1] for r in per_rank) for i in range(args.repeats)] for k in names}
        wall = {k: statistics.median(v) for k, v in walls.items()}
        ratios = [o / t for o, t in zip(walls["1f1b"], walls["torch_1f1b"])]
        low, high = median_ci(ratios)
        bubble = {k: 1 - nominal / wall[k] for k in names}
        measured = {k: statistics.median(1 - u / w for u, w in zip(busy[k], walls[k])) for k in names}
        print(
            f"{m:>3} {1 / (m + 1):>7.3f} {bubble['gpipe']:>7.3f} {bubble['1f1b']:>7.3f} {bubble['torch_1f1b']:>7.3f} "
            f"{'':>6} {measured['gpipe']:>6.3f} {measured['1f1b']:>6.3f} {measured['torch_1f1b']:>6.3f} "
            f"{wall['1f1b']:>12.4f} {wall['torch_1f1b']:>13.4f} {statistics.median(ratios):>6.3f} "
            f"{low:>6.3f}-{high:<6.3f} {min(ratios):>6.3f}-{max(ratios):<6.3f}"
        )


if __name__ == "__main__":
    main()
