"""Fixtures: recording shims for external commands, and the worker script's path."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

WORKER = str(Path(__file__).with_name("train_worker.py"))

_SHIM = """#!{python}
import json, os, sys
entry = {{"name": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
          "env": {{k: os.environ.get(k) for k in os.environ.get("SHIM_ENV_NAMES", "").split(",") if k}}}}
if entry["name"] == "sbatch" and sys.argv[1:] and os.path.isfile(sys.argv[-1]):
    entry["script"] = open(sys.argv[-1]).read()
if entry["name"] == "sbatch" and "--parsable" in sys.argv:
    print(os.environ.get("SHIM_SBATCH_OUT", "77"))
args = sys.argv[1:]
if entry["name"] == "scontrol" and args[:2] == ["-M", os.environ.get("SHIM_CLUSTER")]:
    args = args[2:]  # the cluster the waiter was told to query
if entry["name"] == "scontrol" and args[:3] == ["-o", "show", "job"]:
    if os.environ.get("SHIM_JOB_UNKNOWN"):
        sys.exit(1)
    print("JobId=" + args[3] + " JobName=scaling JobState=COMPLETED Reason=None ExitCode=0:0")
elif entry["name"] == "scontrol" and sys.argv[1:3] == ["show", "hostnames"]:
    print(os.environ.get("SHIM_FIRST_NODE", "node-a"))
elif entry["name"] == "scontrol" and sys.argv[1:3] == ["show", "node"]:
    print("NodeName=" + sys.argv[3] + " Arch=x86_64 CoresPerSocket=1")
    print("   NodeAddr=" + os.environ.get("SHIM_NODE_ADDR", sys.argv[3]) + " NodeHostName=" + sys.argv[3])
with open(os.environ["SHIM_RECORD"], "a") as f:
    f.write(json.dumps(entry) + "\\n")
"""


@pytest.fixture
def worker_script() -> str:
    return WORKER


@pytest.fixture
def shims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Callable[[], list[dict]]]:
    """``shims("docker", "sbatch")`` puts recording executables first on PATH; returns a reader of the records."""
    bin_dir = tmp_path / "shim-bin"
    record = tmp_path / "shim-record.jsonl"

    def install(*names: str) -> Callable[[], list[dict]]:
        bin_dir.mkdir(exist_ok=True)
        for name in names:
            path = bin_dir / name
            path.write_text(_SHIM.format(python=sys.executable))
            path.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("SHIM_RECORD", str(record))

        def read() -> list[dict]:
            if not record.exists():
                return []
            return [json.loads(line) for line in record.read_text().splitlines()]

        return read

    return install
