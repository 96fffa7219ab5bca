"""Where each kind of parameter's gradient is averaged and its optimizer storage sharded.

A *dense* parameter is held by every DP × CP rank of its (pp, tp): its gradient is
averaged over ``topology.axis("dp_cp").group`` and ZeRO shards it over
``topology.axis("dp_shard").group`` (all of DP × CP, or an HSDP shard group whose
replicas all-reduce the shards).

An *expert* parameter (``ParameterMeta.is_expert``) under ``expert_parallel_size = ep > 1``
is held only by the DP × CP / ep ranks of its ``topology.axis("edp").group``,
and its gradient there already sums the contributions of every token of its
expert-parallel group (the token all-to-all's backward brings them home). The
DP × CP mean is then the sum over the ranks holding it divided by DP × CP: the average
over that group divided by ``ep``. ZeRO shards it over that same group (HSDP does not
apply to experts: they are split ``ep`` ways already).

A :class:`ShardSpace` is one of these; the optimizer keeps one per kind and gives each
its own reducer (ZeRO 0-2), shard gather (ZeRO 1-2) or ZeRO-3 gatherer and scatter.
:func:`place_parameters` puts each trainable parameter's slot in its space.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from scaling.nn import ParameterMeta
from scaling.optim._comm import group_size
from scaling.optim._config import OptimizerConfig, muon_offload_refusal
from scaling.optim._param_group import OptimizerParamGroup
from scaling.optim._reducer import GradientReducer
from scaling.optim._shard_gather import ShardGather
from scaling.optim._slots import ParamSlot
from scaling.optim._update import state_names, update_rule
from scaling.optim._zero3 import ParameterGatherer
from scaling.optim._zero3_scatter import GradientScatter
from scaling.topology import Topology

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(eq=False)
class ShardSpace:
    """One kind of parameter: the ranks holding it, its ZeRO shards, and the machinery reducing them.

    Attributes:
        kind: ``"dense"`` or ``"expert"``.
        replicas: the ranks holding the same parameters; gradients are averaged there.
        shard_group: the ranks ZeRO shards over (the replicas, or an HSDP shard group).
        replicate_group: HSDP: the replicas of this rank's shard; else None.
        world: number of ZeRO shards (1 without ZeRO or with one rank).
        rank: this rank's shard index.
        divisor: the average over ``replicas`` is divided by this as well (``ep`` for experts).
        counts_in_norm: whether this rank adds the space's owned gradients to the global
            norm (every shard once, or, unsharded, the first replica only).
        experts_apart: (dense space) expert parameters live in a space of their own.
        indices: positions of the space's slots in the optimizer's slot list.
    """

    kind: str
    replicas: ProcessGroup | None
    shard_group: ProcessGroup | None
    replicate_group: ProcessGroup | None
    world: int
    rank: int
    divisor: int
    counts_in_norm: bool
    experts_apart: bool = False
    indices: list[int] = field(default_factory=list)
    slots: list[ParamSlot] = field(default_factory=list)
    reducer: GradientReducer | None = None
    shard_gather: ShardGather | None = None
    gatherer: ParameterGatherer | None = None
    scatter: GradientScatter | None = None

    def holds(self, meta: ParameterMeta) -> bool:
        """Whether a parameter with ``meta`` belongs here (frozen ones included)."""
        if self.kind == "expert":
            return meta.is_expert
        return not (meta.is_expert and self.experts_apart)

    def add(self, index: int, slot: ParamSlot) -> None:
        self.indices.append(index)
        self.slots.append(slot)

    def start_reduction(self, zero_stage: int, bucket_size_bytes: int, reduce_dtype: torch.dtype | None) -> None:
        """Create the backward-overlapped reducer (ZeRO 0-2) and the shard gather (ZeRO 1-2);
        ``reduce_dtype``: what bf16/fp16 gradients travel in (None: their own dtype)."""
        if zero_stage < 3 and self.slots and group_size(self.replicas) > 1:
            # ZeRO 0 all-reduces buckets; ZeRO 1 and 2 reduce-scatter them into the owned shards.
            mode = ("all_reduce", "shard", "shard_free")[zero_stage]
            assert self.replicas is not None
            self.reducer = GradientReducer(self.slots, self.replicas, bucket_size_bytes, mode, reduce_dtype)
        if zero_stage in (1, 2) and self.world > 1 and self.slots:
            assert self.shard_group is not None
            self.shard_gather = ShardGather(self.slots, self.shard_group, bucket_size_bytes)

    def attach_zero3(
        self, modules: list[torch.nn.Module], reshard_after_forward: bool, reduce_dtype: torch.dtype | None
    ) -> ParameterGatherer:
        """ZeRO-3: gather and free this space's parameters (frozen ones included) per layer."""
        self.gatherer = ParameterGatherer(
            modules, self.slots, self.shard_group, reshard_after_forward=reshard_after_forward, takes_frozen=self.holds
        )
        self.scatter = GradientScatter(
            self.gatherer.layers, self.shard_group, self.replicate_group, self.divisor, reduce_dtype
        )
        return self.gatherer

    def discard(self) -> None:
        """Drop reductions in flight (``zero_grad``)."""
        if self.reducer is not None:
            self.reducer.discard()
        if self.scatter is not None:
            self.scatter.discard()

    def finish_reduction(self) -> None:
        """Wait for the reduction overlapped with backward; the gradients then hold the DP × CP mean."""
        if self.reducer is not None:
            self.reducer.finish()
        if self.scatter is not None:
            self.scatter.finish()  # divides by the whole DP × CP itself
        elif self.divisor > 1:
            for slot in self.slots:
                grad = slot.grad_shard if slot.grad_shard is not None else slot.param.grad
                if grad is not None:
                    grad.div_(self.divisor)


def shard_spaces(topology: Topology, zero_stage: int) -> list[ShardSpace]:
    """The dense space and, with expert parallelism, the expert space (see the module docstring)."""
    shard_group = topology.axis("dp_shard").group
    world = group_size(shard_group) if zero_stage >= 1 else 1
    dense = ShardSpace(
        "dense",
        topology.axis("dp_cp").group,
        shard_group,
        topology.axis("dp_replicate").group,
        world,
        topology.axis("dp_shard").rank if world > 1 else 0,
        1,
        counts_in_norm=topology.axis("dp_replicate").rank == 0 if world > 1 else topology.axis("dp_cp").rank == 0,
    )
    if topology.axis("ep").size == 1:
        return [dense]
    group = topology.axis("edp").group
    world = group_size(group) if zero_stage >= 1 else 1
    rank = topology.axis("edp").rank
    expert = ShardSpace(
        "expert",
        group,
        group,
        None,
        world,
        rank if world > 1 else 0,
        topology.axis("ep").size,
        counts_in_norm=world > 1 or rank == 0,
    )
    dense.experts_apart = True
    return [dense, expert]


def place_parameters(
    spaces: Sequence[ShardSpace], parameter_groups: Sequence[OptimizerParamGroup], config: OptimizerConfig
) -> tuple[list[ParamSlot], list[ShardSpace]]:
    """A slot for each trainable parameter of ``parameter_groups``, in group order, added to the
    space that holds it; returns the slots and each slot's space.

    Raises:
        ValueError: a parameter in two groups, or a Muon group with ``cpu_offload``.
    """
    slots: list[ParamSlot] = []
    space_of: list[ShardSpace] = []
    owner: dict[int, str] = {}
    for gi, group in enumerate(parameter_groups):
        for name, param, meta in group.trainable():
            if id(param) in owner:
                raise ValueError(
                    f"parameter {name!r} is in groups {owner[id(param)]!r} and {group.name!r}; put it in one"
                )
            owner[id(param)] = group.name
            space = next(sp for sp in spaces if sp.holds(meta))
            rule = update_rule(config, group.config.method, meta.logical_shape)
            if rule == "muon" and config.cpu_offload:
                raise ValueError(muon_offload_refusal(f"parameter group {group.name!r} (method='muon')"))
            slot = ParamSlot(
                name,
                param,
                meta,
                gi,
                space.world,
                space.rank,
                config.master_weights,
                state_names(config, rule),
                offload=config.cpu_offload,
                rule=rule,
            )
            space.add(len(slots), slot)
            space_of.append(space)
            slots.append(slot)
    return slots, space_of
