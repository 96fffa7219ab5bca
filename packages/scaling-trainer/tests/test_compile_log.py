"""The step log names each recompilation of a compiled layer and why (Dynamo's failed guard)."""

import logging

import torch

from scaling.nn import CompileConfig, compile_layer
from scaling.trainer._compiled import CompileLog


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.compile_config = CompileConfig(enabled=True, backend="eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


def test_not_compiled_adds_nothing():
    assert CompileLog(torch.nn.Linear(2, 2), 0, torch.device("cpu")).step_metrics(1) == {}


def test_recompiles_are_logged_with_the_reason(caplog):
    module = Tiny()
    compile_layer(module, module.compile_config)
    torch._dynamo.reset()
    log = CompileLog(module, 0, torch.device("cpu"))
    module(torch.randn(2, 4))
    first = log.step_metrics(1)
    assert first["compile/graphs"] >= 1 and first["compile/recompiles"] == 0
    module(torch.randn(2, 4))
    assert log.step_metrics(2)["compile/recompiles"] == 0  # warm
    with caplog.at_level(logging.WARNING, logger="scaling.trainer"):
        module(torch.randn(3, 4))  # a new batch size
        third = log.step_metrics(3)
    assert third["compile/recompiles"] == 1 and third["compile/graphs"] == first["compile/graphs"] + 1
    (record,) = [r for r in caplog.records if "recompiled" in r.getMessage()]
    assert record.getMessage().startswith(
        "rank 0, step 3: compiled code recompiled (a layer or the loss): Tiny.forward: "
    )
    assert "size mismatch" in record.getMessage()


class Printing(Tiny):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        print("", end="")  # Dynamo cannot trace print: the graph breaks here
        return y.relu()


def test_graph_breaks_are_counted_and_logged(caplog):
    module = Printing()
    compile_layer(module, module.compile_config)
    torch._dynamo.reset()
    log = CompileLog(module, 0, torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="scaling.trainer"):
        module(torch.randn(2, 4))
        metrics = log.step_metrics(1)
    assert metrics["compile/graph_breaks"] >= 1
    (record,) = [r for r in caplog.records if "graph break" in r.getMessage()]
    assert "print" in record.getMessage()
