"""all_gather_async: the values of the blocking all_gather, recorded when issued, sizes checked."""

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import all_gather, all_gather_async, get_recorder
from scaling.testing import run_distributed


def _gather():
    group = dist.new_group(list(range(dist.get_world_size())))
    rank = dist.get_rank()
    shard = torch.arange(3, dtype=torch.float64) + 10 * rank
    before = get_recorder().records(group)
    out = torch.full((6,), -1.0, dtype=torch.float64)
    handle = all_gather_async(out, shard, group)
    recorded = [(r.op, r.shapes) for r in get_recorder().records(group)[len(before) :]]
    handle.wait()
    handle.wait()  # a second wait is a no-op
    bad = []
    for wrong_out in (torch.empty(5, dtype=torch.float64), torch.empty(6, dtype=torch.float32)):
        try:
            all_gather_async(wrong_out, shard, group)
        except ValueError as exc:
            bad.append(str(exc))
    alone = torch.empty(3, dtype=torch.float64)
    all_gather_async(alone, shard, None).wait()  # no group: a copy
    return out, all_gather(shard, group), recorded, bad, alone


@pytest.mark.distributed
def test_all_gather_async_equals_all_gather_and_is_recorded():
    out = run_distributed(_gather, 2, timeout_seconds=60)
    expected = torch.tensor([0.0, 1.0, 2.0, 10.0, 11.0, 12.0], dtype=torch.float64)
    for rank, (gathered, blocking, recorded, bad, alone) in enumerate(out):
        torch.testing.assert_close(gathered, expected, rtol=0, atol=0)
        torch.testing.assert_close(blocking, expected, rtol=0, atol=0)
        assert len(recorded) == 1 and recorded[0][0] == "all_gather"
        assert len(bad) == 2 and all("do not fit a group of 2" in m for m in bad)
        torch.testing.assert_close(alone, expected[3 * rank : 3 * rank + 3], rtol=0, atol=0)


def test_all_gather_async_rejects_an_output_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"input of shape \[3\].*output of shape \[4\].*do not fit a group of 1"):
        all_gather_async(torch.empty(4), torch.zeros(3), None)
