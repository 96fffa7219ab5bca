"""Start the launches, stream their output, and stop the rest when one group fails.

Inside a node torchrun's elastic agent supervises the workers. Across launches (one pdsh
command per slots group) nothing else would: when one launch fails, the others get
``teardown_timeout_s`` to fail on their own (their workers lose their peers) and are then
sent SIGTERM, then SIGKILL, so the runner always returns.

Each launch runs in its own session (so teardown reaches a whole process tree), which
also means a SIGTERM or SIGINT sent to the runner (``kill``, Ctrl-C, a scheduler's
preemption) would not reach torchrun. While the launches run, the runner therefore
forwards SIGTERM and SIGINT to every launch's process group and keeps waiting: torchrun
passes the signal to its workers, which stop at a step boundary and save (scaling's
trainer), and the runner then reports the signal (``run_launches`` returns its number).
Handlers are installed only when the runner runs in the main thread (Python's rule).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import IO

from scaling.runner._commands import Launch
from scaling.runner._failures import FailureParser, RunReport

#: What ``signal.signal`` returns and takes back: a handler, ``SIG_DFL``/``SIG_IGN``, or None.
SignalHandler = Callable[[int, types.FrameType | None], object] | int | None

_KILL_GRACE_S = 10.0
# After a forwarded signal: time for torchrun to stop its workers (its own grace is 30 s) before SIGKILL.
SIGNAL_GRACE_S = 90.0
_FORWARDED = (signal.SIGTERM, signal.SIGINT)
_POLL_S = 0.1


def run_launches(launches: list[Launch], teardown_timeout_s: float) -> tuple[list[int], RunReport, int | None]:
    """Run ``launches`` concurrently.

    Returns:
        The launches' exit codes, what their torchrun agents reported (failed ranks, agents
        stopped by a signal), and the number of the signal (SIGTERM or SIGINT) the runner
        received and forwarded, or ``None``.
    """
    for launch in launches:
        for path, content in launch.files:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
    parsers = [FailureParser() for _ in launches]
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    forwarder = _Forwarder(procs)
    forwarder.install()
    try:
        for launch, parser in zip(launches, parsers):
            if forwarder.received is not None:
                break  # stopped while starting: launch nothing more (the started ones got the signal)
            proc = subprocess.Popen(
                list(launch.argv),
                env={**os.environ, **launch.env},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group, so teardown reaches torchrun's workers too
            )
            procs.append(proc)
            forwarder.catch_up()  # a signal that arrived while this launch was being started
            prefix = f"[{launch.label.split(':')[0]}] " if len(launches) > 1 else ""
            assert proc.stdout is not None and proc.stderr is not None
            # The agents' failure reports are on stderr; a rank's prints on stdout never mix into it.
            for stream, sink, reader in ((proc.stdout, sys.stdout, None), (proc.stderr, sys.stderr, parser)):
                pump = threading.Thread(target=_pump, args=(stream, sink, prefix, reader), daemon=True)
                pump.start()
                pumps.append(pump)
            if launch.follow is not None:
                pump = threading.Thread(target=_follow, args=(Path(launch.follow), proc, prefix, parser), daemon=True)
                pump.start()
                pumps.append(pump)
        _wait(procs, teardown_timeout_s, forwarder)
    except BaseException:
        _stop(procs)
        raise
    finally:
        forwarder.uninstall()
        for pump in pumps:
            pump.join(timeout=5.0)
    codes = [p.returncode for p in procs]
    return codes, RunReport.merge(parsers), forwarder.received


class _Forwarder:
    """Passes SIGTERM / SIGINT received by the runner on to every launch's process group."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.received: int | None = None
        self.at: float | None = None
        self._previous: dict[int, SignalHandler] = {}
        self._signalled: set[int] = set()
        self._announced = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in _FORWARDED:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        # No printing here: the handler may interrupt a write to the same stream (see announce).
        if self.received is None:
            self.received, self.at = signum, time.monotonic()
        self._signalled.clear()
        self.catch_up(signum)

    def announce(self) -> None:
        """Say once, outside the handler, that a signal was received and forwarded."""
        if self.received is not None and not self._announced:
            self._announced = True
            print(
                f"scaling-run: received {signal.Signals(self.received).name}; forwarding it to the ranks and "
                f"waiting up to {SIGNAL_GRACE_S:.0f} s for them to stop",
                file=sys.stderr,
                flush=True,
            )

    def catch_up(self, signum: int | None = None) -> None:
        """Send the received signal to every running launch that has not had it yet."""
        signum = signum or self.received
        if signum is None:
            return
        for proc in self.procs:
            if proc.pid not in self._signalled and proc.poll() is None:
                self._signalled.add(proc.pid)
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass


def _show(line: str, sink: IO[str], prefix: str, parser: FailureParser | None) -> None:
    """Write an output line through, unless it is an agent's report (the parser keeps those)."""
    if parser is None or not parser.feed(line):
        sink.write(prefix + line)


def _pump(stream: IO[bytes], sink: IO[str], prefix: str, parser: FailureParser | None) -> None:
    for raw in iter(stream.readline, b""):
        _show(raw.decode(errors="replace"), sink, prefix, parser)
        sink.flush()
    stream.close()


def _follow(path: Path, proc: subprocess.Popen[bytes], prefix: str, parser: FailureParser) -> None:
    """Show and read the lines of ``path`` as they are written, until ``proc`` has ended and all are read."""
    position, partial = 0, b""
    while True:
        done = proc.poll() is not None  # read once more after the end: the job wrote its last lines first
        if path.exists():
            with path.open("rb") as f:
                f.seek(position)
                chunk = f.read()
            position += len(chunk)
            *lines, partial = (partial + chunk).split(b"\n")
            if done and partial:
                lines, partial = [*lines, partial], b""
            for raw in lines:
                _show(raw.decode(errors="replace") + "\n", sys.stdout, prefix, parser)
            sys.stdout.flush()
        if done:
            return
        time.sleep(_POLL_S * 5)


def _wait(procs: list[subprocess.Popen[bytes]], teardown_timeout_s: float, forwarder: _Forwarder) -> None:
    deadline: float | None = None
    while any(p.poll() is None for p in procs):
        if deadline is None and any(p.returncode not in (None, 0) for p in procs):
            deadline = time.monotonic() + teardown_timeout_s
        forwarder.announce()
        if forwarder.at is not None and (deadline is None or deadline > forwarder.at + SIGNAL_GRACE_S):
            deadline = forwarder.at + SIGNAL_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs)
            return
        time.sleep(_POLL_S)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each running process group, then SIGKILL what is left after a grace period."""
    for sig, grace in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        running = [p for p in procs if p.poll() is None]
        for proc in running:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace
        while any(p.poll() is None for p in running) and time.monotonic() < end:
            time.sleep(_POLL_S)
