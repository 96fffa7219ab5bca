"""DataParallel, the sharding component (#48): the optimizer only updates what it is handed.

The numbers (parity of every ZeRO stage, HSDP, offload and experts with one process) are
test_parity.py's and test_zero3.py's, which run through the Optimizer that builds this
component; here: the contract between the two, and the optimizer's source kept free of
data parallelism's modes.
"""

import ast
import inspect
import os
import sys

import pytest
import torch

import scaling.optim._optimizer
from scaling.optim import DataParallel, Optimizer, OptimizerConfig
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from optim_models import model  # noqa: E402

MODES = {
    "zero0": {"zero_stage": 0},
    "zero1": {"zero_stage": 1},
    "zero1-overlap": {"zero_stage": 1, "overlap_param_gather": True},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "zero1-offload": {"zero_stage": 1, "cpu_offload": True},
    "zero3-offload": {"zero_stage": 3, "cpu_offload": True},
}


def _one_update_per_slot(settings: dict) -> tuple[list[int], list[str], float]:
    """One step of a DataParallel on its own: each slot handed to ``update`` how many times,
    on which device, and the largest difference of the handed gradients from the DP mean."""
    topo = make_topology()
    layers, groups = model()
    dp = DataParallel(OptimizerConfig(**settings), groups, topo, model=None)
    dp.attach_model([layers[0], layers[2]] if settings["zero_stage"] == 3 else layers)
    torch.manual_seed(1 + topo.axis("dp").rank)  # each rank its own batch
    x = torch.randn(4, 6)
    dp.zero_grad()
    dp.set_gradient_accumulation_steps(1)
    layers(x).pow(2).mean().backward()
    grads = dp.reduced_grads()
    # The reference: the full gradient of the mean loss over both ranks' batches, in one process.
    reference_layers, _ = model()
    batches = []
    for rank in range(topo.axis("dp").size):
        torch.manual_seed(1 + rank)
        batches.append(torch.randn(4, 6))
    sum(reference_layers(b).pow(2).mean() for b in batches).div(len(batches)).backward()
    full = {n: p.grad.reshape(-1) for n, p in zip(_names(layers), reference_layers.parameters())}
    error = max(
        (g.cpu() - full[s.name][s.start : s.end]).abs().max().item() if g.numel() else 0.0
        for s, g in zip(dp.slots, grads)
    )
    calls = [0] * len(dp.slots)
    devices: list[str] = []

    def update(indices: list[int], owned: list[torch.Tensor]) -> None:
        for i, g in zip(indices, owned):
            calls[i] += 1
            devices.append(g.device.type)

    dp.update(grads, update)
    dp.finish_parameter_gather()  # the offloaded ZeRO-3 update runs in a thread until here
    dp.end_step()
    return calls, sorted(set(devices)), error


def _names(layers: torch.nn.Module) -> list[str]:
    return [p.parameter_meta.key for p in layers.parameters()]


QUICK = ("zero1", "zero3-offload")  # the rest in the slow tier (the quick one stays under 2 minutes)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [m if m in QUICK else pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_update_is_handed_each_owned_gradient_once_in_every_mode(mode: str) -> None:
    for calls, devices, error in run_distributed(_one_update_per_slot, 2, MODES[mode], timeout_seconds=60):
        assert calls == [1] * len(calls), f"{mode}: update called {calls} times per slot"
        assert devices == ["cpu"]
        assert error < 1e-6, f"{mode}: the handed gradients are not the DP mean of the owned elements"


def test_the_optimizer_has_no_branch_on_data_parallel_modes_and_installs_no_hook() -> None:
    tree = ast.parse(inspect.getsource(scaling.optim._optimizer))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Optimizer"]
    assert cls.end_lineno is not None and cls.end_lineno - cls.lineno + 1 <= 200, "Optimizer grew past 200 lines"
    modes = {"zero_stage", "cpu_offload", "overlap_param_gather", "gatherer", "spaces", "shard_gather"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            read = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
            assert not read & modes, f"line {node.lineno}: the optimizer branches on {sorted(read & modes)}"
        if isinstance(node, ast.Attribute):
            assert "hook" not in node.attr, f"line {node.lineno}: the optimizer touches a hook ({node.attr})"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            assert not (module or "").startswith("scaling.nn"), f"the optimizer imports {module}"


def _built() -> tuple[bool, bool, bool]:
    layers, groups = model()
    opt = Optimizer(OptimizerConfig(zero_stage=1), groups, make_topology())
    names = [s.name for s in opt.slots] == _names(layers)
    return isinstance(opt.data_parallel, DataParallel), opt.slots is opt.data_parallel.slots, names


@pytest.mark.distributed
def test_the_optimizer_builds_one_component_and_shares_its_slots() -> None:
    assert run_distributed(_built, 1) == [(True, True, True)]
