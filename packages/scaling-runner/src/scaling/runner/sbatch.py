"""Submit a batch job and wait for it: ``python -m scaling.runner.sbatch JOB_SCRIPT``.

What ``sbatch --wait`` does, with three differences the runner needs:

- the job is polled every second (``scontrol show job``; ``sbatch --wait`` returned up to
  ~30 s after a job ended, seen here), and it counts as ended only once its steps have
  finished (no COMPLETING flag), so the job's output file is whole when this returns;
- the exit code is the job's own: the batch script's code, or ``128 + N`` where signal N
  ended it (``scancel``: 143), and ``128 + N`` when signal N here cancelled it;
- SIGTERM or SIGINT here (the runner forwarding its own, Ctrl-C) cancels the job with
  ``scancel`` (SLURM sends SIGTERM to every step: scaling's trainer saves) and keeps
  waiting for it to end, so no rank outlives the runner.
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


def job_status(job_id: str) -> tuple[str, int] | None:
    """``(state, exit code)`` of a job from ``scontrol show job``; None while it is unknown or unreadable.

    The state is ``COMPLETING`` until every step of an ended job has finished.
    """
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    state = re.search(r"\bJobState=(\S+)", out.stdout)
    code = re.search(r"\bExitCode=(\d+):(\d+)", out.stdout)
    if out.returncode != 0 or state is None or code is None:
        return None
    status, signum = int(code.group(1)), int(code.group(2))
    return state.group(1), 128 + signum if signum else status


def main(argv: list[str] | None = None) -> int:
    """Submit ``argv[0]`` (further items are sbatch options before it); return the job's exit code."""
    args = sys.argv[1:] if argv is None else argv
    submitted = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    if submitted.returncode != 0:
        print(submitted.stderr.strip() or submitted.stdout.strip(), file=sys.stderr)
        return submitted.returncode
    job_id = submitted.stdout.strip().split(";")[0]
    print(f"Submitted batch job {job_id}", flush=True)
    cancelled: list[int] = []

    def cancel(signum: int, frame: types.FrameType | None) -> None:
        if not cancelled:
            cancelled.append(signum)
            subprocess.run(["scancel", job_id], capture_output=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, cancel)
    while True:
        status = job_status(job_id)
        if status is not None and status[0] in _ENDED:
            # Cancelled on request: the signal's code, whatever the job's steps returned.
            return 128 + cancelled[0] if cancelled else status[1]
        time.sleep(_POLL_S)


if __name__ == "__main__":
    sys.exit(main())
