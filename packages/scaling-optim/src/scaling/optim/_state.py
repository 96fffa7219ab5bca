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

from typing import TYPE_CHECKING, Protocol

import torch

from scaling.optim._comm import all_gather_chunks
from scaling.optim._config import OptimizerConfig
from scaling.optim._loss_scaler import LossScaler
from scaling.optim._param_group import OptimizerParamGroup
from scaling.optim._slots import ParamSlot
from scaling.optim._spaces import ShardSpace
from scaling.optim._zero3 import ParameterGatherer
from scaling.topology import Topology

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from scaling.config import StateDict


class StatefulOptimizer(Protocol):
    """What the state functions read and restore (``Optimizer`` has it)."""

    topology: Topology
    config: OptimizerConfig
    slots: list[ParamSlot]
    spaces: list[ShardSpace]
    parameter_groups: list[OptimizerParamGroup]
    loss_scaler: LossScaler
    gatherer: ParameterGatherer | None
    step_count: int


# DTensor (and sympy with it: ~0.35 s of CPU) is imported where a state dict is built or read,
# not by ``import scaling.optim``: a process that never checkpoints does without it.


def _entries(slot: ParamSlot) -> dict[str, torch.Tensor]:
    """The owned elements of each state tensor of ``slot``, fp32 master first."""
    out = {"master": slot.work_param()}
    out.update(slot.state)
    return out


def optimizer_state(opt: StatefulOptimizer) -> StateDict:
    """Counters, loss scaler, schedules and per-parameter DTensors (see the module docstring).

    Each kind of parameter's ZeRO shards are gathered over its shard group (``opt.spaces``).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    topo = opt.topology
    mesh = topo.device_mesh["dp", "tp"]
    owners, outputs = [], []
    for space in opt.spaces:
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
        all_gather_chunks(chunks, fulls, group, opt.config.allreduce_bucket_size)
        outputs += fulls
    params: dict[str, dict[str, DTensor]] = {}
    for (slot, name), full in zip(owners, outputs):
        meta = slot.meta
        tp_placement = (
            Shard(meta.parallel_dim) if meta.parallel_dim is not None and meta.is_model_parallel else Replicate()
        )
        local = full.view(slot.param.shape)
        logical = torch.Size(meta.logical_shape)
        params.setdefault(meta.key, {})[name] = DTensor.from_local(
            local,
            mesh,
            [Replicate(), tp_placement],
            run_check=False,
            shape=logical,
            stride=torch.empty(logical, device="meta").stride(),
        )
    return {
        "step": opt.step_count,
        "loss_scaler": opt.loss_scaler.state_dict(),
        "groups": {g.name: g.scheduler.state_dict() for g in opt.parameter_groups},
        "params": params,
    }


def _tp_local(slot: ParamSlot, value: torch.Tensor, key: str, name: str, tp_rank: int) -> torch.Tensor:
    """``value`` as this rank's TP-local tensor: a DTensor's local part or a slice of a full tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    meta = slot.meta
    if tuple(value.shape) == tuple(meta.logical_shape) and meta.is_model_parallel:
        assert meta.parallel_dim is not None
        value = value.chunk(meta.model_parallel_size, dim=meta.parallel_dim)[tp_rank]
    if tuple(value.shape) != tuple(slot.param.shape):
        raise ValueError(
            f"optimizer state {key!r}.{name} has shape {list(value.shape)}; expected the logical shape "
            f"{list(meta.logical_shape)} or this rank's local shape {list(slot.param.shape)}"
        )
    return value


def load_optimizer_state(opt: StatefulOptimizer, state: StateDict) -> None:
    """Load a state from :func:`optimizer_state` saved with any layout (after DCP filled it in).

    Raises:
        ValueError: groups or parameter keys differ, a state tensor is missing, or a
            tensor's shape is neither the logical nor this rank's local shape.
    """
    groups = {g.name: g for g in opt.parameter_groups}
    if set(state["groups"]) != set(groups):
        raise ValueError(f"optimizer state has groups {sorted(state['groups'])}, this optimizer {sorted(groups)}")
    keys = {slot.meta.key for slot in opt.slots}
    if set(state["params"]) != keys:
        missing, extra = sorted(keys - set(state["params"])), sorted(set(state["params"]) - keys)
        raise ValueError(f"optimizer state parameter keys differ: missing {missing}, unexpected {extra}")
    tp_rank = opt.topology.axis("tp").rank
    for slot in opt.slots:
        entry = state["params"][slot.meta.key]
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
    if opt.gatherer is not None:
        for slot in opt.slots:
            if slot.master is not None and slot.param_shard is not None:
                slot.param_shard.copy_(slot.master)
    opt.step_count = int(state["step"])
    opt.loss_scaler.load_state_dict(state["loss_scaler"])
    for name, sched_state in state["groups"].items():
        groups[name].scheduler.load_state_dict(sched_state)
