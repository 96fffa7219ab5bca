"""save / load: layout-independent checkpoints of a parallelized model through DCP.

Model parameters and optimizer state become DTensors keyed by the parameter path of the
unmodified model (a fused q/k/v weight is viewed as ``[..., parts, n]`` so its shard is a
regular one); each pipeline stage contributes the keys of the parameters it holds, and
DCP reads by key, so a checkpoint saved with one (pp, dp, tp) layout loads into any other.

The optimizer state takes one of two forms, by who runs the update:

- the user's ``torch.optim`` optimizer (``zero_stage=0``, ``float32``): its per-parameter
  state tensors, and its parameter groups' hyperparameters as JSON;
- :class:`scaling.optim.Optimizer` (ZeRO, reduced precision): its own layout-independent
  :meth:`~scaling.optim.Optimizer.state_dict` (ZeRO shards gathered, fp32 master weights
  and moments keyed by ``meta.key``), the one the trainer checkpoints, with fused weights
  viewed as above; the user's optimizer's parameter groups (the LRs the scheduler set) go
  alongside.

A checkpoint loads into a plan whose optimizer state has the same form.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from scaling.nn import ParameterMeta
from scaling.trainer.auto._optimizer import ParallelOptimizer
from scaling.trainer.auto._parallelize import ParallelModel
from scaling.trainer.auto._plan import Plan
from scaling.trainer.auto._tp import unshard_view
from scaling.trainer.checkpoint import CheckpointError, load_checkpoint, model_state_dict, save_checkpoint

if TYPE_CHECKING:
    from scaling.config import StateDict

#: Top-level key of each optimizer-state form in the checkpoint tree.
_TORCH_FORM, _ENGINE_FORM = "optimizer", "scaling_optim"


def _chunks(model: ParallelModel, meta: ParameterMeta) -> int:
    """The number of fused parts (q, k, v) of a TP-planned parameter, 1 otherwise."""
    owner = model.plan.module_sharding.get(meta.local_name.rpartition(".")[0])
    return owner.chunks if owner is not None and meta.parallel_dim is not None else 1


def _entries(
    model: ParallelModel, tensors: dict[int, torch.Tensor] | None = None
) -> list[tuple[str, torch.Tensor, ParameterMeta]]:
    """``(path, view, meta)`` per parameter (or per same-shaped tensor in ``tensors``)."""
    out = []
    for name, param, meta in model.named_parameters_with_meta():
        local = param.detach() if tensors is None else tensors.get(id(param))
        if local is None:
            continue
        chunks, dim = _chunks(model, meta), meta.parallel_dim
        shape = list(meta.logical_shape)
        if chunks > 1 and dim is not None:
            local, dim = unshard_view(local, dim, chunks)
            shape[dim - 1 : dim] = [chunks, shape[dim - 1] // chunks]
        out.append((name, local, ParameterMeta(meta.local_name, tuple(shape), dim, meta.model_parallel_size)))
    return out


def _fused_view(value: DTensor, dim: int, chunks: int) -> DTensor:
    """``value`` (local part and global shape) with the ``chunks`` fused parts of ``dim`` as a new dim."""
    local, new_dim = unshard_view(value.to_local(), dim, chunks)
    shape = list(value.shape)
    shape[dim : dim + 1] = [chunks, shape[dim] // chunks]
    placements = [Shard(new_dim) if isinstance(p, Shard) else p for p in value.placements]
    logical = torch.Size(shape)
    stride = torch.empty(logical, device="meta").stride()
    return DTensor.from_local(local, value.device_mesh, placements, run_check=False, shape=logical, stride=stride)


def _torch_tree(model: ParallelModel, optimizer: ParallelOptimizer) -> StateDict:
    inner = optimizer.optimizer
    per_key: dict[str, StateDict] = {}
    names = {n for s in inner.state.values() for n in s}
    for slot in sorted(names):
        tensors = {id(p): s[slot] for p, s in inner.state.items() if slot in s and s[slot].shape == p.shape}
        for key, value in model_state_dict(_entries(model, tensors), model.topology).items():
            per_key.setdefault(key, {})[slot] = value
    for _name, param, meta in model.named_parameters_with_meta():
        for slot, value in inner.state.get(param, {}).items():
            if slot not in per_key.get(meta.key, {}):
                per_key.setdefault(meta.key, {})[slot] = value  # scalars like Adam's step
    return {"state": per_key, "param_groups": _groups(optimizer)}


def _groups(optimizer: ParallelOptimizer) -> list[StateDict]:
    """The user's optimizer's hyperparameters per group (the LR its scheduler set among them)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]


def _engine_tree(model: ParallelModel, optimizer: ParallelOptimizer) -> StateDict:
    """scaling.optim's own state dict (as the trainer saves it), fused weights viewed by part."""
    assert optimizer.engine is not None
    state = optimizer.engine.state_dict()
    fused = {meta.key: _chunks(model, meta) for _, _, meta in model.named_parameters_with_meta()}
    dims = {meta.key: meta.parallel_dim for _, _, meta in model.named_parameters_with_meta()}
    params = {}
    for key, slots in state["params"].items():
        chunks, dim = fused.get(key, 1), dims.get(key)
        params[key] = (
            {n: _fused_view(v, dim, chunks) for n, v in slots.items()} if chunks > 1 and dim is not None else slots
        )
    return {**state, "params": params, "param_groups": _groups(optimizer)}


def _ensure_state(optimizer: ParallelOptimizer) -> None:
    """Create the user's optimizer's lazily-built state with one step at lr=0 and zero grads."""
    if optimizer.engine is not None:
        return  # scaling.optim builds its state up front
    inner = optimizer.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    if all(p in inner.state and inner.state[p] for p in params):
        return
    lrs = [g["lr"] for g in inner.param_groups]
    for g in inner.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    inner.step()
    inner.zero_grad(set_to_none=True)
    for g, lr in zip(inner.param_groups, lrs):
        g["lr"] = lr


def _tree(state: StateDict) -> StateDict:
    model = state["model"]
    if not isinstance(model, ParallelModel):
        raise TypeError(f"state['model'] must be the model parallelize() returned, got {type(model).__name__}")
    optimizer = state.get("optimizer")
    if optimizer is not None and not isinstance(optimizer, ParallelOptimizer):
        raise TypeError(
            f"state['optimizer'] must be the optimizer parallelize() returned, got {type(optimizer).__name__}"
        )
    tree: StateDict = {"model": model_state_dict(_entries(model), model.topology)}
    if optimizer is not None:
        if optimizer.engine is None:
            tree[_TORCH_FORM] = _torch_tree(model, optimizer)
        else:
            tree[_ENGINE_FORM] = _engine_tree(model, optimizer)
    if state.get("lr_scheduler") is not None:
        tree["lr_scheduler"] = state["lr_scheduler"].state_dict()
    return tree


def _whole_parameters(state: StateDict) -> AbstractContextManager[None]:
    """Every parameter whole (ZeRO-3 gathers them through the optimizer); a no-op otherwise."""
    optimizer, model = state.get("optimizer"), state.get("model")
    if isinstance(optimizer, ParallelOptimizer) and optimizer.engine is not None:
        return optimizer.engine.full_parameters()
    if isinstance(model, ParallelModel) and model.plan is not None and model.plan.zero_stage == 3:
        raise ValueError("a zero_stage=3 model's parameters are sharded: pass its optimizer in the state too")
    return nullcontext()


def full_state_dict(model: ParallelModel, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unmodified model's whole parameters, keyed by their paths, in memory on the CPU.

    Collective (every rank of the run calls it): TP shards are gathered over their group
    (fused weights part by part), ZeRO-3 parameters inside ``model.full_parameters()``, and the
    pipeline stages' parameters sent to every stage, so the result is what the one-process
    model's ``state_dict()`` holds (a tied weight once, under its first path). For
    ``transformers`` models, ``model.module.save_pretrained(path, state_dict=...)`` on rank 0
    writes an HF folder of any plan (it empties the mapping it is given: pass a copy to keep it).

    Args:
        rank0_only: other ranks return ``{}`` (they still take part in the gathers).
    """
    shapes = {meta.key: meta.logical_shape for _, _, meta in model.named_parameters_with_meta()}
    with model.full_parameters(), torch.no_grad():
        state = model_state_dict(_entries(model), model.topology)
        whole = {
            key: (value.full_tensor() if isinstance(value, DTensor) else value).reshape(shapes[key]).cpu().clone()
            for key, value in state.items()
        }
    pp = model.topology.axis("pp")
    if pp.size > 1:  # every stage's parameters to every stage
        stages: list[dict[str, torch.Tensor] | None] = [None] * pp.size
        dist.all_gather_object(stages, whole, group=pp.group)
        whole = {k: v for stage in stages if stage is not None for k, v in stage.items()}
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return whole


def save(path: str | Path, state: StateDict, step: int = 0) -> Path:
    """Save ``{"plan", "model", "optimizer", "lr_scheduler"}`` (collective, every rank).

    Works for every plan :func:`parallelize` runs (any pp, dp, tp, ZeRO stage and
    precision); each rank writes only the parameters its pipeline stage holds.

    Args:
        path: checkpoint root; the step goes to ``path/step_{step:08d}``.
        state: the plan and the objects :func:`parallelize` returned (optimizer and
            scheduler optional).
        step: the step number naming the folder.

    Returns:
        The committed step folder.

    Raises:
        TypeError: ``state["model"]`` or ``state["optimizer"]`` is not what
            :func:`parallelize` returned.
    """
    with _whole_parameters(state):
        tree = _tree(state)
        plan: Plan = state.get("plan") or state["model"].plan
        return save_checkpoint(path, step, tree, state["model"].topology, extra={"plan": plan.to_dict()}).wait()


def load(path: str | Path, state: StateDict, step: int | None = None, *, optimizer_state: bool = True) -> Plan:
    """Load a checkpoint written by :func:`save` into ``state``'s objects (any layout).

    Args:
        path: checkpoint root.
        state: ``{"model", "optimizer", "lr_scheduler"}`` from :func:`parallelize` under the new
            plan; ``{"model"}`` alone loads the weights only (a ZeRO-3 plan needs its optimizer
            there too, to place them in its shards).
        step: the step to load (default: the latest).
        optimizer_state: False: the weights (and the scheduler, if given) only; the optimizer
            given places them (ZeRO-3 shards, fp32 master weights) and keeps its own state.
            The way to load the weights of a plan whose optimizer state has the other form.

    Returns:
        The plan the checkpoint was saved with.

    Raises:
        ValueError: the optimizer state was saved in the other form (``zero_stage=0`` with
            ``float32`` keeps the user's optimizer; any other plan uses ``scaling.optim``).
        CheckpointError: a missing or corrupt checkpoint, or keys or shapes that differ.
    """
    optimizer = state.get("optimizer")
    restored: ParallelOptimizer | None = optimizer if optimizer_state else None  # whose state is read
    if restored is not None:
        _ensure_state(restored)
    model: ParallelModel = state["model"]
    # A checkpoint saved before the first optimizer.step() has no state for the user's
    # optimizer (torch builds it lazily): those keys may be missing, and stay fresh.
    fresh_ok = [rf"{_TORCH_FORM}\.state\..*"] if restored is not None and restored.engine is None else []
    # What the state does not ask for is not read (the optimizer's state, the scheduler's).
    skipped = [] if restored is not None else [rf"{_TORCH_FORM}\..*", rf"{_ENGINE_FORM}\..*"]
    skipped += [] if state.get("lr_scheduler") is not None else [r"lr_scheduler\..*"]
    wanted = {k: v for k, v in state.items() if k != "optimizer" or restored is not None}
    with _whole_parameters(state), torch.no_grad():  # ZeRO-3: loaded into the gathered parameters
        tree = _tree(wanted)
        try:
            loaded = load_checkpoint(path, tree, model.topology, step=step, allowed_missing=fresh_ok, ignored=skipped)
        except CheckpointError as e:
            _raise_if_other_form(tree, e)
            raise
        for _, local, meta in _entries(model):
            value = loaded.state["model"][meta.key]
            src = value.to_local() if isinstance(value, DTensor) else value
            if src.data_ptr() != local.data_ptr():
                local.copy_(src)
        if optimizer is not None and optimizer.engine is not None:
            optimizer.engine.sync_from_parameters()  # master weights / ZeRO-3 shards from the loaded values
    if restored is not None and restored.engine is None:
        _load_torch(model, restored, loaded.state[_TORCH_FORM], set(loaded.missing_keys))
    elif restored is not None:
        _load_engine(model, restored, loaded.state[_ENGINE_FORM])
    if state.get("lr_scheduler") is not None:
        state["lr_scheduler"].load_state_dict(loaded.state["lr_scheduler"])
    return Plan.from_dict(loaded.extra["plan"])


def _raise_if_other_form(tree: StateDict, error: CheckpointError) -> None:
    forms = {
        _TORCH_FORM: "zero_stage=0 and precision='float32'",
        _ENGINE_FORM: "zero_stage > 0, reduced precision or cpu_offload",
    }
    mine = [f for f in forms if f in tree]
    for form, plan in forms.items():
        if mine and form not in tree and f"'{form}." in str(error) and "no rank expects" in str(error):
            raise ValueError(
                f"load: the checkpoint's optimizer state was saved by a plan with {plan}, this plan has "
                f"{forms[mine[0]]}; load with a plan of the same kind, or pass optimizer_state=False to load the "
                "model (and scheduler) only"
            ) from error


def _load_torch(model: ParallelModel, optimizer: ParallelOptimizer, loaded: StateDict, missing: set[str]) -> None:
    inner = optimizer.optimizer
    for _name, param, meta in model.named_parameters_with_meta():
        slots = {f"{_TORCH_FORM}.state.{meta.key}.{slot}" for slot in inner.state.get(param, {})}
        if slots and slots <= missing:
            inner.state.pop(param)  # saved before the first step: the state starts fresh, as it was
            continue
        if slots & missing:
            raise CheckpointError(f"the checkpoint's optimizer state of {meta.key!r} lacks {sorted(slots & missing)}")
        for slot, value in loaded["state"].get(meta.key, {}).items():
            target = inner.state[param][slot]
            src = value.to_local() if isinstance(value, DTensor) else value
            if isinstance(src, torch.Tensor) and src.data_ptr() != target.data_ptr():
                with torch.no_grad():
                    target.view(-1).copy_(src.reshape(-1))
    for group, saved in zip(inner.param_groups, loaded["param_groups"]):
        group.update(saved)


def _load_engine(model: ParallelModel, optimizer: ParallelOptimizer, loaded: StateDict) -> None:
    """Hand the loaded state to scaling.optim's ``load_state_dict`` (fused views back to local shape)."""
    assert optimizer.engine is not None
    shapes = {meta.key: param.shape for _, param, meta in model.named_parameters_with_meta()}
    params = {
        key: {n: v.to_local().reshape(shapes[key]) if v.dim() != len(shapes[key]) else v for n, v in slots.items()}
        for key, slots in loaded["params"].items()
    }
    optimizer.engine.load_state_dict({k: v for k, v in loaded.items() if k != "param_groups"} | {"params": params})
    for group, saved in zip(optimizer.optimizer.param_groups, loaded["param_groups"]):
        group.update(saved)
