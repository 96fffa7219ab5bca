"""Optimizer: loss scaling, global norm, clipping, the non-finite policy and the update.

Data parallelism (placement, reduction, ZeRO 0-3, offload) is :class:`DataParallel`'s, which
the optimizer builds and hands its update to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from scaling.optim._compat import foreach_mul_
from scaling.optim._config import OptimizerConfig
from scaling.optim._data_parallel import DataParallel
from scaling.optim._grad_norm import global_norm_squared
from scaling.optim._loss_scaler import LossScaler
from scaling.optim._param_group import OptimizerParamGroup
from scaling.optim._state import load_owned_state, load_parameter_state, owned_state, parameter_state
from scaling.optim._step_output import OptimizerStepOutput
from scaling.optim._update import UpdateItem, apply_updates
from scaling.topology import Topology

if TYPE_CHECKING:
    from scaling.config import StateDict


class Optimizer:
    """Mixed-precision optimizer over :class:`OptimizerParamGroup`\\ s, with data parallelism.

    Args:
        config: update rule, ZeRO stage, clipping, loss scaler and non-finite policy.
        parameter_groups: the groups; each trainable parameter in exactly one.
        topology: an initialised :class:`~scaling.topology.Topology`; gradients are
            averaged over DP × CP (``axis("dp_cp")``), ``reduce_over_tp`` gradients summed
            over its ``axis("tp")``, and the norm reduced over ``axis("replica")`` and DP × CP.
        zero3_modules, model: what ZeRO-3 and ``overlap_param_gather`` hook into
            (:class:`DataParallel`; ``BaseTrainer`` attaches its model itself).

    What data parallelism does (placement, reduction, ZeRO, offload, the hooks) is
    ``self.data_parallel``'s (:class:`DataParallel`); this class scales the loss, takes the
    global norm, clips, applies the non-finite policy, updates the tensors it is given and
    advances the learning rates.

    Raises:
        ValueError: duplicate group names, or :class:`DataParallel`'s refusals.

    Example::

        opt = Optimizer(config=OptimizerConfig(), parameter_groups=groups, topology=topology)
        opt.zero_grad(); opt.backward(loss); out = opt.step()  # OptimizerStepOutput
    """

    def __init__(
        self,
        config: OptimizerConfig,
        parameter_groups: Sequence[OptimizerParamGroup],
        topology: Topology,
        zero3_modules: Sequence[torch.nn.Module] | None = None,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
    ) -> None:
        names = [g.name for g in parameter_groups]
        if len(set(names)) != len(names):
            raise ValueError(f"parameter group names must be unique, got {names}")
        self.config = config
        self.parameter_groups = list(parameter_groups)
        self.topology = topology
        self.loss_scaler = LossScaler(config.loss_scaler)
        self.step_count = 0
        self._loss_non_finite = torch.zeros((), device=topology.device)
        self.data_parallel = DataParallel(config, self.parameter_groups, topology, zero3_modules, model)
        self.slots = self.data_parallel.slots

    def attach_model(self, model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        """:meth:`DataParallel.attach_model`: ZeRO-3 and ``overlap_param_gather`` hook into the model."""
        self.data_parallel.attach_model(model)

    def zero_grad(self) -> None:
        """Drop the gradients (``param.grad = None``) and any ZeRO-2 gradient shards."""
        self.data_parallel.zero_grad()
        self._loss_non_finite.zero_()

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Gradients accumulate over ``steps`` passes: :meth:`DataParallel.set_gradient_accumulation_steps`."""
        self.data_parallel.set_gradient_accumulation_steps(steps)

    def no_sync(self) -> AbstractContextManager[None]:
        """DDP's ``no_sync``: :meth:`DataParallel.no_sync`."""
        return self.data_parallel.no_sync()

    def finish_gradient_reduction(self) -> None:
        """Wait for the DP gradient averaging: :meth:`DataParallel.finish_gradient_reduction`."""
        self.data_parallel.finish_gradient_reduction()

    def finish_parameter_gather(self) -> None:
        """Wait for the updated parameters: :meth:`DataParallel.finish_parameter_gather`."""
        self.data_parallel.finish_parameter_gather()

    def full_parameters(self) -> AbstractContextManager[None]:
        """Context in which every parameter is whole (ZeRO-3 gathers them; otherwise a no-op)."""
        return self.data_parallel.full_parameters()

    def sync_from_parameters(self) -> None:
        """Take the parameters' values as the masters: :meth:`DataParallel.sync_from_parameters`."""
        self.data_parallel.sync_from_parameters()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` multiplied by the current loss scale.

        Call once per micro-batch; gradients accumulate until :meth:`step`. A
        non-finite loss is remembered (without a host sync) and makes the next step
        follow the non-finite policy on every rank.
        """
        self._loss_non_finite += (~torch.isfinite(loss.detach())).to(self._loss_non_finite.dtype).sum()
        scale = self.loss_scaler.scale
        (loss * scale if scale != 1.0 else loss).backward()

    @torch.no_grad()
    def step(self) -> OptimizerStepOutput:
        """Reduce gradients, unscale, clip, apply the non-finite policy, update, advance the LR.

        Returns:
            :class:`OptimizerStepOutput`, the same on every rank.

        Raises:
            FloatingPointError: on every rank, when a loss or gradient is non-finite,
                the loss scaler is off and ``non_finite_policy='fail'``.
        """
        dp = self.data_parallel
        dp.check_attached()
        dp.shards_will_change()
        dp.finish_parameter_gather()  # a module unused in forward may still be gathering
        grads = dp.reduced_grads()
        norm_sq, non_finite = global_norm_squared(dp.norm_terms(grads), self._loss_non_finite, self.topology)
        self._loss_non_finite.zero_()
        scale = self.loss_scaler.scale
        lrs = self.learning_rates
        if non_finite:
            dp.end_step()
            if not self.loss_scaler.enabled and self.config.non_finite_policy == "fail":
                raise FloatingPointError(
                    f"non-finite loss or gradient at step {self.step_count + 1} (seen on at least one rank; "
                    "non_finite_policy='fail'); lower the learning rate, enable the loss scaler for fp16, or set "
                    "non_finite_policy='skip'"
                )
            self.loss_scaler.update(overflow=True)
            return self._output(None, None, lrs, skip=True)
        norm = math.sqrt(norm_sq) / scale
        factor = 1.0 / scale
        clipped = norm
        if self.config.gradient_clipping > 0:
            coef = min(self.config.gradient_clipping / (norm + 1e-6), 1.0)
            factor *= coef
            clipped = norm * coef
        self.step_count += 1
        if factor != 1.0:
            foreach_mul_(grads, factor)
        step = self.step_count

        def update(indices: list[int], owned: list[torch.Tensor]) -> None:
            items = []
            for index, grad, slot in zip(indices, owned, (self.slots[i] for i in indices)):
                group = self.parameter_groups[slot.group_index].config
                lr, decay, independent = lrs[group.name], group.weight_decay, group.independent_weight_decay
                items.append(UpdateItem(slot.work_param(), grad, slot.state, lr, decay, independent, slot.rule, index))
            apply_updates(self.config, items, step, dp.whole_matrices())

        dp.update(grads, update)
        dp.end_step()
        for group in self.parameter_groups:
            group.scheduler.step()
        self.loss_scaler.update(overflow=False)
        return self._output(norm, clipped, lrs, skip=False)

    def _output(self, norm: float | None, clip: float | None, lrs: dict[str, float], skip: bool) -> OptimizerStepOutput:
        return OptimizerStepOutput(
            global_grad_norm=norm,
            global_grad_norm_clipped=clip,
            learning_rates=lrs,
            overflow=skip,
            skipped=skip,
            no_overflow_steps=self.loss_scaler.no_overflow_steps,
            current_loss_scale=self.loss_scaler.scale,
            step=self.step_count,
        )

    @property
    def learning_rates(self) -> dict[str, float]:
        """LR the next update of each group uses, by group name."""
        return {g.name: g.scheduler.get_lr(self.step_count + 1) for g in self.parameter_groups}

    def state_dict(self, owned: bool = False) -> StateDict:
        """Counters, loss scaler, schedules, and each parameter's state as DTensors of its logical
        shape keyed by ``meta.key`` (``_state.parameter_state``): loads into any layout. ``owned``:
        this rank's own elements instead (``owned_state``: no collective; loads at this layout only)."""
        self.data_parallel.finish_parameter_gather()
        params = (owned_state if owned else parameter_state)(self.data_parallel)
        groups = {g.name: g.scheduler.state_dict() for g in self.parameter_groups}
        scaler = self.loss_scaler.state_dict()
        return {"step": self.step_count, "loss_scaler": scaler, "groups": groups, "params": params}

    def load_state_dict(self, state: StateDict, owned: bool = False) -> None:
        """Restore a state from :meth:`state_dict`, saved with this layout or any other (after DCP
        filled it in; with ``owned``, as ``state_dict(owned=True)`` took it, at this layout).

        Raises:
            ValueError: groups or parameter keys differ, a state tensor is missing, or a
                tensor's shape is neither the logical nor this rank's local shape.
        """
        groups = {g.name: g for g in self.parameter_groups}
        if set(state["groups"]) != set(groups):
            raise ValueError(f"optimizer state has groups {sorted(state['groups'])}, this optimizer {sorted(groups)}")
        self.data_parallel.finish_parameter_gather()
        self.data_parallel.shards_will_change()
        (load_owned_state if owned else load_parameter_state)(self.data_parallel, state["params"])
        self.step_count = int(state["step"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        for name, scheduler_state in state["groups"].items():
            groups[name].scheduler.load_state_dict(scheduler_state)

    def __repr__(self) -> str:
        return (
            f"Optimizer({self.config.method}, zero_stage={self.config.zero_stage}, groups="
            f"{[g.name for g in self.parameter_groups]}, {len(self.slots)} trainable, step={self.step_count}, "
            f"{self.loss_scaler!r})"
        )
