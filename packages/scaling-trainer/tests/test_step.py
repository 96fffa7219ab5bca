"""scaling.trainer.train_step / evaluation_step: the step around the pipeline schedule.

Parity with one process after a real optimizer step (dp2·pp2, dp2·pp2·tp2), the results
on every rank (metric names that change, a step that raises), evaluation, the module's
train/eval mode, and the step's shape (one function under 80 lines).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest
import torch

from scaling.collectives import get_recorder
from scaling.nn import BaseLayer, ColumnParallelLinear, LayerSpec, RowParallelLinear
from scaling.optim import (
    LearningRateSchedulerConfig,
    Optimizer,
    OptimizerConfig,
    OptimizerParamGroup,
    OptimizerParamGroupConfig,
)
from scaling.pipeline import ParallelModule
from scaling.testing import assert_parity, make_topology, run_distributed, shard
from scaling.trainer import evaluation_step, train_step

WIDTH, NUM_LAYERS, NUM_MICRO_BATCHES = 6, 4, 2


@dataclass
class Hidden:
    x: torch.Tensor


@dataclass
class Pair:
    """A micro-batch: inputs and regression targets."""

    x: torch.Tensor
    target: torch.Tensor

    def only_inputs(self) -> Hidden:
        return Hidden(self.x)

    def only_targets(self) -> Pair:
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> Pair:
        return Pair(self.x.to(device, non_blocking=non_blocking), self.target.to(device, non_blocking=non_blocking))


class TPBlock(BaseLayer[Hidden, Hidden]):
    def __init__(self, width: int, topology: object) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(width, 2 * width, parallel_output=True, topology=topology)
        self.down = RowParallelLinear(2 * width, width, parallel_input=True, topology=topology)

    def forward(self, h: Hidden) -> Hidden:
        return Hidden(torch.tanh(self.down(torch.tanh(self.up(h.x)))))


def mse(out: Hidden, batch: Pair) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return torch.nn.functional.mse_loss(out.x, batch.target), {"mean_output": out.x.detach().mean()}


def spread(out: Hidden, batch: Pair) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return mse(out, batch)[0], {"max": out.x.detach().max(), "min": out.x.detach().min()}


def pairs(num: int, seed: int = 0) -> list[Pair]:
    g = torch.Generator().manual_seed(seed)
    return [Pair(torch.randn(3, WIDTH, generator=g), torch.randn(3, WIDTH, generator=g)) for _ in range(num)]


def build(tp: int = 1, pp: int = 1, lr: float = 0.1, optimizer_class: type = Optimizer) -> tuple:
    topo = make_topology(model_parallel_size=tp, pipe_parallel_size=pp)
    module = ParallelModule([LayerSpec(TPBlock, WIDTH, topology=topo) for _ in range(NUM_LAYERS)], topo)
    config = OptimizerParamGroupConfig(learning_rate_scheduler=LearningRateSchedulerConfig(learning_rate=lr))
    group = OptimizerParamGroup(list(module.named_parameters_with_meta()), config)
    return module, optimizer_class(OptimizerConfig(method="sgd"), [group], topo)


def train_one_step(tp: int, pp: int, batches_per_replica: list[list[Pair]]) -> tuple[float, dict]:
    module, optimizer = build(tp, pp)
    topo = module.topology
    recorder = get_recorder()
    recorder.reset_counters()
    out = train_step(module, batches_per_replica[topo.axis("dp").rank], optimizer, mse)
    weights = {n: (p.detach().clone(), meta.parallel_dim) for n, p, meta in module.named_parameters_with_meta()}
    reducer = optimizer.data_parallel.spaces[0].reducer
    # DP all-reduces of the step, and the buckets one backward launches (no reducer without DP).
    dp = recorder.group_name(topo.axis("dp").group)
    calls = recorder.calls_by_op_and_group().get(("all_reduce", dp), 0)
    buckets = 0 if reducer is None else len(reducer.buckets)
    return out.loss, {
        "weights": weights,
        "tp_rank": topo.axis("tp").rank,
        "lr": out.learning_rates,
        "dp_all_reduces": (calls, buckets),
    }


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "tp", "pp"), [(4, 1, 2), pytest.param(8, 2, 2, marks=pytest.mark.slow)])
def test_data_tensor_pipe_parallel_matches_one_process(world: int, tp: int, pp: int) -> None:
    dp = world // (tp * pp)
    replicas = [pairs(NUM_MICRO_BATCHES, seed=d) for d in range(dp)]
    # One process sees every replica's micro-batches: the same mean loss and gradient.
    ((ref_loss, ref),) = run_distributed(train_one_step, 1, 1, 1, [sum(replicas, [])])
    results = run_distributed(train_one_step, world, tp, pp, replicas, timeout_seconds=180)
    for loss, got in results:
        assert loss == pytest.approx(ref_loss, rel=1e-6)  # every rank reports the loss
        assert got["lr"] == ref["lr"]
        for name, (param, dim) in got["weights"].items():
            full = ref["weights"][name][0]
            expected = full if dim is None or tp == 1 else shard(full, dim, got["tp_rank"], tp)
            assert_parity(param, expected, rtol=1e-6, atol=1e-7, name=name)
        # The micro-batches' gradients are reduced once, in the last backward, not once per micro-batch;
        # two more all-reduces on the DP group: the gradient norm's and the step results' (loss, metrics).
        calls, buckets = got["dp_all_reduces"]
        assert buckets >= 1 and calls == buckets + 2, (calls, buckets, NUM_MICRO_BATCHES)


def metrics_rank() -> list[tuple[float, dict[str, float]]]:
    module, optimizer = build(pp=2, lr=0.0)  # no update: every step sees the same weights
    return [
        (s.loss, s.metrics) for s in (train_step(module, pairs(2), optimizer, fn) for fn in (mse, mse, spread, mse))
    ]


@pytest.mark.distributed
def test_metrics_reach_every_stage_when_their_names_change() -> None:
    # Step 2 takes the one-tensor path (names cached), steps 3 and 4 change the names.
    rank0, rank1 = run_distributed(metrics_rank, 2, timeout_seconds=120)
    assert rank0 == rank1
    assert [sorted(m) for _, m in rank0] == [["mean_output"], ["mean_output"], ["max", "min"], ["mean_output"]]
    assert rank0[0] == rank0[1] == rank0[3]
    (reference,) = run_distributed(_reference_outputs, 1)
    assert rank0[2][1]["max"] == pytest.approx(sum(float(o.max()) for o in reference) / 2, rel=1e-6)


def _reference_outputs() -> list[torch.Tensor]:
    module, _ = build()
    with torch.no_grad():
        return [module(b).x for b in pairs(2)]


class FailsOnce(Optimizer):
    """Raises from its second step() on every rank, after all of the step's messages."""

    calls = 0

    def step(self):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 2:
            raise FloatingPointError("the optimizer gives up on this step")
        return super().step()


def failed_step_rank() -> list[float | None]:
    module, optimizer = build(pp=2, lr=0.0, optimizer_class=FailsOnce)
    out: list[float | None] = []
    for batches in (pairs(2), pairs(2), pairs(3), pairs(2)):
        try:
            out.append(train_step(module, batches, optimizer, mse).loss)
        except FloatingPointError:
            out.append(None)
    return out


@pytest.mark.distributed
def test_a_step_that_raises_keeps_the_result_broadcast_paired() -> None:
    # Step 2 raises after rank 0 posted its result receive: the last stage still sends
    # one broadcast for it, so steps 3 and 4 report their own results instead of hanging.
    rank0, rank1 = run_distributed(failed_step_rank, 2, timeout_seconds=60)
    assert rank0 == rank1
    assert rank0[1] is None and rank0[0] == rank0[3] and rank0[2] != rank0[0]


def evaluation_rank(pp: int) -> tuple[float, float, bool]:
    module, optimizer = build(pp=pp)
    module.train()
    evaluated = evaluation_step(module, pairs(NUM_MICRO_BATCHES), mse)
    assert module.training and all(p.grad is None for p in module.parameters())  # mode restored, no backward
    trained = train_step(module, pairs(NUM_MICRO_BATCHES), optimizer, mse)
    return evaluated.loss, trained.loss, evaluated.global_grad_norm is None


@pytest.mark.distributed
def test_evaluation_step_matches_one_process_and_the_training_loss() -> None:
    (one,) = run_distributed(evaluation_rank, 1, 1)
    for evaluated, trained, no_norm in run_distributed(evaluation_rank, 2, 2, timeout_seconds=120):
        assert evaluated == pytest.approx(one[0], rel=1e-6) and trained == pytest.approx(evaluated, rel=1e-6)
        assert no_norm


def mode_rank() -> tuple[bool, bool, bool]:
    module, optimizer = build(lr=0.0)
    module.eval()
    train_step(module, pairs(1), optimizer, mse)
    all_training = all(m.training for m in module.modules())
    module.layers["1"].eval()  # e.g. a frozen layer the caller keeps in eval mode
    train_step(module, pairs(1), optimizer, mse)
    return all_training, module.training, module.layers["1"].training


@pytest.mark.distributed
def test_train_step_switches_an_eval_module_to_training_and_keeps_a_submodule_in_eval() -> None:
    assert run_distributed(mode_rank, 1) == [(True, True, False)]


def test_the_step_is_one_short_function() -> None:
    lines = inspect.getsource(train_step).splitlines()
    assert len(lines) < 80, f"train_step is {len(lines)} lines; the step stays one function under 80"


def test_a_batch_that_cannot_move_is_refused_with_what_to_add() -> None:
    from scaling.trainer._placement import to_device

    assert to_device(None, torch.device("cpu")) is None  # a rank that reads no data
    batch = pairs(1)[0]
    assert to_device(batch, torch.device("cpu")).x is batch.x  # already there: no copy
    with pytest.raises(TypeError, match=r"a batch of type list cannot be moved to cpu: it has no to\(device"):
        to_device([torch.ones(1)], torch.device("cpu"))
