"""Which process groups a topology creates (a name and, for each rank, the ranks of its group), and creating them."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Protocol

import torch.distributed as dist

RanksOf = Callable[[int], list[int]]


class _Coordinates(Protocol):
    @property
    def dp(self) -> int: ...

    @property
    def cp(self) -> int: ...


class _Grid(Protocol):
    """What the group table reads of a ``Topology`` (its sizes and rank arithmetic)."""

    @property
    def world_size(self) -> int: ...

    @property
    def pipe_parallel_size(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def data_parallel_shard_size(self) -> int: ...

    @property
    def context_parallel_size(self) -> int: ...

    @property
    def expert_parallel_size(self) -> int: ...

    def coordinates(self, rank: int | None = None) -> _Coordinates: ...

    def _ranks_along(self, rank: int, axis: str) -> list[int]: ...

    def _dp_ranks_where(self, rank: int, key: Callable[[int, int], object]) -> list[int]: ...


def group_specs(topo: _Grid) -> list[tuple[str, RanksOf]]:
    """``(name, ranks_of)`` for every group the ``Topology`` ``topo`` creates, in creation order (the same on every rank).

    Groups that would equal another are left out; the ``Topology`` properties fall back to
    that other group (or to None, "no communication", for a group of one rank).
    """
    shard, ep = topo.data_parallel_shard_size, topo.expert_parallel_size
    dp, cp = topo.data_parallel_size, topo.context_parallel_size

    def replica(r: int) -> tuple[int, int]:
        c = topo.coordinates(r)
        return c.dp, c.cp

    specs: list[tuple[str, RanksOf]] = [
        ("pp", lambda r: topo._ranks_along(r, "pp")),
        ("dp", lambda r: topo._ranks_along(r, "dp")),
        ("cp", lambda r: topo._ranks_along(r, "cp")),
        ("tp", lambda r: topo._ranks_along(r, "tp")),
        ("mp", lambda r: [x for x in range(topo.world_size) if replica(x) == replica(r)]),
    ]
    if dp > 1 and cp > 1:  # DP × CP, where it differs from both the DP and the CP group
        specs.append(("dp_cp", lambda r: topo._dp_ranks_where(r, lambda d, c: 0)))
    if topo.pipe_parallel_size > 1:  # a second pipe group (see pipe_parallel_result_group)
        specs.append(("pp_result", lambda r: topo._ranks_along(r, "pp")))
    if 1 < shard < dp:  # HSDP: consecutive DP ranks (with their CP ranks) shard, the groups replicate
        specs.append(("dp_shard", lambda r: topo._dp_ranks_where(r, lambda d, c: d // shard)))
        specs.append(("dp_replicate", lambda r: topo._dp_ranks_where(r, lambda d, c: (d % shard, c))))
    if ep > 1:
        # EP: consecutive DP ranks (same CP rank) split the experts; the ranks holding the
        # same experts (every CP rank too) reduce their gradients.
        specs.append(("ep", lambda r: topo._dp_ranks_where(r, lambda d, c: (d // ep, c))))
        if dp * cp > ep:
            specs.append(("edp", lambda r: topo._dp_ranks_where(r, lambda d, c: d % ep)))
    return specs


def new_groups(topo: _Grid, rank: int, timeout: datetime.timedelta) -> dict[str, dist.ProcessGroup]:
    """Create every group of :func:`group_specs` with ``timeout``; the ones ``rank`` belongs to, by name.

    ``new_group`` is collective over the default group: every rank creates every group in
    the same order and keeps the ones it belongs to. (``init_device_mesh`` would create the
    per-dimension groups with torch's 30-minute default timeout.)
    """
    mine: dict[str, dist.ProcessGroup] = {}
    for name, ranks_of in group_specs(topo):
        seen: set[tuple[int, ...]] = set()
        for r in range(topo.world_size):
            ranks = tuple(ranks_of(r))
            if ranks in seen:
                continue
            seen.add(ranks)
            group = dist.new_group(list(ranks), timeout=timeout, group_desc=name)
            if rank in ranks:
                mine[name] = group
    return mine
