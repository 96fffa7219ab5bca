"""VocabParallelEmbedding and vocab_parallel_cross_entropy against torch, odd vocab sizes."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from scaling.collectives import copy_to_model_parallel_region
from scaling.nn import VocabParallelEmbedding, vocab_parallel_cross_entropy, vocab_range
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from nn_parity import check_layer_parity, close  # noqa: E402

VOCAB, DIM = 11, 6


def test_tp1_initialisation_equals_torch_embedding():
    torch.manual_seed(3)
    layer = VocabParallelEmbedding(VOCAB, DIM)
    torch.manual_seed(3)
    assert torch.equal(layer.weight, torch.nn.Embedding(VOCAB, DIM).weight)


def test_vocab_range_pads_the_last_ranks():
    assert [vocab_range(11, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [vocab_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"num_embeddings=0 and embedding_dim=4 must both be >= 1"):
        VocabParallelEmbedding(0, 4)
    logits, targets = torch.randn(2, 3), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"reduction='avg'; choose 'mean', 'sum' or 'none'"):
        vocab_parallel_cross_entropy(logits, targets, None, reduction="avg")
    with pytest.raises(ValueError, match=r"label_smoothing=1.0 must be in \[0, 1\)"):
        vocab_parallel_cross_entropy(logits, targets, None, label_smoothing=1.0)


def _embedding_parity(tp, vocab):
    topo = make_topology(model_parallel_size=tp)
    torch.manual_seed(0)
    layer = VocabParallelEmbedding(vocab, DIM, topology=topo)
    torch.manual_seed(0)
    ref = torch.nn.Embedding(vocab, DIM)
    ids = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(3, 7, DIM, generator=torch.Generator().manual_seed(2))
    y, y_ref = layer(ids), ref(ids)
    y.backward(grad_out)
    y_ref.backward(grad_out)
    check_layer_parity(layer, ref, [y], [y_ref], [], [], topo.axis("tp").group)
    return tuple(layer.weight.shape)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_embedding_matches_torch_with_odd_vocab(tp):
    shapes = run_distributed(_embedding_parity, tp, tp, VOCAB, timeout_seconds=60)
    assert shapes == [(-(-VOCAB // tp), DIM)] * tp


def _cross_entropy_parity(tp):
    """Logits from a column-parallel LM head over a padded odd vocab; loss and grads vs F.cross_entropy."""
    topo = make_topology(model_parallel_size=tp)
    group = topo.axis("tp").group
    padded = -(-VOCAB // tp) * tp
    g = torch.Generator().manual_seed(0)
    full_logits = torch.randn(2, 5, padded, generator=g) * 3
    targets = torch.randint(0, VOCAB, (2, 5), generator=g)
    targets[0, 1] = targets[1, 4] = -100
    weights = torch.rand(2, 5, generator=g)
    results = []
    for smoothing in (0.0, 0.1):
        for w in (None, weights):
            ref_logits = full_logits[..., :VOCAB].clone().requires_grad_(True)
            per_token = F.cross_entropy(
                ref_logits.flatten(0, 1), targets.flatten(), reduction="none", label_smoothing=smoothing
            ).view(2, 5)
            keep = (targets != -100).float() * (1.0 if w is None else w)
            ref_loss = (per_token * keep).sum() / keep.sum()
            if w is None:
                close(
                    ref_loss,
                    F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), label_smoothing=smoothing),
                    "torch mean",
                )
            ref_loss.backward()
            shard = full_logits.chunk(tp, dim=-1)[topo.axis("tp").rank].clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(
                shard, targets, group, label_smoothing=smoothing, loss_weights=w, vocab_size=VOCAB
            )
            loss.backward()
            close(loss, ref_loss, f"loss smoothing={smoothing} weights={w is not None}")
            full_grad = torch.cat([ref_logits.grad, torch.zeros(2, 5, padded - VOCAB)], dim=-1)
            close(shard.grad, full_grad.chunk(tp, dim=-1)[topo.axis("tp").rank], "logits grad")
            results.append(loss.item())
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(tp):
    losses = run_distributed(_cross_entropy_parity, tp, tp, timeout_seconds=60)
    assert all(r == losses[0] for r in losses)


def _lm_head_with_tied_embedding(tp):
    """Embedding -> LM head sharing its (padded) weight -> loss: same loss and grads as one process."""
    topo = make_topology(model_parallel_size=tp)
    group = topo.axis("tp").group
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(VOCAB, DIM, topology=topo)
    torch.manual_seed(0)
    ref = torch.nn.Embedding(VOCAB, DIM)
    ids = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(1))
    h = emb(ids)
    logits = F.linear(copy_to_model_parallel_region(h, group), emb.weight)
    loss = vocab_parallel_cross_entropy(logits, ids, group, vocab_size=VOCAB)
    loss.backward()
    h_ref = ref(ids)
    ref_loss = F.cross_entropy(F.linear(h_ref, ref.weight).flatten(0, 1), ids.flatten())
    ref_loss.backward()
    close(loss, ref_loss, "loss")
    check_layer_parity(emb, ref, [], [], [], [], group)
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_tied_lm_head_over_padded_vocab(tp):
    assert run_distributed(_lm_head_with_tied_embedding, tp, tp, timeout_seconds=60) == [True] * tp


def test_one_rank_cross_entropy_masks_padding_columns_and_reduces_like_torch():
    """Without a TP group the fused path runs; padded columns and every reduction match torch."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, VOCAB + 2, generator=g) * 3
    targets = torch.randint(0, VOCAB, (2, 5), generator=g)
    targets[1, 2] = -100
    weights = torch.rand(2, 5, generator=g)
    keep = (targets != -100).float()
    for reduction in ("mean", "sum", "none"):
        for w in (None, weights):
            x = logits.clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(
                x, targets, None, label_smoothing=0.1, loss_weights=w, vocab_size=VOCAB, reduction=reduction
            )
            x_ref = logits[..., :VOCAB].clone().requires_grad_(True)
            per_token = F.cross_entropy(
                x_ref.flatten(0, 1), targets.flatten(), reduction="none", label_smoothing=0.1
            ).view(2, 5) * (keep if w is None else keep * w)
            ref = {"mean": per_token.sum() / (keep if w is None else keep * w).sum(), "sum": per_token.sum()}
            ref_loss = ref.get(reduction, per_token)
            close(loss, ref_loss, f"{reduction} weights={w is not None}")
            loss.sum().backward()
            ref_loss.sum().backward()
            close(x.grad[..., :VOCAB], x_ref.grad, "logits grad")
            assert torch.equal(x.grad[..., VOCAB:], torch.zeros(2, 5, 2))
