"""A tiny classifier with dropout, its dataset and a worker that trains it with BaseTrainer."""

from __future__ import annotations

import hashlib
import os
import signal
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from scaling.config import BaseConfig
from scaling.data import BaseDataset, BaseDatasetBatch, BaseDatasetItem
from scaling.nn import BaseLayer, ColumnParallelLinear, LayerSpec, RowParallelLinear
from scaling.optim import Optimizer, OptimizerConfig, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.pipeline import ParallelModule
from scaling.testing import make_topology
from scaling.trainer import BaseContext, BaseTrainer, TrainerConfig


@dataclass
class Item(BaseDatasetItem):
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Batch(BaseDatasetBatch):
    x: torch.Tensor | None
    y: torch.Tensor | None

    def only_inputs(self) -> Batch:
        return Batch(self.x, None)

    def only_targets(self) -> Batch:
        return Batch(None, self.y)


class Blobs(BaseDataset[Item, Batch]):
    """Four Gaussian blobs in 8 dimensions (fixed seed)."""

    def __init__(self, n: int = 256) -> None:
        rng = np.random.default_rng(0)
        centers = rng.normal(size=(4, 8)) * 3
        labels = rng.integers(0, 4, n)
        self.x = torch.from_numpy((centers[labels] + rng.normal(size=(n, 8))).astype(np.float32))
        self.y = torch.from_numpy(labels.astype(np.int64))

    def ident(self) -> str:
        return "blobs"

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Item:
        return Item(self.x[i], self.y[i])

    def collate(self, items: list[Item]) -> Batch:
        return Batch(torch.stack([i.x for i in items]), torch.stack([i.y for i in items]))


@dataclass
class IO:
    h: torch.Tensor


class Hidden(BaseLayer[Any, IO]):
    def __init__(self, topology: Any) -> None:
        super().__init__()
        self.linear = ColumnParallelLinear(8, 16, parallel_output=True, topology=topology)

    def forward(self, batch: Batch) -> IO:
        # Dropout on a TP-sharded activation draws from the TP-specific stream.
        return IO(F.dropout(torch.relu(self.linear(batch.x)), p=0.2, training=self.training))


class Head(BaseLayer[IO, IO]):
    def __init__(self, topology: Any) -> None:
        super().__init__()
        self.linear = RowParallelLinear(16, 4, parallel_input=True, topology=topology)

    def forward(self, x: IO) -> IO:
        return IO(self.linear(x.h))


def loss_function(out: IO, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return F.cross_entropy(out.h, batch.y), {"accuracy": (out.h.argmax(1) == batch.y).float().mean()}


class AppConfig(BaseConfig):
    _require_descriptions = False
    trainer: TrainerConfig


def param_hash(module: ParallelModule) -> str:
    h = hashlib.sha256()
    for name, p, _ in module.named_parameters_with_meta():
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def build_trainer(
    tp: int,
    pp: int,
    trainer: dict[str, Any],
    zero_stage: int = 1,
    loss: Any = loss_function,
    shard: int | None = None,
    dataset: Blobs | None = None,
) -> BaseTrainer[Any]:
    """The classifier at (tp, pp) with ZeRO ``zero_stage``, ready to train under ``trainer`` settings.

    ``shard``: HSDP's ``data_parallel_shard_size`` (with ``zero_stage=3``); ``dataset``: default ``Blobs()``.

    With pipeline parallelism the optimizer overlaps its parameter gather with the next
    forward (``overlap_param_gather``), so resume tests cover that path too.
    """
    topology = make_topology(
        model_parallel_size=tp,
        pipe_parallel_size=pp,
        global_batch_size=16,
        micro_batch_size=4,
        data_parallel_shard_size=shard,
    )
    config = AppConfig(trainer=TrainerConfig(**trainer))
    context = BaseContext(config=config, topology=topology)
    context.initialize(seed=config.trainer.seed)
    module = ParallelModule(
        [LayerSpec(Hidden, topology=topology), LayerSpec(Head, topology=topology)], topology, seed=1
    )
    group = OptimizerParamGroup(
        named_parameters_with_meta=list(module.named_parameters_with_meta()),
        config=OptimizerParamGroupConfig(name="all", weight_decay=0.01),
    )
    overlap = pp > 1 and zero_stage in (1, 2)
    optimizer_config = OptimizerConfig(zero_stage=zero_stage, overlap_param_gather=overlap)
    optimizer = Optimizer(optimizer_config, [group], topology, model=module)
    dataset = dataset if dataset is not None else Blobs()
    return BaseTrainer(
        config=config.trainer,
        context=context,
        parallel_module=module,
        optimizer=optimizer,
        dataset=dataset,
        dataset_evaluation=None,
        sync_batch_to_model_parallel=dataset.sync_batch_to_model_parallel,
        metrics_aggregation_fn=None,
        loss_function=loss,
    )


def train_worker(
    tp: int, pp: int, trainer: dict[str, Any], zero_stage: int = 1, sigterm_at: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Train on this rank; ``sigterm_at=(rank, step)`` sends SIGTERM to that rank during that step."""
    built: list[BaseTrainer[Any]] = []

    def loss_with_signal(out: IO, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        context = built[0].context
        if sigterm_at is not None and (context.topology.global_rank, context.iterations + 1) == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss_function(out, batch)

    trainer_obj = build_trainer(tp, pp, trainer, zero_stage, loss_with_signal)
    built.append(trainer_obj)
    context, module = trainer_obj.context, trainer_obj.parallel_module
    try:
        history = trainer_obj.run_training(return_metrics=True) or []
    except SystemExit as exc:
        return {"exit_code": exc.code, "step": context.iterations}
    return {"losses": [m["training/loss"] for m in history], "hash": param_hash(module), "step": context.iterations}
