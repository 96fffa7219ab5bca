"""The training script every process runs (started by the runner through torchrun).

It follows the walkthrough: context, layers as LayerSpecs in a ParallelModule, an
Optimizer over parameter groups, datasets, and a BaseTrainer.
"""

from __future__ import annotations

from pathlib import Path

from scaling.config import JsonDict, Metrics
from scaling.mlp.config import MLPConfig
from scaling.mlp.context import MLPContext
from scaling.mlp.data import MNISTDataset
from scaling.mlp.model import layer_specs, loss_function, metrics_aggregation_fn
from scaling.optim import Optimizer, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.pipeline import ParallelModule
from scaling.runner import load_payload
from scaling.topology import Topology
from scaling.trainer import BaseTrainer


def build_trainer(config: MLPConfig, topology: Topology) -> BaseTrainer[MLPContext]:
    """Everything of one rank, ready for ``run_training()``."""
    context = MLPContext(config=config, topology=topology)
    context.initialize(seed=config.trainer.seed)

    dataset = MNISTDataset(train=True, mnist_path=config.data.mnist_path)
    dataset_evaluation = MNISTDataset(train=False, mnist_path=config.data.mnist_path)

    arch = config.architecture
    parallel_module = ParallelModule(
        layer_specs=layer_specs(topology, dataset.num_features, arch.hidden_size, arch.num_blocks, arch.num_classes),
        topology=topology,
        seed=config.trainer.seed,
        static_shapes=config.training.static_shapes,
        compile=config.training.compile,
    )

    parameter_groups = [
        OptimizerParamGroup(
            named_parameters_with_meta=[(n, p, m) for n, p, m in parallel_module.named_parameters_with_meta()],
            config=OptimizerParamGroupConfig(
                name="weight_decay_params",
                weight_decay=config.training.weight_decay,
                learning_rate_scheduler=config.learning_rate_scheduler,
            ),
        ),
    ]
    optimizer = Optimizer(
        config=config.optimizer, parameter_groups=parameter_groups, topology=topology, model=parallel_module
    )

    return BaseTrainer(
        config=config.trainer,
        context=context,
        parallel_module=parallel_module,
        optimizer=optimizer,
        dataset=dataset,
        dataset_evaluation=dataset_evaluation,
        sync_batch_to_model_parallel=dataset.sync_batch_to_model_parallel,
        metrics_aggregation_fn=metrics_aggregation_fn,
        loss_function=loss_function,
    )


def main(payload: JsonDict | None = None) -> list[Metrics]:
    """Train with the config in ``payload`` (default: the one the runner handed over)."""
    config = MLPConfig.from_dict(payload if payload is not None else load_payload())
    topology = Topology.from_env(config.topology)
    trainer = build_trainer(config, topology)
    history = trainer.run_training(return_metrics=True) or []
    if config.data.plot and topology.global_rank == 0 and config.logger.log_dir is not None:
        from scaling.mlp.plot import plot_history, read_metrics

        # The whole run's rows, a resumed run's earlier attempts included (metrics.jsonl), where kept.
        rows = Path(config.logger.log_dir) / "metrics.jsonl"
        plot_history(read_metrics(rows) if rows.is_file() else history, Path(config.logger.log_dir) / "training.png")
    topology.destroy()
    return history


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # torchrun then reports this rank's exception, and scaling-run names it in its summary.
    record(main)()
