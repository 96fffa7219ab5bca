"""The host update of ZeRO-3 with ``cpu_offload``, run in a thread while the next step starts.

``step()`` hands the update to :class:`HostUpdate` as one piece of work per layer, in
forward order (the parameters a layer gathers first: their update on the host copies and
the copy into their device shards), and returns. The next forward's gather of layer ``i``
waits only for pieces ``0..i``, so the host updates the later layers while the device
computes the earlier ones; anything reading all the parameters or the optimizer state
waits for all of it. An error in the thread is raised by the wait, on the caller's thread.
Only local work runs in the thread: collectives stay on the main thread, whose order
every rank must keep.

:class:`HostCopies` moves the data between the device and the host without stalling
either: on CUDA the gradients go into pinned host memory by non-blocking copies, each
layer's behind an event the thread waits for, and the updated values go back to the
device on a stream of the thread's own; on CPU both are plain (the host is the device).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch


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
        """Copy each host ``source`` into its device ``target``; returns once they have arrived."""
        if not self.cuda:
            for target, source in pairs:
                target.copy_(source)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            for target, source in pairs:
                target.copy_(source, non_blocking=True)
        self._stream.synchronize()
