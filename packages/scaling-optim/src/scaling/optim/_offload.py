"""The host update of ZeRO-3 with ``cpu_offload``, run in a thread while the next step starts.

``step()`` hands the update (on the host copies) and the copy into the device shards to
:class:`HostUpdate` and returns; the next forward's first gather, and anything reading the
parameters or the optimizer state, calls :meth:`HostUpdate.wait` first. An error in the
thread is raised by that wait, on the caller's thread. Only local work runs in the thread:
collectives stay on the main thread, whose order every rank must keep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class HostUpdate:
    """At most one update in flight; :meth:`wait` joins it and re-raises its error."""

    def __init__(self) -> None:
        self._running: tuple[threading.Thread, list[BaseException]] | None = None

    @property
    def in_flight(self) -> bool:
        """An update was started and not waited for."""
        return self._running is not None

    def start(self, work: Callable[[], None]) -> None:
        """Run ``work`` in a thread (after waiting for the previous one)."""
        self.wait()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 (re-raised by wait(), on the caller's thread)
                errors.append(exc)

        thread = threading.Thread(target=run, name="scaling-offload-update", daemon=True)
        thread.start()
        self._running = (thread, errors)

    def wait(self) -> None:
        """Wait for the update in flight, if any; raise its error."""
        if self._running is not None:
            thread, errors = self._running
            thread.join()
            self._running = None
            if errors:
                raise errors[0]
