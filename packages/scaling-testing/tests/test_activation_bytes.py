"""ActivationBytes: the bytes forward passes' storages hold when a backward begins, on the CPU."""

from __future__ import annotations

import torch

from scaling.testing import ActivationBytes


def test_a_backward_finds_what_the_forward_saved_and_views_and_parameters_do_not_count():
    weight = torch.nn.Parameter(torch.randn(100, 100))
    x = torch.randn(100, 100)
    with ActivationBytes() as watch:
        hidden = x @ weight  # saved by nothing: relu keeps its own output
        out = hidden.relu().t()  # the transpose is a view of relu's output
        del hidden
        assert watch.held() == 100 * 100 * 4
        loss = out.sum()
        loss.backward()
    assert watch.at_backward == 100 * 100 * 4 + 4 + 4  # relu's output, the loss and its seed gradient
    del out, loss
    assert watch.held() == 0


def test_the_most_held_over_several_backwards_is_kept_and_a_storage_resized_to_nothing_counts_nothing():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    with ActivationBytes() as watch:
        for rows in (8, 32, 16):
            (torch.randn(rows, 64) @ weight).tanh().sum().backward()
        assert watch.at_backward == 2 * 32 * 64 * 4 + 4 + 4  # the input made under the watch counts too
        kept = torch.randn(256, 64).requires_grad_()
        doubled = kept * 2
        doubled.untyped_storage().resize_(0)  # ZeRO-3 frees a gathered parameter this way
        assert watch.held() == 256 * 64 * 4
