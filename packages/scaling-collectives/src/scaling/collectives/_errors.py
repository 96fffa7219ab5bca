"""Errors raised when ranks disagree about, or do not arrive at, a collective."""

from __future__ import annotations

from collections.abc import Sequence


class CollectiveError(RuntimeError):
    """A collective failed; the message says which group, op and ranks.

    Attributes:
        group: display name of the group (``tp``, ``dp``, ``world``, ...).
        op: the op this rank was running (``all_reduce``, ``send``, ...).
        seq: its sequence number within the group.
        divergent_ranks: global ranks that called something different (named first).
        missing_ranks: global ranks that did not arrive.
    """

    def __init__(
        self,
        message: str,
        group: str,
        op: str,
        seq: int,
        *,
        divergent: Sequence[int] = (),
        missing: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.group = group
        self.op = op
        self.seq = seq
        self.divergent_ranks = list(divergent)
        self.missing_ranks = list(missing)


class CollectiveMismatchError(CollectiveError):
    """Ranks of one group called different collectives as the same sequence number."""


class CollectiveTimeoutError(CollectiveError):
    """A collective (or a p2p transfer) did not complete within the group's timeout."""
