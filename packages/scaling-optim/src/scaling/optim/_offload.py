"""The host side of ``cpu_offload``: under ZeRO-3 the update runs in a thread while the next step starts.

``step()`` hands the update to :class:`LayeredHostUpdate`, which runs it in a
:class:`HostUpdate` thread as one piece of work per layer, in forward order (the
parameters a layer gathers first: their update on the host copies and the copy into
their device shards), and returns. The next forward's gather of layer ``i``
waits only for pieces ``0..i``, so the host updates the later layers while the device
computes the earlier ones; anything reading all the parameters or the optimizer state
waits for all of it. An error in the thread is raised by the wait, on the caller's thread.
Only local work runs in the thread: collectives stay on the main thread, whose order
every rank must keep.

:class:`HostCopies` (ZeRO 0-2 with offload use it too, without the thread) moves the data
between the device and the host without stalling either: on CUDA the gradients go into pinned host memory by non-blocking copies, each
layer's behind an event the thread waits for, and the updated values go back to the
device on a stream of the thread's own; on CPU both are plain (the host is the device).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import torch

from scaling.optim._slots import ParamSlot


class HostUpdate:
    """At most one update in flight, as pieces run in order; :meth:`wait` waits for a prefix of them."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._done, self._pieces = 0, 0  # pieces finished in the update in flight, and in all
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    @property
    def in_flight(self) -> bool:
        """An update was started and not waited for."""
        return self._thread is not None

    def start(self, pieces: Sequence[Callable[[], None]]) -> None:
        """Run ``pieces`` one after another in a thread (after waiting for the previous update)."""
        self.wait()
        self._done, self._pieces, self._error = 0, len(pieces), None

        def run() -> None:
            for piece in pieces:
                try:
                    piece()
                except BaseException as exc:  # noqa: BLE001 (re-raised by wait(), on the caller's thread)
                    with self._changed:
                        self._error = exc
                        self._changed.notify_all()
                    return
                with self._changed:
                    self._done += 1
                    self._changed.notify_all()

        self._thread = threading.Thread(target=run, name="scaling-offload-update", daemon=True)
        self._thread.start()

    def wait(self, through: int | None = None) -> None:
        """Wait until pieces ``0..through`` are done (None: all of them, and the thread); raise an error of the thread."""
        thread = self._thread
        if thread is None:
            return
        if through is not None:
            with self._changed:
                self._changed.wait_for(lambda: self._done > min(through, self._pieces - 1) or self._error is not None)
                if self._error is None:
                    return
        thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class HostCopies:
    """Device <-> host copies for the offloaded update of one step (see the module's doc).

    Args:
        device: the device the parameters and gradients live on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        # The thread's stream for the copies back to the device (made at the first): they need
        # not queue behind the next forward's kernels on the main stream.
        self._stream: torch.cuda.Stream | None = None
        # Pinned host buffers in a target's dtype (by target), for sources of another dtype.
        self._staging: dict[int, torch.Tensor] = {}

    def to_host(self, grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Start copying ``grads`` to the host; returns the host tensors and a wait for them (call it in the thread)."""
        if not self.cuda:
            return [g.cpu() for g in grads], lambda: None
        host = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in grads]
        for h, g in zip(host, grads):
            h.copy_(g, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        return host, copied.synchronize

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each host ``source`` into its device ``target``; returns once they have arrived.

        On CUDA a source of another dtype (fp32 masters of bf16 shards) is cast on the host into a
        pinned buffer of the target's dtype kept for the next steps, then copied without blocking:
        copied directly, torch would cast into pageable memory, whose copy is synchronous and
        slower, and would move twice the bytes had it cast on the device.
        """
        if not self.cuda:
            for target, source in pairs:
                target.copy_(source)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            for target, source in pairs:
                if source.dtype != target.dtype:
                    staged = self._staging.get(id(target))
                    if staged is None or staged.shape != target.shape or staged.dtype != target.dtype:
                        staged = torch.empty(target.shape, dtype=target.dtype, pin_memory=True)
                        self._staging[id(target)] = staged
                    source = staged.copy_(source)
                target.copy_(source, non_blocking=True)
        self._stream.synchronize()  # the staging buffers are free again when this returns


class LayeredHostUpdate:
    """ZeRO-3 with ``cpu_offload``: the host update of a step as one piece per layer, in a thread.

    Args:
        device: the device of the parameters and gradients.
    """

    def __init__(self, device: torch.device) -> None:
        self.thread = HostUpdate()
        self.copies = HostCopies(device)
        #: Slot indices by the first layer that gathers them, in forward order (see :meth:`order`).
        self.layers: list[list[int]] = []

    @property
    def in_flight(self) -> bool:
        return self.thread.in_flight

    def wait(self, through: int | None = None) -> None:
        """:meth:`HostUpdate.wait`: the gatherers' ``before_gather``."""
        self.thread.wait(through)

    def order(self, slots: Sequence[ParamSlot], layers: Sequence[Sequence[Sequence[ParamSlot]]]) -> None:
        """Group ``slots`` by the first layer that holds them; ``layers``: each gatherer's layers (one list of layers)."""
        first: dict[int, int] = {}
        for gatherer_layers in layers:
            for layer, members in enumerate(gatherer_layers):
                for slot in members:
                    first[id(slot)] = min(layer, first.get(id(slot), layer))
        self.layers = [[] for _ in range(max(first.values(), default=0) + 1)]
        for index, slot in enumerate(slots):
            self.layers[first.get(id(slot), 0)].append(index)

    def start(
        self,
        slots: Sequence[ParamSlot],
        grads: Sequence[torch.Tensor],
        update: Callable[[list[int], list[torch.Tensor]], None],
    ) -> None:
        """Start the update: each layer's gradients to the host now, and in the thread, layer by
        layer, ``update(slot indices, host gradients)`` and the copy of the updated master shards
        into the device shards."""
        pieces = []
        for indices in self.layers:
            host, arrived = self.copies.to_host([grads[i] for i in indices])
            shards = [(s.param_shard, s.master) for s in (slots[i] for i in indices)]
            pieces.append(functools.partial(self._piece, arrived, indices, host, update, shards))
        self.thread.start(pieces)

    def _piece(
        self,
        arrived: Callable[[], None],
        indices: list[int],
        host: list[torch.Tensor],
        update: Callable[[list[int], list[torch.Tensor]], None],
        shards: list[tuple[torch.Tensor | None, torch.Tensor | None]],
    ) -> None:
        arrived()
        update(indices, host)
        self.copies.to_device([(shard, master) for shard, master in shards if shard is not None and master is not None])
