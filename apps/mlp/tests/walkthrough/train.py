"""The walkthrough's training script, from its code blocks (../shared/seeds/001_*.txt).

Only the imports and the pieces the walkthrough names without showing (MLPLayerIO,
MLPBaseLayer, MLPLayerRowParallel, the context set-up, the metrics aggregation and the
filled-in ``...`` arguments) are ours; every code block is pasted unmodified.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as f

from scaling.mlp.config import MLPConfig
from scaling.mlp.context import MLPContext
from scaling.mlp.data import MNISTDataset, MNISTDatasetBatch
from scaling.nn import BaseLayer, ColumnParallelLinear, LayerSpec, RowParallelLinear
from scaling.optim import Optimizer, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.pipeline import ParallelModule
from scaling.runner import load_payload
from scaling.topology import Topology
from scaling.trainer import BaseTrainer


@dataclass
class MLPLayerIO:
    activations: torch.Tensor


class MLPBaseLayer(BaseLayer[MLPLayerIO, MLPLayerIO, MLPLayerIO]):  # input, output, last-layer output
    pass


class MLPLayerRowParallel(MLPBaseLayer):
    def __init__(self, in_features: int, out_features: int, topology: Topology):
        super().__init__()
        self.linear = RowParallelLinear(
            in_features=in_features, out_features=out_features, parallel_input=False, topology=topology
        )

    def forward(self, x: MNISTDatasetBatch) -> MLPLayerIO:
        return MLPLayerIO(activations=f.relu(self.linear(torch.flatten(x.inputs, start_dim=1))))


# ---- code block "1. Creating a Parallel Module" (the class) ----
class MLPLinearColumnParallel(MLPBaseLayer):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        topology: Topology,
    ):
        super().__init__()
        self.linear = ColumnParallelLinear(
            in_features=in_features,
            out_features=out_features,
            parallel_output=True,
            topology=topology,
        )

    def forward(self, x: MLPLayerIO) -> MLPLayerIO:
        preactivations = torch.flatten(x.activations, start_dim=1)
        preactivations = self.linear(preactivations)
        activations = f.relu(preactivations)
        return MLPLayerIO(activations=activations)


MLPLayerColumnParallel = MLPLinearColumnParallel  # the walkthrough uses both names


# ---- code block "3. Loss Function and Metrics Collection" ----
def loss_function(
    output: MLPLayerIO,
    batch: MNISTDatasetBatch,
) -> tuple[torch.Tensor, dict[str, float]]:

    loss = torch.nn.functional.cross_entropy(output.activations, torch.tensor(batch.targets, dtype=torch.long))

    accuracy = sum(output.activations.argmax(dim=1) == batch.targets) / batch.targets.shape[0]

    return loss, {"accuracy": accuracy}


def metrics_aggregation_fn(topology, metrics):
    return {k: sum(float(m[k]) for m in metrics) / len(metrics) for k in metrics[0]}


def main():
    config = MLPConfig.from_dict(load_payload())
    topology = Topology.from_env(config.topology)
    context = MLPContext(config=config, topology=topology)
    context.initialize(seed=config.trainer.seed)
    dataset = MNISTDataset(train=True, mnist_path=config.data.mnist_path)
    dataset_evaluation = MNISTDataset(train=False, mnist_path=config.data.mnist_path)

    # ---- code block "1. Creating a Parallel Module" (the specs) ----
    layer_specs = [
        LayerSpec(
            module_class=MLPLayerRowParallel,
            topology=context.topology,
            in_features=784,
            out_features=64,
        ),
        LayerSpec(
            module_class=MLPLayerColumnParallel,
            topology=context.topology,
            in_features=64,
            out_features=10,
        ),
    ]

    parallel_module = ParallelModule(
        layer_specs=layer_specs,
        topology=topology,
    )

    # ---- code block "2. Initializing the Optimizer" ----
    parameter_groups = [
        OptimizerParamGroup(
            named_parameters_with_meta=[(n, p, m) for n, p, m in parallel_module.named_parameters_with_meta()],
            config=OptimizerParamGroupConfig(
                name="weight_decay_params",
                weight_decay=context.config.training.weight_decay,
                learning_rate_scheduler=context.config.learning_rate_scheduler,
            ),
        ),
    ]

    optimizer = Optimizer(
        config=context.config.optimizer,
        parameter_groups=parameter_groups,
        topology=context.topology,
    )

    # ---- code block "Walkthrough" (the trainer), with the `...` filled in ----
    trainer = BaseTrainer(
        config=config.trainer,
        context=context,
        dataset=dataset,
        dataset_evaluation=dataset_evaluation,
        parallel_module=parallel_module,
        optimizer=optimizer,
        sync_batch_to_model_parallel=dataset.sync_batch_to_model_parallel,
        metrics_aggregation_fn=metrics_aggregation_fn,
        loss_function=loss_function,
    )

    trainer.run_training()


if __name__ == "__main__":
    main()
