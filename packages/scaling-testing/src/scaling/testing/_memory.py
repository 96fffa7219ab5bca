"""Activation and peak bytes on any device, CPU included, from the storages torch's operators create.

CPU PyTorch keeps no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU twin), so
the planner's activation predictions are checked by watching every operator's outputs under a
``TorchDispatchMode``: a storage first seen as the output of an operator running outside a backward
pass (the autograd engine has no current node) is a forward's, held until it is freed (a weak
reference's callback). A view's or an in-place operator's output shares an input's storage and is not
new, so the model's parameters and buffers never count. ``PeakBytes`` adds the storages that exist
before (the model state, given) and keeps the most all of them held after any operator.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Storages(TorchDispatchMode):
    """The storages it watches, weakly, each counted as it is sized now (ZeRO-3 frees a gathered
    parameter by resizing its storage to 0, which no operator sees); ``_after`` sees each operator's
    arguments and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def _watch(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self._live:
            self._live[key] = weakref.ref(storage, _forget(self._live, key))

    def held(self) -> int:
        """The bytes the watched storages that live hold now."""
        # A copy: a storage freed meanwhile on another thread (a communication thread dropping its
        # buffer) removes itself from ``_live`` while this sums.
        live = [ref() for ref in list(self._live.values())]
        return sum(storage.nbytes() for storage in live if storage is not None)

    def __torch_dispatch__(
        self,
        func: Callable[..., object],
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        out = func(*args, **(kwargs or {}))
        self._after((args, kwargs), [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out

    def _after(self, arguments: object, outputs: list[torch.Tensor]) -> None:
        raise NotImplementedError


class ActivationBytes(_Storages):
    """Watch the storages forward passes create while they live.

    Attributes:
        at_backward: the most bytes the forward passes' storages held when a backward pass began
            (its first operator): the activations a backward finds, a pipeline's in-flight
            micro-batches included.

    Example::

        with ActivationBytes() as watch:
            trainer.train_step()
        watch.at_backward
    """

    def __init__(self) -> None:
        super().__init__()
        self.at_backward = 0
        self._graph_task = -1

    def _after(self, arguments: object, outputs: list[torch.Tensor]) -> None:
        if torch._C._current_autograd_node() is not None:  # in a backward pass
            if (task := torch._C._current_graph_task_id()) != self._graph_task:
                self._graph_task = task
                self.at_backward = max(self.at_backward, self.held())
            return
        inputs = {id(t.untyped_storage()) for t in tree_leaves(arguments) if isinstance(t, torch.Tensor)}
        for tensor in outputs:
            if tensor.device.type != "meta" and id(tensor.untyped_storage()) not in inputs:
                self._watch(tensor.untyped_storage())


class PeakBytes(_Storages):
    """The most bytes held after any operator run under it: the storages of ``existing`` (the model
    state: parameters, gradients, optimizer state) and every storage an operator creates, while it
    lives.

    Only weak references are kept: drop your own references to what ``existing`` held (a gradient
    the step sets to None is then freed, as in a run without the watch).

    Attributes:
        peak: the most held; ``held()``: what is held now.
    """

    def __init__(self, existing: Iterable[torch.Tensor]) -> None:
        super().__init__()
        for tensor in existing:
            self._watch(tensor.untyped_storage())
        self.peak = self.held()

    def _after(self, arguments: object, outputs: list[torch.Tensor]) -> None:
        for tensor in outputs:
            if tensor.device.type != "meta":
                self._watch(tensor.untyped_storage())
        self.peak = max(self.peak, self.held())


def _forget(live: dict[int, weakref.ref[torch.UntypedStorage]], key: int) -> Callable[[object], None]:
    def freed(_: object) -> None:
        live.pop(key, None)

    return freed
