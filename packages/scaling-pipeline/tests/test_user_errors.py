"""Layers written in the original library's style: they run, or fail with errors that name the layer and the fix."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from scaling.nn import BaseLayer, ColumnParallelLinear, LayerInputError, LayerSpec, RowParallelLinear
from scaling.pipeline import ParallelModule
from scaling.testing import make_topology, run_distributed

pytestmark = pytest.mark.distributed


@dataclass
class Digits:
    inputs: torch.Tensor
    targets: torch.Tensor

    def only_inputs(self) -> Digits:
        return self

    def only_targets(self) -> Digits:
        return self


@dataclass
class IO:
    activations: torch.Tensor


class RowFirst(BaseLayer[Digits, IO, IO]):  # the original library's three type parameters
    def __init__(self, topology: object, parallel_input: bool) -> None:
        super().__init__()
        self.linear = RowParallelLinear(784, 64, parallel_input=parallel_input, topology=topology)

    def forward(self, x: Digits) -> IO:
        return IO(torch.relu(self.linear(x.inputs)))


class ColumnLast(BaseLayer[IO, IO, IO]):
    def __init__(self, topology: object) -> None:
        super().__init__()
        self.linear = ColumnParallelLinear(64, 10, parallel_output=True, topology=topology)

    def forward(self, x: IO) -> IO:
        return IO(self.linear(x.activations))


def cross_entropy(output: IO, batch: Digits) -> tuple[torch.Tensor, dict]:
    return torch.nn.functional.cross_entropy(output.activations, batch.targets), {}


def run(parallel_input: bool) -> str:
    topo = make_topology(model_parallel_size=2)
    specs = [LayerSpec(RowFirst, topo, parallel_input), LayerSpec(ColumnLast, topo)]
    module = ParallelModule(specs, topo)
    batch = Digits(torch.randn(8, 784), torch.full((8,), 9))
    try:
        module.run_schedule([batch], cross_entropy)
    except (LayerInputError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_whole_input_to_a_row_parallel_first_layer_names_the_layer_and_the_fix() -> None:
    for message in run_distributed(run, 2, True):
        assert message == (
            "LayerInputError: layer 0 (RowFirst): RowParallelLinear(784 -> 64) got an input of shape [8, 784], "
            "the whole input; with parallel_input=True it takes this rank's split, [..., 392] at "
            "model_parallel_size=2: pass parallel_input=False to split a whole input here, or feed it a "
            "ColumnParallelLinear with parallel_output=True"
        )


def test_split_logits_reaching_the_loss_name_the_last_layer_and_the_fix() -> None:
    for message in run_distributed(run, 2, False):
        assert message.startswith(
            "ValueError: the loss function failed on the output of the last layer (layer 1, ColumnLast), which "
            "is split over tensor parallelism: its ColumnParallelLinear 'linear' has parallel_output=True at "
            "model_parallel_size=2, so each rank's output holds 5 of its 10 features. Set parallel_output=False "
            "on that layer, or compute the loss with scaling.nn.vocab_parallel_cross_entropy (it takes split "
            "logits); the error was: IndexError: Target 9 is out of bounds."
        ), message


class PlainIO:  # the original library's LayerIO style: a plain class, no @dataclass
    def __init__(self, activations: torch.Tensor) -> None:
        self.activations = activations


class Tanh(BaseLayer[PlainIO, PlainIO, PlainIO]):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x: PlainIO | Digits) -> PlainIO:
        h = x.inputs if isinstance(x, Digits) else x.activations
        return PlainIO(torch.tanh(self.linear(h)))


def mse(output: PlainIO, batch: Digits) -> tuple[torch.Tensor, dict]:
    return torch.nn.functional.mse_loss(output.activations, batch.targets), {}


def plain_io(pp: int) -> float | None:
    topo = make_topology(pipe_parallel_size=pp)
    module = ParallelModule([LayerSpec(Tanh) for _ in range(4)], topo, seed=3)
    g = torch.Generator().manual_seed(0)
    batches = [Digits(torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)) for _ in range(2)]
    out = module.run_schedule(batches, mse)
    return sum(float(v) for v in out.losses.values()) / 2 if out.losses else None


def test_plain_class_layer_io_crosses_pipeline_stages() -> None:
    (one,) = run_distributed(plain_io, 1, 1)
    first, last = run_distributed(plain_io, 2, 2)
    assert first is None and last == pytest.approx(one, rel=1e-6)
