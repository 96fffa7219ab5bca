"""Explain a failed send/recv by comparing this rank's point-to-point history with its peers'.

Gloo completes a receive whose buffer is larger than the message (the rest stays as it
was) and a send stays pending until its peer posts the receive, so a pipeline bug shows
up as a timeout later, or as garbage. When a transfer fails, the rank publishes its
send/recv ring through the store (as every rank whose collective fails does), waits a
bounded time for its peers' and names, per transfer, what the peer did: never posted the
matching call, posted it with another shape or dtype, or did not report at all. The
k-th send from rank A to rank B matches the k-th receive on B from A.
"""

from __future__ import annotations

import pickle
import time

import torch.distributed as dist

from scaling.collectives import _compat
from scaling.collectives._diagnosis import P2P_REPORT, _exchange, p2p_report, with_diagnostics
from scaling.collectives._errors import CollectiveTimeoutError
from scaling.collectives._recorder import CollectiveRecord, get_recorder

Pair = tuple[str, "int | None"]
History = tuple[list[CollectiveRecord], dict[Pair, int]]
_OTHER = {"send": "recv", "recv": "send"}


def _numbered(history: History) -> dict[Pair, dict[int, CollectiveRecord]]:
    """``(op, peer) -> {k: record}``: the ring's records numbered per pair (1 = the pair's first call)."""
    ring, totals = history
    per_pair: dict[Pair, list[CollectiveRecord]] = {}
    for rec in ring:
        per_pair.setdefault((rec.op, rec.peer), []).append(rec)
    # The ring keeps the newest calls, so the last record of a pair is call number totals[pair].
    return {
        pair: {totals[pair] - len(recs) + 1 + i: rec for i, rec in enumerate(recs)} for pair, recs in per_pair.items()
    }


def _where(rec: CollectiveRecord) -> str:
    return f"p2p #{rec.seq} at {rec.call_site}"


def explain(me: int, rec: CollectiveRecord, k: int, peer_history: History | None, wait: float) -> tuple[str, bool]:
    """What the peer of ``rec`` (this rank's k-th ``rec.op`` with it) did; ``(text, mismatch)``."""
    peer = rec.peer
    if peer_history is None:
        partner = "did not receive it" if rec.op == "send" else "did not send it"
        return (
            f"rank {peer} {partner} and did not report within {wait:.1f}s (hung, dead, or busy outside a collective)",
            False,
        )
    other = _OTHER[rec.op]
    direction = "from" if other == "recv" else "to"
    posted = peer_history[1].get((other, me), 0)
    if posted < k:
        ring = peer_history[0]
        last = f"; its last p2p call was #{ring[-1].seq} {ring[-1].describe()} at {ring[-1].call_site}" if ring else ""
        return (
            f"rank {peer} never posted the matching {other} (it posted {posted} {other}s {direction} rank {me}{last})",
            True,
        )
    match = _numbered(peer_history).get((other, me), {}).get(k)
    if match is None:
        return f"rank {peer} posted the matching {other} (no longer in its ring)", False
    if (match.shapes, match.dtypes) != (rec.shapes, rec.dtypes):
        return f"rank {peer} posted the matching {other} as {match.describe()} ({_where(match)})", True
    return f"rank {peer} posted the matching {match.describe()} ({_where(match)})", False


def p2p_failure(
    recs: list[CollectiveRecord], group: dist.ProcessGroup | None, exc: BaseException
) -> CollectiveTimeoutError:
    """The error to raise after the transfers ``recs`` of one ``batch_send_recv`` failed with ``exc``."""
    timeout = _compat.group_timeout(group).total_seconds()
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    me = dist.get_rank()
    elapsed = time.time() - recs[0].start_time
    lines = [f"point-to-point transfer failed on rank {me} after {elapsed:.1f}s (timeout {timeout:.1f}s): {reason}"]
    peers = sorted({rec.peer for rec in recs if rec.peer is not None})
    wait = min(timeout, get_recorder().max_diagnosis_seconds)
    payload = p2p_report()
    try:
        got = _exchange(P2P_REPORT, [me, *peers], payload, wait)
    except (RuntimeError, OSError) as store_exc:
        lines.append(f"(could not reach the store to compare with the peers: {store_exc})")
        got = {me: payload}
    mine: History = pickle.loads(payload)
    histories = {r: pickle.loads(v) for r, v in got.items() if r != me}
    numbered = _numbered(mine)
    failing = {rec.seq for rec in recs}
    # The first earlier transfer a peer posted differently: gloo let it through, everything after is off.
    for pair, calls in sorted(numbered.items(), key=lambda kv: min(r.seq for r in kv[1].values())):
        if pair[1] not in histories:
            continue
        for k, rec in sorted(calls.items()):
            if rec.seq in failing or rec.seq > recs[0].seq:
                continue
            text, mismatch = explain(me, rec, k, histories[rec.peer], wait)  # type: ignore[index]
            if mismatch:
                lines.append(f"  earlier: {rec.describe()} ({_where(rec)}): {text}")
                break
    missing = [p for p in peers if p not in histories]
    divergent: list[int] = []
    for rec in recs:
        k = next(n for n, r in numbered[(rec.op, rec.peer)].items() if r.seq == rec.seq)
        text, mismatch = explain(me, rec, k, histories.get(rec.peer), wait)  # type: ignore[arg-type]
        lines.append(f"  {rec.describe()} ({_where(rec)}): {text}")
        if mismatch and rec.peer is not None:
            # A peer that never posted the matching call did not arrive; one that posted another shape diverged.
            (missing if "never posted" in text else divergent).append(rec.peer)
    error = CollectiveTimeoutError(
        "\n".join(lines),
        "p2p",
        recs[0].op,
        recs[0].seq,
        missing=sorted(set(missing)),
        divergent=sorted(set(divergent)),
    )
    return with_diagnostics(error)  # type: ignore[return-value]
