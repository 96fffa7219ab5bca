"""Optimizer: DP/TP gradient reduction, loss scaling, global norm, clipping, ZeRO 0-3, update."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import torch

from scaling.optim._accumulate import GradientAccumulator
from scaling.optim._comm import all_reduce_
from scaling.optim._compat import foreach_copy_, foreach_mul_
from scaling.optim._config import OptimizerConfig
from scaling.optim._grad_norm import global_norm_squared, mark_norm_owners
from scaling.optim._loss_scaler import LossScaler
from scaling.optim._offload import LayeredHostUpdate
from scaling.optim._param_group import OptimizerParamGroup
from scaling.optim._reducer import check_backward_passes
from scaling.optim._slots import owned_grads
from scaling.optim._spaces import ShardSpace, place_parameters, shard_spaces
from scaling.optim._state import load_optimizer_state, optimizer_state
from scaling.optim._step_output import OptimizerStepOutput
from scaling.optim._update import UpdateItem, apply_updates
from scaling.optim._weak import weak_hook
from scaling.optim._zero3 import (
    ParameterGatherer,
    check_own_storage,
    check_sharding,
    check_zero3,
    free_storage,
    zero3_units,
)
from scaling.topology import Topology

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from scaling.config import StateDict


class Optimizer:
    """Mixed-precision, ZeRO-sharded optimizer over :class:`OptimizerParamGroup`\\ s.

    Args:
        config: update rule, ZeRO stage, clipping, loss scaler and non-finite policy.
        parameter_groups: the groups; each trainable parameter in exactly one.
        topology: an initialised :class:`~scaling.topology.Topology`; gradients are
            averaged over DP × CP (``axis("dp_cp")``), ``reduce_over_tp`` gradients summed
            over its ``axis("tp")``, and the norm reduced over ``axis("replica")`` and DP × CP.
        zero3_modules: with ``zero_stage=3`` only: the layers in forward order, for a
            model that does not name them (default: ``model.layer_modules()``). Their
            trained parameters are freed at once and gathered around each layer's forward
            and backward; use :meth:`full_parameters` to read them outside a forward.
        model: the module (or modules) holding the parameters, the same as a later
            :meth:`attach_model` (which ``BaseTrainer`` calls): ZeRO-3 and
            ``config.overlap_param_gather`` hook into it.

    Raises:
        ValueError: duplicate group names, a parameter in two groups, ``zero3_modules``
            without ``zero_stage=3``, a ZeRO-3 parameter sharing storage, or a ``model``
            that does not name its layers under ZeRO-3 (see :meth:`attach_model`).

    Example::

        opt = Optimizer(config=OptimizerConfig(), parameter_groups=groups, topology=topology)
        opt.zero_grad()
        opt.backward(loss)
        out = opt.step()  # OptimizerStepOutput
    """

    def __init__(
        self,
        config: OptimizerConfig,
        parameter_groups: Sequence[OptimizerParamGroup],
        topology: Topology,
        zero3_modules: Sequence[torch.nn.Module] | None = None,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
    ) -> None:
        check_zero3(config.zero_stage, zero3_modules)
        names = [g.name for g in parameter_groups]
        if len(set(names)) != len(names):
            raise ValueError(f"parameter group names must be unique, got {names}")
        self.config = config
        self.parameter_groups = list(parameter_groups)
        self.topology = topology
        self.loss_scaler = LossScaler(config.loss_scaler)
        self.step_count = 0
        check_sharding(config, topology.config)
        # Where gradients are averaged and ZeRO shards: over DP × CP (or HSDP shard groups)
        # for dense parameters, over the ranks holding them for experts (_spaces.py).
        self.spaces: list[ShardSpace] = shard_spaces(topology, config.zero_stage)
        self.slots, self._space_of = place_parameters(self.spaces, self.parameter_groups, config)
        mark_norm_owners(self.slots, topology)
        self._loss_non_finite = torch.zeros((), device=topology.device)
        if config.zero_stage == 3:
            for slot in self.slots:
                check_own_storage(slot)
                slot.param_shard = slot.flat_param()[slot.start : slot.end].clone()
        #: ZeRO-3: the dense parameters' gatherer (the experts' is ``spaces[1].gatherer``).
        self.gatherer: ParameterGatherer | None = None
        self._hooks: list[RemovableHandle] = []
        self._model_attached = False
        # ZeRO-3 with cpu_offload: the host update of the last step, running in a thread.
        self._host_update = LayeredHostUpdate(topology.device)
        self._dp_reduced = False
        self._reduce_dtype = torch.float32 if config.grad_reduce_in_fp32 else None
        # ZeRO 0/1 16-bit gradients summed in fp32 over micro-batches; its hooks run before the reducer's.
        self._accumulator = (
            GradientAccumulator(self.slots) if config.zero_stage < 2 and config.grad_reduce_in_fp32 else None
        )
        for space in self.spaces:
            space.start_reduction(config.zero_stage, config.allreduce_bucket_size, self._reduce_dtype)
        # Hooks last: a constructor that raises leaves no hook behind on the parameters.
        if zero3_modules is not None:
            self.attach_model(zero3_modules)
        elif model is not None:
            self.attach_model(model)

    @property
    def needs_model(self) -> bool:
        """Whether this optimizer hooks into the model (ZeRO-3, ``overlap_param_gather``)."""
        gathers = any(space.shard_gather is not None for space in self.spaces)
        return self.config.zero_stage == 3 or (gathers and self.config.overlap_param_gather)

    def attach_model(self, model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        """Hook into the model whose parameters this optimizer updates (once; later calls do nothing).

        ZeRO-3 gathers and frees each layer's parameters around its forward and backward
        (the layers: ``model.layer_modules()``, as a ``ParallelModule`` names them, or a
        sequence of modules in forward order) and frees them now; ``overlap_param_gather``
        makes each module wait for its parameters' gather before its forward. Otherwise
        a no-op. ``BaseTrainer`` calls it, so walkthrough code needs no change.

        Raises:
            ValueError: ZeRO-3 with a module that does not name its layers, or with layers
                that leave a trained parameter out.
        """
        if self._model_attached or not self.needs_model:
            return
        if self.config.zero_stage == 3:
            units = zero3_units(model)
            for space in self.spaces:
                gatherer = space.attach_zero3(units, self.config.zero3_reshard_after_forward, self._reduce_dtype)
                gatherer.before_gather = self._host_update.wait
            self.gatherer = self.spaces[0].gatherer
            self._host_update.order(self.slots, [gatherer.layers for gatherer in self._gatherers()])
            for index, slot in enumerate(self.slots):
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._make_grad_hook(index)))
            for gatherer in self._gatherers():
                gatherer.free_all()
        else:
            for space in self.spaces:
                if space.shard_gather is not None:
                    self._hooks += space.shard_gather.wait_hooks(model)
        self._model_attached = True

    def _gatherers(self) -> list[ParameterGatherer]:
        """ZeRO-3: each space's gatherer (dense, then experts); empty otherwise."""
        return [space.gatherer for space in self.spaces if space.gatherer is not None]

    # ----------------------------------------------------------------- backward
    def zero_grad(self) -> None:
        """Drop the gradients (``param.grad = None``) and any ZeRO-2 gradient shards."""
        for space in self.spaces:
            space.discard()
        if self._accumulator is not None:
            self._accumulator.discard()
        self._dp_reduced = False
        for slot in self.slots:
            slot.param.grad = None
            slot.grad_shard = None
        self._loss_non_finite.zero_()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` multiplied by the current loss scale.

        Call once per micro-batch; gradients accumulate until :meth:`step`. A
        non-finite loss is remembered (without a host sync) and makes the next step
        follow the non-finite policy on every rank.
        """
        self._loss_non_finite += (~torch.isfinite(loss.detach())).to(self._loss_non_finite.dtype).sum()
        scale = self.loss_scaler.scale
        (loss * scale if scale != 1.0 else loss).backward()

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Each step's gradients accumulate over ``steps`` backward passes (its micro-batches).

        With ZeRO 0 and 1 the DP reduction then runs once per step, overlapped with the last
        pass, instead of once per pass (as Megatron-LM does; DeepSpeed's
        ``gradient_accumulation_steps``). ZeRO 2 and 3 keep reducing in every pass, so that a
        full gradient never outlives its backward (their point). The result is the same
        either way, up to the rounding of summing before or after the average. With ZeRO 0 and
        1, 16-bit parameters, master weights and ``grad_reduce_in_fp32`` the passes' gradients
        are summed in fp32 and rounded into ``.grad`` once, in the last pass (``.grad`` is None
        between passes; ZeRO 2 and 3 sum into fp32 gradient shards). The trainer's step sets it
        to the number of micro-batches; the default is 1.

        Raises:
            ValueError: ``steps`` is not a positive int.
        """
        check_backward_passes(steps, "gradient accumulation steps")
        if self._accumulator is not None:
            self._accumulator.accumulate(steps)
        for space in self.spaces:
            if space.reducer is not None and space.reducer.mode != "shard_free":
                space.reducer.accumulate(steps)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync``: backward passes inside it accumulate locally, and the first pass
        after it (or :meth:`step`) runs the DP reduction of the sum. ZeRO 0-2; under ZeRO-3
        every pass reduce-scatters all the same (its gradients are not kept whole).
        """
        with ExitStack() as stack:
            for space in self.spaces:
                if space.reducer is not None:
                    stack.enter_context(space.reducer.no_sync())
            yield

    def _make_grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        # The hook holds the optimizer weakly (see weak_hook) and finds its slot by index: the
        # slot holds the parameter, so capturing it would make the same cycle.
        def hook(optimizer: Optimizer, param: torch.Tensor) -> None:
            # ZeRO-3: once the layer's gradients have all accumulated they are reduce-scattered
            # together (GradientScatter) and only the owned shards are kept; the parameter is
            # freed. A tied weight keeps its .grad for the sum over pipeline stages; the step
            # reduces it.
            slot, scatter = optimizer.slots[index], optimizer._space_of[index].scatter
            assert scatter is not None
            scatter.grad_ready(slot)
            if optimizer.config.zero3_reshard_after_forward:
                free_storage(slot)

        return weak_hook(self, hook)

    # --------------------------------------------------------------------- step
    def finish_gradient_reduction(self) -> None:
        """Wait for the DP gradient averaging overlapped with backward.

        Afterwards ``.grad`` holds the DP average (ZeRO 0); with ZeRO 1 only the
        elements this rank owns do and the rest of ``.grad`` is zero; with ZeRO 2 and 3
        the owned average is in the optimizer and ``.grad`` is None (pipeline-tied
        parameters: as ZeRO 1 under ZeRO 2; under ZeRO 3 they keep their whole ``.grad``,
        which :meth:`step` reduces). Call it before changing gradients across ranks outside
        the optimizer (e.g. summing tied weights over pipeline stages, which keeps the
        same DP ownership on every stage); :meth:`step` calls it otherwise. Runs once
        per step.
        """
        if not self._dp_reduced:  # DP averages, mostly overlapped with backward already
            if self._accumulator is not None:
                self._accumulator.flush()
            for space in self.spaces:
                space.finish_reduction()
        self._dp_reduced = True

    def _check_attached(self) -> None:
        if self.needs_model and not self._model_attached:
            what = "zero_stage=3" if self.config.zero_stage == 3 else "overlap_param_gather=True"
            raise RuntimeError(
                f"{what} hooks into the model, and no model was attached to this Optimizer: BaseTrainer does it; "
                "otherwise pass Optimizer(..., model=module) or call optimizer.attach_model(module) before the "
                "first forward"
            )

    def _reduced_grads(self) -> list[torch.Tensor]:
        topo, bucket = self.topology, self.config.allreduce_bucket_size
        self.finish_gradient_reduction()
        if self.config.zero_stage == 0:
            for slot in self.slots:
                if slot.param.grad is None:
                    slot.param.grad = torch.zeros_like(slot.param)
        for space in self.spaces:  # ZeRO-3: tied weights (and parameters whose hook did not run)
            if space.scatter is not None:
                space.scatter.reduce_now([s for s in space.slots if s.param.grad is not None])
        grads = owned_grads(self.slots)
        # Summing over TP commutes with the DP reduction, so it runs on what this rank owns (the
        # shards under ZeRO), in the update's dtype (fp32 with master weights: not rounded to 16 bits).
        tp_grads = [g for s, g in zip(self.slots, grads) if s.meta.reduce_over_tp]
        all_reduce_(tp_grads, topo.axis("tp").group, bucket, average=False)
        return grads

    @torch.no_grad()
    def step(self) -> OptimizerStepOutput:
        """Reduce gradients, unscale, clip, apply the non-finite policy, update, advance the LR.

        Returns:
            :class:`OptimizerStepOutput`, the same on every rank.

        Raises:
            FloatingPointError: on every rank, when a loss or gradient is non-finite,
                the loss scaler is off and ``non_finite_policy='fail'``.
        """
        self._check_attached()
        self._shards_will_change()
        self.finish_parameter_gather()  # a module unused in forward may still be gathering
        grads = self._reduced_grads()
        counted = [
            ([grads[i] for i in space.indices if self.slots[i].counts_in_norm], space.counts_in_norm)
            for space in self.spaces
        ]
        norm_sq, non_finite = global_norm_squared(counted, self._loss_non_finite, self.topology)
        scale = self.loss_scaler.scale
        lrs = {g.name: g.scheduler.get_lr(self.step_count + 1) for g in self.parameter_groups}
        if non_finite:
            self._clear_grad_shards()
            if not self.loss_scaler.enabled and self.config.non_finite_policy == "fail":
                raise FloatingPointError(
                    f"non-finite loss or gradient at step {self.step_count + 1} (seen on at least one rank; "
                    "non_finite_policy='fail'); lower the learning rate, enable the loss scaler for fp16, or set "
                    "non_finite_policy='skip'"
                )
            self.loss_scaler.update(overflow=True)
            return self._output(None, None, lrs, overflow=True)
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
        if self.gatherer is not None and self.config.cpu_offload:
            # ZeRO-3: the host update runs in a thread, layer by layer (_offload.py); the next
            # forward's gather of a layer waits for its piece and the earlier ones only.
            step = self.step_count
            self._host_update.start(
                self.slots,
                grads,
                functools.partial(self._update_item, lrs=lrs),
                lambda items: apply_updates(self.config, items, step),
            )
        else:
            if self.config.cpu_offload:  # ZeRO 0-2: every gradient to the host, then update there
                grads, arrived = self._host_update.copies.to_host(grads)
                arrived()
            items = [self._update_item(i, grad, lrs) for i, grad in enumerate(grads)]
            for space in self.spaces:
                mine = [items[i] for i in space.indices]
                gather = space.shard_gather
                if gather is None:
                    apply_updates(self.config, mine, self.step_count)
                    continue
                # ZeRO 1/2: each entry's gather runs while the next entry is updated, and
                # with overlap_param_gather also while the next forward runs.
                for entry, indices in enumerate(gather.entries):
                    apply_updates(self.config, [mine[i] for i in indices], self.step_count)
                    gather.launch(entry)
                if not self.config.overlap_param_gather:
                    gather.finish()
            self._write_back()
        self._clear_grad_shards()
        for group in self.parameter_groups:
            group.scheduler.step()
        self.loss_scaler.update(overflow=False)
        return self._output(norm, clipped, lrs, overflow=False)

    def finish_parameter_gather(self) -> None:
        """Wait until every parameter holds its updated value (``overlap_param_gather``, and
        the host update of ZeRO-3 with ``cpu_offload``).

        Forward pre-hooks do this per module; call it before reading parameters outside
        a forward (checkpoints, evaluation code that bypasses the modules, comparisons).
        :meth:`state_dict`, :meth:`load_state_dict`, :meth:`full_parameters` and
        :meth:`step` call it themselves. A no-op otherwise.
        """
        for space in self.spaces:
            if space.shard_gather is not None:
                space.shard_gather.finish()
        self._host_update.wait()

    def _update_item(self, index: int, grad: torch.Tensor, lrs: dict[str, float]) -> UpdateItem:
        slot, work = self.slots[index], self.slots[index].work_param()
        group = self.parameter_groups[slot.group_index].config
        return UpdateItem(work, grad, slot.state, lrs[group.name], group.weight_decay, group.independent_weight_decay)

    def _write_back(self) -> None:
        """Copy updated master weights into the parameters (unsharded) or the ZeRO-3 shards."""
        if self.gatherer is not None:
            # ZeRO-3: parameters stay sharded; the next forward gathers the new values.
            for slot in self.slots:
                if slot.master is not None and slot.param_shard is not None:
                    slot.param_shard.copy_(slot.master)
            return
        # Unsharded slots (sharded ZeRO 1/2 ones gather in step(), see ShardGather). One
        # multi-tensor copy (and cast) instead of a kernel per parameter: on a GPU, ~280
        # launches a step fewer at 0.87B parameters.
        masters = [(s.flat_param(), s.master) for s in self.slots if s.master is not None and s.shard_world == 1]
        if masters:
            foreach_copy_([p for p, _ in masters], [m for _, m in masters])

    def _shards_will_change(self) -> None:
        """ZeRO-3: drop prefetches and float8 scales taken from the shards about to change."""
        for gatherer in self._gatherers():
            gatherer.shards_will_change()

    def _clear_grad_shards(self) -> None:
        for slot in self.slots:
            slot.grad_shard = None
        self._loss_non_finite.zero_()
        for gatherer in self._gatherers():
            gatherer.free_all()  # layers kept whole (zero3_reshard_after_forward=False) or unused

    def _output(
        self, norm: float | None, clipped: float | None, lrs: dict[str, float], overflow: bool
    ) -> OptimizerStepOutput:
        return OptimizerStepOutput(
            global_grad_norm=norm,
            global_grad_norm_clipped=clipped,
            learning_rates=lrs,
            overflow=overflow,
            skipped=overflow,
            no_overflow_steps=self.loss_scaler.no_overflow_steps,
            current_loss_scale=self.loss_scaler.scale,
            step=self.step_count,
        )

    # --------------------------------------------------------------- accessors
    @property
    def learning_rates(self) -> dict[str, float]:
        """LR the next update of each group uses, by group name."""
        return {g.name: g.scheduler.get_lr(self.step_count + 1) for g in self.parameter_groups}

    def state_dict(self) -> StateDict:
        """This rank's optimizer state keyed by ``meta.key`` (see :func:`optimizer_state`)."""
        self.finish_parameter_gather()
        return optimizer_state(self)

    def load_state_dict(self, state: StateDict) -> None:
        """Restore a state from :meth:`state_dict` (same layout)."""
        self.finish_parameter_gather()
        self._shards_will_change()
        load_optimizer_state(self, state)

    @torch.no_grad()
    def sync_from_parameters(self) -> None:
        """Take the parameters' current values as the optimizer's own copy of them.

        The fp32 master weights and (ZeRO-3) the owned shards are what the next update
        starts from, so after writing into the parameters outside the optimizer (loading
        a model checkpoint without its optimizer state) call this, with the parameters
        whole (inside :meth:`full_parameters` under ZeRO-3).

        Raises:
            RuntimeError: under ZeRO-3, a parameter is not whole.
        """
        self._host_update.wait()
        self._shards_will_change()
        frozen = [slot for gatherer in self._gatherers() for slot in gatherer.frozen]
        for slot in [*self.slots, *frozen]:
            if slot.param_shard is None and slot.master is None:
                continue  # the parameter is its own master
            if slot.param.untyped_storage().nbytes() < slot.numel * slot.param.element_size():
                raise RuntimeError(
                    f"sync_from_parameters: parameter {slot.name!r} is freed (zero_stage=3); call it inside "
                    "optimizer.full_parameters()"
                )
            owned = slot.flat_param()[slot.start : slot.end]
            if slot.param_shard is not None:
                slot.param_shard.copy_(owned)
            if slot.master is not None:
                slot.master.copy_(owned)

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Context in which every parameter is whole (ZeRO-3 gathers them; otherwise a no-op)."""
        self.finish_parameter_gather()
        with ExitStack() as stack:
            for gatherer in self._gatherers():
                stack.enter_context(gatherer.full_parameters())
            yield

    def __repr__(self) -> str:
        return (
            f"Optimizer({self.config.method}, zero_stage={self.config.zero_stage}, groups="
            f"{[g.name for g in self.parameter_groups]}, {len(self.slots)} trainable, step={self.step_count}, "
            f"{self.loss_scaler!r})"
        )
