"""dp2·pp2 and dp2·pp2·tp2 match one process: loss and weights after a real optimizer step."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from scaling.nn import BaseLayer, ColumnParallelLinear, LayerSpec, RowParallelLinear
from scaling.pipeline import ParallelModule
from scaling.testing import assert_parity, make_topology, run_distributed, shard

optim = pytest.importorskip("scaling.optim")

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_test_model import IO, loss_function, micro_batches  # noqa: E402

pytestmark = pytest.mark.distributed
WIDTH, NUM_LAYERS, NUM_MICRO_BATCHES = 6, 4, 2


class TPBlock(BaseLayer[IO, IO]):
    def __init__(self, width: int, topology: object) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(width, 2 * width, parallel_output=True, topology=topology)
        self.down = RowParallelLinear(2 * width, width, parallel_input=True, topology=topology)

    def forward(self, x: IO) -> IO:
        return IO(torch.tanh(self.down(torch.tanh(self.up(x.activations)))))


def train_one_step(tp: int, pp: int, schedule: str, batches_per_replica: list[list]) -> tuple[float, dict]:
    topo = make_topology(model_parallel_size=tp, pipe_parallel_size=pp)
    specs = [LayerSpec(TPBlock, WIDTH, topology=topo) for _ in range(NUM_LAYERS)]
    module = ParallelModule(specs, topo, schedule=schedule)
    config = optim.OptimizerParamGroupConfig(
        learning_rate_scheduler=optim.LearningRateSchedulerConfig(learning_rate=0.1)
    )
    group = optim.OptimizerParamGroup(list(module.named_parameters_with_meta()), config)
    optimizer = optim.Optimizer(optim.OptimizerConfig(method="sgd"), [group], topo)
    out = module.train_step(batches_per_replica[topo.data_parallel_rank], optimizer, loss_function)
    weights = {n: (p.detach().clone(), meta.parallel_dim) for n, p, meta in module.named_parameters_with_meta()}
    return out.loss, {"weights": weights, "tp_rank": topo.model_parallel_rank, "lr": out.learning_rates}


@pytest.mark.parametrize(("world", "tp", "pp"), [(4, 1, 2), pytest.param(8, 2, 2, marks=pytest.mark.slow)])
def test_data_tensor_pipe_parallel_matches_one_process(world: int, tp: int, pp: int) -> None:
    dp = world // (tp * pp)
    replicas = [micro_batches(NUM_MICRO_BATCHES, WIDTH, seed=d) for d in range(dp)]
    # One process sees every replica's micro-batches: the same mean loss and gradient.
    ((ref_loss, ref),) = run_distributed(train_one_step, 1, 1, 1, "1f1b", [sum(replicas, [])])
    results = run_distributed(train_one_step, world, tp, pp, "1f1b", replicas, timeout_seconds=180)
    for loss, got in results:
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert got["lr"] == ref["lr"]
        for name, (param, dim) in got["weights"].items():
            full = ref["weights"][name][0]
            expected = full if dim is None or tp == 1 else shard(full, dim, got["tp_rank"], tp)
            assert_parity(param, expected, rtol=1e-6, atol=1e-7, name=name)
