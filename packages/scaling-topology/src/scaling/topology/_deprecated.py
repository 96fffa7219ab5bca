"""``Topology``'s names of 0.1 that mislead, kept for one minor version: each warns and answers as its new name."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class _Replica(Protocol):
    @property
    def model_replica_group(self) -> ProcessGroup: ...

    @property
    def model_replica_ranks(self) -> list[int]: ...


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"Topology.{old} is deprecated; use Topology.{new} (same group)", DeprecationWarning, stacklevel=3)


class DeprecatedNames:
    """Mixed into ``Topology``; removed in 0.2."""

    @property
    def model_pipe_parallel_group(self: _Replica) -> ProcessGroup:
        """Deprecated name of :attr:`model_replica_group` (it spans TP × PP, not "model parallel"
        alone, which means TP here); removed in 0.2."""
        _deprecated("model_pipe_parallel_group", "model_replica_group")
        return self.model_replica_group

    @property
    def model_pipe_parallel_ranks(self: _Replica) -> list[int]:
        """Deprecated name of :attr:`model_replica_ranks`; removed in 0.2."""
        _deprecated("model_pipe_parallel_ranks", "model_replica_ranks")
        return self.model_replica_ranks
