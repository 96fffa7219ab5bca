"""DataParallel: what data parallelism does to a model's parameters and gradients (#48).

The sharding component of the one-engine design: it places each trainable parameter in its
shard space (dense over DP × CP or HSDP's shard group, experts over their expert-data-parallel
ranks), reduces gradients in buckets overlapped with the backward (16-bit gradients summed in
fp32), keeps ZeRO 1/2/3's shards (ZeRO-3: hooks on the model gather each layer before its
forward and backward and free it after), CPU offload with its layer-by-layer host update, and
the float8 all-gather. It hands the optimizer the local tensors to update (each slot's owned
gradient) and runs the optimizer's update where the layout puts it (on the device, on the
host, layer by layer in a thread, or one gather entry at a time); the optimizer never asks
which ZeRO stage or offload mode runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import torch

from scaling.optim._accumulate import GradientAccumulator
from scaling.optim._comm import all_reduce_
from scaling.optim._compat import foreach_copy_
from scaling.optim._config import OptimizerConfig
from scaling.optim._grad_norm import mark_norm_owners
from scaling.optim._offload import LayeredHostUpdate
from scaling.optim._param_group import OptimizerParamGroup
from scaling.optim._reducer import check_backward_passes
from scaling.optim._slots import ParamSlot, owned_grads
from scaling.optim._spaces import ShardSpace, place_parameters, shard_spaces
from scaling.optim._update import WholeMatrices
from scaling.optim._weak import weak_hook
from scaling.optim._whole import LogicalFrame
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

#: ``update(indices, grads)``: the optimizer's update of the slots at ``indices`` with their
#: gradients (device or host tensors, in the slots' compute dtype).
Update = Callable[[list[int], list[torch.Tensor]], None]


class DataParallel:
    """Data parallelism over a model's trainable parameters: placement, reduction, ZeRO 0-3, offload.

    Args:
        config: the optimizer's config; read here: ``zero_stage``, ``cpu_offload``,
            ``overlap_param_gather``, ``allreduce_bucket_size``, ``grad_reduce_in_fp32``,
            ``zero3_reshard_after_forward`` and the master-weight settings the slots keep.
        parameter_groups: the optimizer's groups (each trainable parameter in one).
        topology: the ranks; gradients are averaged over ``axis("dp_cp")`` (HSDP: its shard
            and replicate axes; experts: their expert-data-parallel ranks) and ``reduce_over_tp``
            gradients summed over ``axis("tp")``.
        zero3_modules, model: see :meth:`attach_model` (hooks are installed last).

    ``Optimizer`` builds one (``optimizer.data_parallel``); the walkthrough's code never names it.
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
        check_sharding(config, topology.config)
        self.config = config
        self.topology = topology
        #: Where gradients are averaged and ZeRO shards: dense, then experts (``_spaces.py``).
        self.spaces: list[ShardSpace] = shard_spaces(topology, config.zero_stage)
        self.slots: list[ParamSlot]
        self.slots, self._space_of = place_parameters(self.spaces, parameter_groups, config)
        mark_norm_owners(self.slots, topology)
        if config.zero_stage == 3:
            for slot in self.slots:
                check_own_storage(slot)
                slot.param_shard = slot.flat_param()[slot.start : slot.end].clone()
        #: ZeRO-3: the dense parameters' gatherer (the experts' is ``spaces[1].gatherer``).
        self.gatherer: ParameterGatherer | None = None
        self._hooks: list[RemovableHandle] = []
        self._model_attached = False
        # cpu_offload: the host update (ZeRO-3: of the last step, layer by layer in a thread).
        self._host_update = LayeredHostUpdate(topology.device)
        self._reduced = False
        #: Called as ``observer(slots, grads)`` with each step's reduced gradients (this rank's owned
        #: elements, before unscaling and clipping); a tool that reads them (``scaling.trainer.numerics``).
        self.grad_observers: list[Callable[[Sequence[ParamSlot], list[torch.Tensor]], None]] = []
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

    # ------------------------------------------------------------------ model
    @property
    def needs_model(self) -> bool:
        """Whether this hooks into the model (ZeRO-3, ``overlap_param_gather``)."""
        gathers = any(space.shard_gather is not None for space in self.spaces)
        return self.config.zero_stage == 3 or (gathers and self.config.overlap_param_gather)

    def attach_model(self, model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        """Hook into the model whose parameters these are (once; later calls do nothing).

        ZeRO-3 gathers and frees each layer's parameters around its forward and backward
        (the layers: ``model.layer_modules()``, as a ``ParallelModule`` names them, or a
        sequence of modules in forward order) and frees them now; ``overlap_param_gather``
        makes each module wait for its parameters' gather before its forward. Otherwise
        a no-op. ``BaseTrainer`` calls it (through the optimizer).

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

    def check_attached(self) -> None:
        """Raises RuntimeError when the layout hooks into a model and none was attached."""
        if self.needs_model and not self._model_attached:
            what = "zero_stage=3" if self.config.zero_stage == 3 else "overlap_param_gather=True"
            raise RuntimeError(
                f"{what} hooks into the model, and no model was attached to this Optimizer: BaseTrainer does it; "
                "otherwise pass Optimizer(..., model=module) or call optimizer.attach_model(module) before the "
                "first forward"
            )

    def _gatherers(self) -> list[ParameterGatherer]:
        """ZeRO-3: each space's gatherer (dense, then experts); empty otherwise."""
        return [space.gatherer for space in self.spaces if space.gatherer is not None]

    def _make_grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        # The hook holds this object weakly (see weak_hook) and finds its slot by index: the
        # slot holds the parameter, so capturing it would make the same cycle.
        def hook(dp: DataParallel, param: torch.Tensor) -> None:
            # ZeRO-3: once the layer's gradients have all accumulated they are reduce-scattered
            # together (GradientScatter) and only the owned shards are kept; the parameter is
            # freed. A tied weight keeps its .grad for the sum over pipeline stages; the step
            # reduces it.
            slot, scatter = dp.slots[index], dp._space_of[index].scatter
            assert scatter is not None
            scatter.grad_ready(slot)
            if dp.config.zero3_reshard_after_forward:
                free_storage(slot)

        return weak_hook(self, hook)

    # -------------------------------------------------------------- gradients
    def zero_grad(self) -> None:
        """Drop the gradients (``param.grad = None``) and any ZeRO-2 gradient shards."""
        for space in self.spaces:
            space.discard()
        if self._accumulator is not None:
            self._accumulator.discard()
        self._reduced = False
        for slot in self.slots:
            slot.param.grad = None
            slot.grad_shard = None

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
        after it (or the optimizer's step) runs the DP reduction of the sum. ZeRO 0-2; under ZeRO-3
        every pass reduce-scatters all the same (its gradients are not kept whole).
        """
        with ExitStack() as stack:
            for space in self.spaces:
                if space.reducer is not None:
                    stack.enter_context(space.reducer.no_sync())
            yield

    def finish_gradient_reduction(self) -> None:
        """Wait for the DP gradient averaging overlapped with backward.

        Afterwards ``.grad`` holds the DP average (ZeRO 0); with ZeRO 1 only the
        elements this rank owns do and the rest of ``.grad`` is zero; with ZeRO 2 and 3
        the owned average is in the optimizer and ``.grad`` is None (pipeline-tied
        parameters: as ZeRO 1 under ZeRO 2; under ZeRO 3 they keep their whole ``.grad``,
        which the step reduces). Call it before changing gradients across ranks outside
        the optimizer (e.g. summing tied weights over pipeline stages, which keeps the
        same DP ownership on every stage); the step calls it otherwise. Runs once
        per step.
        """
        if not self._reduced:  # DP averages, mostly overlapped with backward already
            if self._accumulator is not None:
                self._accumulator.flush()
            for space in self.spaces:
                space.finish_reduction()
        self._reduced = True

    def reduced_grads(self) -> list[torch.Tensor]:
        """Each slot's owned gradient, averaged over its data-parallel ranks and summed over TP
        where the parameter asks (``reduce_over_tp``), in the slot's compute dtype."""
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
        all_reduce_(tp_grads, self.topology.axis("tp").group, self.config.allreduce_bucket_size, average=False)
        for observe in self.grad_observers:
            observe(self.slots, grads)
        return grads

    def norm_terms(self, grads: Sequence[torch.Tensor]) -> list[tuple[list[torch.Tensor], bool]]:
        """``grads`` by shard space, for ``global_norm_squared``: the gradients whose squares this
        rank adds, and whether the space's sum still runs over its shard group."""
        return [
            ([grads[i] for i in space.indices if self.slots[i].counts_in_norm], space.counts_in_norm)
            for space in self.spaces
        ]

    # ------------------------------------------------- layout-independent frame
    def whole_matrices(self) -> WholeMatrices:
        """The calls Muon's update takes whole matrices through (``_whole.LogicalFrame``)."""
        frame = LogicalFrame(self.slots, self._space_of, self.topology.axis("tp"))
        return WholeMatrices(frame.orthogonaliser, frame.gather_whole, frame.owned_part, frame.logical_shape)

    # ----------------------------------------------------------------- update
    def update(self, grads: list[torch.Tensor], update: Update) -> None:
        """Run the optimizer's ``update`` of every slot where this layout puts it, then bring the
        parameters their new values.

        ZeRO-3 with ``cpu_offload``: in a thread, layer by layer on the host (each layer's
        gradients copied there now), and the next forward's gather of a layer waits for its
        piece only. ``cpu_offload`` otherwise: every gradient to the host, then the update there.
        ZeRO 1/2: one gather entry at a time, each entry's all-gather running while the next
        is updated (with ``overlap_param_gather`` also while the next forward runs).
        """
        if self.gatherer is not None and self.config.cpu_offload:
            self._host_update.start(self.slots, grads, update)
            return
        if self.config.cpu_offload:
            grads, arrived = self._host_update.copies.to_host(grads)
            arrived()
        for space in self.spaces:
            gather = space.shard_gather
            if gather is None:
                update(list(space.indices), [grads[i] for i in space.indices])
                continue
            for entry, positions in enumerate(gather.entries):
                indices = [space.indices[p] for p in positions]
                update(indices, [grads[i] for i in indices])
                gather.launch(entry)
            if not self.config.overlap_param_gather:
                gather.finish()
        self._write_back()

    def _write_back(self) -> None:
        """Copy updated master weights into the parameters (unsharded) or the ZeRO-3 shards."""
        if self.gatherer is not None:
            # ZeRO-3: parameters stay sharded; the next forward gathers the new values.
            for slot in self.slots:
                if slot.master is not None and slot.param_shard is not None:
                    slot.param_shard.copy_(slot.master)
            return
        # Unsharded slots (sharded ZeRO 1/2 ones gather in update(), see ShardGather). One
        # multi-tensor copy (and cast) instead of a kernel per parameter: on a GPU, ~280
        # launches a step fewer at 0.87B parameters.
        masters = [(s.flat_param(), s.master) for s in self.slots if s.master is not None and s.shard_world == 1]
        if masters:
            foreach_copy_([p for p, _ in masters], [m for _, m in masters])

    def end_step(self) -> None:
        """After a step (updated or skipped): drop the gradient shards and free the layers kept
        whole (``zero3_reshard_after_forward=False``) or unused."""
        for slot in self.slots:
            slot.grad_shard = None
        for gatherer in self._gatherers():
            gatherer.free_all()

    # ------------------------------------------------------------- parameters
    def shards_will_change(self) -> None:
        """ZeRO-3: drop prefetches and float8 scales taken from the shards about to change."""
        for gatherer in self._gatherers():
            gatherer.shards_will_change()

    def finish_parameter_gather(self) -> None:
        """Wait until every parameter holds its updated value (``overlap_param_gather``, and
        the host update of ZeRO-3 with ``cpu_offload``).

        Forward pre-hooks do this per module; call it before reading parameters outside
        a forward (checkpoints, evaluation code that bypasses the modules, comparisons).
        :meth:`full_parameters` and the optimizer's ``state_dict``, ``load_state_dict``
        and ``step`` call it themselves. A no-op otherwise.
        """
        for space in self.spaces:
            if space.shard_gather is not None:
                space.shard_gather.finish()
        self._host_update.wait()

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Context in which every parameter is whole (ZeRO-3 gathers them; otherwise a no-op)."""
        self.finish_parameter_gather()
        with ExitStack() as stack:
            for gatherer in self._gatherers():
                stack.enter_context(gatherer.full_parameters())
            yield

    @contextmanager
    def whole(self, params: Collection[torch.Tensor]) -> Iterator[None]:
        """``params`` whole inside the block (ZeRO-3 gathers the layers holding them, and frees them
        after it; otherwise a no-op). A frozen parameter changed in place there keeps the change
        (an aux-loss-free balancing bias moved between steps). Every rank enters it alike."""
        self.finish_parameter_gather()
        with ExitStack() as stack:
            for gatherer in self._gatherers():
                stack.enter_context(gatherer.whole(params))
            yield

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
        self.shards_will_change()
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
