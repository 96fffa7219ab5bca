"""A tiny MLP as LayerSpecs, shared by the module and parity tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scaling.nn import BaseLayer, LayerSpec


@dataclass
class IO:
    activations: torch.Tensor


@dataclass
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor

    def only_inputs(self) -> IO:
        return IO(self.inputs)

    def only_targets(self) -> Batch:
        return Batch(self.inputs[:0], self.targets)


class Block(BaseLayer[IO, IO]):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: IO) -> IO:
        return IO(torch.tanh(self.linear(x.activations)))


def specs(num_layers: int = 4, width: int = 6) -> list[LayerSpec]:
    return [LayerSpec(Block, width) for _ in range(num_layers)]


def loss_function(output: IO, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = torch.nn.functional.mse_loss(output.activations, batch.targets)
    return loss, {"mean_output": output.activations.detach().mean()}


def micro_batches(num: int, width: int = 6, seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [Batch(torch.randn(3, width, generator=g), torch.randn(3, width, generator=g)) for _ in range(num)]
