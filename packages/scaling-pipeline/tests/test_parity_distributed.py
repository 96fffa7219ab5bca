"""pp = 2 and 4 with each schedule match one process: losses and every gradient (fp32, 1e-6 rel)."""

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
from pipeline_test_model import Block, GradCapture, loss_function, micro_batches, specs  # noqa: E402

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


def pipeline_rank(pp: int, schedule: str, static_shapes: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    topo = make_topology(pipe_parallel_size=pp)
    module = ParallelModule(specs(NUM_LAYERS), topo, schedule=schedule, static_shapes=static_shapes)
    optimizer = GradCapture(module)
    batches = micro_batches(NUM_MICRO_BATCHES)
    out = module.train_step(batches, optimizer, loss_function)
    return out.loss, optimizer.grads


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_pipeline_matches_one_process(pp: int, schedule: str) -> None:
    results = run_distributed(pipeline_rank, pp, pp, schedule, timeout_seconds=120)
    ref_loss, ref_grads = reference(schedule)
    grads: dict[str, torch.Tensor] = {}
    for loss, rank_grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-6)  # every rank reports the loss
        assert not set(grads) & set(rank_grads)  # each layer lives on exactly one stage
        grads.update(rank_grads)
    assert_parity(grads, ref_grads, rtol=1e-6, atol=1e-9, name="grads")


@pytest.mark.parametrize("pp", [2, 4])
def test_static_shapes_match_one_process(pp: int) -> None:
    # Headerless hand-offs after each channel's first message: the same losses and gradients.
    results = run_distributed(pipeline_rank, pp, pp, "1f1b", True, timeout_seconds=120)
    ref_loss, ref_grads = reference("1f1b")
    grads: dict[str, torch.Tensor] = {}
    for loss, rank_grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        grads.update(rank_grads)
    assert_parity(grads, ref_grads, rtol=1e-6, atol=1e-9, name="grads")


def interleaved_rank(pp: int, static_shapes: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    topo = make_topology(pipe_parallel_size=pp)
    module = ParallelModule(
        specs(NUM_LAYERS), topo, schedule="interleaved_1f1b", num_virtual_stages=2, static_shapes=static_shapes
    )
    # Stage s holds virtual stages s and p + s: two chunks, layers far apart in the model.
    assert [list(r) for r in module.chunks] == [
        list(module.partition[topo.pipe_parallel_rank + c * pp]) for c in (0, 1)
    ]
    optimizer = GradCapture(module)
    module.train_step(micro_batches(NUM_MICRO_BATCHES), optimizer, loss_function)
    handshakes = module._pipe_transport.handshakes_received
    # A second step (no update in between) gives the same result without a handshake:
    # the transport and its shape cache live as long as the module.
    out = module.train_step(micro_batches(NUM_MICRO_BATCHES), optimizer, loss_function)
    assert module._pipe_transport.handshakes_received == handshakes == 2  # activations and gradients, once
    # Forward-only evaluation over the same ring, on a transport of its own (no grad: the
    # activations' metadata differs), which leaves the training transport's cache alone.
    assert module.evaluation_step(micro_batches(NUM_MICRO_BATCHES), loss_function).loss == pytest.approx(
        out.loss, rel=1e-6
    )
    assert module._pipe_transport_no_grad.handshakes_received == 1  # activations only
    module.train_step(micro_batches(NUM_MICRO_BATCHES), optimizer, loss_function)
    assert module._pipe_transport.handshakes_received == 2
    return out.loss, optimizer.grads


@pytest.mark.parametrize(("world", "pp", "static_shapes"), [(2, 2, False), (4, 4, False), (4, 2, False), (2, 2, True)])
def test_interleaved_matches_one_process(world: int, pp: int, static_shapes: bool) -> None:
    # Two virtual stages per rank: activations go round the ring (last stage -> first
    # stage's second chunk) through the batched exchanges; (4, 2) is dp2 x pp2, where
    # every data-parallel replica sees the same micro-batches. With static shapes both
    # directions to the one peer of a two-stage ring go without headers.
    results = run_distributed(interleaved_rank, world, pp, static_shapes, timeout_seconds=120)
    ref_loss, ref_grads = reference("interleaved_1f1b")
    grads: dict[str, torch.Tensor] = {}
    for loss, rank_grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for name, grad in rank_grads.items():
            assert_parity(grad, ref_grads[name], rtol=1e-6, atol=1e-9, name=name)
        grads.update(rank_grads)
    assert set(grads) == set(ref_grads)  # every layer's gradient was checked
    assert len(results[0][1]) == len(ref_grads) // pp  # each rank holds 2 chunks of NUM_LAYERS / (2 pp) layers


def two_metrics(output, batch):  # type: ignore[no-untyped-def]
    loss, _ = loss_function(output, batch)
    return loss, {"max": output.activations.detach().max(), "min": output.activations.detach().min()}


def metrics_rank() -> list[tuple[float, dict[str, float]]]:
    topo = make_topology(pipe_parallel_size=2)
    module = ParallelModule(specs(4), topo)
    optimizer = GradCapture(module)  # no update: every step sees the same weights
    out = []
    for fn in (loss_function, loss_function, two_metrics, loss_function):
        step = module.train_step(micro_batches(2), optimizer, fn)
        out.append((step.loss, step.metrics))
    return out


def test_metrics_reach_every_stage_when_their_names_change() -> None:
    # Step 2 takes the one-tensor path (names cached), steps 3 and 4 change the names.
    rank0, rank1 = run_distributed(metrics_rank, 2, timeout_seconds=120)
    assert rank0 == rank1
    assert [sorted(m) for _, m in rank0] == [["mean_output"], ["mean_output"], ["max", "min"], ["mean_output"]]
    assert rank0[0] == rank0[1] == rank0[3]
    topo = Topology(TopologyConfig(world_size=1, model_parallel_size=1, pipe_parallel_size=1, device="cpu"), 0)
    ref = ParallelModule(specs(4), topo)
    with torch.no_grad():
        outs = [ref(b).activations for b in micro_batches(2)]
    assert rank0[2][1]["max"] == pytest.approx(sum(float(o.max()) for o in outs) / 2, rel=1e-6)


class FailsOnce(GradCapture):
    """Raises from its second step() on every rank, after all of the step's messages."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.calls = 0

    def step(self) -> None:
        self.calls += 1
        if self.calls == 2:
            raise FloatingPointError("the optimizer gives up on this step")
        super().step()


def failed_step_rank() -> list[float | None]:
    topo = make_topology(pipe_parallel_size=2)
    module = ParallelModule(specs(4), topo)
    optimizer = FailsOnce(module)  # no update: steps with the same batches give the same loss
    out: list[float | None] = []
    for batches in (micro_batches(2), micro_batches(2), micro_batches(3), micro_batches(2)):
        try:
            out.append(module.train_step(batches, optimizer, loss_function).loss)
        except FloatingPointError:
            out.append(None)
    return out


def test_a_step_that_raises_keeps_the_result_broadcast_paired() -> None:
    # Step 2 raises after rank 0 posted its result receive: the last stage still sends
    # one broadcast for it, so steps 3 and 4 report their own results instead of hanging.
    rank0, rank1 = run_distributed(failed_step_rank, 2, timeout_seconds=60)
    assert rank0 == rank1
    assert rank0[1] is None and rank0[0] == rank0[3] and rank0[2] != rank0[0]


def tied_specs() -> list:
    # Layers 0 and 3 share linear.weight (as an input embedding and an LM head would).
    return [
        TiedLayerSpec("tie", ["linear.weight"], Block, 6),
        *specs(2),
        TiedLayerSpec("tie", ["linear.weight"], Block, 6),
    ]


def tied_rank(pp: int) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    topo = make_topology(pipe_parallel_size=pp)
    module = ParallelModule(tied_specs(), topo, schedule="1f1b")
    weights = {n: p.detach().clone() for n, p, _ in module.named_parameters_with_meta()}
    optimizer = GradCapture(module)
    out = module.train_step(micro_batches(NUM_MICRO_BATCHES), optimizer, loss_function)
    return out.loss, weights, optimizer.grads


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
    for loss, weights, grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for name in weights:
            twin = "layers.0.linear.weight" if name == "layers.3.linear.weight" else name
            assert_parity(weights[name], ref_weights[twin], bitwise=True, name=f"initial {name}")
            assert_parity(grads[name], ref_grads[twin], rtol=1e-6, atol=1e-9, name=f"grad {name}")


def evaluation_rank(pp: int) -> float:
    topo = make_topology(pipe_parallel_size=pp)
    module = ParallelModule(specs(NUM_LAYERS), topo)
    return module.evaluation_step(micro_batches(NUM_MICRO_BATCHES), loss_function).loss


def test_evaluation_step_matches_one_process() -> None:
    losses = run_distributed(evaluation_rank, 2, 2, timeout_seconds=120)
    ref_loss, _ = reference("1f1b")
    assert losses == pytest.approx([ref_loss, ref_loss], rel=1e-6)
