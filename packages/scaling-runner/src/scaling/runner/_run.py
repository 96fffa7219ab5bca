"""Start the launches, stream their output, and stop the rest when one group fails.

Inside a node torchrun's elastic agent supervises the workers. Across launches (one pdsh
command per slots group) nothing else would: when one launch fails, the others get
``teardown_timeout_s`` to fail on their own (their workers lose their peers) and are then
sent SIGTERM, then SIGKILL, so the runner always returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from scaling.runner._commands import Launch
from scaling.runner._failures import FailureParser, RankFailure

_KILL_GRACE_S = 10.0
_POLL_S = 0.1


def run_launches(launches: list[Launch], teardown_timeout_s: float) -> tuple[list[int], list[RankFailure]]:
    """Run ``launches`` concurrently; return their exit codes and the rank failures torchrun reported."""
    for launch in launches:
        for path, content in launch.files:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
    parsers = [FailureParser() for _ in launches]
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    try:
        for launch, parser in zip(launches, parsers):
            proc = subprocess.Popen(
                list(launch.argv),
                env={**os.environ, **launch.env},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group, so teardown reaches torchrun's workers too
            )
            procs.append(proc)
            prefix = f"[{launch.label.split(':')[0]}] " if len(launches) > 1 else ""
            assert proc.stdout is not None and proc.stderr is not None
            for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                pump = threading.Thread(target=_pump, args=(stream, sink, prefix, parser), daemon=True)
                pump.start()
                pumps.append(pump)
        _wait(procs, teardown_timeout_s)
    except BaseException:
        _stop(procs)
        raise
    finally:
        for pump in pumps:
            pump.join(timeout=5.0)
    codes = [p.returncode for p in procs]
    failures = sorted((f for p in parsers for f in p.failures.values()), key=lambda f: f.rank)
    return codes, failures


def _pump(stream: IO[bytes], sink: IO[str], prefix: str, parser: FailureParser) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        parser.feed(line)
        sink.write(prefix + line)
        sink.flush()
    stream.close()


def _wait(procs: list[subprocess.Popen[bytes]], teardown_timeout_s: float) -> None:
    deadline: float | None = None
    while any(p.poll() is None for p in procs):
        if deadline is None and any(p.returncode not in (None, 0) for p in procs):
            deadline = time.monotonic() + teardown_timeout_s
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
