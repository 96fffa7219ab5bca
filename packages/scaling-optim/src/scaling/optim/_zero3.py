"""ZeRO-3: parameters live as DP shards and are gathered per layer, with prefetch, then freed.

Why our own and not FSDP2 (``fully_shard``): FSDP2 replaces every parameter with a new
DTensor parameter, which drops the :class:`~scaling.nn.ParameterMeta` the optimizer,
clipping and checkpoints read, changes the parameter objects the pipeline and the
param groups already hold, and needs the TP layers to be DTensor-aware. Here the
parameter objects stay; only their storage is freed (``untyped_storage().resize_(0)``)
and refilled, as FSDP1 does, so the rest of Scaling sees ordinary parameters.

Lifecycle per layer (``modules`` in forward order; a parameter belongs to the innermost
module that holds it, and a weight tied between two layers to both). Frozen parameters
(LoRA's base weights) are sharded, gathered and freed alike; they are not updated by
the optimizer, but one changed in place while whole (a mixture-of-experts router's
balancing bias; its version counter tells) is written back into its shard when freed:

- forward pre-hook: make the layer whole (waiting for its prefetch if one runs), start
  the async all-gather of the next layer (prefetch);
- forward post-hook: free the layer (``reshard_after_forward``; otherwise it stays whole
  until the optimizer step, which spares the re-gathers of later micro-batches and of
  the backward, as FSDP2's ``reshard_after_forward=False`` does for pipeline stages);
  when grad is enabled, hook the outputs so that each gradient reaching them makes the
  layer whole again (and the first one prefetches the previous layer), and the inputs so
  that the layer's frozen parameters are freed once its input gradients exist (its
  backward is done; trained parameters are freed as their gradients accumulate). A
  forward run inside a backward (activation checkpointing's recomputation) frees
  nothing: its backward is about to read the parameters;
- post-accumulate-grad hook (in the optimizer): free the parameter again; once every
  gradient of a layer has accumulated in this backward, reduce-scatter them all in one
  asynchronous collective (``_zero3_scatter.GradientScatter``, at most two in flight) into the
  owned shards (pipeline-tied weights keep their ``.grad`` until the tied sum over
  stages; the step reduces it).

This works under every pipeline schedule: micro-batches only change how often a layer
is gathered, and the zero-bubble weight pass accumulates through the same hooks.

Refilling goes through ``param.data`` so autograd's version counter is untouched: the
tensors saved for backward see the same values they were computed with.

A freed parameter has no storage, and torch reads a tensor's data without checking that it
has any: ``weight.norm()`` between steps would read freed memory (a segmentation fault).
So a freed parameter is a :class:`FreedParameter` until its layer is gathered again: its
metadata (shape, dtype, device, grad, hooks) reads as before, and any op on its values
raises a ``RuntimeError`` naming the parameter and the context that makes it whole
(``optimizer.full_parameters()``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.distributed as dist

from scaling.collectives import PendingCollective, all_gather_async
from scaling.nn import ParameterMeta
from scaling.optim._comm import group_size
from scaling.optim._compat import in_backward
from scaling.optim._slots import ParamSlot
from scaling.optim._weak import weak_hook
from scaling.optim._zero3_float8 import WIRE_FLOAT8, Float8Gathers, fill_float8

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.utils.hooks import RemovableHandle

    from scaling.optim._config import OptimizerConfig
    from scaling.topology import TopologyConfig


class LayeredModule(Protocol):
    """A model that names its layers in forward order (``ParallelModule`` does): the ZeRO-3 units."""

    def layer_modules(self) -> Sequence[torch.nn.Module]: ...


# What a freed parameter still answers: its metadata and storage handle, the hooks and the
# gradient. Properties are read (``__get__``) or set (``__set__``) by name; methods by function.
_FREED_PROPERTIES = frozenset(
    {"shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout", "_version", "grad_fn",
     "is_cuda", "is_meta", "is_sparse", "names", "_base", "is_quantized", "is_nested", "output_nr"}
)  # fmt: skip
_FREED_METHODS = frozenset(
    {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.element_size,
     torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.stride, torch.Tensor.storage_offset,
     torch.Tensor.is_contiguous, torch.Tensor.requires_grad_, torch.Tensor.register_hook,
     torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.__hash__, torch.Tensor._is_view,
     torch.Tensor.get_device, torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_signed,
     # Differentiating with respect to it (the zero-bubble weight pass) reads none of its values,
     # nor does making a tensor like it (a missing gradient's zeros).
     torch.autograd.backward, torch.autograd.grad, torch.zeros_like, torch.empty_like, torch.ones_like,
     torch.full_like, torch.Tensor.new_zeros, torch.Tensor.new_empty, torch.Tensor.new_ones, torch.Tensor.new_full}
)  # fmt: skip


class FreedParameter(torch.nn.Parameter):
    """A ZeRO-3 parameter whose storage is freed (between its layer's uses): reading its values
    raises a ``RuntimeError`` that names it, instead of reading freed memory. Its metadata reads as
    a parameter's; the gatherer turns it back into a ``torch.nn.Parameter`` when it refills it."""

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., object],
        types: Collection[type],
        args: Sequence[object] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", "") if getattr(func, "__name__", "") in ("__get__", "__set__") else ""
        if name in _FREED_PROPERTIES or func in _FREED_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        param = next(a for a in args if isinstance(a, FreedParameter))
        meta = getattr(param, "parameter_meta", None)
        what = (
            f"parameter {meta.key!r}"
            if isinstance(meta, ParameterMeta)
            else f"a parameter of shape {list(param.shape)}"
        )
        raise RuntimeError(
            f"{what} is sharded by ZeRO-3 (zero_stage=3): between its layer's uses this rank holds only its shard, "
            f"so {getattr(func, '__name__', func)} cannot read it; read it inside `with optimizer.full_parameters():` "
            "(the high-level API's `with model.full_parameters():`), which gathers every parameter"
        )


def free_storage(slot: ParamSlot) -> None:
    slot.param.untyped_storage().resize_(0)
    if type(slot.param) is torch.nn.Parameter:
        slot.param.__class__ = FreedParameter
    if slot.float8_weight is not None:
        slot.float8_weight.tensor.untyped_storage().resize_(0)


def _refilled(param: torch.nn.Parameter) -> None:
    """``param`` (its storage resized back) a plain parameter again."""
    if type(param) is FreedParameter:
        param.__class__ = torch.nn.Parameter  # type: ignore[assignment]


def _meta_of(param: torch.Tensor, name: str) -> ParameterMeta:
    meta = getattr(param, "parameter_meta", None)
    return meta if isinstance(meta, ParameterMeta) else ParameterMeta(name, tuple(param.shape))


def _is_whole(slot: ParamSlot) -> bool:
    return bool(slot.param.untyped_storage().nbytes() == slot.numel * slot.param.element_size())


def _own_parameters(modules: Sequence[torch.nn.Module]) -> list[list[torch.nn.Parameter]]:
    """Each module's parameters less those of the other modules nested inside it."""
    ids = {id(m) for m in modules}
    out = []
    for module in modules:
        nested = {id(p) for sub in module.modules() if sub is not module and id(sub) in ids for p in sub.parameters()}
        out.append([p for p in module.parameters() if id(p) not in nested])
    return out


def _iter_tensors(obj: object) -> Iterator[torch.Tensor]:
    """Tensors inside a layer's output: tensors, sequences, mappings and dataclasses (LayerIO)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _iter_tensors(getattr(obj, f.name))


class _Pending(NamedTuple):
    """An all-gather in flight: its handle (None with one rank), the receive buffer (None with
    one rank: the shards are copied in), one rank's width in it, and (float8 all-gathers: a
    byte buffer) each float8 weight's inverse scale."""

    work: PendingCollective | None
    buffer: torch.Tensor | None
    width: int
    inverse: dict[int, torch.Tensor]


class ParameterGatherer:
    """Gathers and frees the ZeRO-3 parameters of each layer around its forward and backward.

    Args:
        modules: the layers, in forward order; each parameter of a layer that the
            optimizer trains is gathered for that layer.
        slots: the optimizer's slots (with ``param_shard`` set).
        group: the data-parallel group the shards are spread over (None: one rank).
        reshard_after_forward: free each layer after its forward (else at the step).
        takes_frozen: which frozen parameters of the layers this gatherer shards (by
            their meta; the expert ones go to the experts' gatherer under EP).
    """

    def __init__(
        self,
        modules: Sequence[torch.nn.Module],
        slots: Sequence[ParamSlot],
        group: ProcessGroup | None,
        reshard_after_forward: bool = True,
        takes_frozen: Callable[[ParameterMeta], bool] = lambda meta: True,
    ) -> None:
        by_param = {id(s.param): s for s in slots}
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        owned = _own_parameters(modules)
        world, rank = group_size(group), dist.get_rank(group) if group is not None else 0
        #: Slots of the frozen parameters (no optimizer state, never updated): sharded too.
        self.frozen: list[ParamSlot] = []
        for params in owned:
            for p in params:
                meta = _meta_of(p, f"frozen.{len(self.frozen)}")
                if id(p) not in by_param and not p.requires_grad and takes_frozen(meta):
                    slot = ParamSlot(meta.key, p, meta, -1, world, rank, False, ())
                    check_own_storage(slot)
                    slot.param_shard = slot.flat_param()[slot.start : slot.end].clone()
                    by_param[id(p)] = slot
                    self.frozen.append(slot)
        self.layers: list[list[ParamSlot]] = [
            [by_param[id(p)] for p in params if id(p) in by_param] for params in owned
        ]
        frozen_ids = {id(s) for s in self.frozen}
        # A frozen parameter's version counter when last made whole: a change means an
        # in-place update (gathering writes through .data, which leaves the counter alone).
        self._versions: dict[int, int] = {}
        self._frozen_of: list[list[ParamSlot]] = [[s for s in layer if id(s) in frozen_ids] for layer in self.layers]
        covered = {id(s) for layer in self.layers for s in layer}
        missing = [s.name for s in slots if id(s) not in covered]
        if missing:
            raise ValueError(
                f"zero_stage=3: parameters {missing} belong to none of the modules passed as zero3_modules; "
                "pass every layer that uses a trained parameter"
            )
        # The float8 linears' weights that travel in float8, their scales and gathered float8 copies.
        self._float8 = Float8Gathers(modules, by_param, group)
        #: Layers whole with weights dequantised from float8 (forward / backward only; exact
        #: gathers, as for checkpoints, gather them again in their own dtype).
        self._lossy: set[int] = set()
        self._pending: dict[int, _Pending] = {}
        #: Bytes this rank has put into all-gathers (its shards' part), and how many it started.
        self.sent_bytes, self.gathers = 0, 0
        #: Called before a gather reads the shards of layers ``0..index`` (None: of all
        #: layers): the optimizer's wait for its host update.
        self.before_gather: Callable[[int | None], None] | None = None
        self.handles: list[RemovableHandle] = []
        for index, module in enumerate(modules):
            self.handles.append(module.register_forward_pre_hook(self._pre_forward(index)))
            # Before the module's other forward hooks: one may raise to end a pipeline stage
            # there (the auto API's), and the outputs must be hooked for the backward anyway.
            self.handles.append(module.register_forward_hook(self._post_forward(index), prepend=True))

    # ------------------------------------------------------------- gathering
    def _start(self, index: int, exact: bool = False) -> None:
        if index in self._pending or not 0 <= index < len(self.layers) or not self.layers[index]:
            return
        if not self.reshard_after_forward and all(_is_whole(s) for s in self.layers[index]):
            return  # kept whole since its first use in this step
        if self.before_gather is not None:
            self.before_gather(index)
        slots = self.layers[index]
        world = group_size(self.group)
        inverse: dict[int, torch.Tensor] = {}
        if not exact and any(s in self._float8 for s in slots):
            send, inverse = self._float8.pack(slots, self.before_gather)
        elif world == 1:  # one rank (an expert held by one rank, ZeRO-3 on one device): the shards are whole
            self._pending[index] = _Pending(None, None, 0, inverse)
            return
        else:
            send = torch.cat([s.padded_chunk(s.param_shard) for s in slots])  # type: ignore[arg-type]
        if world == 1:  # float8 on one rank: the same quantised bytes as with more, not sent
            self._pending[index] = _Pending(None, send, send.numel(), inverse)
            return
        self.sent_bytes += send.numel() * send.element_size()
        self.gathers += 1
        recv = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
        work = all_gather_async(recv, send, self.group)  # recorded, diagnosed and its wait counted
        self._pending[index] = _Pending(work, recv, send.numel(), inverse)

    @property
    def amax_reductions(self) -> int:
        """How many float8 amax all-reduces ran (one per step with float8 all-gathers)."""
        return self._float8.amax_reductions

    def gather(self, index: int, exact: bool = False) -> None:
        """Make layer ``index``'s parameters whole (waiting for a prefetch if one is running).

        ``exact``: whole in their own dtype even where float8 all-gathers are on (for a
        checkpoint or any read outside a forward); a layer made whole from float8 is gathered again.
        """
        if exact and (index in self._lossy or (index in self._pending and self._pending[index].inverse)):
            self._drop_pending(index)
            self._lossy.discard(index)
            for slot in self.layers[index]:
                free_storage(slot)
        if index not in self._pending and all(_is_whole(s) for s in self.layers[index]):
            if not exact:
                self._float8.fill_from_whole(self.layers[index], self.before_gather)
            return
        self._start(index, exact)
        if index not in self._pending:
            return
        pending = self._pending.pop(index)
        if pending.work is not None:
            pending.work.wait()
        grid = pending.buffer.view(-1, pending.width) if pending.buffer is not None else None
        offset = 0
        for slot in self.layers[index]:
            storage = slot.param.untyped_storage()
            nbytes = slot.numel * slot.param.element_size()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
            _refilled(slot.param)
            if grid is None:
                assert slot.param_shard is not None
                full = slot.param_shard
            elif not pending.inverse:
                full = grid[:, offset : offset + slot.chunk].reshape(-1)[: slot.numel]
                offset += slot.chunk
            else:  # a byte grid: each slot's columns are its chunk in its wire dtype
                dtype = WIRE_FLOAT8 if slot in self._float8 else slot.param.dtype
                width = slot.chunk * dtype.itemsize
                full = grid[:, offset : offset + width].contiguous().view(dtype).reshape(-1)[: slot.numel]
                if id(slot) in pending.inverse:
                    fill_float8(slot, full, pending.inverse[id(slot)])
                    full = full.float() * pending.inverse[id(slot)]
                offset += width
            slot.param.data.view(-1).copy_(full)
            if slot.group_index < 0:
                self._versions[id(slot)] = slot.param._version
        if pending.inverse:
            self._lossy.add(index)
        else:
            self._lossy.discard(index)

    def _drop_pending(self, index: int) -> None:
        pending = self._pending.pop(index, None)
        if pending is not None and pending.work is not None:
            pending.work.wait()

    def shards_will_change(self) -> None:
        """Finish and drop prefetches not consumed, and forget the float8 weights' amax: the
        shards are about to change (every rank calls this at the same point: the step, a load)."""
        for index in list(self._pending):
            self._drop_pending(index)
        self._float8.forget_amax()

    def _keep_in_place_update(self, slot: ParamSlot) -> None:
        """Write a frozen parameter changed in place while whole back into its shard.

        Its version is recorded while it is whole (from the gather to this call), so a
        parameter freed already has none.
        """
        version = self._versions.pop(id(slot), None)
        if version is not None and version != slot.param._version and slot.param_shard is not None:
            slot.param_shard.copy_(slot.flat_param()[slot.start : slot.end])

    def free(self, index: int) -> None:
        for slot in self._frozen_of[index]:
            if index not in self._lossy:  # a float8 round trip is no in-place update
                self._keep_in_place_update(slot)
        for slot in self.layers[index]:
            free_storage(slot)
        self._lossy.discard(index)

    def free_frozen(self, index: int) -> None:
        """Free layer ``index``'s frozen parameters (its backward is done)."""
        if self.reshard_after_forward:
            for slot in self._frozen_of[index]:
                self._keep_in_place_update(slot)
                free_storage(slot)

    def gather_all(self) -> None:
        """Every layer whole in its parameters' own dtype (exact, float8 all-gathers or not)."""
        for index in range(len(self.layers)):
            self.gather(index, exact=True)

    def free_all(self) -> None:
        for index in range(len(self.layers)):
            self.free(index)

    @contextmanager
    def whole(self, params: Collection[torch.Tensor]) -> Iterator[None]:
        """The layers holding any of ``params`` whole (exact) inside the block, and freed after it;
        a frozen parameter changed in place there is written back into its shard. Every rank of
        the shard group enters it with the same parameters."""
        wanted = {id(p) for p in params}
        indices = [i for i, layer in enumerate(self.layers) if any(id(s.param) in wanted for s in layer)]
        for index in indices:
            self.gather(index, exact=True)
        try:
            yield
        finally:
            for index in indices:
                self.free(index)

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Every parameter whole inside the block. Read-only for trained parameters (the owned shards and
        masters are the truth; see ``sync_from_parameters``); a frozen one changed in place is written back."""
        self.gather_all()
        try:
            yield
        finally:
            self.free_all()

    # ----------------------------------------------------------------- hooks
    # The hooks hold the gatherer weakly (see weak_hook).
    def _pre_forward(self, index: int) -> Callable[[torch.nn.Module, tuple[object, ...]], None]:
        def hook(gatherer: ParameterGatherer, module: torch.nn.Module, args: tuple[object, ...]) -> None:
            gatherer.gather(index)
            if in_backward():  # a recomputation goes on backwards
                return
            gatherer._start(index + 1)  # prefetch: overlaps the next layer's gather with this layer
            inputs = [t for t in _iter_tensors(args) if t.requires_grad]
            if torch.is_grad_enabled() and inputs and gatherer._frozen_of[index]:
                done = weak_hook(gatherer, lambda g, grads: g.free_frozen(index))
                torch.autograd.graph.register_multi_grad_hook(inputs, done)

        return weak_hook(self, hook)

    def _post_forward(self, index: int) -> Callable[[torch.nn.Module, tuple[object, ...], object], None]:
        def hook(
            gatherer: ParameterGatherer, module: torch.nn.Module, args: tuple[object, ...], output: object
        ) -> None:
            if in_backward():  # a checkpointed recomputation: the backward reads these parameters next
                return
            if gatherer.reshard_after_forward:
                gatherer.free(index)
            if not torch.is_grad_enabled():
                return
            prefetched = [False]

            def regather(gatherer: ParameterGatherer, grad: torch.Tensor) -> None:
                gatherer.gather(index)  # a no-op when whole: several outputs, or the weight pass
                if not prefetched[0]:
                    prefetched[0] = True
                    gatherer._start(index - 1)  # backward runs layers in reverse

            hook_once = weak_hook(gatherer, regather)
            for tensor in _iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(hook_once)

        return weak_hook(self, hook)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._float8.detach()


def check_sharding(optimizer: OptimizerConfig, topology: TopologyConfig) -> None:
    """Refuse an HSDP layout the optimizer cannot run (before any process group starts).

    Raises:
        ValueError: ``data_parallel_shard_size`` set below ``data_parallel_size`` with a
            ZeRO stage other than 3, or set to 1.
    """
    shard, dp = topology.data_parallel_shard_size, topology.data_parallel_size
    if shard is None or dp is None or shard == dp:
        return
    if shard == 1:
        raise ValueError(
            "topology.data_parallel_shard_size=1 shards nothing (every DP rank a replica): leave it unset and use "
            "optimizer.zero_stage=0 for plain data parallelism"
        )
    if optimizer.zero_stage != 3:
        raise ValueError(
            f"topology.data_parallel_shard_size={shard} (HSDP: shard over {shard} ranks, replicate "
            f"{dp // shard} times) needs optimizer.zero_stage=3, got zero_stage={optimizer.zero_stage}; set "
            "zero_stage=3, or leave data_parallel_shard_size unset"
        )


def check_zero3(zero_stage: int, modules: Sequence[torch.nn.Module] | None) -> None:
    """Refuse ZeRO-3 arguments that do not work."""
    if zero_stage != 3 and modules is not None:
        raise ValueError(f"zero3_modules is only used with zero_stage=3, got zero_stage={zero_stage}")


def zero3_units(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules ZeRO-3 gathers one at a time: ``model.layer_modules()`` (a ``ParallelModule``'s
    layers) or the given sequence of modules.

    Raises:
        ValueError: ``model`` is a module that does not name its layers.
    """
    if isinstance(model, torch.nn.Module):
        layer_modules = getattr(model, "layer_modules", None)
        if layer_modules is None:
            raise ValueError(
                f"zero_stage=3 needs the layers in forward order, and {type(model).__name__} does not name them "
                "(it has no layer_modules()); pass zero3_modules=[layer, ...] to Optimizer, or use a ParallelModule"
            )
        return list(layer_modules())
    return list(model)


def check_own_storage(slot: ParamSlot) -> None:
    if not _is_whole(slot):
        raise ValueError(
            f"zero_stage=3: parameter {slot.name!r} shares its storage with other tensors; ZeRO-3 frees each "
            "parameter's storage between uses, so every parameter needs its own (clone it)"
        )
