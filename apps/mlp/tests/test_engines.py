"""The MLP app launched through real engines: a two-node SLURM job and podman containers.

Every run trains the same data-parallel model (2 ranks) and must log the per-step losses of
the local runner's run within 1e-6; the stop tests show that ``scancel`` and ``docker stop``
reach every rank, which saves, and that ``scaling-run`` reports a non-zero exit code.
The engines start here (engines_testlib); where one is missing the test skips with the reason.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from engines_testlib import EngineMissing, host_mounts, skeleton_image, slurm_cluster
from mlp_testlib import small_config

from scaling.mlp.__main__ import main
from scaling.runner import free_port

pytestmark = pytest.mark.slow

STEPS = 6
TOLERANCE = 1e-6


def _free_port() -> int:
    return free_port()  # below the ephemeral range: no outgoing connection takes it before torchrun binds


def _config(tmp: Path, name: str, steps: int, runner: dict[str, Any], **trainer: Any) -> Path:
    """The MLP app at dp=2 for ``steps`` steps, logging every step to ``tmp/name``; the schedule is fixed."""
    cfg = small_config(dp=2, steps=steps)
    cfg["learning_rate_scheduler"].update(learning_rate_decay_iters=STEPS, learning_rate_warmup_steps=2)
    cfg["logger"].update(log_dir=str(tmp / name))
    cfg["trainer"].update(log_interval=1, **trainer)
    cfg["runner"] = {"nproc_per_node": 2, "master_port": _free_port(), **runner}
    cfg["data"]["plot"] = False
    path = tmp / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(log_dir: Path) -> dict[int, float]:
    path = log_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["training/loss"] for r in rows if "training/loss" in r}


def _assert_same(got: dict[int, float], reference: dict[int, float], steps: range) -> None:
    assert sorted(got) == list(steps), got
    for step in steps:
        assert abs(got[step] - reference[step]) <= TOLERANCE, (step, got[step], reference[step])


def _latest(ckpt: Path) -> int:
    name = (ckpt / "latest").read_text().strip()
    assert (ckpt / name / "commit.json").exists(), f"{name} is not committed"
    return int(name.split("_")[1])


def _stop_when_training(launch_argv: list[str], log_dir: Path, stop: Any) -> int:
    """Run the app in a thread; once it logged step 2, call ``stop()``; return the app's exit code."""
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(main(launch_argv)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 240
    while len(_losses(log_dir)) < 2:
        assert thread.is_alive() and time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)
    stop()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the run did not end within 120 s of the stop"
    return result[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The local runner's per-step losses, run once for all pytest-xdist workers (a file under a lock)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base  # this session's folder either way
    with open(shared / "engines-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = shared / "engines-reference.json"
        if not cache.exists():
            tmp = tmp_path_factory.mktemp("local")
            assert main([str(_config(tmp, "log", STEPS, {"runner_type": "local"}))]) == 0
            cache.write_text(json.dumps(_losses(tmp / "log")))
    return {int(step): loss for step, loss in json.loads(cache.read_text()).items()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        with slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
            yield running
    except EngineMissing as exc:
        pytest.skip(reason=f"no SLURM cluster can start here: {exc}")


@pytest.fixture(scope="module")
def image() -> str:
    try:
        return skeleton_image()
    except EngineMissing as exc:
        pytest.skip(reason=f"no container can run here: {exc}")


def _slurm_runner(tmp: Path) -> dict[str, Any]:
    return {"runner_type": "slurm", "nproc_per_node": 1, "payload_dir": str(tmp / "runs"),
            "slurm_config": {"num_nodes": 2}}  # fmt: skip


def test_a_two_node_slurm_job_trains_like_the_local_runner(cluster, reference, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    assert main([str(_config(tmp_path, "log", STEPS, _slurm_runner(tmp_path)))]) == 0
    _assert_same(_losses(tmp_path / "log"), reference, range(1, STEPS + 1))
    out = capfd.readouterr().out
    assert "Submitted batch job" in out
    (job,) = (tmp_path / "runs").glob("*/job.out")
    last = f"step {STEPS}/{STEPS} | "
    assert last in job.read_text() and last in out  # the job's output, followed


def test_inside_an_allocation_the_runner_starts_its_ranks_with_srun(cluster, reference, tmp_path):
    # A user's own batch job runs the app: with SLURM_JOB_ID set the runner submits nothing and
    # starts one torchrun per node of the allocation with srun.
    config = _config(tmp_path, "log", STEPS, _slurm_runner(tmp_path))
    script = tmp_path / "job.sbatch"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --output={tmp_path / 'job.out'}\n"
        f"cd {Path.cwd()}\nexec {sys.executable} -m scaling.mlp {config}\n"
    )
    env = {**os.environ, **cluster.env}
    job = subprocess.run([sys.executable, "-m", "scaling.runner.sbatch", str(script)], env=env, text=True,
                         capture_output=True, timeout=300)  # fmt: skip
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert job.returncode == 0, (job.stdout + job.stderr + out)[-3000:]
    _assert_same(_losses(tmp_path / "log"), reference, range(1, STEPS + 1))
    assert not list((tmp_path / "runs").glob("*/job.sbatch")), "the runner wrote a batch script inside the job"
    assert "Submitted batch job" not in out and f"step {STEPS}/{STEPS} | " in out


def test_scancel_reaches_every_rank_which_saves_and_the_code_is_non_zero(cluster, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    ckpt = tmp_path / "ckpt"
    path = _config(tmp_path, "log", 100_000, _slurm_runner(tmp_path), save_dir=str(ckpt), save_interval=100_000)
    code = _stop_when_training([str(path)], tmp_path / "log", lambda: cluster.run("scancel", "-u", "root"))
    err = capfd.readouterr().err
    assert code == 143, err[-3000:]
    assert "were stopped by SIGTERM from outside the runner (scancel, docker stop, preemption); exit code 143" in err
    stopped = max(_losses(tmp_path / "log"))
    assert _latest(ckpt) == stopped  # both ranks stopped after the same step and committed it


def _container_runner(image: str, tmp: Path) -> dict[str, Any]:
    mounts = host_mounts(tmp)
    return {"runner_type": "pdsh_docker", "docker_config": {"command": "podman", "image": image, "mounts": mounts,
            "python_executable": sys.executable}}  # fmt: skip


def test_a_container_run_checkpoints_to_the_host_and_resumes_outside(image, reference, tmp_path):
    ckpt, cid = tmp_path / "ckpt", tmp_path / "container.id"
    runner = _container_runner(image, tmp_path)
    runner["docker_config"]["extra_args"] = ["--cidfile", str(cid)]  # podman writes it: a container ran
    inside = _config(tmp_path, "inside", 4, runner, save_dir=str(ckpt), save_interval=4)
    assert main([str(inside)]) == 0
    assert len(cid.read_text().strip()) == 64
    _assert_same(_losses(tmp_path / "inside"), reference, range(1, 5))
    assert _latest(ckpt) == 4  # in the mounted host directory
    outside = _config(tmp_path, "outside", STEPS, {"runner_type": "local"}, load_dir=str(ckpt))
    assert main([str(outside)]) == 0
    _assert_same(_losses(tmp_path / "outside"), reference, range(5, STEPS + 1))


def test_docker_stop_reaches_every_rank_which_saves_and_the_code_is_non_zero(image, tmp_path, capfd):
    ckpt = tmp_path / "ckpt"
    runner = {**_container_runner(image, tmp_path), "run_id": f"stop-{tmp_path.name}"}
    path = _config(tmp_path, "log", 100_000, runner, save_dir=str(ckpt), save_interval=100_000)

    def stop() -> None:
        label = f"label=scaling.run_id={runner['run_id']}"
        ids = subprocess.run(["podman", "ps", "-q", "--filter", label], capture_output=True, text=True, check=True)
        assert ids.stdout.split(), "no container carries the run's label"
        subprocess.run(["podman", "stop", "--time", "60", *ids.stdout.split()], check=True, capture_output=True)

    code = _stop_when_training([str(path)], tmp_path / "log", stop)
    err = capfd.readouterr().err
    assert code == 143, err[-3000:]
    assert "were stopped by SIGTERM from outside the runner (scancel, docker stop, preemption); exit code 143" in err
    assert _latest(ckpt) == max(_losses(tmp_path / "log"))


def test_stopping_the_waiting_runner_cancels_the_job(cluster, tmp_path):
    # The runner forwards its SIGTERM to the batch job's waiter, which cancels the job and waits
    # for its steps to end: nothing outlives the runner, and the code says SIGTERM.
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n"
        f"#SBATCH --output={tmp_path / 'job.out'}\n"
        # Each task records its SIGTERM in a file of its own: srun's output forwarding may drop
        # a line written while the step is being torn down (seen once in CI). The signal reaches
        # every process of the step, so the task loops on short sleeps: with `sleep 300 & wait`
        # a sleep killed first let bash end before its own trap ran (seen once in CI).
        f'srun bash -c \'trap "touch {tmp_path}/stopped.$SLURM_PROCID; exit 7" TERM; echo running; '
        "while :; do sleep 0.2; done'\n"
    )
    env = {**os.environ, **cluster.env}
    waiter = subprocess.Popen([sys.executable, "-m", "scaling.runner.sbatch", str(script)], env=env, text=True,
                              stdout=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "job.out").exists() or (tmp_path / "job.out").read_text().count("running") < 2:
            assert waiter.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        waiter.send_signal(signal.SIGTERM)
        assert waiter.wait(timeout=60) == 143
        stopped = sorted(p.name for p in tmp_path.glob("stopped.*"))
        assert stopped == ["stopped.0", "stopped.1"], (tmp_path / "job.out").read_text()  # both got SIGTERM first
    finally:
        waiter.kill()
