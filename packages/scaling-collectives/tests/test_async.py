"""all_reduce_async / reduce_scatter_async: same values as the blocking forms, named errors on wait()."""

import datetime
import json

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import (
    CollectiveTimeoutError,
    PendingCollective,
    all_reduce,
    all_reduce_async,
    get_recorder,
    reduce_scatter,
    reduce_scatter_async,
)
from scaling.testing import run_distributed

GROUP_TIMEOUT = 2.0  # seconds: the hung-peer case below fails within a few of these


def _group(name, timeout=GROUP_TIMEOUT):
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=timeout))
    get_recorder().name_group(group, name)
    return group


def _values():
    group = _group("dp", timeout=30.0)
    rank = dist.get_rank()
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
    blocking = all_reduce(x.clone(), group)
    y = x.clone()
    handle = all_reduce_async(y, group)
    handle.wait()
    handle.wait()  # a second wait is a no-op
    world = dist.get_world_size()
    flat = torch.arange(4 * world, dtype=torch.float64) + 10 * rank
    out = torch.empty(4, dtype=torch.float64)
    pending = reduce_scatter_async(out, flat.clone(), group)  # the input is scratch
    pending.wait()
    ops = [r.op for r in get_recorder().records(group)[-3:]]
    try:
        reduce_scatter_async(torch.empty(3), flat, group)  # 4 * world elements do not split into world x 3
        bad = None
    except ValueError as exc:
        bad = str(exc)
    return blocking, y, reduce_scatter(flat.clone(), group), out, ops, bad


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])  # two ranks: one exchange with the peer; more: gloo's all-reduce
def test_async_forms_equal_the_blocking_forms_and_are_recorded(world):
    out = run_distributed(_values, world, timeout_seconds=60)
    expected_sum = torch.arange(6, dtype=torch.float32).reshape(2, 3) * sum(range(1, world + 1))
    full = torch.arange(4 * world, dtype=torch.float64) * world + 10 * sum(range(world))
    for rank, (blocking, y, rs_blocking, rs_async, ops, bad) in enumerate(out):
        torch.testing.assert_close(blocking, expected_sum, rtol=0, atol=0)
        torch.testing.assert_close(y, blocking, rtol=0, atol=0)
        torch.testing.assert_close(rs_async, rs_blocking, rtol=0, atol=0)
        torch.testing.assert_close(rs_async, full[4 * rank : 4 * rank + 4], rtol=0, atol=0)
        # Recorded when issued, like the blocking calls: all_reduce, all_reduce_async, reduce_scatter_async.
        assert ops == ["all_reduce", "all_reduce", "reduce_scatter"]
        assert (
            bad is not None
            and f"input of shape [{4 * world}] and output of shape [3] do not fit a group of {world}" in bad
        )


def _hung_peer(op, diagnostics_dir):
    group = _group("dp")
    get_recorder().configure(diagnostics_dir=diagnostics_dir)
    get_recorder().step = 3
    try:
        if dist.get_rank() == 0:
            if op == "all_reduce":
                handle = all_reduce_async(torch.ones(4, 2), group)
            else:
                handle = reduce_scatter_async(torch.empty(3), torch.ones(6), group)
            try:
                handle.wait()
            except CollectiveTimeoutError as exc:
                return str(exc), exc.missing_ranks, exc.op, exc.group
        return None
    finally:
        get_recorder().configure(diagnostics_dir=None)
        get_recorder().step = None
        # Rank 1 never issues the collective; it waits here, on the default group, for rank 0's error.
        dist.barrier()


@pytest.mark.slow
@pytest.mark.waits
@pytest.mark.distributed
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_wait_names_the_rank_that_never_issued_the_collective(op, tmp_path):
    message, missing, got_op, group = run_distributed(_hung_peer, 2, op, str(tmp_path), timeout_seconds=60)[0]
    assert (missing, got_op, group) == ([1], op, "dp")
    described = f"{op}(shape=[{'4, 2' if op == 'all_reduce' else '6'}], dtype=float32)"
    assert message.startswith(f"{described} as collective #")
    assert "of the dp group (ranks [0, 1]) failed on rank 0" in message
    assert "rank 1 did not arrive: no report within 2.0s" in message
    # The failing rank wrote its diagnostics file and named it; the healthy rank wrote none.
    assert message.endswith(f"diagnostics of this rank: {tmp_path / 'rank_0.json'}")
    report = json.loads((tmp_path / "rank_0.json").read_text())
    assert (report["rank"], report["step"]) == (0, 3)
    assert report["reason"] == message.rsplit("\ndiagnostics of this rank:", 1)[0]
    last = report["last_collectives"][-1]
    assert (last["describe"], last["group"], last["ranks"]) == (described, "dp", [0, 1])
    assert last["call_site"].startswith("test_async.py:") and last["call_site"].endswith("in _hung_peer")
    assert report["calls_by_op_and_group"][f"{op}/dp"] >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0.json"]


def test_single_rank_forms_are_done_handles():
    x = torch.ones(3)
    handle = all_reduce_async(x, None)
    assert isinstance(handle, PendingCollective)
    handle.wait()
    assert torch.equal(x, torch.ones(3))
    out = torch.empty(3)
    reduce_scatter_async(out, torch.arange(3.0), None).wait()
    assert torch.equal(out, torch.arange(3.0))


@pytest.mark.parametrize(
    ("out_shape", "in_shape"), [((3,), (4,)), ((3, 1), (3,)), ((3,), (3, 1))], ids=["numel", "2d-out", "2d-in"]
)
def test_reduce_scatter_async_rejects_bad_sizes(out_shape, in_shape):
    with pytest.raises(ValueError, match=r"reduce_scatter_async: input of shape .* do not fit a group of 1"):
        reduce_scatter_async(torch.empty(out_shape), torch.empty(in_shape), None)
