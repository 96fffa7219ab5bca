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


def pipeline_rank(pp: int, schedule: str) -> tuple[float, dict[str, torch.Tensor]]:
    topo = make_topology(pipe_parallel_size=pp)
    module = ParallelModule(specs(NUM_LAYERS), topo, schedule=schedule)
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
