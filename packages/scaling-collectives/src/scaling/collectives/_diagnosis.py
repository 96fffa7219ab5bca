"""Compare the collective sequences of the ranks of a group and name the first divergence.

Ranks exchange their recorded calls through the rendezvous store, not through a
process group: after a timeout the group's own transport may be wedged (gloo closes
the pair on a protocol violation), while the store still answers. Three entry points:

- :func:`pre_check` (debug mode): before collective #n, every rank publishes what it is
  about to call and waits for the others; a mismatch or a rank that never arrives
  raises at once, on every rank, instead of a hang or silent garbage.
- :func:`diagnose_failure`: a collective raised (timeout, closed connection); the rank
  publishes its ring, waits a bounded time for the others', and explains.
- :func:`check_consistency`: the explicit per-step check.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence

import torch.distributed as dist

from scaling.collectives import _compat
from scaling.collectives._errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from scaling.collectives._recorder import CollectiveRecord, _GroupState, get_recorder

_PREFIX = "scaling.collectives"
P2P_REPORT = f"{_PREFIX}/p2p_report"  # + /<rank>: that rank's send/recv ring, newest report wins
_RECENT = 4  # seqs shown per rank in the grid of an error
CLOSED_CONNECTION_WAIT_S = 2.0  # how long a rank whose peer vanished waits for the others' reports


def format_ranks(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0, 2, 5-7``."""
    ranks = sorted(ranks)
    runs: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _exchange(prefix: str, ranks: Sequence[int], payload: bytes, timeout_s: float) -> dict[int, bytes]:
    """Publish ``payload`` under ``prefix`` and collect the other ranks' until ``timeout_s``."""
    store = _compat.default_store()
    me = dist.get_rank()
    store.set(f"{prefix}/{me}", payload)  # type: ignore[arg-type]  # the binding takes bytes too
    got = {me: payload}
    pending = [r for r in ranks if r != me]
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    while pending:
        for r in list(pending):
            key = f"{prefix}/{r}"
            if store.check([key]):
                got[r] = store.get(key)
                pending.remove(r)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return got


def first_divergence(rings: dict[int, list[CollectiveRecord]]) -> tuple[str, list[int], int] | None:
    """Explain the first sequence number at which the ranks' calls differ.

    Returns ``(message, divergent_ranks, seq)`` or ``None`` when every rank made the
    same calls over the window all of them still hold.
    """
    by_seq = {r: {rec.seq: rec for rec in ring} for r, ring in rings.items()}
    last = {r: max(seqs, default=0) for r, seqs in by_seq.items()}
    lo = max((min(seqs) for seqs in by_seq.values() if seqs), default=1)
    group = next((rec.group for ring in rings.values() for rec in ring), "?")
    for seq in range(lo, max(last.values(), default=0) + 1):
        cats: dict[object, list[int]] = {}
        for r in sorted(rings):
            rec = by_seq[r].get(seq)
            cats.setdefault(rec.signature() if rec is not None else None, []).append(r)
        if len(cats) == 1:
            continue
        # The reference is what most ranks did (ties: the lowest rank's call).
        ref_sig = max(cats, key=lambda s: (len(cats[s]), -min(cats[s])))
        reference = _clause(by_seq, last, seq, ref_sig, cats[ref_sig])
        others = [(s, rs) for s, rs in cats.items() if s != ref_sig]
        lines = [
            f"{_clause(by_seq, last, seq, sig, ranks)} as collective #{seq} of the {group} group"
            f"{',' if sig is None else ''} while {reference}"
            for sig, ranks in others
        ]
        divergent = sorted(r for _, rs in others for r in rs)
        return "; ".join(lines) + "\n" + _grid(by_seq, seq), divergent, seq
    return None


def _clause(
    by_seq: dict[int, dict[int, CollectiveRecord]], last: dict[int, int], seq: int, sig: object, ranks: list[int]
) -> str:
    """``rank 3 called all_reduce(...)``, or what the ranks that never got to ``seq`` did last."""
    if sig is None:
        prev = by_seq[ranks[0]].get(last[ranks[0]])
        before = f"; last was #{prev.seq} {prev.describe()}" if prev is not None else ""
        return f"{format_ranks(ranks)} never called it (made {last[ranks[0]]} calls{before})"
    return f"{format_ranks(ranks)} called {by_seq[ranks[0]][seq].describe()}"


def _grid(by_seq: dict[int, dict[int, CollectiveRecord]], seq: int) -> str:
    """Rank × seq table of the calls leading up to ``seq``, with call sites."""
    lines = [f"recent collectives per rank (#{max(1, seq - _RECENT + 1)}..#{seq}):"]
    for r in sorted(by_seq):
        cells = []
        for s in range(max(1, seq - _RECENT + 1), seq + 1):
            rec = by_seq[r].get(s)
            cells.append(f"#{s} {rec.describe()}" if rec is not None else f"#{s} -")
        here = by_seq[r].get(seq)
        site = f"   [at {here.call_site}]" if here is not None else ""
        lines.append(f"  rank {r}: " + " | ".join(cells) + site)
    return "\n".join(lines)


def _timeout_seconds(group: dist.ProcessGroup | None) -> float:
    return _compat.group_timeout(group).total_seconds()


def pre_check(group: dist.ProcessGroup, state: _GroupState, rec: CollectiveRecord) -> None:
    """Debug mode: every rank of ``group`` announces collective ``rec`` and compares."""
    timeout = _timeout_seconds(group)
    prefix = f"{_PREFIX}/debug/{state.key}/{rec.seq}"
    # The last few calls (already checked) travel along so the error can show the lead-up.
    got = _exchange(prefix, state.ranks, pickle.dumps(list(state.ring)[-_RECENT:]), timeout)
    state.debug_keys.append(f"{prefix}/{dist.get_rank()}")
    # Every peer has read the keys of seq n-2 once they all published seq n-1.
    while len(state.debug_keys) > 2:
        _delete(state.debug_keys.pop(0))
    missing = [r for r in state.ranks if r not in got]
    rings = {r: pickle.loads(v) for r, v in got.items()}
    found = first_divergence(rings) if len(rings) > 1 else None
    if found is not None:
        message, divergent, _ = found
        raise with_diagnostics(
            CollectiveMismatchError(message, rec.group, rec.op, rec.seq, divergent=divergent, missing=missing)
        )
    if missing:
        raise with_diagnostics(
            CollectiveTimeoutError(
                f"{format_ranks(missing)} did not arrive at {rec.describe()}, collective #{rec.seq} of the "
                f"{rec.group} group (ranks {list(state.ranks)}), within the group timeout of {timeout:.1f}s; "
                f"{format_ranks(sorted(got))} did",
                rec.group,
                rec.op,
                rec.seq,
                missing=missing,
            )
        )


def _delete(key: str) -> None:
    try:
        _compat.default_store().delete_key(key)
    except (RuntimeError, NotImplementedError):
        pass  # a store without deletion only grows; the check stays correct


def diagnose_failure(
    group: dist.ProcessGroup, state: _GroupState, rec: CollectiveRecord, exc: BaseException
) -> CollectiveError:
    """The error to raise after collective ``rec`` failed with ``exc`` (timeout or transport).

    Also writes this rank's diagnostics file when the recorder has a directory.
    """
    return with_diagnostics(_diagnose(group, state, rec, exc))


def _diagnose(
    group: dist.ProcessGroup, state: _GroupState, rec: CollectiveRecord, exc: BaseException
) -> CollectiveError:
    timeout = _timeout_seconds(group)
    elapsed = time.time() - rec.start_time
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    head = (
        f"{rec.describe()} as collective #{rec.seq} of the {rec.group} group (ranks {list(state.ranks)}) "
        f"failed on rank {dist.get_rank()} after {elapsed:.1f}s (group timeout {timeout:.1f}s): {reason}"
    )
    wait = min(timeout, get_recorder().max_diagnosis_seconds)
    if "timed out" not in reason.lower():
        # A closed connection: a peer process is gone. The live ranks at this collective fail
        # within moments of each other, so a short window collects their reports, and the job
        # is not kept waiting a full timeout for a rank that can never answer.
        wait = min(wait, CLOSED_CONNECTION_WAIT_S)
    state.incidents += 1
    publish_p2p_report()
    try:
        got = _exchange(
            f"{_PREFIX}/incident/{state.key}/{state.incidents}", state.ranks, pickle.dumps(list(state.ring)), wait
        )
    except (RuntimeError, OSError) as store_exc:
        return CollectiveTimeoutError(
            f"{head}\n(could not reach the store to compare ranks: {store_exc})", rec.group, rec.op, rec.seq
        )
    rings = {r: pickle.loads(v) for r, v in got.items()}
    missing = [r for r in state.ranks if r not in got]
    parts = [head]
    found = first_divergence(rings) if len(rings) > 1 else None
    if missing:
        parts.append(
            f"{format_ranks(missing)} did not arrive: no report within {wait:.1f}s "
            "(hung, dead, or busy outside a collective)"
        )
    if found is not None:
        message, divergent, _ = found
        return CollectiveMismatchError(
            "\n".join([head, message, *parts[1:]]), rec.group, rec.op, rec.seq, divergent=divergent, missing=missing
        )
    late = _late_ranks(rings, rec.seq, timeout)
    if late:
        parts.append(late)
    return CollectiveTimeoutError("\n".join(parts), rec.group, rec.op, rec.seq, missing=missing)


def p2p_report() -> bytes:
    """This rank's send/recv ring and per-(op, peer) call counts, pickled for the store."""
    return pickle.dumps(get_recorder().p2p_snapshot())


def publish_p2p_report() -> None:
    """Leave this rank's send/recv history where a failing pipeline peer looks for it."""
    try:
        _compat.default_store().set(f"{P2P_REPORT}/{dist.get_rank()}", p2p_report())  # type: ignore[arg-type]
    except (RuntimeError, OSError):
        pass  # best effort: the peer then says this rank did not report


def with_diagnostics(err: CollectiveError) -> CollectiveError:
    """Write this rank's diagnostics file for ``err`` (when configured) and name it in the message."""
    try:
        path = get_recorder().write_diagnostics(str(err))
    except OSError as write_exc:  # the collective's error matters more than the file
        err.args = (f"{err.args[0]}\n(could not write the diagnostics file: {write_exc})",)
        return err
    if path is not None:
        err.args = (f"{err.args[0]}\ndiagnostics of this rank: {path}",)
    return err


def _late_ranks(rings: dict[int, list[CollectiveRecord]], seq: int, timeout: float) -> str:
    starts = {r: rec.start_time for r, ring in rings.items() for rec in ring if rec.seq == seq}
    if not starts:
        return ""
    first = min(starts.values())
    late = {r: t - first for r, t in starts.items() if t - first > 0.5 * timeout}
    return "; ".join(f"rank {r} arrived {d:.1f}s after the first rank" for r, d in sorted(late.items()))


def check_consistency(group: dist.ProcessGroup | None, timeout_seconds: float | None = None) -> int:
    """Compare the recorded collectives of every rank of ``group``; call it on all of them.

    Use it once per step (or after a suspicious hang) to catch ranks whose sequences
    drifted apart before the drift turns into a hang. Works on gloo and NCCL alike:
    the comparison goes through the rendezvous store.

    Args:
        group: the group to check; ``None`` or one rank returns at once.
        timeout_seconds: how long to wait for the other ranks (default: the group's timeout).

    Returns:
        The number of collectives compared (the newest sequence number).

    Raises:
        CollectiveMismatchError: a rank called a different collective (the first divergence is named).
        CollectiveTimeoutError: a rank did not reach the check in time (named).
    """
    if group is None or dist.get_world_size(group) == 1:
        return 0
    state = get_recorder().state(group)
    timeout = _timeout_seconds(group) if timeout_seconds is None else float(timeout_seconds)
    state.checks += 1
    ring = list(state.ring)
    got = _exchange(f"{_PREFIX}/check/{state.key}/{state.checks}", state.ranks, pickle.dumps(ring), timeout)
    rings = {r: pickle.loads(v) for r, v in got.items()}
    found = first_divergence(rings)
    missing = [r for r in state.ranks if r not in got]
    last = ring[-1] if ring else None
    op, seq = (last.op, last.seq) if last is not None else ("check_consistency", 0)
    if found is not None:
        message, divergent, seq = found
        raise CollectiveMismatchError(message, state.name, op, seq, divergent=divergent, missing=missing)
    if missing:
        raise CollectiveTimeoutError(
            f"check_consistency of the {state.name} group: {format_ranks(missing)} did not arrive within "
            f"{timeout:.1f}s; {format_ranks(sorted(got))} did",
            state.name,
            op,
            seq,
            missing=missing,
        )
    return state.seq
