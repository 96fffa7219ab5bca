"""save / load: layout-independent checkpoints of a parallelized model through DCP.

Model parameters and optimizer state become DTensors keyed by the parameter path of the
unmodified model (a fused q/k/v weight is viewed as ``[..., parts, n]`` so its shard is a
regular one); the scheduler and the optimizer's hyperparameters go to JSON. A checkpoint
saved with one (dp, tp) layout therefore loads into any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from scaling.nn import ParameterMeta
from scaling.trainer.auto._optimizer import ParallelOptimizer
from scaling.trainer.auto._parallelize import ParallelModel
from scaling.trainer.auto._plan import Plan
from scaling.trainer.auto._tp import unshard_view
from scaling.trainer.checkpoint import load_checkpoint, model_state_dict, save_checkpoint


def _entries(model: ParallelModel, tensors: dict[int, torch.Tensor] | None = None) -> list[tuple[str, Any, Any]]:
    """``(path, view, meta)`` per parameter (or per same-shaped tensor in ``tensors``)."""
    out = []
    for name, param, meta in model.named_parameters_with_meta():
        local = param.detach() if tensors is None else tensors.get(id(param))
        if local is None:
            continue
        owner = model.plan.module_sharding.get(meta.local_name.rpartition(".")[0])
        chunks = owner.chunks if owner is not None and meta.parallel_dim is not None else 1
        dim = meta.parallel_dim
        shape = list(meta.logical_shape)
        if chunks > 1 and dim is not None:
            local, dim = unshard_view(local, dim, chunks)
            shape[dim - 1 : dim] = [chunks, shape[dim - 1] // chunks]
        out.append((name, local, ParameterMeta(meta.local_name, tuple(shape), dim, meta.model_parallel_size)))
    return out


def _optimizer_tree(model: ParallelModel, optimizer: ParallelOptimizer) -> dict[str, Any]:
    inner = optimizer.optimizer
    per_key: dict[str, dict[str, Any]] = {}
    names = {n for s in inner.state.values() for n in s}
    for slot in sorted(names):
        tensors = {id(p): s[slot] for p, s in inner.state.items() if slot in s and s[slot].shape == p.shape}
        for key, value in model_state_dict(_entries(model, tensors), model.topology).items():
            per_key.setdefault(key, {})[slot] = value
    for _name, param, meta in model.named_parameters_with_meta():
        for slot, value in inner.state.get(param, {}).items():
            if slot not in per_key.get(meta.key, {}):
                per_key.setdefault(meta.key, {})[slot] = value  # scalars like Adam's step
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return {"state": per_key, "param_groups": groups}


def _ensure_state(optimizer: ParallelOptimizer) -> None:
    """Create the optimizer's lazily-built state with one step at lr=0 and zero grads."""
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


def _tree(state: dict[str, Any]) -> dict[str, Any]:
    model = state["model"]
    if not isinstance(model, ParallelModel):
        raise TypeError(f"state['model'] must be the model parallelize() returned, got {type(model).__name__}")
    tree: dict[str, Any] = {"model": model_state_dict(_entries(model), model.topology)}
    if state.get("optimizer") is not None and state["optimizer"].engine is not None:
        raise ValueError(
            "save/load: the optimizer state of a plan with zero_stage > 0 or precision != 'float32' "
            "(scaling.optim) is not checkpointed by scaling.trainer.auto yet; pass optimizer=None to save the "
            "model and scheduler only"
        )
    if state.get("optimizer") is not None:
        tree["optimizer"] = _optimizer_tree(model, state["optimizer"])
    if state.get("lr_scheduler") is not None:
        tree["lr_scheduler"] = state["lr_scheduler"].state_dict()
    return tree


def save(path: str | Path, state: dict[str, Any], step: int = 0) -> Path:
    """Save ``{"plan", "model", "optimizer", "lr_scheduler"}`` (collective, every rank).

    Args:
        path: checkpoint root; the step goes to ``path/step_{step:08d}``.
        state: the plan and the objects :func:`parallelize` returned (optimizer and
            scheduler optional).
        step: the step number naming the folder.

    Returns:
        The committed step folder.

    Raises:
        TypeError: ``state["model"]`` is not a parallelized model.
    """
    tree = _tree(state)
    plan: Plan = state.get("plan") or state["model"].plan
    model = state["model"]
    return save_checkpoint(path, step, tree, model.topology, extra={"plan": plan.to_dict()}).wait()


def load(path: str | Path, state: dict[str, Any], step: int | None = None) -> Plan:
    """Load a checkpoint written by :func:`save` into ``state``'s objects (any layout).

    Args:
        path: checkpoint root.
        state: ``{"model", "optimizer", "lr_scheduler"}`` from :func:`parallelize` under the new plan.
        step: the step to load (default: the latest).

    Returns:
        The plan the checkpoint was saved with.
    """
    if state.get("optimizer") is not None:
        _ensure_state(state["optimizer"])
    tree = _tree(state)
    model: ParallelModel = state["model"]
    loaded = load_checkpoint(path, tree, model.topology, step=step)
    with torch.no_grad():
        for _, local, meta in _entries(model):
            value = loaded.state["model"][meta.key]
            src = value.to_local() if isinstance(value, DTensor) else value
            if src.data_ptr() != local.data_ptr():
                local.copy_(src)
    if state.get("optimizer") is not None:
        _load_optimizer(model, state["optimizer"], loaded.state["optimizer"])
    if state.get("lr_scheduler") is not None:
        state["lr_scheduler"].load_state_dict(loaded.state["lr_scheduler"])
    return Plan.from_dict(loaded.extra["plan"])


def _load_optimizer(model: ParallelModel, optimizer: ParallelOptimizer, loaded: Any) -> None:
    inner = optimizer.optimizer
    for _name, param, meta in model.named_parameters_with_meta():
        for slot, value in loaded["state"].get(meta.key, {}).items():
            target = inner.state[param][slot]
            src = value.to_local() if isinstance(value, DTensor) else value
            if isinstance(src, torch.Tensor) and src.data_ptr() != target.data_ptr():
                with torch.no_grad():
                    target.view(-1).copy_(src.reshape(-1))
    for group, saved in zip(inner.param_groups, loaded["param_groups"]):
        group.update(saved)
