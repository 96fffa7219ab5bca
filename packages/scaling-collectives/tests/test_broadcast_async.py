"""broadcast_async: a receiver posts early, the source broadcasts later; values and record."""

import time

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import broadcast_async, get_recorder, recv, send
from scaling.testing import run_distributed


def _early_receive():
    world = list(range(dist.get_world_size()))
    group, other = dist.new_group(world), dist.new_group(world)
    rank = dist.get_rank()
    values = torch.tensor([float(rank), -1.0], dtype=torch.float64)
    before = len(get_recorder().records(group))
    if rank == 1:
        handle = broadcast_async(values, 0, group)  # posted before rank 0 has anything to send
    # meanwhile, point-to-point traffic on another group goes on
    if rank == 0:
        send(torch.arange(4.0), 1, other)
        time.sleep(0.2)
        values.copy_(torch.tensor([7.0, 8.0], dtype=torch.float64))
        handle = broadcast_async(values, 0, group)
        got = None
    else:
        got = recv(torch.empty(4), 0, other)
    handle.wait()
    recorded = [(r.op, r.peer) for r in get_recorder().records(group)[before:]]
    broadcast_async(values, 0, None).wait()  # no group: nothing to do
    return values, got, recorded


@pytest.mark.distributed
def test_broadcast_async_posted_early_receives_the_later_send():
    for rank, (values, got, recorded) in enumerate(run_distributed(_early_receive, 2, timeout_seconds=60)):
        torch.testing.assert_close(values, torch.tensor([7.0, 8.0], dtype=torch.float64), rtol=0, atol=0)
        if rank == 1:
            torch.testing.assert_close(got, torch.arange(4.0), rtol=0, atol=0)
        assert recorded == [("broadcast", 0)]
