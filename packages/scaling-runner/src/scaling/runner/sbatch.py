"""Submit a batch job and wait for it: ``python -m scaling.runner.sbatch JOB_SCRIPT``.

What ``sbatch --wait`` does, with three differences the runner needs:

- the job is polled every second (``scontrol show job``; ``sbatch --wait`` returned up to
  ~30 s after a job ended, seen here), and it counts as ended only once its steps have
  finished (no COMPLETING flag), so the job's output file is whole when this returns;
- the exit code is the job's own: the batch script's code, or ``128 + N`` where signal N
  ended it (``scancel``: 143), and ``128 + N`` when signal N here cancelled it;
- SIGTERM or SIGINT here (the runner forwarding its own, Ctrl-C) sends SIGTERM to every
  task of the job's steps at once (``scancel --signal=TERM``: scaling's trainer saves), and
  cancels the job (``scancel``) if it has not ended :data:`STOP_GRACE_S` later, at a second
  signal, or at once when it is not running yet; it keeps waiting for the job to end, so no
  rank outlives the runner. Not a plain ``scancel`` first: that signals ``srun`` twice (as a
  process of the batch step and as the job's step launcher), which makes it kill the
  step's tasks while some have not had their SIGTERM yet (seen here: one of two tasks).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import types

_ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
          "TIMEOUT"}  # fmt: skip
_POLL_S = 1.0
#: After the SIGTERM to the steps, how long the job has to end before it is cancelled (the
#: runner waits 90 s for this waiter, see ``scaling.runner._run.SIGNAL_GRACE_S``).
STOP_GRACE_S = 60.0


#: How long a submitted job may stay unknown to ``scontrol`` before the waiter gives up (a job
#: submitted to another cluster than the one queried, or purged before the first poll).
UNKNOWN_TIMEOUT_S = 120.0


def _on(cluster: str | None) -> list[str]:
    """``-M CLUSTER`` for scontrol and scancel when sbatch named the cluster (``jobid;cluster``)."""
    return ["-M", cluster] if cluster else []


def job_status(job_id: str, cluster: str | None = None) -> tuple[str, int] | None:
    """``(state, exit code)`` of a job from ``scontrol show job``; None while it is unknown or unreadable.

    The state is ``COMPLETING`` until every step of an ended job has finished.
    """
    out = subprocess.run(["scontrol", *_on(cluster), "-o", "show", "job", job_id], capture_output=True, text=True)
    state = re.search(r"\bJobState=(\S+)", out.stdout)
    code = re.search(r"\bExitCode=(\d+):(\d+)", out.stdout)
    if out.returncode != 0 or state is None or code is None:
        return None
    status, signum = int(code.group(1)), int(code.group(2))
    return state.group(1), 128 + signum if signum else status


def main(argv: list[str] | None = None) -> int:
    """Submit ``argv[0]`` (further items are sbatch options before it); return the job's exit code
    (127 with one line when a SLURM command is missing, 1 when the job stays unknown)."""
    try:
        return _submit_and_wait(sys.argv[1:] if argv is None else argv)
    except FileNotFoundError as exc:  # subprocess could not find sbatch, scontrol or scancel
        print(
            f"scaling-run: {exc.filename} not found on PATH: runner_type='slurm' needs SLURM's client commands "
            "(sbatch, srun, scontrol, scancel) on this machine",
            file=sys.stderr,
        )
        return 127


def _submit_and_wait(args: list[str]) -> int:
    submitted = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    if submitted.returncode != 0:
        print(submitted.stderr.strip() or submitted.stdout.strip(), file=sys.stderr)
        return submitted.returncode
    # --parsable prints "jobid" or, on a multi-cluster setup, "jobid;cluster".
    job_id, _, named = submitted.stdout.strip().partition(";")
    cluster = named.strip() or None
    print(f"Submitted batch job {job_id}" + (f" on cluster {cluster}" if cluster else ""), flush=True)
    cancelled: list[int] = []  # the signal that stopped the job, once one did
    cancel_at: list[float] = []  # when to cancel the job outright

    def stop(signum: int, frame: types.FrameType | None) -> None:
        if cancelled:
            cancel_at[:] = [0.0]  # a second signal: cancel now
            return
        cancelled.append(signum)
        status = job_status(job_id, cluster)
        running = status is not None and status[0] == "RUNNING"
        signalled = (
            running
            and subprocess.run(["scancel", *_on(cluster), "--signal=TERM", job_id], capture_output=True).returncode == 0
        )
        cancel_at.append(time.monotonic() + STOP_GRACE_S if signalled else 0.0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    known_at = time.monotonic()
    while True:
        if cancel_at and time.monotonic() >= cancel_at[0]:
            cancel_at[:] = [float("inf")]
            subprocess.run(["scancel", *_on(cluster), job_id], capture_output=True)
        status = job_status(job_id, cluster)
        if status is not None and status[0] in _ENDED:
            # Stopped on request: the signal's code, whatever the job's steps returned.
            return 128 + cancelled[0] if cancelled else status[1]
        if status is not None:
            known_at = time.monotonic()
        elif time.monotonic() - known_at > UNKNOWN_TIMEOUT_S:
            where = f" -M {cluster}" if cluster else ""
            print(
                f"scaling-run: job {job_id} has been unknown to `scontrol{where} show job` for "
                f"{UNKNOWN_TIMEOUT_S:.0f} s; giving up waiting (look it up with sacct{where} -j {job_id})",
                file=sys.stderr,
            )
            return 1
        time.sleep(_POLL_S)


if __name__ == "__main__":
    sys.exit(main())
