"""ParallelModule in one process (pp=1): building, seeding, names, train/eval steps."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from scaling.pipeline import ParallelModule
from scaling.topology import Topology, TopologyConfig

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_test_model import GradCapture, loss_function, micro_batches, specs  # noqa: E402


def topology() -> Topology:
    return Topology(TopologyConfig(world_size=1, model_parallel_size=1, pipe_parallel_size=1, device="cpu"), 0)


def test_layers_seeded_by_index_and_outer_stream_untouched() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    module = ParallelModule(specs(3), topology(), seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    torch.manual_seed(7 + 2)
    reference = specs(3)[2].initialize()
    assert torch.equal(module.layers["2"].linear.weight, reference.linear.weight)


def test_names_and_metas_are_layout_independent() -> None:
    module = ParallelModule(specs(2), topology())
    rows = list(module.named_parameters_with_meta())
    assert [n for n, _, _ in rows] == [
        "layers.0.linear.weight",
        "layers.0.linear.bias",
        "layers.1.linear.weight",
        "layers.1.linear.bias",
    ]
    assert all(meta.key == name for name, _, meta in rows)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b"])
def test_train_step_matches_plain_autograd(schedule: str) -> None:
    v = 2 if schedule == "interleaved_1f1b" else 1
    module = ParallelModule(specs(4), topology(), schedule=schedule, num_virtual_stages=v)
    batches = micro_batches(3)
    optimizer = GradCapture(module)
    out = module.train_step(batches, optimizer, loss_function)
    module.zero_grad()
    losses = []
    for b in batches:  # one-process gradient accumulation
        loss = loss_function(module(b), b)[0]
        (loss / len(batches)).backward()
        losses.append(float(loss.detach()))
    assert out.loss == pytest.approx(sum(losses) / 3, rel=1e-6)
    for name, p, _ in module.named_parameters_with_meta():
        torch.testing.assert_close(optimizer.grads[name], p.grad, rtol=1e-6, atol=0)
    assert set(out.metrics) == {"mean_output"} and out.step_duration > 0


def test_train_step_switches_an_eval_module_to_training_and_keeps_a_submodule_in_eval() -> None:
    module = ParallelModule(specs(2), topology())
    module.eval()
    module.train_step(micro_batches(1), GradCapture(module), loss_function)
    assert all(m.training for m in module.modules())
    module.layers["1"].eval()  # e.g. a frozen layer the caller keeps in eval mode
    module.train_step(micro_batches(1), GradCapture(module), loss_function)
    assert module.training and not module.layers["1"].training


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_evaluation_step_is_forward_only(schedule: str) -> None:
    v = 2 if schedule == "interleaved_1f1b" else 1
    module = ParallelModule(specs(2 * v), topology(), schedule=schedule, num_virtual_stages=v)
    out = module.evaluation_step(micro_batches(2), loss_function)
    with torch.no_grad():
        expected = sum(float(loss_function(module(b), b)[0]) for b in micro_batches(2)) / 2
    assert out.loss == pytest.approx(expected, rel=1e-6)
    assert all(p.grad is None for p in module.parameters()) and out.global_grad_norm is None


def test_bad_schedule_and_virtual_stages() -> None:
    with pytest.raises(ValueError, match=r"schedule='2f2b' is unknown; choose one of \['1f1b', 'gpipe'"):
        ParallelModule(specs(2), topology(), schedule="2f2b")
    with pytest.raises(ValueError, match=r"num_virtual_stages=2 needs schedule='interleaved_1f1b'"):
        ParallelModule(specs(4), topology(), num_virtual_stages=2)


def test_interleaved_needs_layers_divisible_into_virtual_stages() -> None:
    topo = Topology(TopologyConfig(world_size=2, model_parallel_size=1, pipe_parallel_size=2, device="cpu"), 0)
    with pytest.raises(
        ValueError, match=r"num_layers=6 is not divisible into pipe_parallel_size=2 x num_virtual_stages=2 = 4"
    ):
        ParallelModule(specs(6), topo, schedule="interleaved_1f1b", num_virtual_stages=2)


def test_executor_grad_leaves_follow_the_transport_flatten_order() -> None:
    import dataclasses
    from typing import NamedTuple

    from scaling.collectives import tensors_requiring_grad
    from scaling.pipeline._executor import _grad_leaves

    @dataclasses.dataclass
    class Hidden:
        mask: torch.Tensor
        h: torch.Tensor
        extra: dict[str, object]

    class Pair(NamedTuple):
        a: torch.Tensor
        b: object

    def leaf(requires_grad: bool) -> torch.Tensor:
        return torch.ones(2, requires_grad=requires_grad)

    obj = [
        Hidden(leaf(False), leaf(True), {"z": leaf(True), "n": None, "s": "x", "t": (leaf(True), 3)}),
        Pair(leaf(True), {"deep": [leaf(False), leaf(True)]}),
        leaf(True),
        2.5,
    ]
    expected = tensors_requiring_grad(obj)
    got = _grad_leaves(obj)
    assert len(got) == len(expected) == 6
    assert all(g is e for g, e in zip(got, expected))
    assert all(g is e for g, e in zip(_grad_leaves(obj), expected))  # cached field names: the same walk
