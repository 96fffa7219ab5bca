"""pp = 2 and 4 with each schedule match one process: losses and every gradient (fp32, 1e-6 rel).

The stages run ``ParallelModule.run_schedule`` (and, with tied layers, ``reduce_tied_gradients``),
as the trainer's step does; the step's result broadcast and update are tested in scaling-trainer.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import scaling.collectives
from scaling.nn import TiedLayerSpec
from scaling.pipeline import ParallelModule
from scaling.testing import assert_parity, make_topology, run_distributed
from scaling.topology import Topology, TopologyConfig

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_test_model import Block, loss_function, micro_batches, specs  # noqa: E402

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not hasattr(scaling.collectives, "PipeTransport"),
        reason="scaling.collectives.PipeTransport is not available yet (collectives issue)",
    ),
]

NUM_LAYERS, NUM_MICRO_BATCHES = 8, 4


def reference(schedule: str) -> tuple[float, dict[str, torch.Tensor]]:
    topo = Topology(TopologyConfig(world_size=1, model_parallel_size=1, pipe_parallel_size=1, device="cpu"), 0)
    module = ParallelModule(specs(NUM_LAYERS), topo)
    losses = []
    for b in micro_batches(NUM_MICRO_BATCHES):
        loss = loss_function(module(b), b)[0]
        (loss / NUM_MICRO_BATCHES).backward()
        losses.append(float(loss.detach()))
    return sum(losses) / NUM_MICRO_BATCHES, {n: p.grad.clone() for n, p, _ in module.named_parameters_with_meta()}


def run_once(module: ParallelModule, batches: list) -> tuple[float | None, dict[str, torch.Tensor]]:
    """One schedule from zero gradients: (mean loss on the last stage, else None; this stage's gradients)."""
    module.zero_grad(set_to_none=True)
    out = module.run_schedule(batches, loss_function)
    module.reduce_tied_gradients()
    loss = sum(float(v) for v in out.losses.values()) / len(out.losses) if out.losses else None
    return loss, {n: p.grad.clone() for n, p, _ in module.named_parameters_with_meta()}


def check_losses(losses: list[float | None], ref_loss: float, num_pipes: int = 1) -> None:
    """The last stage of each pipe reports the loss; no other stage computes one."""
    reported = [loss for loss in losses if loss is not None]
    assert len(reported) == num_pipes
    assert reported == pytest.approx([ref_loss] * num_pipes, rel=1e-6)


def pipeline_rank(pp: int, schedule: str, static_shapes: bool = False) -> tuple[float | None, dict[str, torch.Tensor]]:
    topo = make_topology(pipe_parallel_size=pp)
    module = ParallelModule(specs(NUM_LAYERS), topo, schedule=schedule, static_shapes=static_shapes)
    return run_once(module, micro_batches(NUM_MICRO_BATCHES))


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_pipeline_matches_one_process(pp: int, schedule: str) -> None:
    results = run_distributed(pipeline_rank, pp, pp, schedule, timeout_seconds=120)
    ref_loss, ref_grads = reference(schedule)
    check_losses([loss for loss, _ in results], ref_loss)
    grads: dict[str, torch.Tensor] = {}
    for _, rank_grads in results:
        assert not set(grads) & set(rank_grads)  # each layer lives on exactly one stage
        grads.update(rank_grads)
    assert_parity(grads, ref_grads, rtol=1e-6, atol=1e-9, name="grads")


@pytest.mark.parametrize("pp", [2, 4])
def test_static_shapes_match_one_process(pp: int) -> None:
    # Headerless hand-offs after each channel's first message: the same losses and gradients.
    results = run_distributed(pipeline_rank, pp, pp, "1f1b", True, timeout_seconds=120)
    ref_loss, ref_grads = reference("1f1b")
    check_losses([loss for loss, _ in results], ref_loss)
    grads: dict[str, torch.Tensor] = {}
    for _, rank_grads in results:
        grads.update(rank_grads)
    assert_parity(grads, ref_grads, rtol=1e-6, atol=1e-9, name="grads")


#: Where each schedule with two chunks per stage puts stage s's chunks (virtual stages).
TWO_CHUNKS = {
    "interleaved_1f1b": lambda s, pp: (s, pp + s),  # a loop: layers far apart in the model
    "zb_v": lambda s, pp: (s, 2 * pp - 1 - s),  # a V: down the stages and back up
}


def two_chunk_rank(pp: int, schedule: str, static_shapes: bool = False) -> tuple[float | None, dict[str, torch.Tensor]]:
    topo = make_topology(pipe_parallel_size=pp)
    module = ParallelModule(
        specs(NUM_LAYERS), topo, schedule=schedule, num_virtual_stages=2, static_shapes=static_shapes
    )
    s = topo.axis("pp").rank
    assert [list(r) for r in module.chunks] == [list(module.partition[vs]) for vs in TWO_CHUNKS[schedule](s, pp)]
    batches = micro_batches(NUM_MICRO_BATCHES)
    run_once(module, batches)
    transports = module.transports
    assert transports.training is not None and transports.forward_only is None
    handshakes = transports.training.handshakes_received
    # A second run gives the same result without a handshake: the transport and its
    # shape cache live as long as the module.
    loss, grads = run_once(module, batches)
    assert transports.training.handshakes_received == handshakes
    if schedule == "interleaved_1f1b":
        assert handshakes == 2  # activations and gradients, once
    else:
        assert (loss is not None) == (s == 0)  # the last virtual stage, with the loss, is on stage 0
    # Forward-only evaluation on a transport of its own (no grad: the activations' metadata
    # differs), which leaves the training transport's cache alone.
    evaluated = module.run_schedule(batches, loss_function, forward_only=True)
    if loss is not None:
        assert sum(float(v) for v in evaluated.losses.values()) / NUM_MICRO_BATCHES == pytest.approx(loss, rel=1e-6)
    assert transports.forward_only is not None
    if schedule == "interleaved_1f1b":
        assert transports.forward_only.handshakes_received == 1
    run_once(module, batches)
    assert transports.training.handshakes_received == handshakes
    return loss, grads


@pytest.mark.parametrize("schedule", sorted(TWO_CHUNKS))
@pytest.mark.parametrize(("world", "pp", "static_shapes"), [(2, 2, False), (4, 4, False), (4, 2, False), (2, 2, True)])
def test_two_chunks_per_stage_match_one_process(world: int, pp: int, static_shapes: bool, schedule: str) -> None:
    # Interleaved: activations go round the ring (last stage -> first stage's second chunk)
    # through the batched exchanges. ZB-V: stage 0 computes the first layers and the loss, the
    # last stage turns the micro-batch round without a message, and each stage talks to both of
    # its neighbours in both directions. (4, 2) is dp2 x pp2, where every data-parallel replica
    # sees the same micro-batches; with static shapes the hand-offs go without headers.
    results = run_distributed(two_chunk_rank, world, pp, schedule, static_shapes, timeout_seconds=120)
    ref_loss, ref_grads = reference(schedule)
    check_losses([loss for loss, _ in results], ref_loss, num_pipes=world // pp)
    grads: dict[str, torch.Tensor] = {}
    for _, rank_grads in results:
        for name, grad in rank_grads.items():
            assert_parity(grad, ref_grads[name], rtol=1e-6, atol=1e-9, name=name)
        grads.update(rank_grads)
    assert set(grads) == set(ref_grads)  # every layer's gradient was checked
    assert len(results[0][1]) == len(ref_grads) // pp  # each rank holds 2 chunks of NUM_LAYERS / (2 pp) layers


def tied_specs() -> list:
    # Layers 0 and 3 share linear.weight (as an input embedding and an LM head would).
    return [
        TiedLayerSpec("tie", ["linear.weight"], Block, 6),
        *specs(2),
        TiedLayerSpec("tie", ["linear.weight"], Block, 6),
    ]


def tied_rank(pp: int) -> tuple[float | None, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    topo = make_topology(pipe_parallel_size=pp)
    module = ParallelModule(tied_specs(), topo, schedule="1f1b")
    weights = {n: p.detach().clone() for n, p, _ in module.named_parameters_with_meta()}
    loss, grads = run_once(module, micro_batches(NUM_MICRO_BATCHES))  # the tied sum included
    return loss, weights, grads


@pytest.mark.parametrize("pp", [2, 4])
def test_tied_layers_across_stages_match_one_process(pp: int) -> None:
    results = run_distributed(tied_rank, pp, pp, timeout_seconds=120)
    topo = Topology(TopologyConfig(world_size=1, model_parallel_size=1, pipe_parallel_size=1, device="cpu"), 0)
    ref = ParallelModule(tied_specs(), topo)
    ref_weights = {n: p.detach().clone() for n, p, _ in ref.named_parameters_with_meta()}
    assert "layers.3.linear.weight" not in ref_weights  # one Parameter in one process
    ref_loss = 0.0
    for b in micro_batches(NUM_MICRO_BATCHES):
        loss = loss_function(ref(b), b)[0]
        (loss / NUM_MICRO_BATCHES).backward()
        ref_loss += float(loss.detach()) / NUM_MICRO_BATCHES
    ref_grads = {n: p.grad for n, p, _ in ref.named_parameters_with_meta()}
    check_losses([loss for loss, _, _ in results], ref_loss)
    for _, weights, grads in results:
        for name in weights:
            twin = "layers.0.linear.weight" if name == "layers.3.linear.weight" else name
            assert_parity(weights[name], ref_weights[twin], bitwise=True, name=f"initial {name}")
            assert_parity(grads[name], ref_grads[twin], rtol=1e-6, atol=1e-9, name=f"grad {name}")


def evaluation_rank(pp: int) -> float | None:
    topo = make_topology(pipe_parallel_size=pp)
    module = ParallelModule(specs(NUM_LAYERS), topo)
    out = module.run_schedule(micro_batches(NUM_MICRO_BATCHES), loss_function, forward_only=True)
    assert all(p.grad is None for p in module.parameters())
    return sum(float(v) for v in out.losses.values()) / NUM_MICRO_BATCHES if out.losses else None


def test_forward_only_schedule_matches_one_process() -> None:
    losses = run_distributed(evaluation_rank, 2, 2, timeout_seconds=120)
    ref_loss, _ = reference("1f1b")
    check_losses(losses, ref_loss)
