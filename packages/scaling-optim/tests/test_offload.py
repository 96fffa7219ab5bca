"""HostUpdate: the offloaded ZeRO-3 update runs as pieces in a thread; waits cover a prefix of them."""

import threading

import pytest
import torch

from scaling.optim._offload import HostCopies, HostUpdate


def test_a_wait_covers_the_pieces_up_to_its_layer_and_an_error_reaches_the_waiter():
    update, ran, gate = HostUpdate(), [], threading.Event()

    def blocked() -> None:
        assert gate.wait(timeout=10)
        ran.append(1)

    def fails() -> None:
        raise ValueError("piece 2 failed")

    update.start([lambda: ran.append(0), blocked, fails])
    update.wait(0)  # returns while piece 1 is still blocked
    assert ran == [0] and update.in_flight
    gate.set()
    with pytest.raises(ValueError, match="piece 2 failed"):
        update.wait(7)  # past the last piece: all of them
    assert ran == [0, 1] and not update.in_flight
    update.wait()  # nothing in flight any more

    update.start([])
    update.wait(0)
    update.start([lambda: ran.append(2)])  # waits for the one before
    update.wait()
    assert ran == [0, 1, 2]


def test_host_copies_on_cpu_are_the_tensors_themselves():
    copies = HostCopies(torch.device("cpu"))
    grad = torch.ones(3)
    host, arrived = copies.to_host([grad])
    arrived()
    assert host[0] is grad
    target = torch.zeros(3)
    copies.to_device([(target, grad)])
    assert torch.equal(target, grad)
