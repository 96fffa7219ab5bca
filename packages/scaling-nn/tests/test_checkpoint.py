"""Activation checkpointing (per layer, per stage, selective, per operator) reproduces losses and grads with
dropout on; per-operator checkpointing keeps less than none and more than per layer."""

import pytest
import torch
import torch.nn.functional as F

from scaling.nn import (
    MATMUL_AND_ATTENTION,
    AttentionConfig,
    ParallelMLP,
    ParallelSelfAttention,
    checkpoint_layer,
    checkpoint_sequential_layers,
)
from scaling.testing import ActivationBytes, make_topology, run_distributed
from scaling.topology import seed_all

H = 16


class Block(torch.nn.Module):
    def __init__(self, topology, tracker, selective):
        super().__init__()
        self.attention = ParallelSelfAttention(
            AttentionConfig(H, 4, attention_dropout=0.3, checkpoint_core_attention=selective),
            topology=topology,
            rng_tracker=tracker,
        )
        self.mlp = ParallelMLP(H, 32, topology=topology)

    def forward(self, x):
        x = x + self.attention(x)
        # Replicated activations: dropout from the default generator (same on every TP rank).
        return x + F.dropout(self.mlp(x), 0.3, training=self.training)


def _run(topology, mode):
    tracker = seed_all(1234, topology)
    torch.manual_seed(0)
    blocks = [Block(topology, tracker, selective=mode == "selective") for _ in range(2)]
    tracker = seed_all(99, topology)  # same streams for every mode, after the (identical) init
    for b in blocks:
        b.attention.rng_tracker = tracker
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    losses = []
    for _ in range(2):  # two steps: the streams must continue identically after a recomputation
        if mode in ("layer", "operators"):
            h = x
            save = MATMUL_AND_ATTENTION if mode == "operators" else None
            for b in blocks:
                h = checkpoint_layer(b, h, rng_tracker=tracker, save=save)
        elif mode == "stage":
            h = checkpoint_sequential_layers(blocks, x, rng_tracker=tracker)
        else:
            h = x
            for b in blocks:
                h = b(h)
        loss = h.pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
    grads = [x.grad] + [p.grad for b in blocks for p in b.parameters()]
    return losses, grads


def _checkpoint_parity(tp):
    topo = make_topology(model_parallel_size=tp)
    ref_losses, ref_grads = _run(topo, "none")
    assert not torch.equal(ref_losses[0], ref_losses[1])  # dropout differs between steps
    for mode in ("selective", "layer", "stage", "operators"):
        losses, grads = _run(topo, mode)
        for a, e in zip(losses + grads, ref_losses + ref_grads):
            assert torch.equal(a, e), mode
    return [x.item() for x in ref_losses]


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_checkpointing_is_bitwise_identical_with_dropout(tp):
    out = run_distributed(_checkpoint_parity, tp, tp, timeout_seconds=90)
    assert all(o == out[0] for o in out)


def test_per_operator_checkpointing_keeps_the_products_and_recomputes_the_rest():
    torch.manual_seed(0)
    layers = [
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(3)
    ]
    x = torch.randn(32, 64, requires_grad=True)

    def held(mode):
        with ActivationBytes() as watch:
            h = x
            for layer in layers:
                h = (
                    layer(h)
                    if mode == "none"
                    else checkpoint_layer(layer, h, save=MATMUL_AND_ATTENTION if mode == "operators" else None)
                )
            h.sum().backward()
        grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        return watch.at_backward, grads

    (none, expected), (operators, got), (layer, _) = held("none"), held("operators"), held("layer")
    for a, e in zip(got, expected):
        assert torch.equal(a, e)
    # Per layer the products' outputs ([32, 256] and [32, 64] per layer) are kept; GELU's is not.
    assert layer < operators < none
    assert none - operators == 3 * 32 * 256 * 4  # GELU's output, recomputed from the kept product
