"""ActivationBytes (what forward passes' storages hold when a backward begins) and PeakBytes (the most
held, the model state included), on the CPU."""

from __future__ import annotations

import torch

from scaling.testing import ActivationBytes, PeakBytes


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


def test_the_peak_counts_the_existing_state_until_it_is_freed_and_what_operators_make():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(16, 64)
    weight.grad = torch.zeros(64, 64)
    watch = PeakBytes([weight, weight.grad])
    assert watch.peak == 2 * 64 * 64 * 4
    with watch:
        weight.grad = None  # the step drops last step's gradient: no reference is left
        assert watch.held() == 64 * 64 * 4
        (x @ weight).sum().backward()
    # When the new gradient is made: the weight, that gradient, the sum's gradient made whole for the
    # product's backward ([16, 64]), the sum and its seed (the product itself was freed: nothing saves it).
    assert watch.peak == 2 * 64 * 64 * 4 + 16 * 64 * 4 + 4 + 4


def test_storages_freed_on_another_thread_while_the_watch_sums_do_not_break_it():
    # CI once lost a rank to "dictionary changed size during iteration": a thread dropped the last
    # reference to a watched storage while the training thread summed what is held.
    import queue
    import sys
    import threading

    watch = PeakBytes([])
    handed: queue.Queue[list[torch.Tensor] | None] = queue.Queue()

    def drop() -> None:
        while handed.get() is not None:
            pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=drop)
    thread.start()
    try:
        for _ in range(2000):
            batch = [torch.empty(8) for _ in range(20)]
            for storage in (tensor.untyped_storage() for tensor in batch):
                watch._watch(storage)
            handed.put(batch)
            del storage
            del batch
            watch.held()
    finally:
        handed.put(None)
        thread.join()
        sys.setswitchinterval(interval)
    assert watch.held() == 0
