"""A failed send/recv is explained from the peer's own send/recv history (real gloo, short timeouts)."""

import datetime

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import CollectiveTimeoutError, get_recorder, recv, send
from scaling.testing import run_distributed

GROUP_TIMEOUT = 2.0  # seconds


def _group():
    return dist.new_group([0, 1], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))


def _both_send():
    group = _group()
    me = dist.get_rank()
    try:
        send(torch.ones(3) if me == 0 else torch.ones(2), 1 - me, group)  # nobody receives
    except CollectiveTimeoutError as exc:
        return str(exc), exc.missing_ranks, exc.divergent_ranks
    finally:
        dist.barrier()
    return None


@pytest.mark.slow  # waits out a transfer timeout (~12 s)
@pytest.mark.waits
@pytest.mark.distributed
def test_send_whose_peer_never_posted_the_recv_names_the_peer_and_what_it_did():
    out = run_distributed(_both_send, 2, timeout_seconds=60)
    message, missing, divergent = out[0]
    assert (missing, divergent) == ([1], [])
    assert message.startswith("point-to-point transfer failed on rank 0 after"), message
    assert "  send(shape=[3], dtype=float32, peer=1) (p2p #1 at test_p2p_diagnosis.py:" in message
    assert (
        "rank 1 never posted the matching recv (it posted 0 recvs from rank 0; its last p2p call was "
        "#1 send(shape=[2], dtype=float32, peer=0) at test_p2p_diagnosis.py:" in message
    ), message
    assert "rank 0 never posted the matching recv (it posted 0 recvs from rank 1;" in out[1][0]


def _shape_drift():
    group = _group()
    me = dist.get_rank()
    try:
        if me == 0:
            send(torch.ones(3), 1, group)
            recv(torch.empty(2), 1, group)  # rank 1 never sends: both wait
        else:
            recv(torch.empty(4), 0, group)  # gloo lets a 3-element message into a 4-element buffer
            recv(torch.empty(2), 0, group)
    except CollectiveTimeoutError as exc:
        return str(exc), exc.missing_ranks
    finally:
        dist.barrier()
    return None


@pytest.mark.waits
@pytest.mark.distributed
def test_earlier_transfer_with_another_shape_is_named():
    (msg0, missing0), (msg1, missing1) = run_distributed(_shape_drift, 2, timeout_seconds=60)
    assert missing0 == [1] and missing1 == [0]
    # The root cause first: the transfer gloo let through although the shapes differ.
    assert "  earlier: send(shape=[3], dtype=float32, peer=1) (p2p #1 at test_p2p_diagnosis.py:" in msg0
    assert "rank 1 posted the matching recv as recv(shape=[4], dtype=float32, peer=0) (p2p #1 at" in msg0
    assert "  earlier: recv(shape=[4], dtype=float32, peer=0) (p2p #1 at" in msg1
    assert "rank 0 posted the matching send as send(shape=[3], dtype=float32, peer=1) (p2p #1 at" in msg1
    # Then the transfer that hung: rank 1 waits for a second send that rank 0 never posts, and vice versa.
    assert msg0.index("earlier:") < msg0.index("  recv(shape=[2], dtype=float32, peer=1) (p2p #2 at")
    assert "rank 1 never posted the matching send (it posted 0 sends to rank 0; its last p2p call was #2 recv" in msg0
    assert "rank 0 never posted the matching send (it posted 1 sends to rank 1; its last p2p call was #2 recv" in msg1


def _pairs_restart():
    recorder = get_recorder()
    me = dist.get_rank()
    if me == 0:
        send(torch.ones(1), 1)
    else:
        recv(torch.empty(1), 0)
    return recorder.p2p_snapshot()[1]


@pytest.mark.distributed
def test_p2p_numbering_restarts_with_each_default_group():
    # Pooled workers keep the recorder; each call's new default group starts the pairs at 1 again.
    for _ in range(2):
        pairs = run_distributed(_pairs_restart, 2, timeout_seconds=60)
        assert pairs == [{("send", 1): 1}, {("recv", 0): 1}]
