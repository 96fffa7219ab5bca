"""ParallelModule in one process (pp=1): building, seeding, names, running its schedules."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from scaling.nn import TiedLayerSpec
from scaling.pipeline import ParallelModule
from scaling.topology import Topology, TopologyConfig

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_test_model import Block, loss_function, micro_batches, specs  # noqa: E402


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


def test_initialisation_follows_the_runs_seed() -> None:
    # As in the walkthrough: BaseContext.initialize(seed=TrainerConfig.seed) seeds the
    # topology (seed_all), and a ParallelModule built without a seed takes it up.
    from scaling.topology import seed_all

    def first_weight(topo: Topology, **seed: int) -> torch.Tensor:
        return ParallelModule(specs(2), topo, **seed).layers["0"].linear.weight.detach()

    unseeded = topology()
    assert unseeded.seed is None and torch.equal(first_weight(unseeded), first_weight(unseeded, seed=42))
    runs = {}
    for run_seed in (7, 42):
        topo = topology()
        seed_all(run_seed, topo)
        assert topo.seed == run_seed
        runs[run_seed] = first_weight(topo)
        assert torch.equal(runs[run_seed], first_weight(topology(), seed=run_seed))
    assert not torch.equal(runs[7], runs[42])


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
def test_schedule_matches_plain_autograd(schedule: str) -> None:
    v = 2 if schedule == "interleaved_1f1b" else 1
    module = ParallelModule(specs(4), topology(), schedule=schedule, num_virtual_stages=v)
    batches = micro_batches(3)
    out = module.run_schedule(batches, loss_function)
    grads = {name: p.grad.clone() for name, p, _ in module.named_parameters_with_meta()}
    module.zero_grad()
    for i, b in enumerate(batches):  # one-process gradient accumulation
        loss, metrics = loss_function(module(b), b)
        (loss / len(batches)).backward()
        assert float(out.losses[i]) == pytest.approx(float(loss.detach()), rel=1e-6)
        assert set(out.metrics[i]) == set(metrics) == {"mean_output"}
    for name, p, _ in module.named_parameters_with_meta():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=0)


def test_loss_backward_and_scale_are_the_callers() -> None:
    # A mixed-precision caller scales the loss in its own backward; the split backward
    # (zb_h1's input pass) applies loss_scale itself. Both give scale x the plain gradients.
    plain = ParallelModule(specs(2), topology(), schedule="1f1b")
    plain.run_schedule(micro_batches(2), loss_function)
    for schedule in ("1f1b", "zb_h1"):
        module = ParallelModule(specs(2), topology(), schedule=schedule)
        seen: list[float] = []

        def scaled_backward(loss: torch.Tensor, seen: list[float] = seen) -> None:
            seen.append(float(loss.detach()))
            (loss * 8.0).backward()

        module.run_schedule(micro_batches(2), loss_function, loss_backward=scaled_backward, loss_scale=8.0)
        assert len(seen) == (2 if schedule == "1f1b" else 0), schedule
        for (_, p, _), (_, q, _) in zip(module.named_parameters_with_meta(), plain.named_parameters_with_meta()):
            torch.testing.assert_close(p.grad, 8.0 * q.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_forward_only_schedule_computes_no_gradients(schedule: str) -> None:
    v = 2 if schedule == "interleaved_1f1b" else 1
    module = ParallelModule(specs(2 * v), topology(), schedule=schedule, num_virtual_stages=v)
    out = module.run_schedule(micro_batches(2), loss_function, forward_only=True)
    with torch.no_grad():
        expected = [float(loss_function(module(b), b)[0]) for b in micro_batches(2)]
    assert [float(out.losses[i]) for i in range(2)] == pytest.approx(expected, rel=1e-6)
    assert all(p.grad is None for p in module.parameters())


def test_instruction_timings_are_recorded_when_asked() -> None:
    module = ParallelModule(specs(2), topology())
    module.run_schedule(micro_batches(1), loss_function)
    module.instruction_timings = []
    module.run_schedule(micro_batches(1), loss_function)
    assert [name for name, _, _ in module.instruction_timings] == [
        "LoadMicroBatch(mb=0)",
        "Forward(mb=0, chunk=0)",
        "Backward(mb=0, chunk=0)",
    ]
    assert all(start <= end for _, start, end in module.instruction_timings)


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


def test_tied_copies_name_every_other_layer_of_the_group() -> None:
    """With one stage the tied weight is one parameter (saved once); tied_copies names the keys the
    head's copy has at more stages, for the checkpointer to read it from."""
    tied = [
        TiedLayerSpec("tie", ["linear.weight"], Block, 6),
        *specs(2),
        TiedLayerSpec("tie", "linear.weight", Block, 6),
    ]
    module = ParallelModule(tied, topology())
    assert "layers.3.linear.weight" not in [n for n, _, _ in module.named_parameters_with_meta()]
    assert module.tied_copies() == {
        "layers.0.linear.weight": ["layers.3.linear.weight"],
        "layers.3.linear.weight": ["layers.0.linear.weight"],
    }
    assert ParallelModule(specs(2), topology()).tied_copies() == {}
