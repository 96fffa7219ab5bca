"""SIGTERM/SIGINT: every rank agrees at the next step boundary, saves, and exits.

A handler only sets a flag. At each step boundary the ranks all-reduce (MAX) the flag
over the default group, so a signal delivered to one rank (a scheduler's preemption
notice, a Ctrl-C on one node) stops every rank after the same step. The trainer then
saves a checkpoint and exits with ``128 + signal number`` (143 for SIGTERM, 130 for
SIGINT), the shell convention, so launchers see an interrupted run, not a success.
"""

from __future__ import annotations

import signal
import types
from typing import Any

import torch
import torch.distributed as dist

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code_for(signum: int) -> int:
    """The process exit code after a graceful stop on ``signum``."""
    return 128 + int(signum)


class SignalWatcher:
    """Records SIGTERM/SIGINT and lets all ranks agree on them at step boundaries."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.received: int = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> SignalWatcher:
        for sig in HANDLED_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self.received = int(signum)

    def agreed_signal(self) -> int:
        """The signal any rank received (0 if none); collective over the default group."""
        flag = torch.tensor([self.received], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
