"""ParallelOptimizer: the user's optimizer, with DP, tied-weight, ZeRO and precision handling.

With ``zero_stage=0`` and ``float32`` the user's own ``torch.optim`` optimizer updates the
parameters after gradients are summed over pipeline stages (tied weights) and averaged
over DP (``torch.optim.Muon`` too, except under TP: it would orthogonalise each rank's piece
of a matrix). Otherwise the update runs in :class:`scaling.optim.Optimizer` (ZeRO 1/2 sharding,
fp32 master weights, loss scaling for fp16) configured from the user's optimizer: its
type, hyperparameters and parameter groups. The user's optimizer then only carries the
learning rates: the scheduler ``lr_scheduler_fn`` built on it sets ``param_groups[i]["lr"]``
and each ``step()`` reads them, so any ``torch.optim.lr_scheduler`` works unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch
import torch.distributed as dist

from scaling.nn import get_parameter_meta
from scaling.optim import (
    GradientReducer,
    LossScalerConfig,
    Optimizer,
    OptimizerConfig,
    OptimizerParamGroup,
    OptimizerParamGroupConfig,
    OptimizerStepOutput,
)
from scaling.topology import Topology
from scaling.trainer.auto._pipeline import PipelineStage
from scaling.trainer.auto._plan import Plan

if TYPE_CHECKING:
    from scaling.collectives import AutogradContext
    from scaling.config import StateDict


class PlannedModel(Protocol):
    """What the optimizer needs of the parallelized model (``ParallelModel`` has it)."""

    module: torch.nn.Module
    plan: Plan
    topology: Topology
    pipeline: PipelineStage | None
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None
    gradient_sync: Callable[[], AbstractContextManager[None]] | None
    whole_parameters: Callable[[], AbstractContextManager[None]] | None

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def layer_modules(self) -> list[torch.nn.Module]: ...


#: One of a torch optimizer's ``param_groups``: ``params`` and the hyperparameters by name.
#: ``Any``: torch types them so (each optimizer has its own keys and value types).
ParamGroup: TypeAlias = dict[str, Any]

_PRECISION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _TorchGroupLR:
    """A ``scaling.optim`` group schedule that reads the LR a torch scheduler set on a torch param group."""

    def __init__(self, group: ParamGroup) -> None:
        self.group = group

    def get_lr(self, step: int) -> float:
        return float(self.group["lr"])

    @property
    def current_lr(self) -> float:
        return float(self.group["lr"])

    def step(self) -> None:
        """The torch scheduler advances the LR (``scheduler.step()`` in the user's loop)."""

    def state_dict(self) -> StateDict:
        return {}

    def load_state_dict(self, state: StateDict) -> None:
        """Nothing to restore: the torch scheduler's state is saved on its own."""


def _config(
    optimizer: torch.optim.Optimizer, zero_stage: int, precision: str, cpu_offload: bool = False
) -> OptimizerConfig:
    kind = type(optimizer).__name__
    groups = optimizer.param_groups
    why = f"zero_stage={zero_stage} / precision={precision!r} run the update in scaling.optim.Optimizer"
    g = groups[0]
    loss_scaler = LossScalerConfig(enable=precision == "float16")
    common = {"zero_stage": zero_stage, "loss_scaler": loss_scaler, "master_weights": True, "cpu_offload": cpu_offload}
    if kind == "Muon":  # torch.optim.Muon (torch >= 2.9): the same arithmetic, on whole matrices
        for key in ("momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"):
            if len({str(group[key]) for group in groups}) > 1:
                raise ValueError(f"{why}, which takes one {key} for all of Muon's parameter groups")
        muon = {
            "momentum": g["momentum"], "nesterov": g["nesterov"], "ns_coefficients": tuple(g["ns_coefficients"]),
            "eps": g["eps"], "ns_steps": g["ns_steps"], "adjust_lr": g["adjust_lr_fn"] or "original",
        }  # fmt: skip
        return OptimizerConfig.model_validate({"method": "muon", "muon": muon, **common})
    for key in ("amsgrad", "nesterov", "maximize"):
        if any(g.get(key) for g in groups):
            raise ValueError(f"{why}, which has no {key}=True; optimizer_fn returned {kind} with {key}=True")
    if kind == "SGD" and any(g.get("dampening", 0) for g in groups):
        raise ValueError(f"{why}, which has no SGD dampening; use dampening=0")
    shared = ("betas", "eps", "momentum")
    for key in shared:
        values = {str(g.get(key)) for g in groups}
        if len(values) > 1:
            raise ValueError(f"{why}, which takes one {key} for all parameter groups; {kind} has {sorted(values)}")
    if kind in ("AdamW", "Adam"):
        method = "adamw" if kind == "AdamW" or g.get("decoupled_weight_decay") else "adam"
        beta1, beta2 = g["betas"]
        return OptimizerConfig.model_validate(
            {"method": method, "beta1": beta1, "beta2": beta2, "eps": g["eps"], **common}
        )
    if kind == "SGD":
        return OptimizerConfig.model_validate({"method": "sgd", "momentum": g.get("momentum", 0.0), **common})
    raise ValueError(
        f"{why}, which implements AdamW, Adam, SGD and Muon; optimizer_fn returned {kind}. Use one of those, or "
        f"zero_stage=0 and precision='float32' to keep {kind} as is"
    )


def build_engine(optimizer: torch.optim.Optimizer, model: PlannedModel) -> Optimizer:
    """A :class:`scaling.optim.Optimizer` doing what ``optimizer`` would, per the plan's ZeRO and precision.

    Raises:
        ValueError: an optimizer type or option ``scaling.optim`` does not implement.
    """
    plan = model.plan
    config = _config(optimizer, plan.zero_stage, plan.precision, plan.cpu_offload)
    names = {id(p): n for n, p in model.module.named_parameters()}
    groups = []
    for i, torch_group in enumerate(optimizer.param_groups):
        triples = [(names[id(p)], p, get_parameter_meta(p)) for p in torch_group["params"]]
        group_config = OptimizerParamGroupConfig(name=f"group_{i}", weight_decay=torch_group.get("weight_decay", 0.0))
        group = OptimizerParamGroup(triples, group_config)
        group.scheduler = _TorchGroupLR(torch_group)  # type: ignore[assignment]
        groups.append(group)
    units = model.layer_modules() if plan.zero_stage == 3 else None
    return Optimizer(config, groups, model.topology, zero3_modules=units)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by the loss scale (fp16 with the plain ``loss.backward()``)."""

    @staticmethod
    def forward(ctx: AutogradContext, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: AutogradContext, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class ParallelOptimizer:
    """The optimizer :func:`parallelize` returns: ``zero_grad()`` and ``step()`` as in the plain loop.

    ``step()`` sums the gradients of weights held on several pipeline stages, averages
    over DP (ZeRO 1/2: reduce-scatters) and updates. ``optimizer.optimizer`` is the
    user's optimizer (schedulers are built on it); ``optimizer.engine`` the
    :class:`scaling.optim.Optimizer` when the plan asks for ZeRO or reduced precision.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: PlannedModel) -> None:
        self.optimizer, self.model = optimizer, model
        self._params = [p for p in model.parameters() if p.requires_grad]
        plan = model.plan
        # torch.optim.Muon on TP pieces would orthogonalise each piece: the engine gathers whole matrices.
        muon_on_pieces = type(optimizer).__name__ == "Muon" and model.topology.axis("tp").size > 1
        needs_engine = plan.zero_stage or plan.precision != "float32" or plan.cpu_offload or muon_on_pieces
        self.engine = build_engine(optimizer, model) if needs_engine else None
        # Without the engine the user's optimizer updates; the DP average is still the one
        # reducer, all-reducing buckets while backward goes on (DDP's overlap).
        group = model.topology.axis("dp_cp").group
        self.reducer = (
            GradientReducer.over_parameters(self._params, group)
            if self.engine is None and self._params and group is not None and dist.get_world_size(group) > 1
            else None
        )
        if self.engine is not None and self.engine.loss_scaler.enabled:
            model.scale_loss = lambda loss: _ScaleGrad.apply(loss, self.engine.loss_scaler.scale)  # type: ignore[union-attr]
        if model.pipeline is not None:
            model.pipeline.backward_fn = self.backward
            # model(batch) runs every micro-batch's backward: reduce over DP in the last one.
            if self.engine is not None:
                self.engine.set_gradient_accumulation_steps(plan.num_micro_batches)
            elif self.reducer is not None:
                self.reducer.accumulate(plan.num_micro_batches)
        if self.engine is not None:
            model.gradient_sync = self.engine.no_sync
            model.whole_parameters = self.engine.full_parameters
        elif self.reducer is not None:
            model.gradient_sync = self.reducer.no_sync

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad`` (ZeRO gradient shards dropped too)."""
        if self.engine is not None:
            self.engine.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            if self.reducer is not None:
                self.reducer.discard()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the loss scale applied (fp16)."""
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            loss.backward()

    def step(self, closure: Callable[[], float] | None = None) -> OptimizerStepOutput | float | None:
        """Reduce gradients (tied weights over stages, DP), then update."""
        stage = self.model.pipeline
        if self.engine is not None:
            if closure is not None:
                raise ValueError("step(closure) is not supported with zero_stage > 0, reduced precision or cpu_offload")
            if stage is not None:
                self.engine.finish_gradient_reduction()  # DP first: the tied sum keeps the DP ownership
                stage.reduce_tied_gradients()
            out = self.engine.step()
            # The user's optimizer carries the LRs but never steps; tell its torch scheduler the
            # update ran (the flag torch's step wrapper sets), or scheduler.step() warns that it
            # came before optimizer.step() (torch 2.6-2.13; harmless where the flag is unused).
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
            return out
        if self.reducer is not None:
            self.reducer.finish()
        if stage is not None:
            stage.reduce_tied_gradients()
        return self.optimizer.step(closure)

    @property
    def param_groups(self) -> list[ParamGroup]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict[torch.Tensor, StateDict]:
        """The user's optimizer's state (empty when ``engine`` runs the update; see its ``slots``)."""
        return self.optimizer.state

    def state_dict(self) -> StateDict:
        """This rank's state; use :func:`save` for layout-independent checkpoints."""
        return self.optimizer.state_dict() if self.engine is None else self.engine.state_dict()

    def load_state_dict(self, state_dict: StateDict) -> None:
        if self.engine is None:
            self.optimizer.load_state_dict(state_dict)
        else:
            self.engine.load_state_dict(state_dict)


def precision_dtype(precision: str) -> torch.dtype:
    """The parameter dtype of a plan's ``precision``."""
    return _PRECISION_DTYPES[precision]
