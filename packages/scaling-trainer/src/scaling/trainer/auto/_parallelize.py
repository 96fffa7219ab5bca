"""parallelize: a plan plus an unmodified model -> model, optimizer, scheduler, loader."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from scaling.collectives import all_reduce_gradients
from scaling.nn import ParameterMeta, get_parameter_meta
from scaling.topology import Topology, TopologyConfig
from scaling.trainer.auto._deferred import is_deferred, materialize
from scaling.trainer.auto._plan import Plan
from scaling.trainer.auto._policy import shard_dim
from scaling.trainer.auto._tp import make_shard_fn


class ParallelModel(torch.nn.Module):
    """The user's model, TP-sharded per the plan; ``forward(batch)`` returns the loss.

    A mapping batch is passed as keyword arguments (``model(**batch)``), anything else
    positionally; an output with a ``loss`` attribute (``transformers``) yields that loss.
    """

    def __init__(self, module: torch.nn.Module, plan: Plan, topology: Topology) -> None:
        super().__init__()
        self.module, self.plan, self.topology = module, plan, topology

    def forward(self, batch: Any) -> Any:
        out = self.module(**batch) if isinstance(batch, Mapping) else self.module(batch)
        return getattr(out, "loss", out)

    def named_parameters_with_meta(self) -> list[tuple[str, torch.nn.Parameter, ParameterMeta]]:
        """``(path, param, meta)`` for each unique parameter, paths as in the unmodified model."""
        return [(n, p, get_parameter_meta(p)) for n, p in self.module.named_parameters()]


class ParallelOptimizer:
    """Wraps the optimizer ``optimizer_fn`` built: ``step()`` first averages gradients over DP.

    Everything else (``zero_grad``, ``param_groups``, ``state``, schedulers built on it)
    is the wrapped optimizer's; ``optimizer.optimizer`` is the wrapped one.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: ParallelModel) -> None:
        self.optimizer, self.model = optimizer, model
        self._params = [p for p in model.parameters() if p.requires_grad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average gradients over the data-parallel group, then step the wrapped optimizer."""
        all_reduce_gradients(self._params, self.model.topology.data_parallel_group)
        return self.optimizer.step(closure)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        """This rank's (local-shard) state; use :func:`save` for layout-independent checkpoints."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def _topology(plan: Plan, topology: Topology | None) -> Topology:
    if not (dist.is_available() and dist.is_initialized()) and plan.world_size > 1:
        raise ValueError(f"parallelize: the plan needs {plan.world_size} ranks; initialise torch.distributed first")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        raise ValueError(
            f"parallelize: the plan needs world_size dp*tp*pp={plan.world_size} but {world} ranks are running; "
            "regenerate the plan for this world size"
        )
    if topology is None:
        cfg = TopologyConfig(
            world_size=world,
            model_parallel_size=plan.model_parallel_size,
            pipe_parallel_size=plan.pipe_parallel_size,
            data_parallel_size=plan.data_parallel_size,
            device="cpu",
        )
        topology = Topology(cfg, dist.get_rank() if dist.is_initialized() else 0).initialize_distributed()
    sizes = (topology.data_parallel_size, topology.model_parallel_size, topology.pipe_parallel_size)
    if sizes != (plan.data_parallel_size, plan.model_parallel_size, plan.pipe_parallel_size):
        raise ValueError(f"parallelize: topology (dp, tp, pp)={sizes} differs from the plan's")
    return topology


def attach_metas(module: torch.nn.Module, plan: Plan) -> None:
    """Attach a :class:`ParameterMeta` keyed by the parameter path to every parameter."""
    for path, sub in module.named_modules():
        sharding = plan.module_sharding.get(path)
        for name, p in sub.named_parameters(recurse=False):
            full = f"{path}.{name}" if path else name
            if hasattr(p, "parameter_meta"):  # tied: keep the first path's identity
                continue
            dim = None if sharding is None else shard_dim(sharding, name)
            tp = plan.model_parallel_size if dim is not None else 1
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= tp
            ParameterMeta(full, tuple(shape), dim, tp).attach(p)


def parallelize(
    plan: Plan,
    model: torch.nn.Module,
    optimizer_fn: Callable[[torch.nn.Module], torch.optim.Optimizer],
    lr_scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None,
    dataset: Dataset | None,
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    topology: Topology | None = None,
) -> tuple[ParallelModel, ParallelOptimizer, Any, DataLoader | None]:
    """Make ``model`` nD-parallel per ``plan``; the returned objects run the plain loop.

    Materialises a deferred model shard by shard (values equal to the slices of a
    one-process :func:`materialize` under ``plan.seed``), replaces planned modules by
    TP shards, builds the optimizer on the local parameters, wraps it so ``step()``
    averages gradients over DP, and shards ``dataset`` over DP (each DP rank gets
    ``global_batch_size / dp`` samples per step, in order).

    Args:
        plan: from :func:`generate_plan`.
        model: from :func:`deferred_init` (or an already materialised, unsharded model).
        optimizer_fn: ``model -> torch.optim.Optimizer`` over ``model.parameters()``.
        lr_scheduler_fn: ``optimizer -> scheduler`` (or ``None``).
        dataset: a map-style dataset (or ``None``: no loader).
        collate_fn: the loader's ``collate_fn``.
        topology: an initialised topology (default: built from the plan's sizes on the
            running default process group).

    Returns:
        ``(model, optimizer, scheduler, data_loader)``.

    Raises:
        ValueError: the world size differs from the plan, or the plan pipelines
            (``pipe_parallel_size > 1`` is not supported by :func:`parallelize` yet).
    """
    if plan.pipe_parallel_size > 1:
        raise ValueError(
            f"parallelize: pipe_parallel_size={plan.pipe_parallel_size} is not supported yet for unmodified "
            "models; use pipeline_parallel.size=1 (or the explicit LayerSpec/ParallelModule way in)"
        )
    topology = _topology(plan, topology)
    tp_rank, tp = topology.model_parallel_rank, topology.model_parallel_size
    group = topology.model_parallel_group if tp > 1 else None
    shard_fn = make_shard_fn(model, plan.module_sharding, group, tp_rank, tp)
    if is_deferred(model):
        materialize(model, plan.seed, shard_fn)
    else:
        for path in plan.module_sharding:
            replacement = shard_fn(path, model.get_submodule(path))
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, replacement)
    attach_metas(model, plan)
    wrapped = ParallelModel(model, plan, topology)
    optimizer = ParallelOptimizer(optimizer_fn(model), wrapped)
    scheduler = lr_scheduler_fn(optimizer.optimizer) if lr_scheduler_fn is not None else None
    loader = None
    if dataset is not None:
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=topology.data_parallel_size, rank=topology.data_parallel_rank, shuffle=False
        )
        per_rank = plan.global_batch_size // plan.data_parallel_size
        loader = DataLoader(dataset, batch_size=per_rank, sampler=sampler, collate_fn=collate_fn, drop_last=True)
    return wrapped, optimizer, scheduler, loader
