"""The MLP: column- and row-parallel linear layers as LayerSpecs, its loss and metrics.

Layers alternate column-parallel (output split over TP) and row-parallel (input split
over TP, output all-reduced), so a pair needs one all-reduce in forward and one in
backward, and activations between a pair stay sharded, also across a pipeline stage
boundary. With ``num_blocks`` pairs the model has ``2 * num_blocks`` pipeline layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as f

from scaling.mlp.data import MNISTDatasetBatch
from scaling.nn import BaseLayer, ColumnParallelLinear, LayerSpec, RowParallelLinear
from scaling.topology import Topology


@dataclass
class MLPLayerIO:
    activations: torch.Tensor


# Any: the first layer takes the batch, the others an MLPLayerIO.
class MLPBaseLayer(BaseLayer[Any, MLPLayerIO]):
    """Takes the batch (first layer) or the previous layer's :class:`MLPLayerIO`."""

    @staticmethod
    def _inputs(x: MLPLayerIO | MNISTDatasetBatch) -> torch.Tensor:
        if isinstance(x, MNISTDatasetBatch):
            assert x.inputs is not None  # the first stage always receives inputs
            return torch.flatten(x.inputs, start_dim=1)
        return x.activations


class MLPLayerColumnParallel(MLPBaseLayer):
    """Column-parallel linear + ReLU; the output stays split over TP."""

    def __init__(self, in_features: int, out_features: int, topology: Topology | None = None) -> None:
        super().__init__()
        self.linear = ColumnParallelLinear(
            in_features=in_features, out_features=out_features, parallel_output=True, topology=topology
        )

    def forward(self, x: MLPLayerIO | MNISTDatasetBatch) -> MLPLayerIO:
        return MLPLayerIO(activations=f.relu(self.linear(self._inputs(x))))


class MLPLayerRowParallel(MLPBaseLayer):
    """Row-parallel linear (input split over TP), ReLU unless it is the output layer."""

    def __init__(
        self, in_features: int, out_features: int, topology: Topology | None = None, activation: bool = True
    ) -> None:
        super().__init__()
        self.activation = activation
        self.linear = RowParallelLinear(
            in_features=in_features, out_features=out_features, parallel_input=True, topology=topology
        )

    def forward(self, x: MLPLayerIO | MNISTDatasetBatch) -> MLPLayerIO:
        out = self.linear(self._inputs(x))
        return MLPLayerIO(activations=f.relu(out) if self.activation else out)


def layer_specs(
    topology: Topology | None, in_features: int, hidden_size: int, num_blocks: int, num_classes: int
) -> list[LayerSpec]:
    """``num_blocks`` (column, row) pairs: in -> hidden -> ... -> num_classes."""
    specs = []
    for block in range(num_blocks):
        first, last = block == 0, block == num_blocks - 1
        specs.append(
            LayerSpec(
                module_class=MLPLayerColumnParallel,
                topology=topology,
                in_features=in_features if first else hidden_size,
                out_features=hidden_size,
            )
        )
        specs.append(
            LayerSpec(
                module_class=MLPLayerRowParallel,
                topology=topology,
                in_features=hidden_size,
                out_features=num_classes if last else hidden_size,
                activation=not last,
            )
        )
    return specs


def loss_function(output: MLPLayerIO, batch: MNISTDatasetBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy and accuracy of one micro-batch."""
    assert batch.targets is not None  # the last stage always receives targets
    loss = f.cross_entropy(output.activations, batch.targets)
    accuracy = (output.activations.argmax(dim=1) == batch.targets).float().mean()
    return loss, {"accuracy": accuracy.detach()}


def metrics_aggregation_fn(topology: Topology, metrics: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Average each metric over this rank's micro-batches (the pipeline then averages over DP)."""
    return {key: torch.stack([m[key].float() for m in metrics]).mean() for key in metrics[0]}
