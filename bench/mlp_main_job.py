"""Time the README's main-job command on a fresh clone, and report the test accuracy it reaches.

    python bench/mlp_main_job.py            # clones this checkout's HEAD into a temp dir

It runs exactly the README's command (a new venv, the install, `python -m scaling.mlp`) and
prints the wall time of the install and of the training separately, plus the final
evaluation accuracy from runs/mlp/metrics.jsonl. Targets (issue 10): >= 95% accuracy,
the whole command under 5 minutes on the 2-core CPU machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="scaling-main-job-") as tmp:
        clone = Path(tmp) / "scaling"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        start = time.perf_counter()
        subprocess.run(
            "python3 -m venv .venv && . .venv/bin/activate && pip install -q -r requirements/mlp.txt",
            shell=True,
            cwd=clone,
            check=True,
            executable="/bin/bash",
        )
        installed = time.perf_counter()
        run = subprocess.run(
            ". .venv/bin/activate && python -m scaling.mlp",
            shell=True,
            cwd=clone,
            executable="/bin/bash",
            capture_output=True,
            text=True,
        )
        done = time.perf_counter()
        if run.returncode != 0:
            print(run.stdout[-4000:], run.stderr[-4000:], file=sys.stderr)
            return run.returncode
        rows = [json.loads(line) for line in (clone / "runs/mlp/metrics.jsonl").read_text().splitlines()]
        accuracy = [r["evaluation/accuracy"] for r in rows if "evaluation/accuracy" in r][-1]
        print(
            f"install: {installed - start:.0f} s   training (8 processes, dp2·pp2·tp2): {done - installed:.0f} s   "
            f"total: {done - start:.0f} s (target < 300 s)"
        )
        print(f"final test accuracy: {accuracy:.4f} (target >= 0.95)")
        print(f"plot written: {(clone / 'runs/mlp/training.png').is_file()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
