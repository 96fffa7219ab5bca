import pytest
import torch
import torch.distributed as dist

from scaling.collectives import all_gather_flat, reduce_scatter_flat
from scaling.testing import assert_parity, run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-7}


def _reduce_scatter_round_trip():
    group = dist.group.WORLD
    world, r = dist.get_world_size(), dist.get_rank()
    per_rank = [torch.arange(4.0 * world) * (i + 1) for i in range(world)]
    mean = sum(per_rank) / world
    shard = reduce_scatter_flat(per_rank[r].clone(), group)
    assert_parity(shard, mean.chunk(world)[r], name="mean shard", **TOL)
    summed = reduce_scatter_flat(per_rank[r].clone(), group, average=False)
    assert_parity(summed, sum(per_rank).chunk(world)[r], name="sum shard", **TOL)
    assert_parity(all_gather_flat(shard, group), mean, name="gathered", **TOL)
    errors = []
    for call in (lambda: reduce_scatter_flat(torch.zeros(5), group), lambda: all_gather_flat(torch.zeros(2, 2), group)):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_flat_averages_explicitly(world_size):
    errors = run_distributed(_reduce_scatter_round_trip, world_size, timeout_seconds=60)[0]
    pad = -5 % world_size
    assert f"buffer of 5 elements is not divisible by the group size {world_size}; pad it with {pad} zeros" in errors[0]
    assert "expected a 1-D shard, got shape [2, 2]" in errors[1]
