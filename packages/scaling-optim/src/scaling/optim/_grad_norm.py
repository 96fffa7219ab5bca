"""Global gradient norm over TP, PP and DP, and the non-finite verdict every rank shares."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from scaling.collectives import all_reduce
from scaling.optim._comm import group_size
from scaling.optim._compat import foreach_norm
from scaling.optim._slots import ParamSlot
from scaling.topology import Topology


def mark_norm_owners(slots: Sequence[ParamSlot], topology: Topology) -> None:
    """Decide which rank counts each parameter in the global norm, so each counts once.

    A TP-replicated parameter (not ``meta.is_model_parallel``) has the same gradient on
    every TP rank: only TP rank 0 counts it. A tied parameter (``meta.tied_key``) held by
    several pipeline stages counts only on the lowest stage holding that key.
    """
    tp_rank = topology.axis("tp").rank
    for slot in slots:
        slot.counts_in_norm = slot.meta.is_model_parallel or tp_rank == 0
    if topology.axis("pp").size == 1:
        return
    local_keys = sorted({s.meta.tied_key for s in slots if s.meta.tied_key is not None})
    gathered: list[list[str] | None] = [None] * topology.axis("pp").size
    dist.all_gather_object(gathered, local_keys, group=topology.axis("pp").group)
    first_stage: dict[str, int] = {}
    for stage, keys in enumerate(gathered):
        for key in keys or []:
            first_stage.setdefault(key, stage)
    for slot in slots:
        tied = slot.meta.tied_key
        if tied is not None and first_stage[tied] != topology.axis("pp").rank:
            slot.counts_in_norm = False


def global_norm_squared(
    parts: Sequence[tuple[Sequence[torch.Tensor], bool]], loss_non_finite: torch.Tensor, topology: Topology
) -> tuple[float, bool]:
    """The squared global L2 norm of the gradients and whether any rank saw a non-finite value.

    Args:
        parts: per kind of parameter (dense; experts under expert parallelism, see
            ``_spaces.py``): this rank's owned, DP-reduced (still loss-scaled) gradients that
            it counts over TP and PP, and whether it counts them over DP × CP (each shard
            once; unsharded, the first replica).
        loss_non_finite: a 0-dim tensor, > 0 when a loss passed to ``backward`` on this
            rank was non-finite.
        topology: for the model-pipe (TP × PP) and DP × CP groups.

    Returns:
        ``(norm_squared, non_finite)``, identical on every rank.
    """
    device = topology.device
    sums = [_norm_squared(list(grads), device) for grads, _ in parts]
    non_finite = loss_non_finite.to(device=device, dtype=torch.float64).reshape(())
    # Count non-finite values separately: a NaN is kept apart from the sums that the DP
    # replicas zero out below, so every rank sees it.
    flag = non_finite + sum((~torch.isfinite(x)).double() for x in sums)
    vec = torch.stack([*sums, flag])
    if group_size(topology.axis("replica").group) > 1:
        all_reduce(vec, topology.axis("replica").group)
    if topology.axis("dp_cp").size > 1:
        for i, (_, counts) in enumerate(parts):
            if not counts:
                vec[i] = 0.0
        all_reduce(vec, topology.axis("dp_cp").group)
    *squares, flag_sum = vec.tolist()
    norm_sq = sum(squares)
    return norm_sq, bool(flag_sum > 0) or not torch.isfinite(torch.tensor(norm_sq)).item()


def _norm_squared(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared L2 norms in fp64 (0 for none)."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    # Per-tensor norms in the gradient's dtype (as clip_grad_norm_) in one multi-tensor
    # call, squared and summed in fp64: an fp64 copy of every gradient would cost more
    # than the update itself. The norms are stacked first (exactly: a mix of dtypes
    # promotes to the widest) and widened once, not one launch per parameter.
    return torch.stack(foreach_norm(grads)).to(torch.float64).square().sum()
