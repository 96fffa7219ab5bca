"""Layout-independent optimizer state: DTensor views of full logical shapes keyed by ``meta.key``.

Each state tensor (fp32 master weights, Adam moments, SGD momentum) is exposed as a
DTensor on this pipeline stage's ``("dp", "tp")`` sub-mesh: ``Shard(parallel_dim)`` over
TP for TP-split parameters, ``Replicate()`` otherwise, and ``Replicate()`` over DP. ZeRO
shards are flat chunks of a parameter, which no DTensor placement describes, so they are
all-gathered over DP when the state dict is built (a transient copy of this stage's
TP-local state per rank). ``torch.distributed.checkpoint`` can then save from one layout
and load into another (DP size, TP size, ZeRO stage, pipeline split), and a plain tensor
of the full logical shape loads as well (one process, inference tools).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from scaling.optim._comm import all_gather_chunks
from scaling.optim._slots import ParamSlot

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from scaling.config import StateDict
    from scaling.optim._data_parallel import DataParallel


# DTensor (and sympy with it: ~0.35 s of CPU) is imported where a state dict is built or read,
# not by ``import scaling.optim``: a process that never checkpoints does without it.


def _entries(slot: ParamSlot) -> dict[str, torch.Tensor]:
    """The owned elements of each state tensor of ``slot``, fp32 master first."""
    out = {"master": slot.work_param()}
    out.update(slot.state)
    return out


def parameter_state(dp: DataParallel) -> dict[str, dict[str, DTensor]]:
    """Per-parameter DTensors of each state tensor, by ``meta.key`` then name (see the module docstring).

    Each kind of parameter's ZeRO shards are gathered over its shard group (``dp.spaces``).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    topo = dp.topology
    mesh = topo.device_mesh["dp", "tp"]
    owners, outputs = [], []
    for space in dp.spaces:
        chunks, fulls = [], []
        for slot in space.slots:
            for name, owned in _entries(slot).items():
                full = torch.empty(
                    # On the topology's device: the gather runs on its backend (host state under cpu_offload).
                    slot.numel,
                    dtype=torch.float32 if name == "master" else owned.dtype,
                    device=topo.device,
                )
                padded = torch.zeros(slot.chunk, dtype=full.dtype, device=full.device)
                padded[: slot.length].copy_(owned)
                chunks.append(padded)
                fulls.append(full)
                owners.append((slot, name))
        group = space.shard_group if space.world > 1 else None
        all_gather_chunks(chunks, fulls, group, dp.config.allreduce_bucket_size)
        outputs += fulls
    params: dict[str, dict[str, DTensor]] = {}
    tp_rank = topo.axis("tp").rank
    for (slot, name), full in zip(owners, outputs):
        meta = slot.meta
        split = meta.parallel_dim is not None and meta.is_model_parallel
        tp_placement = Shard(meta.parallel_dim) if split and meta.parallel_dim is not None else Replicate()
        local = full.view(slot.param.shape)
        if split and meta.parallel_dim is not None:  # without a padded dimension's padding rows (a vocabulary)
            local = local.narrow(meta.parallel_dim, 0, meta.local_size(tp_rank)[1])
        logical = torch.Size(meta.logical_shape)
        params.setdefault(meta.key, {})[name] = DTensor.from_local(
            local,
            mesh,
            [Replicate(), tp_placement],
            run_check=False,
            shape=logical,
            stride=torch.empty(logical, device="meta").stride(),
        )
    return params


def _tp_local(slot: ParamSlot, value: torch.Tensor, key: str, name: str, tp_rank: int) -> torch.Tensor:
    """``value`` as this rank's TP-local tensor: a DTensor's local part or a slice of a full tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    meta = slot.meta
    if tuple(value.shape) == tuple(meta.logical_shape) and meta.is_model_parallel:
        assert meta.parallel_dim is not None
        held, logical = meta.local_size(tp_rank)
        value = value.narrow(meta.parallel_dim, tp_rank * held, logical)
    if meta.is_model_parallel and meta.parallel_dim is not None and value.shape != slot.param.shape:
        held, logical = meta.local_size(tp_rank)
        if value.shape[meta.parallel_dim] == logical < held:  # a padded dimension: zeros in the padding rows
            pad = list(value.shape)
            pad[meta.parallel_dim] = held - logical
            value = torch.cat([value, value.new_zeros(pad)], dim=meta.parallel_dim)
    if tuple(value.shape) != tuple(slot.param.shape):
        raise ValueError(
            f"optimizer state {key!r}.{name} has shape {list(value.shape)}; expected the logical shape "
            f"{list(meta.logical_shape)} or this rank's local shape {list(slot.param.shape)}"
        )
    return value


def load_parameter_state(dp: DataParallel, params: StateDict) -> None:
    """Load :func:`parameter_state`'s entries saved with any layout (after DCP filled them in).

    Raises:
        ValueError: parameter keys differ, a state tensor is missing, or a tensor's shape is
            neither the logical nor this rank's local shape.
    """
    keys = {slot.meta.key for slot in dp.slots}
    if set(params) != keys:
        missing, extra = sorted(keys - set(params)), sorted(set(params) - keys)
        raise ValueError(f"optimizer state parameter keys differ: missing {missing}, unexpected {extra}")
    tp_rank = dp.topology.axis("tp").rank
    for slot in dp.slots:
        entry = params[slot.meta.key]
        targets = dict(slot.state)
        if slot.master is not None or slot.param_shard is not None:
            # fp32 parameters are their own master and come from the model checkpoint,
            # except under ZeRO-3, where the owned shard is the only copy.
            targets["master"] = slot.work_param()
        for name, target in targets.items():
            if name not in entry:
                raise ValueError(
                    f"optimizer state {slot.meta.key!r} has no {name!r} (has {sorted(entry)}); it was saved by a "
                    "different update rule"
                )
            local = _tp_local(slot, entry[name], slot.meta.key, name, tp_rank)
            target.copy_(local.reshape(-1)[slot.start : slot.end])
    _refill_shards(dp)


def owned_state(dp: DataParallel) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's own elements of each state tensor, by ``meta.key`` then name, as views: no
    collective and no copy (an in-memory copy of the rank; :func:`load_owned_state` restores it
    at the same layout only)."""
    return {slot.meta.key: _owned_entries(slot) for slot in dp.slots}


def load_owned_state(dp: DataParallel, params: StateDict) -> None:
    """Restore :func:`owned_state`'s entries, taken at this layout."""
    for slot in dp.slots:
        for name, target in _owned_entries(slot).items():
            target.copy_(params[slot.meta.key][name])
    _refill_shards(dp)


def _owned_entries(slot: ParamSlot) -> dict[str, torch.Tensor]:
    """:func:`_entries` without the parameter itself (an fp32 parameter is its own master; the
    model's state holds it)."""
    entries = _entries(slot)
    if slot.master is None and slot.param_shard is None:
        del entries["master"]
    return entries


def _refill_shards(dp: DataParallel) -> None:
    """The ZeRO-3 shards a layer gathers start from the loaded fp32 masters."""
    if dp.gatherer is not None:
        for slot in dp.slots:
            if slot.master is not None and slot.param_shard is not None:
                slot.param_shard.copy_(slot.master)
