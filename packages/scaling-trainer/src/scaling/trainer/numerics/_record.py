"""Recording what a trainer's steps compute, in the layout-independent frame.

Per step, on every rank:

- each module's forward **outputs** and the **gradients of its inputs** (the gradient its
  backward produced), as sums over the global batch: the L2 and L1 norms and the largest
  magnitude. An activation's layout (batch over DP, sequence over CP and SP, zigzag order,
  hidden over TP, vocabulary padding) is nowhere in metadata, but these sums do not depend
  on it: the ranks' pieces are disjoint except for copies a TP group holds alike, which are
  counted once (identical sums on TP peers), and padding adds nothing.
- each trainable parameter's **gradient** after the data-parallel reduction (before
  unscaling by the loss scale, which is divided out here, and before clipping), and each
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
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist

from scaling.collectives import all_gather, get_recorder

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from scaling.optim._slots import ParamSlot
    from scaling.trainer._trainer import BaseTrainer

_T = TypeVar("_T")
_Call = tuple[float, float, float, tuple[int, ...]]  # one call's local (‖x‖₂², ‖x‖₁, max |x|, shape)
#: What a rank sends rank 0 per step: its TP group, calls, first-seen order, collectives, gradients.
_Payload = tuple[
    tuple[int, ...],
    dict[tuple[str, str], list[_Call]],
    dict[tuple[str, str], int],
    dict[tuple[str, str], dict[str, int]],
    dict[str, torch.Tensor],
]
OUTPUT = "output"
INPUT_GRAD = "input gradient"
_CONSUMERS = "_numerics_consumers"  # on an input tensor: the modules that took it, innermost first
_LAYER = re.compile(r"^layers\.(\d+)")


class Stats(NamedTuple):
    """Sums over the global batch of one module quantity: ``‖x‖₂``, ``‖x‖₁`` and ``max |x|``."""

    l2: float
    l1: float
    max_abs: float


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


class NumericsRecorder:
    """Hooks a :class:`~scaling.trainer.BaseTrainer`'s model and optimizer and records its steps.

    Args:
        trainer: a built trainer (its model is a ``ParallelModule``, its optimizer a
            ``scaling.optim.Optimizer``); nothing of it changes but the hooks added.
        layout: a description stored in the trace (default: the topology's sizes).

    Example::

        trace = NumericsRecorder(trainer).run(steps=2)  # a Trace on global rank 0, None elsewhere
    """

    # Any: a trainer of any app's context (the recorder reads its model, optimizer and topology only).
    def __init__(self, trainer: BaseTrainer[Any], layout: str | None = None) -> None:
        self.trainer = trainer
        topology = trainer.context.topology
        self.tp = topology.axis("tp")
        self.rank = topology.global_rank
        sizes = {a: topology.axis(a).size for a in ("dp", "tp", "pp", "cp", "ep")}
        self.layout = layout or " ".join(f"{a}{n}" for a, n in sizes.items() if n > 1) or "one process"
        self.module = trainer.parallel_module
        self._handles: list[RemovableHandle] = []
        self._calls: dict[tuple[str, str], list[_Call]] = {}
        self._order: dict[tuple[str, str], int] = {}
        self._collectives: dict[tuple[str, str], dict[str, int]] = {}
        self._open: list[dict[tuple[str, str], int]] = []
        self._names: list[str] = []  # the modules whose forward is running, innermost last
        self._uses: dict[str, int] = {}
        self._since_backward: dict[tuple[str, str], int] = {}
        self._gradients: dict[str, torch.Tensor] = {}
        # A tied weight's copies on later stages (``layers.{N}.embedding.weight``) are the first one's.
        self._copies = {k for k, others in self.module.tied_copies().items()
                        if any(_layer_index(o) < _layer_index(k) for o in others)}  # fmt: skip
        # A rank's loss is its own micro-batches' mean (times the loss scale); the DP × CP average of
        # the parameters' gradients divides by the ranks. Activation gradients are brought to one
        # process's scale by the same factor.
        self._dp_cp = topology.axis("dp_cp").size
        self._grad_factor = 1.0

    # ------------------------------------------------------------------ hooks
    def _note(self, kind: str, name: str, t: torch.Tensor, collectives: dict[str, int], factor: float = 1.0) -> None:
        key = (kind, name)
        self._order.setdefault(key, len(self._order))
        l2sq, l1, max_abs, shape = _local_stats(t)
        self._calls.setdefault(key, []).append((l2sq * factor * factor, l1 * factor, max_abs * factor, shape))
        merged = self._collectives.setdefault(key, {})
        for op, n in collectives.items():
            merged[op] = merged.get(op, 0) + n

    def _pre_hook(self, name: str) -> Callable[[torch.nn.Module, tuple[object, ...], dict[str, object]], None]:
        def hook(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            if _recomputing():
                return
            if _LAYER.fullmatch(name):  # a layer's forward begins: its modules' calls are counted anew
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
        """Each optimizer slot's logical tensor from this rank's owned elements ``tensors[i]``."""
        dp = self.trainer.optimizer.data_parallel
        whole = dp.whole_matrices()
        out: dict[str, torch.Tensor] = {}
        for i, (slot, owned) in enumerate(zip(dp.slots, tensors)):
            full = whole.gather(i, owned.reshape(-1), None)
            assert full is not None
            meta = slot.meta
            if meta.parallel_dim is not None:  # a padded vocabulary's rows beyond the logical size
                full = full.narrow(meta.parallel_dim, 0, meta.logical_shape[meta.parallel_dim])
            if meta.key not in self._copies:
                out[meta.key] = full.detach().float().cpu() / divide
        return out

    def _observe_gradients(self, slots: Sequence[ParamSlot], grads: list[torch.Tensor]) -> None:
        self._gradients = self._whole(grads, divide=self.trainer.optimizer.loss_scaler.scale)

    def _parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of this rank's stage, whole: the trainable ones as the optimizer updates
        them (fp32 masters under mixed precision), the frozen ones (an expert bias) as the model holds them."""
        self.trainer.wait_for_parameters()
        with torch.no_grad():
            out = self._whole([slot.work_param() for slot in self.trainer.optimizer.data_parallel.slots])
            with self.trainer.whole_parameters():
                for _, param, meta in self.module.named_parameters_with_meta():
                    if param.requires_grad or meta.key in self._copies:
                        continue
                    t = param.detach()
                    if meta.is_model_parallel and meta.parallel_dim is not None:
                        dim = meta.parallel_dim
                        t = all_gather(t.contiguous(), self.tp.group, dim=dim).narrow(dim, 0, meta.logical_shape[dim])
                    out[meta.key] = t.float().cpu().clone()
        return out

    def attach(self) -> None:
        for name, sub in self.module.named_modules():
            if not _LAYER.match(name) or isinstance(sub, (torch.nn.ModuleDict, torch.nn.ModuleList)):
                continue
            self._handles.append(sub.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(sub.register_forward_hook(self._hook(name), with_kwargs=True))
        self.trainer.optimizer.data_parallel.grad_observers.append(self._observe_gradients)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        observers = self.trainer.optimizer.data_parallel.grad_observers
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
                self._since_backward = get_recorder().calls_by_op_and_group()
                self._grad_factor = 1.0 / (self.trainer.optimizer.loss_scaler.scale * self._dp_cp)
                metrics = self.trainer.train_step()
                payload: _Payload = (self._tp_ranks(), self._calls, self._order, self._collectives, self._gradients)
                gathered = self._gather_objects(payload)
                after = self._gather(self._parameters())
                if trace is not None and gathered is not None and before is not None and after is not None:
                    updates = {k: after[k] - before[k] for k in after if k in before}
                    trace.steps.append(_combine(float(metrics["training/loss"]), gathered, updates))
                before = after
        finally:
            self.detach()
        return trace

    def _tp_ranks(self) -> tuple[int, ...]:
        group = self.tp.group
        return tuple(dist.get_process_group_ranks(group)) if group is not None else (self.rank,)

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


def _layer_index(name: str) -> int:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else -1


def _combine(loss: float, gathered: list[_Payload], updates: dict[str, torch.Tensor]) -> StepTrace:
    """Rank 0: the ranks' local records as one :class:`StepTrace` (TP copies counted once)."""
    by_group: dict[tuple[tuple[str, str], tuple[int, ...]], list[list[_Call]]] = {}
    order: dict[tuple[str, str], int] = {}
    collectives: dict[tuple[str, str], dict[str, int]] = {}
    gradients: dict[str, torch.Tensor] = {}
    for tp_ranks, calls, local_order, local_collectives, local_gradients in gathered:
        for key, stats in calls.items():
            by_group.setdefault((key, tp_ranks), []).append(stats)
            order.setdefault(key, local_order[key])
        for key, ops in local_collectives.items():
            merged = collectives.setdefault(key, {})
            for op, n in ops.items():
                merged[op] = max(merged.get(op, 0), n)
        for k, v in local_gradients.items():
            gradients.setdefault(k, v)
    sums: dict[tuple[str, str], list[float]] = {}
    for (key, _), members in by_group.items():
        total = sums.setdefault(key, [0.0, 0.0, 0.0])
        for call in zip(*members):  # the TP peers' records of one call
            for s in dict.fromkeys(call):  # a TP group's identical copies count once
                total[0] += s[0]
                total[1] += s[1]
                total[2] = max(total[2], s[2])

    def position(key: tuple[str, str]) -> tuple[int, int, int]:
        kind, name = key
        layer = _layer_index(name)
        return (0, layer, order[key]) if kind == OUTPUT else (1, -layer, order[key])

    activations = {k: Stats(sums[k][0] ** 0.5, sums[k][1], sums[k][2]) for k in sorted(sums, key=position)}
    return StepTrace(loss, activations, {k: collectives.get(k, {}) for k in activations}, gradients, updates)
