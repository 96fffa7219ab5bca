"""Zero-bubble schedules on 4 real stages: the measured bubble against the simulator's.

Every layer's forward, input-gradient and weight-gradient each sleep a fixed time (a cost that
does not compete for the CPU, so 4 ranks on 2 cores keep their costs): the forward and the
input-gradient in a node on the activations' path, the weight-gradient in a node on the weight's
path only, so a zero-bubble schedule's input pass runs the first and its weight pass the second.
The model has ``2 * stages`` such layers: two per stage under 1F1B and ZB-H1 (one chunk), one per
chunk under ZB-V (two chunks per stage, in a V). A stage's busy time is known, ``m * 2 (F + I + W)``
(each rank also measures the time it spent in its sleeps); the measured bubble is ``1 - busy /
wall`` with the slowest rank's wall and the stages' mean measured busy time, the median over the
repetitions. The prediction is ``scaling.pipeline.simulate_schedule`` of the same schedule with
the same costs (a chunk's forward ``F`` per layer it holds, its input and weight passes ``I`` and
``W`` per layer), run in the same process: the printed difference is in percentage points.

    python bench/zero_bubble.py
    python bench/zero_bubble.py --stages 4 --micro-batches 8 16 --layer-ms 10 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from scaling.collectives import PipeTransport
from scaling.nn import BaseLayer, LayerSpec
from scaling.pipeline import SCHEDULES, ParallelModule, simulate_schedule
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for pipeline_bubble

from pipeline_bubble import _BUSY, IO, WIDTH, Batch, _Sleep  # the same fixed-cost pieces  # noqa: E402


class Layer(BaseLayer[IO, IO]):
    """``x W^T`` with F in the forward, I on the input's path and W on the weight's path."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.seconds = seconds

    def forward(self, x: IO) -> IO:
        weight = _Sleep.apply(self.weight, 0.0, self.seconds)  # the weight pass sleeps here
        return IO(_Sleep.apply(torch.nn.functional.linear(x.x, weight), self.seconds, self.seconds))


def _loss(out: IO, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    return torch.nn.functional.mse_loss(out.x, batch.y), {}


_COST_OF = {
    "Forward": "forward",
    "Backward": "backward",
    "BackwardInput": "backward_input",
    "BackwardWeight": "backward_weight",
}


def _step(module: ParallelModule, batches: list[Batch]) -> tuple[float, float, float, dict[str, list[float]]]:
    """One schedule from zero gradients, all ranks starting together: this rank's wall seconds, its
    seconds in the sleeps and in compute instructions, and each compute's seconds by cost kind."""
    module.zero_grad(set_to_none=True)
    module.instruction_timings = []
    torch.distributed.barrier()
    _BUSY[0] = 0.0
    start = time.perf_counter()
    module.run_schedule(batches, _loss)
    wall = time.perf_counter() - start
    kinds: dict[str, list[float]] = {}
    for name, begin, end in module.instruction_timings:
        kind = _COST_OF.get(name.split("(")[0])
        if kind is not None:
            kinds.setdefault(kind, []).append(end - begin)
    return wall, _BUSY[0], sum(sum(v) for v in kinds.values()), kinds


def _latency(topo: Any, rounds: int = 30) -> float:
    """Seconds a hand-off takes between stages 0 and 1 (half the median round trip of one
    activation-sized message through a ``PipeTransport``); 0 elsewhere."""
    pp = topo.axis("pp")
    peer = {0: 1, 1: 0}.get(pp.rank)
    torch.distributed.barrier()
    if peer is None:
        return 0.0
    transport, x, trips = PipeTransport(None, None, topo.device), IO(torch.randn(4, WIDTH)), []
    for _ in range(rounds):
        start = time.perf_counter()
        if pp.rank == 0:
            transport.transfer(sends=[("forward", pp.ranks[peer], x)])
            transport.transfer(receives=[("forward", pp.ranks[peer])])
        else:
            (got,) = transport.transfer(receives=[("forward", pp.ranks[peer])])
            transport.transfer(sends=[("forward", pp.ranks[peer], got)])
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def worker(stages: int, schedules: list[str], ms: list[int], seconds: float, repeats: int) -> tuple[dict, float]:
    """Per (schedule, m): this rank's ``_step`` of each repetition, schedules alternating; the latency."""
    topo = make_topology(pipe_parallel_size=stages)
    modules = {
        name: ParallelModule([LayerSpec(Layer, seconds) for _ in range(2 * stages)], topo, schedule=name)
        for name in schedules
    }
    latency = _latency(topo)
    results: dict = {}
    for m in ms:
        torch.manual_seed(m)
        batches = [Batch(torch.randn(4, WIDTH), torch.randn(4, WIDTH)) for _ in range(m)]
        for module in modules.values():
            _step(module, batches)  # warm-up: handshakes, allocations
        for _ in range(repeats):
            for name, module in modules.items():
                results.setdefault((name, m), []).append(_step(module, batches))
    return results, latency


def simulated(name: str, stages: int, m: int, costs: dict[str, float]) -> float:
    """The simulator's bubble for ``name`` with these costs."""
    return simulate_schedule(SCHEDULES[name], stages, m, costs=costs).bubble_fraction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--layer-ms", type=float, default=10.0, help="F = I = W of one layer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb_h1", "zb_v"])
    args = parser.parse_args()
    seconds = args.layer_ms / 1e3
    outputs = run_distributed(
        worker, args.stages, args.stages, args.schedules, args.micro_batches, seconds, args.repeats,
        timeout_seconds=1200,
    )  # fmt: skip
    per_rank, latency = [r for r, _ in outputs], outputs[0][1]
    print(
        f"{args.stages} stages x 2 layers, F = I = W = {args.layer_ms} ms per layer and micro-batch; median of "
        f"{args.repeats} repetitions (the slowest rank's wall); hand-off latency {latency * 1e3:.2f} ms"
    )
    print("nominal: the sleeps' costs, free messages, against 1 - sleep time / wall (the stages' mean)")
    print("measured costs: each kind's median compute time and the latency, against 1 - compute time / wall")
    print(f"{'schedule':>9} {'m':>3} {'wall s':>7} | {'nominal':>7} {'measured':>8} {'points':>6} | "
          f"{'costs':>7} {'measured':>8} {'points':>6}")  # fmt: skip
    for m in args.micro_batches:
        for name in args.schedules:
            runs = [[r[(name, m)][i] for r in per_rank] for i in range(args.repeats)]
            walls = [max(rank[0] for rank in run) for run in runs]
            sleep_bubble = statistics.median(1 - statistics.mean(r[1] for r in run) / w for run, w in zip(runs, walls))
            busy_bubble = statistics.median(1 - statistics.mean(r[2] for r in run) / w for run, w in zip(runs, walls))
            layers = 1 if name == "zb_v" else 2  # layers a chunk holds
            c = layers * seconds
            nominal = simulated(name, args.stages, m, {"forward": c, "backward": 2 * c, "backward_input": c,
                                                       "backward_weight": c})  # fmt: skip
            durations: dict[str, list[float]] = {}
            for run in runs:
                for rank in run:
                    for kind, values in rank[3].items():
                        durations.setdefault(kind, []).extend(values)
            costs = {kind: statistics.median(values) for kind, values in durations.items()}
            with_latency = simulated(name, args.stages, m, {**costs, "transfer": latency})
            print(
                f"{name:>9} {m:>3} {statistics.median(walls):>7.3f} | {nominal:>7.3f} {sleep_bubble:>8.3f} "
                f"{100 * (sleep_bubble - nominal):>+6.1f} | {with_latency:>7.3f} {busy_bubble:>8.3f} "
                f"{100 * (busy_bubble - with_latency):>+6.1f}"
            )


if __name__ == "__main__":
    main()
