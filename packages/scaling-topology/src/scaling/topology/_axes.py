"""The named axes of the rank grid, each defined once: its ranks, and which process group it uses.

A rank's coordinates are ``(pp, dp, cp, tp)`` (TP fastest). An axis is a set of ranks that
differ in some coordinates and agree in the others; each rank sees its own group of them.
The four mesh axes vary one coordinate each. The derived ones:

``dp_cp``         DP × CP: the ranks holding the same parameters (gradients averaged, ZeRO).
``ep``            consecutive DP ranks (same CP rank) whose experts together make a layer's.
``edp``           the ranks holding the same experts (DP × CP / EP): expert gradients.
``dp_shard``      HSDP's shard group (``data_parallel_shard_size`` DP ranks with their CP
                  ranks): ZeRO shards over it; ``dp_cp`` without HSDP.
``dp_replicate``  HSDP's replicas of one shard (same CP rank).
``replica``       TP × PP at one (dp, cp): one model replica (global norms, model-wide sums).
``pp_result``     the pipe's ranks again, on a second group, for a collective posted early
                  and completed late (the pipeline's step results), so that it never
                  interleaves with the pipe group's activations and tied-weight sums.

Each axis names the group it communicates over (:attr:`AxisSpec.group`): its own, created
under its name; another axis's where the two have the same ranks (``dp_cp`` is ``dp``
without context parallelism); or None, "no communication", for an axis of one rank whose
callers skip it (``ep`` without expert parallelism). These are the rules the ``Topology``
properties of 0.1 had as fallback chains; here they are data, read by group creation and by
:class:`Axis` alike.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: Every axis name, in the order their own groups are created (the same on every rank).
AXIS_NAMES = ("pp", "dp", "cp", "tp", "replica", "dp_cp", "pp_result", "dp_shard", "dp_replicate", "ep", "edp")

RanksOf = Callable[[int], list[int]]


@dataclass(frozen=True)
class RankCoordinates:
    """Where one rank sits in the (pp, dp, cp, tp) grid."""

    pp: int
    dp: int
    tp: int
    cp: int = 0

    def __repr__(self) -> str:
        cp = f", cp={self.cp}" if self.cp else ""
        return f"(pp={self.pp}, dp={self.dp}{cp}, tp={self.tp})"


@dataclass(frozen=True)
class RankGrid:
    """The sizes of the grid and its arithmetic: rank <-> coordinates (no process groups)."""

    pp: int
    dp: int
    cp: int
    tp: int
    dp_shard: int  # DP ranks that shard among themselves (HSDP); dp without HSDP
    ep: int

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def coordinates(self, rank: int) -> RankCoordinates:
        tp, cp, dp = self.tp, self.cp, self.dp
        return RankCoordinates(
            pp=rank // (dp * cp * tp), dp=(rank // (cp * tp)) % dp, tp=rank % tp, cp=(rank // tp) % cp
        )

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def along(self, rank: int, axis: str) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except ``axis`` (one of pp, dp, cp, tp)."""
        c = self.coordinates(rank)
        coords = {"pp": c.pp, "dp": c.dp, "cp": c.cp, "tp": c.tp}
        return [self.rank_of(**{**coords, axis: i}) for i in range(getattr(self, axis))]

    def dp_cp_where(self, rank: int, key: Callable[[int, int], object]) -> list[int]:
        """The DP × CP ranks at ``rank``'s (pp, tp), in (dp, cp) order, whose ``key(dp, cp)`` is ``rank``'s."""
        c = self.coordinates(rank)
        mine = key(c.dp, c.cp)
        return [self.rank_of(c.pp, d, c.tp, k) for d in range(self.dp) for k in range(self.cp) if key(d, k) == mine]


class AxisSpec(NamedTuple):
    """One axis: the ranks of any rank's group, and the name of the group it uses (None: none)."""

    ranks_of: RanksOf
    group: str | None


def axis_specs(grid: RankGrid) -> dict[str, AxisSpec]:
    """Every axis of ``grid``, by name, in :data:`AXIS_NAMES` order."""
    dp, cp, shard, ep = grid.dp, grid.cp, grid.dp_shard, grid.ep
    dp_cp = "dp" if cp == 1 else "cp" if dp == 1 else "dp_cp"
    hsdp = shard < dp

    def replica(rank: int) -> list[int]:
        c = grid.coordinates(rank)
        return [grid.rank_of(p, c.dp, t, c.cp) for p in range(grid.pp) for t in range(grid.tp)]

    if not hsdp:
        shard_group: str | None = dp_cp
    else:
        shard_group = None if shard * cp == 1 else "cp" if shard == 1 else "dp_shard"
    edp_size = dp * cp // ep
    return {
        "pp": AxisSpec(lambda r: grid.along(r, "pp"), "pp"),
        "dp": AxisSpec(lambda r: grid.along(r, "dp"), "dp"),
        "cp": AxisSpec(lambda r: grid.along(r, "cp"), "cp"),
        "tp": AxisSpec(lambda r: grid.along(r, "tp"), "tp"),
        "replica": AxisSpec(replica, "replica"),
        "dp_cp": AxisSpec(lambda r: grid.dp_cp_where(r, lambda d, c: 0), dp_cp),
        "pp_result": AxisSpec(lambda r: grid.along(r, "pp"), "pp_result" if grid.pp > 1 else "pp"),
        "dp_shard": AxisSpec(lambda r: grid.dp_cp_where(r, lambda d, c: d // shard), shard_group),
        "dp_replicate": AxisSpec(
            lambda r: grid.dp_cp_where(r, lambda d, c: (d % shard, c)),
            None if not hsdp else "dp" if shard == 1 else "dp_replicate",
        ),
        "ep": AxisSpec(lambda r: grid.dp_cp_where(r, lambda d, c: (d // ep, c)), None if ep == 1 else "ep"),
        "edp": AxisSpec(
            lambda r: grid.dp_cp_where(r, lambda d, c: d % ep),
            dp_cp if ep == 1 else None if edp_size == 1 else "edp",
        ),
    }


@dataclass(frozen=True, eq=False)
class Axis:
    """One named axis as this rank sees it: ``topology.axis("tp")``.

    Attributes:
        name: the axis's name (:data:`AXIS_NAMES`).
        size: ranks in this rank's group of the axis.
        rank: this rank's place in it, ``ranks.index(global_rank)``.
        ranks: the group's global ranks, in axis order.
        mesh_dim: the ``DeviceMesh`` dimension (pp, dp, cp, tp), None for a derived axis.
    """

    name: str
    size: int
    rank: int
    ranks: list[int]
    mesh_dim: str | None
    _group: Callable[[], ProcessGroup | None] = field(repr=False)

    @property
    def group(self) -> ProcessGroup | None:
        """The process group the axis communicates over; None (no communication) where the
        axis is one rank and its callers skip it. Raises before ``initialize_distributed``."""
        return self._group()

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def previous(self) -> int | None:
        """Global rank before this one on the axis (the previous pipeline stage); None on the first."""
        return None if self.rank == 0 else self.ranks[self.rank - 1]

    @property
    def next(self) -> int | None:
        """Global rank after this one on the axis; None on the last."""
        return None if self.rank == self.size - 1 else self.ranks[self.rank + 1]


def new_groups(
    specs: dict[str, AxisSpec], world_size: int, rank: int, timeout: datetime.timedelta
) -> dict[str, dist.ProcessGroup]:
    """Create the group of every axis that has its own (``spec.group == name``), with ``timeout``;
    the ones ``rank`` belongs to, by name.

    ``new_group`` is collective over the default group: every rank creates every group in
    the same order and keeps the ones it belongs to. (``init_device_mesh`` would create the
    per-dimension groups with torch's 30-minute default timeout.)
    """
    mine: dict[str, dist.ProcessGroup] = {}
    for name, spec in specs.items():
        if spec.group != name:
            continue
        seen: set[tuple[int, ...]] = set()
        for r in range(world_size):
            ranks = tuple(spec.ranks_of(r))
            if ranks in seen:
                continue
            seen.add(ranks)
            group = dist.new_group(list(ranks), timeout=timeout, group_desc=name)
            if rank in ranks:
                mine[name] = group
    return mine
