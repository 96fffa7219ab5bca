"""runner_main: validate, hand over the payload, build the commands, run them, report failures."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from scaling.runner._commands import DEFAULT_REMOTE_PORT, Launch, build_launches, free_port
from scaling.runner._config import RunnerConfig
from scaling.runner._failures import (
    RankFailure,
    RunReport,
    first_failure,
    grouped,
    rank_list,
    signal_name,
    worst_exit_code,
)
from scaling.runner._payload import (
    PAYLOAD_INLINE_ENV,
    PAYLOAD_PATH_ENV,
    dump_payload,
    inline_payload,
    write_payload,
)
from scaling.runner._slurm import build_slurm_launch, slurm_dir

if TYPE_CHECKING:
    from scaling.config import JsonMapping


def plan(config: RunnerConfig, payload: JsonMapping | None = None) -> list[Launch]:
    """The commands :func:`runner_main` would run, without starting anything.

    The payload file (when one is used) is written so that the printed commands run as shown.

    Args:
        config: the validated runner config.
        payload: JSON-able dict handed to every process; ``None`` means ``{}``.

    Returns:
        One :class:`Launch` per command started on this machine (one per pdsh slots group).
    """
    launches, _ = _prepare(config, payload)
    return launches


def runner_main(
    config: RunnerConfig,
    payload: JsonMapping | None = None,
    *,
    dry_run: bool = False,
    exit_on_failure: bool = True,
) -> int:
    """Launch ``config.script`` on every process described by ``config`` and wait for it.

    Every process runs under torchrun, reads its rank from the torchrun environment
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...) and the payload with :func:`load_payload`.

    Args:
        config: where and how to run (see :class:`RunnerConfig`).
        payload: JSON-able dict for every process, usually ``config.as_dict()`` of the app's
            config; keys that look like secrets (``*_token``, ``*_password``) are refused.
        dry_run: print the commands per node (secrets masked) and return 0 without running.
        exit_on_failure: a failed run raises ``SystemExit`` with its exit code (so a run script
            whose last line is ``runner_main(...)`` exits non-zero); ``False`` returns the code.

    Returns:
        0 when every rank succeeded. With ``exit_on_failure=False``, else the worst exit code
        of any rank that failed on its own (shell style: 128 + N for a rank killed by signal
        N); when the runner itself receives SIGTERM or SIGINT while the ranks run, it
        forwards the signal to torchrun (which passes it to the workers: scaling's trainer
        saves and stops), waits for every process to end and returns ``128 + signal`` (143
        for SIGTERM, 130 for SIGINT).

    Raises:
        SystemExit: the run failed (its ``code`` is the exit code above) and
            ``exit_on_failure`` is true. The first failing rank and its error's last line are
            on stderr first, e.g. ``scaling-run: first failure: rank 2 (...) exited with code
            1: CheckpointError: ...``.
        ValueError: for a config without ``script``, or a payload that holds secrets or is
            too large to pass inline.

    Example::

        config = MyAppConfig.from_yaml(sys.argv[1])
        runner_main(config.runner, payload=config.as_dict())  # exits non-zero if a rank failed
    """
    launches, temp_dir = _prepare(config, payload)
    try:
        if dry_run:
            print("\n\n".join(launch.describe() for launch in launches))
            return 0
        from scaling.runner._run import run_launches

        codes, report, signum = run_launches(launches, config.teardown_timeout_s)
        code = _report(codes, report, signum)
        if code != 0 and exit_on_failure:
            raise SystemExit(code)
        return code
    finally:
        if temp_dir is not None and not dry_run:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _report(codes: list[int], report: RunReport, signum: int | None) -> int:
    """Print the run's outcome on stderr (nothing when it succeeded); return its exit code."""
    failures = report.failures
    code = worst_exit_code(failures, codes)
    if signum is None and report.stopped and not any(f.root_cause for f in failures):
        # Signalled where the agents run, not through the runner: scancel, docker stop, preemption.
        outside = max(report.stopped.values())
        code = 128 + outside
        lines = [
            f"scaling-run: the ranks on {', '.join(sorted(report.stopped))} were stopped by {signal_name(outside)} "
            f"from outside the runner (scancel, docker stop, preemption); exit code {code}"
        ]
    elif signum is not None:
        # Stopped on request: the shell convention for the signal, whatever the ranks returned.
        code = 128 + signum
        lines = [f"scaling-run: stopped by {signal_name(signum)}; exit code {code}"]
        lines += [f"scaling-run: {f.describe()}" for f in failures]
    elif code == 0:
        return 0
    else:
        # Each distinct error once: the first failure's traceback (the ranks print none of their
        # own when the runner reports them), then one line per outcome with the ranks it hit.
        first = first_failure(failures)
        lines = _tracebacks(failures, first)
        if first is not None:
            lines.append(f"scaling-run: first failure: {first.describe()}")
            alike = [f.rank for f in failures if f is not first and f.outcome() == first.outcome()]
            if alike:
                lines.append(f"scaling-run: the same error on rank{'s' if len(alike) > 1 else ''} {rank_list(alike)}")
        lines.append(f"scaling-run: the run failed with exit code {code}")
        rest = [f for f in failures if first is None or f.outcome() != first.outcome()]
        lines += [f"scaling-run: {line}" for line in grouped([f for f in rest if f.root_cause])]
        stopped = grouped([f for f in rest if not f.root_cause])
        if stopped:
            lines.append("scaling-run: then stopped or failed in consequence: " + "; ".join(stopped))
        if not failures:
            lines.append(f"scaling-run: no rank reported a failure; launch exit codes {codes}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return code


def _tracebacks(failures: list[RankFailure], first: RankFailure | None) -> list[str]:
    """One traceback per distinct error, the first failure's first (agents report a traceback for
    their node's root cause only: ranks whose collectives broke in consequence add nothing)."""
    shown: dict[str, RankFailure] = {}
    for failure in sorted((f for f in failures if f.traceback), key=lambda f: f is not first):
        shown.setdefault(failure.outcome(), failure)
    lines = []
    for failure in shown.values():
        lines.append(f"scaling-run: traceback of rank {failure.rank} (on {failure.host}):")
        lines += ["  " + line for line in (failure.traceback or "").rstrip().splitlines()]
    return lines


def _prepare(config: RunnerConfig, payload: JsonMapping | None) -> tuple[list[Launch], Path | None]:
    config.require_script()  # before any file is written or process started
    text = dump_payload(payload if payload is not None else {})
    run_id = config.run_id or f"scaling-{uuid.uuid4().hex[:12]}"
    remote = bool(config.host_specs()) or config.runner_type == "slurm"
    port = config.master_port or (DEFAULT_REMOTE_PORT if remote else free_port())
    temp_dir: Path | None = None
    if config.runner_type in ("pdsh", "pdsh_docker") and config.payload_dir is None:
        # No file reaches pdsh nodes or a container, so the payload travels in the environment.
        payload_env = {PAYLOAD_INLINE_ENV: inline_payload(text)}
    else:
        if config.runner_type == "slurm":
            directory = slurm_dir(config, run_id)  # payload_dir's, or ./.scaling-run's
        elif config.payload_dir is not None:
            directory = Path(config.payload_dir) / run_id
        else:
            temp_dir = directory = Path(tempfile.mkdtemp(prefix="scaling-run-"))
        payload_env = {PAYLOAD_PATH_ENV: str(write_payload(text, directory))}
    if config.runner_type == "slurm":
        launches = [build_slurm_launch(config, run_id, payload_env, os.environ, port)]
    else:
        launches = build_launches(config, run_id, payload_env, os.environ, port)
    return launches, temp_dir
