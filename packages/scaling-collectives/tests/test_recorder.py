"""The recorder and hang diagnosis on real gloo groups with short timeouts."""

import datetime
import re

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveRecord,
    CollectiveTimeoutError,
    PipeTransport,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    check_consistency,
    get_recorder,
    recv,
    reduce_scatter,
    send,
)
from scaling.collectives._diagnosis import first_divergence, format_ranks
from scaling.testing import make_topology, run_distributed

GROUP_TIMEOUT = 2.0  # seconds: every failure below is bounded by a few of these


def _short_group(name):
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    get_recorder().name_group(group, name)
    return group


def _record_and_count():
    topo = make_topology(model_parallel_size=2)
    recorder = get_recorder()
    recorder.reset_counters()
    tp = topo.axis("tp").group
    x = torch.ones(4, 8)
    all_reduce(x, tp)
    all_gather(torch.ones(3), tp)
    reduce_scatter(torch.ones(4, 2, dtype=torch.float64), tp)
    broadcast(torch.zeros(2, dtype=torch.int64), topo.axis("tp").ranks[0], tp)
    barrier(tp)
    records = recorder.records(tp)[-5:]
    me = dist.get_rank()
    if me % 2 == 0:
        send(torch.ones(3), me + 1)
    else:
        recv(torch.empty(3), me - 1)
    p2p = recorder.records(None)[-1]
    counters = recorder.bytes_by_op_and_group(), recorder.calls_by_op_and_group()
    # Each group's state caches its counters: a rename and a reset must still take effect.
    extra = dist.new_group(list(range(dist.get_world_size())))
    recorder.name_group(extra, "before")
    all_reduce(torch.ones(2), extra)
    recorder.name_group(extra, "after")
    all_reduce(torch.ones(2), extra)
    renamed = recorder.calls_by_op_and_group()
    recorder.reset_counters()
    all_reduce(torch.ones(2), extra)
    return records, p2p, *counters, renamed, recorder.calls_by_op_and_group()


@pytest.mark.distributed
def test_every_op_is_recorded_with_seq_group_shapes_and_call_site():
    # tp2 x dp2: with tp spanning the whole world the mesh would reuse the default group ("world").
    out = run_distributed(_record_and_count, 4, timeout_seconds=180)  # includes a cold pool start
    for rank, (records, p2p, nbytes, calls, renamed, after_reset) in enumerate(out):
        assert [r.op for r in records] == ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"]
        assert [r.seq for r in records] == list(range(records[0].seq, records[0].seq + 5))
        assert {r.group for r in records} == {"tp"} and records[0].ranks == ((0, 1) if rank < 2 else (2, 3))
        assert records[0].describe() == "all_reduce(shape=[4, 8], dtype=float32)"
        assert records[2].describe() == "reduce_scatter(shape=[4, 2], dtype=float64)"
        assert records[3].describe() == f"broadcast(shape=[2], dtype=int64, src={rank // 2 * 2})"
        assert records[4].describe() == "barrier()"
        assert records[0].call_site.startswith("test_recorder.py:") and records[0].call_site.endswith(
            "_record_and_count"
        )
        assert nbytes[("all_reduce", "tp")] == 4 * 8 * 4 and nbytes[("reduce_scatter", "tp")] == 8 * 8
        assert calls[("barrier", "tp")] == 1
        assert p2p.op == ("send" if rank % 2 == 0 else "recv") and p2p.peer == rank ^ 1 and p2p.group == "p2p"
        assert nbytes[(p2p.op, "p2p")] == 12
        assert renamed[("all_reduce", "before")] == 1 and renamed[("all_reduce", "after")] == 1
        assert after_reset == {("all_reduce", "after"): 1}


def _mismatch(debug):
    group = _short_group("tp")
    recorder = get_recorder()
    recorder.debug = debug
    try:
        all_reduce(torch.ones(3), group)  # collectives #1 and #2 match on every rank
        barrier(group)
        try:
            if dist.get_rank() == 3:
                all_reduce(torch.zeros(4, 8), group)
            else:
                broadcast(torch.zeros(2), 0, group)
            # Without debug mode gloo may let the mismatched call "succeed" on some
            # ranks; their next collective is the one that fails.
            all_reduce(torch.ones(1), group)
        except CollectiveError as exc:
            return type(exc).__name__, str(exc), exc.divergent_ranks
        return None
    finally:
        recorder.debug = False


EXPECTED = "rank 3 called all_reduce(shape=[4, 8], dtype=float32) as collective #3 of the tp group while ranks 0-2 called broadcast(shape=[2], dtype=float32, src=0)"


@pytest.mark.distributed
def test_debug_mode_names_the_rank_that_called_a_different_collective():
    out = run_distributed(_mismatch, 4, True, timeout_seconds=60)
    for kind, message, divergent in out:
        assert kind == "CollectiveMismatchError"  # found by the exchange, before any timeout
        assert message.startswith(EXPECTED), message
        assert divergent == [3]
        assert "rank 3: #1 all_reduce(shape=[3], dtype=float32) | #2 barrier() | #3 all_reduce(shape=[4, 8]" in message


@pytest.mark.waits
@pytest.mark.distributed
def test_mismatch_without_debug_is_named_when_it_fails():
    out = run_distributed(_mismatch, 4, False, timeout_seconds=60)
    assert all(o is not None for o in out), out
    for kind, message, divergent in out:
        assert isinstance(message, str) and "failed on rank" in message
        # Each rank names rank 3 against whichever peers had reported by then.
        assert (
            "rank 3 called all_reduce(shape=[4, 8], dtype=float32) as collective #3 of the tp group while rank"
            in message
        )
        assert kind == "CollectiveMismatchError" and divergent == [3]


def _absent_rank(debug, absent):
    group = _short_group("dp")
    recorder = get_recorder()
    recorder.debug = debug
    try:
        all_reduce(torch.ones(2), group)
        if dist.get_rank() != absent:
            try:
                all_reduce(torch.ones(4, 8), group)
            except CollectiveTimeoutError as exc:
                return str(exc), exc.missing_ranks, exc.op, exc.seq, exc.group
        return None
    finally:
        recorder.debug = False
        # Rejoin on the (healthy) default group so the absent rank outlives its peers' errors.
        dist.barrier()


@pytest.mark.waits
@pytest.mark.distributed
@pytest.mark.parametrize("debug", [pytest.param(False, marks=pytest.mark.slow), True], ids=["on-timeout", "debug"])
def test_rank_that_never_arrives_is_named(debug):
    out = run_distributed(_absent_rank, 3, debug, 2, timeout_seconds=60)
    assert out[2] is None
    for message, missing, op, seq, group in out[:2]:
        assert (missing, op, seq, group) == ([2], "all_reduce", 2, "dp")
        if debug:
            assert message.startswith(
                "rank 2 did not arrive at all_reduce(shape=[4, 8], dtype=float32), collective #2 of the dp group "
                "(ranks [0, 1, 2]), within the group timeout of 2.0s; ranks 0-1 did"
            ), message
        else:
            assert message.startswith(
                "all_reduce(shape=[4, 8], dtype=float32) as collective #2 of the dp group (ranks [0, 1, 2]) failed on rank"
            ), message
            assert "rank 2 did not arrive: no report within 2.0s" in message


def _consistency():
    group = _short_group("tp")
    all_reduce(torch.ones(2, 2), group)
    ok = check_consistency(group)
    # Same bytes, different shapes: gloo completes it, the recorder sees the drift.
    all_reduce(torch.ones(4, 8) if dist.get_rank() == 0 else torch.ones(8, 4), group)
    try:
        check_consistency(group)
    except CollectiveMismatchError as exc:
        return ok, str(exc)
    return ok, None


@pytest.mark.distributed
def test_check_consistency_finds_drift():
    for ok, message in run_distributed(_consistency, 2, timeout_seconds=60):
        assert ok == 1
        assert message.startswith(
            "rank 1 called all_reduce(shape=[8, 4], dtype=float32) as collective #2 of the tp group while rank 0 "
            "called all_reduce(shape=[4, 8], dtype=float32)"
        ), message


def _p2p_failure(kind):
    group = _short_group("pipe")
    peer = 1 if dist.get_rank() == 0 else None
    transport = PipeTransport(
        peer if kind == "recv" else None, peer if kind == "send" else None, torch.device("cpu"), group=group
    )
    try:
        if peer is not None and kind == "recv":
            transport.recv_forward()  # rank 1 never sends
        elif peer is not None:
            transport.send_forward(torch.ones(4), wait=False)  # returns at once; rank 1 never receives
            transport.wait_sends()
    except CollectiveTimeoutError as exc:
        return str(exc), exc.missing_ranks
    finally:
        dist.barrier()
    return None


@pytest.mark.slow
@pytest.mark.waits
@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "missed"), [("recv", "send"), ("send", "receive")])
def test_p2p_timeout_names_the_peer(kind, missed):
    # A blocking receive, and a send left in flight that fails only when waited on.
    message, missing = run_distributed(_p2p_failure, 2, kind, timeout_seconds=60)[0]
    assert missing == [1]
    # The frame's shape and dtype are the transport's business; the peer and what it failed to do are ours
    # (rank 1 sits in a barrier, so it cannot report).
    assert re.search(rf"\n  {kind}\(shape=\[\d+\], dtype=\w+, peer=1\) \(p2p #\d+ at test_recorder.py", message), (
        message
    )
    assert f"rank 1 did not {missed} it" in message, message


def _rec(seq, op, shape, group="tp"):
    return CollectiveRecord(seq, op, group, (0, 1, 2), (shape,), ("float32",), 0, None, ("/a/x.py", 1, "f"), 0.0)


def test_first_divergence_reports_missing_calls_and_nothing_when_equal():
    same = {r: [_rec(1, "all_reduce", (2,))] for r in range(3)}
    assert first_divergence(same) is None
    lagging = {
        0: [_rec(1, "barrier", ()), _rec(2, "all_reduce", (2,))],
        1: [_rec(1, "barrier", ())],
        2: [_rec(1, "barrier", ()), _rec(2, "all_reduce", (2,))],
    }
    message, divergent, seq = first_divergence(lagging)
    assert (divergent, seq) == ([1], 2)
    assert message.startswith(
        "rank 1 never called it (made 1 calls; last was #1 barrier(shape=[], dtype=float32)) as collective #2"
    )
    assert "while ranks 0, 2 called all_reduce(shape=[2], dtype=float32)" in message


def test_format_ranks():
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([2, 0, 1]) == "ranks 0-2"
    assert format_ranks([0, 2, 5, 6, 7]) == "ranks 0, 2, 5-7"


def test_recorder_rejects_bad_names():
    with pytest.raises(ValueError, match=r"name='' must be a non-empty string"):
        get_recorder().name_group(None, "")
