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

import torch

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


def _step(module: ParallelModule, batches: list[Batch]) -> float:
    """One schedule from zero gradients, all ranks starting together: this rank's seconds."""
    module.zero_grad(set_to_none=True)
    torch.distributed.barrier()
    _BUSY[0] = 0.0
    start = time.perf_counter()
    module.run_schedule(batches, _loss)
    return time.perf_counter() - start


def worker(stages: int, schedules: list[str], ms: list[int], seconds: float, repeats: int) -> dict:
    """Per (schedule, m): this rank's (wall, busy) seconds of each repetition, schedules alternating."""
    topo = make_topology(pipe_parallel_size=stages)
    modules = {
        name: ParallelModule([LayerSpec(Layer, seconds) for _ in range(2 * stages)], topo, schedule=name)
        for name in schedules
    }
    results: dict = {}
    for m in ms:
        torch.manual_seed(m)
        batches = [Batch(torch.randn(4, WIDTH), torch.randn(4, WIDTH)) for _ in range(m)]

        for module in modules.values():
            _step(module, batches)  # warm-up: handshakes, allocations
        for _ in range(repeats):
            for name, module in modules.items():
                wall = _step(module, batches)
                results.setdefault((name, m), []).append((wall, _BUSY[0]))
    return results


def predicted(name: str, stages: int, m: int, seconds: float) -> float:
    """The simulator's bubble for ``name`` with this bench's costs (a chunk's per-layer costs times its layers)."""
    per_chunk = 1 if name == "zb_v" else 2  # layers a chunk holds
    c = per_chunk * seconds
    costs = {"forward": c, "backward": 2 * c, "backward_input": c, "backward_weight": c}
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
    per_rank = run_distributed(
        worker, args.stages, args.stages, args.schedules, args.micro_batches, seconds, args.repeats,
        timeout_seconds=1200,
    )  # fmt: skip
    print(
        f"{args.stages} stages x 2 layers, F = I = W = {args.layer_ms} ms per layer and micro-batch; "
        f"median of {args.repeats} repetitions (slowest rank's wall, the stages' mean sleep time)"
    )
    print(f"{'schedule':>9} {'m':>3} {'wall s':>7} {'simulated':>9} {'measured':>8} {'points':>7}")
    for m in args.micro_batches:
        for name in args.schedules:
            runs = range(args.repeats)
            walls = [max(r[(name, m)][i][0] for r in per_rank) for i in runs]
            busy = [statistics.mean(r[(name, m)][i][1] for r in per_rank) for i in runs]
            measured = statistics.median(1 - u / w for u, w in zip(busy, walls))
            simulated = predicted(name, args.stages, m, seconds)
            print(
                f"{name:>9} {m:>3} {statistics.median(walls):>7.3f} {simulated:>9.3f} {measured:>8.3f} "
                f"{100 * (measured - simulated):>+7.1f}"
            )


if __name__ == "__main__":
    main()
