"""Shared pieces of the reliability tests: payloads for fault_train.py and launching it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from scaling.runner import RunnerConfig, runner_main
from scaling.testing import run_distributed

SCRIPT = str(Path(__file__).with_name("fault_train.py"))


def config(
    tmp: Path,
    steps: int = 6,
    tp: int = 2,
    pp: int = 1,
    dp: int = 2,
    timeout_s: float = 30.0,
    trainer: dict[str, Any] | None = None,
    **sections: dict[str, Any],
) -> dict[str, Any]:
    """The ``config`` of a payload: tp·pp·dp ranks, 16 samples per step, no saving unless asked."""
    return {
        "trainer": {"train_iterations": steps, "seed": 3, **(trainer or {})},
        "topology": {
            "model_parallel_size": tp,
            "pipe_parallel_size": pp,
            "data_parallel_size": dp,
            "global_batch_size": 16,
            "micro_batch_size": 16 // dp // 2,
            "device": "cpu",
            "timeout_seconds": timeout_s,
        },
        **sections,
    }


def _nproc(cfg: dict[str, Any]) -> int:
    topo = cfg["topology"]
    return int(topo["model_parallel_size"] * topo["pipe_parallel_size"] * topo["data_parallel_size"])


def launch(
    cfg: dict[str, Any], out: Path, faults: list[dict[str, Any]] | None = None, max_restarts: int = 0, **payload: Any
) -> int:
    """Run fault_train.py on every rank of ``cfg`` through ``runner_main`` (local torchrun, which
    restarts the workers up to ``max_restarts`` times)."""
    out.mkdir(parents=True, exist_ok=True)
    runner = RunnerConfig(script=SCRIPT, nproc_per_node=_nproc(cfg), teardown_timeout_s=10, max_restarts=max_restarts)
    return runner_main(
        runner, {"config": cfg, "out_dir": str(out), "faults": faults or [], **payload}, exit_on_failure=False
    )


def _pooled_rank(cfg: dict[str, Any], out: str, faults: list[dict[str, Any]]) -> str | None:
    from fault_train import run  # on the rank: this folder is on sys.path there (conftest.py)

    try:
        run({"config": cfg, "out_dir": out, "faults": faults})
    except FloatingPointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def pooled(
    cfg: dict[str, Any], out: Path, faults: list[dict[str, Any]] | None = None, timeout_seconds: float = 60.0
) -> list[str | None]:
    """fault_train's training on every rank of ``cfg`` as pooled gloo ranks, with no launch.

    For what the launch itself does not change. Returns, per rank, the FloatingPointError it
    raised as text, or None.
    """
    out.mkdir(parents=True, exist_ok=True)
    return run_distributed(_pooled_rank, _nproc(cfg), cfg, str(out), faults or [], timeout_seconds=timeout_seconds)


def cli_config(
    path: Path, cfg: dict[str, Any], out: Path, faults: list[dict[str, Any]] | None = None, **payload: Any
) -> Path:
    """Write a ``scaling-run`` config file (a ``runner`` section plus fault_train's payload) to ``path``."""
    out.mkdir(parents=True, exist_ok=True)
    runner = {"script": SCRIPT, "nproc_per_node": _nproc(cfg), "teardown_timeout_s": 10}
    path.write_text(
        json.dumps({"runner": runner, "config": cfg, "out_dir": str(out), "faults": faults or [], **payload})
    )
    return path


def start_cli(config_path: Path, log_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``scaling-run config_path *args`` as its own process (own session); output to ``log_dir``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    code = "import sys; from scaling.runner import main; sys.exit(main(sys.argv[1:]))"
    with open(log_dir / "runner.out", "wb") as stdout, open(log_dir / "runner.err", "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-c", code, str(config_path), *args],
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


def parent_pid(pid: int) -> int:
    """The parent of a running ``pid`` (from /proc)."""
    return int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])


def steps(out: Path, rank: int) -> list[dict[str, Any]]:
    """The step records rank ``rank`` wrote, in order (across every run into ``out``)."""
    path = out / f"steps_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(out: Path, rank: int = 0) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in steps(out, rank)}


def worker_pids(out: Path, world_size: int) -> list[int]:
    return [json.loads((out / f"rank{r}.json").read_text())["pid"] for r in range(world_size)]


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def reap(pids: list[int]) -> None:
    """SIGKILL whatever a failed test left running (only the pids this test started)."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
