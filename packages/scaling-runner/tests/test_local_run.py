"""Real torchrun runs on this machine: gloo ranks train a 2-parameter model; a killed rank is named."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaling.runner import RunnerConfig, runner_main

SECRET = "local-secret-value-42"


def reference(world_size: int, steps: int, lr: float) -> tuple[float, float]:
    """The same training in one process on the full batch (equal shards: mean of means = mean)."""
    x = torch.linspace(-1.0, 1.0, 4 * world_size)
    y = 3.0 * x + 1.0
    w = torch.zeros((), requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    for _ in range(steps):
        loss = ((w * x + b - y) ** 2).mean()
        gw, gb = torch.autograd.grad(loss, [w, b])
        with torch.no_grad():
            w -= lr * gw
            b -= lr * gb
    return float(w.detach()), float(b.detach())


def read_ranks(out: Path, world_size: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def run_and_check(worker_script: str, tmp_path: Path, monkeypatch, world_size: int) -> None:
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    payload = {"out_dir": str(tmp_path), "steps": 5, "lr": 0.3, "echo_env": ["WANDB_API_KEY", "PLAIN"]}
    cfg = RunnerConfig(script=worker_script, nproc_per_node=world_size, env={"PLAIN": "x y"})
    assert runner_main(cfg, payload) == 0
    records = read_ranks(tmp_path, world_size)
    w_ref, b_ref = reference(world_size, 5, 0.3)
    for rank, rec in enumerate(records):
        assert (rec["rank"], rec["world_size"], rec["local_rank"], rec["group_rank"]) == (rank, world_size, rank, 0)
        assert rec["allreduce"] == sum(range(world_size))
        assert abs(rec["w"] - w_ref) < 1e-6 and abs(rec["b"] - b_ref) < 1e-6  # DP parity with one process
        assert rec["env"] == {"WANDB_API_KEY": SECRET, "PLAIN": "x y"}
        assert all(SECRET not in cmdline for cmdline in rec["cmdlines"])
    assert len({rec["ppid"] for rec in records}) == 1  # one torchrun agent supervised them all


@pytest.mark.slow
def test_local_eight_processes_train(worker_script, tmp_path, monkeypatch):
    run_and_check(worker_script, tmp_path, monkeypatch, 8)


# The walkthrough's run script ends with a bare ``runner_main(...)``: a failed run must still
# end that process non-zero, naming the first failing rank and its error's last line.
_RUN_SCRIPT = """
import json, sys
from scaling.runner import RunnerConfig, runner_main
cfg = RunnerConfig(script=sys.argv[1], nproc_per_node=2)
runner_main(cfg, payload=json.loads(sys.argv[2]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_a_failed_rank_ends_the_run_script_non_zero(worker_script, tmp_path, fault):
    payload = {"out_dir": str(tmp_path), "steps": 2, "lr": 0.3, "hang": True}
    if fault == "raise":
        payload.update(raise_rank=1, raise_message="the checkpoint is corrupt")
    runner = subprocess.Popen(
        [sys.executable, "-c", _RUN_SCRIPT, worker_script, json.dumps(payload)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}.json").exists() for r in range(2)):
            assert time.monotonic() < deadline and runner.poll() is None, "ranks did not all start"
            time.sleep(0.2)
        victim = read_ranks(tmp_path, 2)[1]["pid"]
        if fault == "kill":
            os.kill(victim, signal.SIGKILL)
        _, err = runner.communicate(timeout=90)
    finally:
        runner.kill()
    first = f"scaling-run: first failure: rank 1 (local_rank 1 on {socket.gethostname()}, pid {victim}) "
    if fault == "kill":
        assert runner.returncode == 128 + signal.SIGKILL, err[-3000:]
        assert first + "was killed by signal 9 (SIGKILL)\n" in err, err[-3000:]
    else:
        assert runner.returncode == 1, err[-3000:]
        assert first + "exited with code 1: RuntimeError: rank 1 gave up: the checkpoint is corrupt\n" in err
    assert "SCALING_RANK_FAILURE" not in err  # the reports are read, not shown


@pytest.mark.slow
def test_an_error_every_rank_raises_is_printed_once_and_threads_are_set_per_rank(worker_script, tmp_path, capfd):
    monkey_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    payload = {"out_dir": str(tmp_path), "steps": 1, "lr": 0.3, "raise_rank": "all", "raise_message": "same"}
    runner = subprocess.run(
        [sys.executable, "-c", _RUN_SCRIPT.replace("nproc_per_node=2", "nproc_per_node=4"), worker_script,
         json.dumps(payload)],
        capture_output=True, text=True, env=monkey_env, timeout=300,
    )  # fmt: skip
    err = runner.stderr
    assert runner.returncode == 1, err[-3000:]
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // 4)
    assert [r["omp_num_threads"] for r in read_ranks(tmp_path, 4)] == [str(threads)] * 4
    summary = [line for line in err.splitlines() if line.startswith("scaling-run: ")]
    assert summary[0] == f"scaling-run: {socket.gethostname()}: 4 rank(s) x {threads} thread(s) on {cores} core(s) " \
        "(OMP_NUM_THREADS; set it to choose)"  # fmt: skip
    assert summary[1].startswith("scaling-run: traceback of rank ")
    assert re.fullmatch(
        r"scaling-run: first failure: rank (\d) \(.*\) exited with code 1: RuntimeError: same", summary[2]
    )
    # The others raised alike ("the same error on ranks ..."), unless torchrun stopped one first.
    assert summary[-1] == "scaling-run: the run failed with exit code 1" or "in consequence" in summary[-1]
    assert any(line.startswith("scaling-run: the same error on rank") or "in consequence" in line for line in summary)
    assert err.count("Traceback (most recent call last)") == 1, err  # the runner's, once; no rank printed its own
    assert "Setting OMP_NUM_THREADS" not in err and "SCALING_RANK_FAILURE" not in err
    assert len(err.splitlines()) < 30, err


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written(tmp_path):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    quick = readme[readme.index("## Quick start") :]
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", quick, re.S)[:3]
    for name, body in zip(["run.py", "train.py", "config.yml"], blocks):
        assert body.startswith(f"# {name}"), body[:40]
        (tmp_path / name).write_text(body)
    done = subprocess.run(
        [sys.executable, "run.py", "config.yml", "runner.nproc_per_node=2", "steps=5"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # Both ranks print at once into one pipe: their lines may run into each other.
    assert sorted(re.findall(r"rank (\d) of 2: 5 steps", done.stdout)) == ["0", "1"], done.stdout
