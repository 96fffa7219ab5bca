"""all_gather_async: the values of the blocking all_gather, recorded when issued, sizes checked."""

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import all_gather, all_gather_async, get_recorder
from scaling.testing import run_distributed


def _gather():
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    rank = dist.get_rank()
    shard = torch.arange(3, dtype=torch.float64) + 10 * rank
    before = get_recorder().records(group)
    out = torch.full((3 * world,), -1.0, dtype=torch.float64)
    handle = all_gather_async(out, shard, group)
    # the in-place form: this rank's part of the output is the input
    in_place = torch.full((3 * world,), -1.0, dtype=torch.float64)
    in_place[3 * rank : 3 * rank + 3] = shard
    all_gather_async(in_place, in_place[3 * rank : 3 * rank + 3], group).wait()
    handle.wait()
    recorded = [(r.op, r.shapes) for r in get_recorder().records(group)[len(before) :]]
    handle.wait()  # a second wait is a no-op
    bad = []
    for wrong_out in (torch.empty(3 * world - 1, dtype=torch.float64), torch.empty(3 * world, dtype=torch.float32)):
        try:
            all_gather_async(wrong_out, shard, group)
        except ValueError as exc:
            bad.append(str(exc))
    alone = torch.empty(3, dtype=torch.float64)
    all_gather_async(alone, shard, None).wait()  # no group: a copy
    return out, in_place, all_gather(shard, group), recorded, bad, alone


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])  # two ranks: one exchange with the peer; more: gloo's all-gather
def test_all_gather_async_equals_all_gather_and_is_recorded(world):
    out = run_distributed(_gather, world, timeout_seconds=60)
    expected = torch.cat([torch.arange(3, dtype=torch.float64) + 10 * r for r in range(world)])
    for rank, (gathered, in_place, blocking, recorded, bad, alone) in enumerate(out):
        torch.testing.assert_close(gathered, expected, rtol=0, atol=0)
        torch.testing.assert_close(in_place, expected, rtol=0, atol=0)
        torch.testing.assert_close(blocking, expected, rtol=0, atol=0)
        assert [op for op, _ in recorded] == ["all_gather", "all_gather"]
        assert len(bad) == 2 and all(f"do not fit a group of {world}" in m for m in bad)
        torch.testing.assert_close(alone, expected[3 * rank : 3 * rank + 3], rtol=0, atol=0)


def test_all_gather_async_rejects_an_output_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"input of shape \[3\].*output of shape \[4\].*do not fit a group of 1"):
        all_gather_async(torch.empty(4), torch.zeros(3), None)
