"""Recording what a training setup's steps compute, in the layout-independent frame.

A ``BaseTrainer`` (both apps) or the high-level API's model and optimizer. Per step, on every rank:

- each module's forward **outputs** and the **gradients of its inputs** (the gradient its
  backward produced), as sums over the global batch: the L2 and L1 norms and the largest
  magnitude. An activation's layout (batch over DP, sequence over CP and SP, zigzag order,
  hidden over TP, vocabulary padding) is nowhere in metadata, but these sums do not depend
  on it: the ranks' pieces are disjoint except for identical records, counted once (a TP
  group's copies; what does not depend on the batch, however many ranks and micro-batches
  computed it), and padding adds nothing.
- each trainable parameter's **gradient** after the data-parallel reduction (before
  unscaling by the loss scale, which is divided out here, and before clipping; where the
  user's torch optimizer updates, as its ``step`` begins), and each
  parameter's **update** (its value after the step minus before, frozen ones such as an
  aux-loss-free expert bias too): whole tensors, gathered through the parameters'
  ``ParameterMeta`` (ZeRO shards, TP splits, expert placement).
- the collectives each module's forward issued and the collectives issued between two
  backward events (from the collective recorder).

Everything is sent to global rank 0 at the end of each step (``gather_object``), which
builds the :class:`Trace`. Meant for a few steps of a small model: it keeps whole
gradients and updates on rank 0 and synchronises with the host for every module call.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist

from scaling.collectives import all_gather, get_recorder

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from scaling.nn import ParameterMeta
    from scaling.optim import Optimizer
    from scaling.optim._slots import ParamSlot
    from scaling.topology import Topology
    from scaling.trainer._trainer import BaseTrainer
    from scaling.trainer.auto import ParallelModel, ParallelOptimizer

_T = TypeVar("_T")
_Call = tuple[float, float, float, tuple[int, ...]]  # one call's local (‖x‖₂², ‖x‖₁, max |x|, shape)
#: What a rank sends rank 0 per step: its calls, their first-seen order, collectives, gradients.
_Payload = tuple[
    dict[tuple[str, str], list[_Call]],
    dict[tuple[str, str], tuple[int, int]],
    dict[tuple[str, str], dict[str, int]],
    dict[str, torch.Tensor],
]
OUTPUT = "output"
INPUT_GRAD = "input gradient"
_CONSUMERS = "_numerics_consumers"  # on an input tensor: the modules that took it, innermost first
_LAYERS = r"^layers\.(\d+)"  # a ParallelModule's blocks: layers.{i}
_AFTER = 1 << 30  # the block index given to modules after the last block (a final norm, a head)


class Stats(NamedTuple):
    """Sums over the global batch of one module quantity: ``‖x‖₂``, ``‖x‖₁``, ``max |x|``, and how
    many elements they cover (``elements``)."""

    l2: float
    l1: float
    max_abs: float
    elements: float = 0.0


@dataclass
class StepTrace:
    """What one step computed. ``activations`` is keyed ``(quantity, name)`` in execution order
    (outputs forward, input gradients backward); ``collectives`` names, for the same keys, the
    ``(op, group) -> calls`` that ran in them on any rank; ``gradients`` and ``updates`` are whole
    tensors by ``ParameterMeta.key``."""

    loss: float
    activations: dict[tuple[str, str], Stats]
    collectives: dict[tuple[str, str], dict[str, int]]
    gradients: dict[str, torch.Tensor]
    updates: dict[str, torch.Tensor]


@dataclass
class Trace:
    """A recorded run: its precision (the least precise of its parameters' dtypes, or
    ``float8``), a description of its layout and its steps."""

    precision: str
    layout: str
    steps: list[StepTrace] = field(default_factory=list)

    def save(self, path: str) -> None:
        """Plain containers, strings, numbers and tensors: :meth:`load` reads them with
        ``torch.load(weights_only=True)``, so a trace file cannot run code."""
        steps = [{**vars(s), "activations": {k: tuple(v) for k, v in s.activations.items()}} for s in self.steps]
        torch.save({"precision": self.precision, "layout": self.layout, "steps": steps}, path)

    @classmethod
    def load(cls, path: str) -> Trace:
        raw = torch.load(path, weights_only=True)
        steps = [StepTrace(**{**s, "activations": {k: Stats(*v) for k, v in s["activations"].items()}})
                 for s in raw["steps"]]  # fmt: skip
        return cls(raw["precision"], raw["layout"], steps)


def _tensors(obj: object, place: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The floating tensors inside a module's inputs or outputs (tuples, lists, dicts,
    dataclasses), each with its place (``""`` for a lone tensor, else e.g. ``"0"``, ``"logits"``)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield place, obj
        return
    if isinstance(obj, (tuple, list)):
        children: list[tuple[object, object]] = list(enumerate(obj))
    elif isinstance(obj, dict):
        children = list(obj.items())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    else:
        return
    for k, v in children:
        yield from _tensors(v, f"{place}/{k}" if place else str(k))


def _named(module: str, place: str) -> str:
    return f"{module}/{place}" if place else module


def _local_stats(t: torch.Tensor) -> _Call:
    x = t.detach().double()
    if x.numel() == 0:
        return 0.0, 0.0, 0.0, tuple(t.shape)
    return float((x * x).sum()), float(x.abs().sum()), float(x.abs().max()), tuple(t.shape)


def _recomputing() -> bool:
    """True while autograd runs a backward (activation checkpointing recomputes a forward there)."""
    return torch._C._current_graph_task_id() != -1


def _calls_since(before: dict[tuple[str, str], int]) -> dict[str, int]:
    now = get_recorder().calls_by_op_and_group()
    return {f"{op} on {group}": n - before.get((op, group), 0) for (op, group), n in now.items()
            if n != before.get((op, group), 0)}  # fmt: skip


def precision_of(module: torch.nn.Module) -> str:
    """``float8`` when a layer computes in float8, else the least precise parameter dtype's name."""
    if any(getattr(m, "float8", None) is not None for m in module.modules()):
        return "float8"
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    for dtype in (torch.float16, torch.bfloat16):
        if dtype in dtypes:
            return str(dtype).removeprefix("torch.")
    return "float32"


@dataclass
class _Parts:
    """What the recorder needs of a training setup (a ``BaseTrainer``'s, or the high-level API's)."""

    module: torch.nn.Module  # hooked; its module names are the trace's names
    topology: Topology
    step: Callable[[], float]  # one optimizer step; its loss
    named_parameters_with_meta: Callable[[], Iterable[tuple[str, torch.nn.Parameter, ParameterMeta]]]
    whole_parameters: Callable[[], AbstractContextManager[None]]
    engine: Optimizer | None  # scaling.optim's optimizer, or None where a torch optimizer updates
    torch_optimizer: torch.optim.Optimizer | None = None
    layers: str = _LAYERS  # the regex of a block's module path; group 1 is its index
    copies: frozenset[str] = frozenset()  # a tied weight's later copies (its first key is recorded)


class NumericsRecorder:
    """Hooks a training setup's model and optimizer and records its steps.

    Args:
        trainer: a built :class:`~scaling.trainer.BaseTrainer` (its model a ``ParallelModule``, its
            optimizer a ``scaling.optim.Optimizer``); nothing of it changes but the hooks added.
            For the high-level API use :meth:`of_model`.
        layout: a description stored in the trace (default: the topology's sizes).

    Example::

        trace = NumericsRecorder(trainer).run(steps=2)  # a Trace on global rank 0, None elsewhere
    """

    # Any: a trainer of any app's context (the recorder reads its model, optimizer and topology only).
    def __init__(self, trainer: BaseTrainer[Any], layout: str | None = None) -> None:
        module = trainer.parallel_module
        copies = frozenset(k for k, others in module.tied_copies().items()
                           if any((_block_of(_LAYERS, o) or 0) < (_block_of(_LAYERS, k) or 0) for o in others))  # fmt: skip

        def step() -> float:
            return float(trainer.train_step()["training/loss"])

        def whole() -> AbstractContextManager[None]:
            trainer.wait_for_parameters()
            return trainer.whole_parameters()

        parts = _Parts(module, trainer.context.topology, step, module.named_parameters_with_meta, whole,
                       trainer.optimizer, copies=copies)  # fmt: skip
        self._setup(parts, layout)

    @classmethod
    def of_model(
        cls, model: ParallelModel, optimizer: ParallelOptimizer, step: Callable[[], float], layout: str | None = None
    ) -> NumericsRecorder:
        """A recorder of the high-level API: ``model`` and ``optimizer`` from ``parallelize``, and
        ``step()`` running one step of the user's loop (``zero_grad``, ``model(batch)``, ``backward``,
        ``optimizer.step()``) and returning its loss (``model.global_loss(loss)``). Module names are
        the unmodified model's (``model.layers.0.self_attn``), blocks found as ``parallelize`` finds them."""
        from scaling.trainer.auto._split import find_blocks

        blocks = model.plan.blocks_path
        if not blocks:
            try:
                blocks = find_blocks(model.module)[0]
            except ValueError:  # no ModuleList: no blocks, the modules in their order
                blocks = ""
        pattern = rf"^{re.escape(blocks)}\.(\d+)" if blocks else r"(?!)"
        torch_optimizer = optimizer.optimizer if optimizer.engine is None else None
        parts = _Parts(model.module, model.topology, step, model.named_parameters_with_meta, model.full_parameters,
                       optimizer.engine, torch_optimizer, pattern)  # fmt: skip
        recorder = cls.__new__(cls)
        recorder._setup(parts, layout)
        return recorder

    def _setup(self, parts: _Parts, layout: str | None) -> None:
        self.parts = parts
        topology = parts.topology
        self.tp = topology.axis("tp")
        self.rank = topology.global_rank
        sizes = {a: topology.axis(a).size for a in ("dp", "tp", "pp", "cp", "ep")}
        self.layout = layout or " ".join(f"{a}{n}" for a, n in sizes.items() if n > 1) or "one process"
        self.module = parts.module
        self._layers = re.compile(parts.layers)
        self._handles: list[RemovableHandle] = []
        self._calls: dict[tuple[str, str], list[_Call]] = {}
        self._order: dict[tuple[str, str], tuple[int, int]] = {}
        self._collectives: dict[tuple[str, str], dict[str, int]] = {}
        self._open: list[dict[tuple[str, str], int]] = []
        self._names: list[str] = []  # the modules whose forward is running, innermost last
        self._uses: dict[str, int] = {}
        self._in_blocks = {OUTPUT: False, INPUT_GRAD: False}
        self._since_backward: dict[tuple[str, str], int] = {}
        self._gradients: dict[str, torch.Tensor] = {}
        # A rank's loss is its own micro-batches' mean (times the loss scale); the DP × CP average of
        # the parameters' gradients divides by the ranks. Activation gradients are brought to one
        # process's scale by the same factor.
        self._dp_cp = topology.axis("dp_cp").size
        self._grad_factor = 1.0

    def _loss_scale(self) -> float:
        engine = self.parts.engine
        return engine.loss_scaler.scale if engine is not None else 1.0

    # ------------------------------------------------------------------ hooks
    def _note(self, kind: str, name: str, t: torch.Tensor, collectives: dict[str, int], factor: float = 1.0) -> None:
        key = (kind, name)
        if key not in self._order:
            block = _block_of(self._layers, name)
            if block is None:  # outside the blocks: before them (embeddings) or after (final norm, head)
                before = not self._in_blocks[kind] if kind == OUTPUT else self._in_blocks[kind]
                block = -1 if before else _AFTER
            else:
                self._in_blocks[kind] = True
            self._order[key] = (block, len(self._order))
        l2sq, l1, max_abs, shape = _local_stats(t)
        self._calls.setdefault(key, []).append((l2sq * factor * factor, l1 * factor, max_abs * factor, shape))
        merged = self._collectives.setdefault(key, {})
        for op, n in collectives.items():
            merged[op] = merged.get(op, 0) + n

    def _pre_hook(self, name: str) -> Callable[[torch.nn.Module, tuple[object, ...], dict[str, object]], None]:
        def hook(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            if _recomputing():
                return
            if self._layers.fullmatch(name):  # a block's forward begins: its modules' calls are counted anew
                self._uses.clear()
            uses = self._uses[name] = self._uses.get(name, 0) + 1
            called = name if uses == 1 else f"{name}#{uses}"  # a module called twice in a layer (a dropout)
            self._names.append(called)
            self._open.append(get_recorder().calls_by_op_and_group())
            inputs = {str(i): a for i, a in enumerate(args)} if len(args) > 1 else {"": args[0]} if args else {}
            for place, t in _tensors({**inputs, **kwargs}):
                if t.requires_grad:
                    # One hook per tensor, naming its consumers innermost first: the module whose
                    # backward made the gradient is named before the modules around it.
                    consumers = getattr(t, _CONSUMERS, None)
                    if consumers is None:
                        consumers = []
                        setattr(t, _CONSUMERS, consumers)
                        t.register_hook(self._grad_hook(consumers))
                    consumers.insert(0, _named(called, place))

        return hook

    def _grad_hook(self, consumers: list[str]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            since = _calls_since(self._since_backward)
            self._since_backward = get_recorder().calls_by_op_and_group()
            for name in consumers:
                self._note(INPUT_GRAD, name, grad, since, self._grad_factor)

        return hook

    def _hook(self, name: str) -> Callable[[torch.nn.Module, tuple[object, ...], dict[str, object], object], None]:
        def hook(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object], output: object) -> None:
            if _recomputing():
                return
            calls = _calls_since(self._open.pop())
            called = self._names.pop()
            for place, t in _tensors(output):
                self._note(OUTPUT, _named(called, place), t, calls)

        return hook

    def _whole(self, tensors: Sequence[torch.Tensor], divide: float = 1.0) -> dict[str, torch.Tensor]:
        """Each of the engine's slots' logical tensor from this rank's owned elements ``tensors[i]``."""
        assert self.parts.engine is not None
        dp = self.parts.engine.data_parallel
        whole = dp.whole_matrices()
        out: dict[str, torch.Tensor] = {}
        for i, (slot, owned) in enumerate(zip(dp.slots, tensors)):
            full = whole.gather(i, owned.reshape(-1), None)
            assert full is not None
            meta = slot.meta
            if meta.parallel_dim is not None:  # a padded vocabulary's rows beyond the logical size
                full = full.narrow(meta.parallel_dim, 0, meta.logical_shape[meta.parallel_dim])
            if meta.key not in self.parts.copies:
                out[meta.key] = full.detach().float().cpu() / divide
        return out

    def _whole_params(self, grads: bool, trainable: bool) -> dict[str, torch.Tensor]:
        """Each parameter's value (or gradient) as this rank holds it, its TP pieces joined."""
        out: dict[str, torch.Tensor] = {}
        for _, param, meta in self.parts.named_parameters_with_meta():
            if param.requires_grad != trainable or meta.key in self.parts.copies:
                continue
            t = param.grad if grads else param.detach()
            if t is None:
                t = torch.zeros_like(param)
            if meta.is_model_parallel and meta.parallel_dim is not None:
                dim = meta.parallel_dim
                t = all_gather(t.contiguous(), self.tp.group, dim=dim).narrow(dim, 0, meta.logical_shape[dim])
            out[meta.key] = t.detach().float().cpu().clone()
        return out

    def _observe_gradients(self, slots: Sequence[ParamSlot], grads: list[torch.Tensor]) -> None:
        self._gradients = self._whole(grads, divide=self._loss_scale())

    def _observe_torch_step(self, optimizer: object, args: object, kwargs: object) -> None:
        """The user's torch optimizer is about to step: its gradients are reduced (no engine)."""
        with torch.no_grad():
            self._gradients = self._whole_params(grads=True, trainable=True)

    def _parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of this rank, whole: the trainable ones as the optimizer updates them (the
        engine's fp32 masters under mixed precision), the frozen ones (an expert bias) as the model holds them."""
        engine = self.parts.engine
        with torch.no_grad():
            out = self._whole([s.work_param() for s in engine.data_parallel.slots]) if engine is not None else {}
            with self.parts.whole_parameters():
                if engine is None:
                    out.update(self._whole_params(grads=False, trainable=True))
                out.update(self._whole_params(grads=False, trainable=False))
        return out

    def attach(self) -> None:
        """Install the hooks (:meth:`run` does it and removes them after)."""
        for name, sub in self.module.named_modules():
            if not name or isinstance(sub, (torch.nn.ModuleDict, torch.nn.ModuleList)):
                continue
            self._handles.append(sub.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(sub.register_forward_hook(self._hook(name), with_kwargs=True))
        if self.parts.engine is not None:
            self.parts.engine.data_parallel.grad_observers.append(self._observe_gradients)
        elif self.parts.torch_optimizer is not None:
            self._handles.append(self.parts.torch_optimizer.register_step_pre_hook(self._observe_torch_step))

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.parts.engine is not None:
            observers = self.parts.engine.data_parallel.grad_observers
            if self._observe_gradients in observers:
                observers.remove(self._observe_gradients)

    # ------------------------------------------------------------------ steps
    def run(self, steps: int) -> Trace | None:
        """Train ``steps`` steps with the hooks on; the :class:`Trace` on global rank 0, None elsewhere."""
        trace = Trace(precision_of(self.module), self.layout) if self.rank == 0 else None
        before = self._gather(self._parameters())
        self.attach()
        try:
            for _ in range(steps):
                self._calls, self._order, self._collectives, self._gradients = {}, {}, {}, {}
                self._in_blocks = {OUTPUT: False, INPUT_GRAD: False}
                self._since_backward = get_recorder().calls_by_op_and_group()
                self._grad_factor = 1.0 / (self._loss_scale() * self._dp_cp)
                loss = self.parts.step()
                payload: _Payload = (self._calls, self._order, self._collectives, self._gradients)
                gathered = self._gather_objects(payload)
                after = self._gather(self._parameters())
                if trace is not None and gathered is not None and before is not None and after is not None:
                    updates = {k: after[k] - before[k] for k in after if k in before}
                    trace.steps.append(_combine(loss, gathered, updates))
                before = after
        finally:
            self.detach()
        return trace

    def _gather_objects(self, payload: _T) -> list[_T] | None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [payload]
        out: list[object] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(payload, out, dst=0)
        return cast("list[_T] | None", out)

    def _gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        parts = self._gather_objects(tensors)
        if parts is None:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        return merged


def _block_of(pattern: str | re.Pattern[str], name: str) -> int | None:
    """The block index in ``name`` (``layers.3.mlp`` -> 3), or None outside the blocks."""
    match = re.match(pattern, name)
    return int(match.group(1)) if match else None


def _combine(loss: float, gathered: list[_Payload], updates: dict[str, torch.Tensor]) -> StepTrace:
    """Rank 0: the ranks' local records as one :class:`StepTrace`. Identical records of one module
    (the same sums and shape) count once: a TP group's copies, and what does not depend on the
    batch (a rotary table, a mask) however many ranks and micro-batches computed it."""
    records: dict[tuple[str, str], dict[_Call, None]] = {}
    order: dict[tuple[str, str], tuple[int, int]] = {}
    collectives: dict[tuple[str, str], dict[str, int]] = {}
    gradients: dict[str, torch.Tensor] = {}
    for calls, local_order, local_collectives, local_gradients in gathered:
        for key, stats in calls.items():
            records.setdefault(key, {}).update(dict.fromkeys(stats))
            order.setdefault(key, local_order[key])
        for key, ops in local_collectives.items():
            merged = collectives.setdefault(key, {})
            for op, n in ops.items():
                merged[op] = max(merged.get(op, 0), n)
        for k, v in local_gradients.items():
            gradients.setdefault(k, v)
    sums = {
        key: (sum(c[0] for c in calls), sum(c[1] for c in calls), max(c[2] for c in calls),
              float(sum(math.prod(c[3]) for c in calls)))
        for key, calls in records.items()
    }  # fmt: skip

    def position(key: tuple[str, str]) -> tuple[int, int, int]:
        block, seen = order[key]
        return (0, block, seen) if key[0] == OUTPUT else (1, -block, seen)

    activations = {k: Stats(sums[k][0] ** 0.5, sums[k][1], sums[k][2], sums[k][3]) for k in sorted(sums, key=position)}
    return StepTrace(loss, activations, {k: collectives.get(k, {}) for k in activations}, gradients, updates)
