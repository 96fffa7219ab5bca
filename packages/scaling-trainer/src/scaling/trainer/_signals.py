"""SIGTERM/SIGINT: every rank agrees at the next step boundary, saves, and exits.

A handler only sets a flag. At each step boundary the ranks all-reduce (MAX) the flag
over the default group, so a signal delivered to one rank (a scheduler's preemption
notice, a Ctrl-C on one node) stops every rank after the same step. The trainer then
saves a checkpoint and exits with ``128 + signal number`` (143 for SIGTERM, 130 for
SIGINT), the shell convention, so launchers see an interrupted run, not a success.

A rank that cannot reach the step boundary (stuck in a collective with a dead peer, or
hung) would ignore the signal; so the handler also arms a watchdog: if the ranks have not
agreed on the signal within ``grace_seconds`` (the collective timeout), the process exits
at once with the same code. torchrun's teardown SIGTERM thus ends a stuck rank promptly,
and the rank first writes its collective diagnostics file (step, last collectives) when
the recorder has a directory (the trainer's ``diagnostics_dir``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import types
from collections.abc import Callable

import torch
import torch.distributed as dist

from scaling.collectives import all_reduce, get_recorder

#: What ``signal.signal`` returns and takes back: a handler, ``SIG_DFL``/``SIG_IGN``, or None.
SignalHandler = Callable[[int, types.FrameType | None], object] | int | None

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code_for(signum: int) -> int:
    """The process exit code after a graceful stop on ``signum``."""
    return 128 + int(signum)


class SignalWatcher:
    """Records SIGTERM/SIGINT and lets all ranks agree on them at step boundaries."""

    def __init__(self, device: torch.device, grace_seconds: float) -> None:
        self.device = device
        self.grace_seconds = grace_seconds
        self.received: int = 0
        self._previous: dict[int, SignalHandler] = {}
        self._watchdog: threading.Timer | None = None

    def install(self) -> SignalWatcher:
        for sig in HANDLED_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        self.disarm()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self.received = int(signum)
        if self._watchdog is None:
            self._watchdog = threading.Timer(self.grace_seconds, self._force_exit, args=(int(signum),))
            self._watchdog.daemon = True
            self._watchdog.start()

    def _force_exit(self, signum: int) -> None:
        message = (
            f"scaling: signal {signum} received but the ranks did not reach a step boundary within "
            f"{self.grace_seconds:.0f} s (a rank is stuck or dead); exiting with {exit_code_for(signum)} without saving"
        )
        try:
            path = get_recorder().write_diagnostics(message.removeprefix("scaling: "))
        except OSError as exc:  # exiting matters more than the file
            path, message = None, f"{message} (could not write the diagnostics file: {exc})"
        if path is not None:
            message = f"{message}; diagnostics: {path}"
        print(message, file=sys.stderr, flush=True)
        os._exit(exit_code_for(signum))

    def disarm(self) -> None:
        """Cancel the watchdog (the ranks agreed; the graceful stop is under way)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def agreed_signal(self) -> int:
        """The signal any rank received (0 if none); collective over the default group."""
        flag = torch.tensor([self.received], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Recorded and diagnosed like every other collective: a rank that never reaches this
            # step boundary is named (CollectiveTimeoutError), not a bare backend timeout.
            all_reduce(flag, dist.group.WORLD, op=dist.ReduceOp.MAX)
        return int(flag.item())
