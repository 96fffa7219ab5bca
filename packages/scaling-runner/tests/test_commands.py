"""Command lines, checked by running them against recording shims (no docker engine, sshd or SLURM here).

The shims record the argv they receive after the real quoting path ran (pdsh's exec
module, a shell standing in for ssh's remote login shell, bash running the sbatch
script), so an argument that is not passed inertly shows up as a mismatch, and an
injected command would create SENTINEL.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scaling.runner import PAYLOAD_PATH_ENV, RunnerConfig, load_payload, plan, runner_main

EVIL = "$(touch SENTINEL) `touch SENTINEL` ' \" ; touch SENTINEL\nsecond line %h"
SECRET = "s3cret-value-123"
PAYLOAD = {"lr": 0.1, "note": EVIL}
SCALING_RUN = str(Path(sys.executable).parent / "scaling-run")


def torchrun(python, nnodes, nproc, endpoint, run_id, script="/app/train.py", args=()):
    return [python, "-m", "scaling.runner.torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--max-restarts", "0", script, *args]  # fmt: skip


def inline(payload):
    return base64.b64encode(json.dumps(payload, sort_keys=True).encode()).decode()


def docker_cfg(**kw):
    base = dict(
        runner_type="pdsh_docker",
        script="/app/train.py",
        hosts=["node1 slots=2", "node2 slots=2"],
        master_port=29500,
        run_id="rid",
        env={"PLAIN": EVIL},
        env_forward=["WANDB_API_KEY", "HF_TOKEN"],
        docker_config={
            "image": "img:1",
            "mounts": [["/data/a b;touch SENTINEL", "/data"]],
            "gpus": "all",
            "extra_args": ["--shm-size=1g"],
        },
    )
    return RunnerConfig(**{**base, **kw})


def expected_docker(nnodes=2, endpoint="node1:29500"):
    return ["run", "--rm", "--network", "host", "--ipc", "host", "--label", "scaling.run_id=rid", "--gpus", "all",
            "-v", "/data/a b;touch SENTINEL:/data", "-e", f"PLAIN={EVIL}", "-e", f"SCALING_PAYLOAD={inline(PAYLOAD)}",
            "-e", "HF_TOKEN", "-e", "WANDB_API_KEY", "--shm-size=1g", "img:1",
            *torchrun("python", nnodes, 2, endpoint, "rid")]  # fmt: skip


@pytest.fixture
def secrets_env(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("HF_TOKEN", SECRET + "-hf")
    monkeypatch.setenv("SHIM_ENV_NAMES", "WANDB_API_KEY,HF_TOKEN,PLAIN,PDSH_SSH_ARGS_APPEND,SCALING_PAYLOAD_PATH")
    return tmp_path


def assert_no_secret(*texts):
    for text in texts:
        assert SECRET not in text


def test_local_command_and_payload_file(worker_script, secrets_env):
    cfg = RunnerConfig(script=worker_script, nproc_per_node=4, master_port=29999, run_id="r1", max_restarts=2)
    [launch] = plan(cfg, PAYLOAD)
    expected = torchrun(sys.executable, 1, 4, "127.0.0.1:29999", "r1", script=worker_script)
    expected[expected.index("--max-restarts") + 1] = "2"
    assert list(launch.argv) == expected
    assert load_payload(launch.env) == PAYLOAD
    assert_no_secret(" ".join(launch.argv), launch.describe(), open(launch.env[PAYLOAD_PATH_ENV]).read())


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="pdsh not installed: apt-get install -y pdsh")
def test_pdsh_docker_through_real_pdsh_exec(shims, secrets_env):
    read = shims("docker")
    assert runner_main(docker_cfg(pdsh_rcmd="exec"), PAYLOAD) == 0
    records = read()
    assert [r["name"] for r in records] == ["docker", "docker"]  # one container per node
    for record in records:
        assert record["argv"] == expected_docker()
        assert record["env"]["WANDB_API_KEY"] == SECRET  # reached docker through the environment only
    assert not (secrets_env / "SENTINEL").exists()


def test_pdsh_docker_over_ssh_remote_shell(shims, secrets_env):
    read = shims("pdsh", "docker")
    cfg = docker_cfg(docker_config={**docker_cfg().docker_config.model_dump(), "sudo": True})
    assert runner_main(cfg, PAYLOAD) == 0
    [pdsh_rec] = read()
    remote = pdsh_rec["argv"][-1]
    assert pdsh_rec["argv"][:-1] == ["-S", "-f", "2", "-R", "ssh", "-w", "node1,node2"]
    assert pdsh_rec["env"]["PDSH_SSH_ARGS_APPEND"] == "-o SendEnv=HF_TOKEN -o SendEnv=WANDB_API_KEY"
    assert_no_secret(remote, json.dumps(pdsh_rec["argv"]))
    # What ssh's remote login shell does with the string: it must hand docker the exact list.
    (secrets_env / "shim-bin" / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
    (secrets_env / "shim-bin" / "sudo").chmod(0o755)
    assert remote.startswith("exec sudo docker run ")
    subprocess.run(["sh", "-c", remote], check=True)
    assert read()[-1]["argv"] == expected_docker()
    assert not (secrets_env / "SENTINEL").exists()


def test_pdsh_docker_without_hosts_runs_docker_here(shims, secrets_env):
    read = shims("docker")
    assert runner_main(docker_cfg(hosts=None, master_port=29501), PAYLOAD) == 0
    [record] = read()
    expected = expected_docker(nnodes=1, endpoint="127.0.0.1:29501")
    expected[expected.index("--nproc-per-node") + 1] = "1"
    assert record["argv"] == expected
    assert record["env"]["HF_TOKEN"] == SECRET + "-hf"


def test_pdsh_plain_over_ssh_remote_shell(shims, secrets_env):
    read = shims("pdsh", "fakepython")
    cfg = RunnerConfig(
        runner_type="pdsh", script="/app/train.py", script_args=["--note", EVIL],
        hosts=["node1 slots=4", "node2 slots=4", "node3 slots=2"], master_addr="10.0.0.1", master_port=29500,
        run_id="rid", env={"PLAIN": EVIL}, env_forward=["WANDB_API_KEY"], python_executable="fakepython",
        workdir=str(secrets_env / "work dir;x"),
    )  # fmt: skip
    (secrets_env / "work dir;x").mkdir()
    assert runner_main(cfg, PAYLOAD) == 0
    # The pdsh groups start concurrently, so the shim's records come in either order.
    pdsh_recs = sorted(read(), key=lambda r: r["argv"][6])
    # Hosts with different slots need different torchrun commands: one pdsh per slots group.
    assert [r["argv"][:7] for r in pdsh_recs] == [
        ["-S", "-f", "2", "-R", "ssh", "-w", "node1,node2"],
        ["-S", "-f", "1", "-R", "ssh", "-w", "node3"],
    ]
    for rec, nproc in zip(pdsh_recs, (4, 2)):
        subprocess.run(["sh", "-c", rec["argv"][-1]], check=True)
        worker = read()[-1]
        assert worker["argv"] == torchrun("fakepython", 3, nproc, "10.0.0.1:29500", "rid", args=["--note", EVIL])[1:]
        assert worker["env"]["PLAIN"] == EVIL
    assert not (secrets_env / "SENTINEL").exists()


def test_sbatch_script_and_its_srun(shims, secrets_env, monkeypatch):
    read = shims("sbatch", "srun", "scontrol")
    cfg = RunnerConfig(
        runner_type="slurm", script="/app/train.py", script_args=["--note", EVIL], nproc_per_node=4, run_id="rid",
        env={"PLAIN": EVIL}, payload_dir=str(secrets_env / "runs"),
        slurm_config={"num_nodes": 2, "partition": "gpu", "gpus_per_node": 4, "extra_args": ["--qos=high"]},
    )  # fmt: skip
    assert runner_main(cfg, PAYLOAD) == 0
    sbatch, scontrol = read()
    script_path = str(secrets_env / "runs" / "rid" / "job.sbatch")
    assert sbatch["argv"] == ["--parsable", script_path]
    assert scontrol["argv"] == ["-o", "show", "job", "77"]  # the waiter polls the job it submitted
    script = sbatch["script"]
    assert_no_secret(script)
    assert script.startswith(
        "#!/bin/bash\n#SBATCH --job-name=scaling\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
    )
    job_out = secrets_env / "runs" / "rid" / "job.out"
    assert (
        f"#SBATCH --partition=gpu\n#SBATCH --gpus-per-node=4\n#SBATCH --output={job_out}\n#SBATCH --qos=high\n"
        in script
    )
    # Run the script as a batch host would, with the allocation's variables set.
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node-[a-b]")
    monkeypatch.setenv("SHIM_FIRST_NODE", "node-a")
    monkeypatch.setenv("SHIM_NODE_ADDR", "10.1.2.3")  # the master is the first node's NodeAddr
    monkeypatch.delenv("WANDB_API_KEY")
    subprocess.run(["bash", script_path], check=True)
    srun = [r for r in read() if r["name"] == "srun"][-1]
    assert srun["argv"] == ["--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"] + torchrun(
        sys.executable, 2, 4, "10.1.2.3:29500", "scaling-77", args=["--note", EVIL]
    )
    assert srun["env"]["PLAIN"] == EVIL
    assert load_payload({PAYLOAD_PATH_ENV: srun["env"]["SCALING_PAYLOAD_PATH"]}) == PAYLOAD
    assert not (secrets_env / "SENTINEL").exists()


def test_srun_inside_an_allocation(shims, secrets_env, monkeypatch):
    read = shims("srun")
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    cfg = RunnerConfig(runner_type="slurm", script="/app/train.py", nproc_per_node=2, master_addr="node-a",
                       master_port=29400, slurm_config={"num_nodes": 3})  # fmt: skip
    assert runner_main(cfg, PAYLOAD) == 0
    [srun] = read()
    assert srun["argv"] == ["--nodes", "3", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"] + torchrun(
        sys.executable, 3, 2, "node-a:29400", "slurm-55"
    )
    assert srun["env"]["WANDB_API_KEY"] == SECRET


def test_failed_command_exit_code_is_raised_or_returned(shims, secrets_env, capfd):
    shims("srun")
    (secrets_env / "shim-bin" / "srun").write_text("#!/bin/sh\nexit 5\n")
    cfg = RunnerConfig(runner_type="slurm", script="/app/train.py", master_addr="n", slurm_config={"num_nodes": 1})
    import os

    os.environ["SLURM_JOB_ID"] = "1"
    try:
        with pytest.raises(SystemExit) as stopped:
            runner_main(cfg, {})
        assert stopped.value.code == 5
        assert runner_main(cfg, {}, exit_on_failure=False) == 5
    finally:
        del os.environ["SLURM_JOB_ID"]
    assert "no rank reported a failure; launch exit codes [5]" in capfd.readouterr().err


def test_payload_with_secret_values_is_refused(worker_script):
    cfg = RunnerConfig(script=worker_script)
    with pytest.raises(ValueError, match=r"payload holds secret-looking keys \['logger.wandb_api_key'\]"):
        plan(cfg, {"logger": {"wandb_api_key": "abc"}})
    with pytest.raises(TypeError, match="payload must be JSON-serialisable"):
        plan(cfg, {"x": object()})


def test_cli_dry_run_masks_secrets(tmp_path, worker_script):
    config = tmp_path / "c.yml"
    config.write_text(f"runner:\n  runner_type: pdsh\n  script: {worker_script}\n  hosts: [node1, node2]\nsteps: 3\n")
    env = {**__import__("os").environ, "WANDB_API_KEY": SECRET, "DB_PASSWORD": SECRET}
    out = subprocess.run(
        [SCALING_RUN, str(config), "runner.nproc_per_node=2", "--dry-run"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    assert "pdsh -S -f 2 -R ssh -w node1,node2" in out.stdout
    assert "#   node1: cd " in out.stdout and "#   node2: cd " in out.stdout
    assert "--nproc-per-node 2" in out.stdout and "PDSH_SSH_ARGS_APPEND='-o SendEnv=WANDB_API_KEY'" in out.stdout
    assert_no_secret(out.stdout, out.stderr)
    bad = subprocess.run(
        [SCALING_RUN, str(config), "runner.hosts=[a;touch X]", "--dry-run"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert bad.returncode == 2 and "host name 'a;touch' (in 'a;touch X') is not allowed" in bad.stderr


# Secrets the old name list missed, and a random-looking value under a plain name.
UNLISTED = {
    "AWS_SECRET_ACCESS_KEY": "aws-" + SECRET,
    "DJANGO_SECRET_KEY": "django-" + SECRET,
    "GITHUB_PAT": "pat-" + SECRET,
    "MY_SETTING": "Zx8Kq2Lm9Np4Rt7Vw1Yb3Cd6Fg",
}


@pytest.mark.parametrize("runner_type", ["pdsh", "pdsh_docker"])
def test_secrets_under_any_name_or_random_values_never_reach_a_command_line(secrets_env, monkeypatch, runner_type):
    for name, value in UNLISTED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PLAIN_SETTING", "plain-value")
    cfg = docker_cfg(runner_type=runner_type, env_forward=[*UNLISTED, "PLAIN_SETTING"], env={})
    launches = plan(cfg, PAYLOAD)
    for launch in launches:
        shown = [" ".join(launch.argv), launch.describe(), json.dumps(launch.env)]
        assert not [name for name, value in UNLISTED.items() if any(value in text for text in shown)], shown
        assert "PLAIN_SETTING=plain-value" in launch.describe()  # plain values still travel as before
        if runner_type == "pdsh":  # over ssh: each secret is sent by name through the ssh channel
            assert launch.env["PDSH_SSH_ARGS_APPEND"].split() == [
                word for name in sorted(UNLISTED) for word in ("-o", f"SendEnv={name}")
            ]
        else:  # docker takes each secret's value from its own environment: `-e NAME`
            argv = list(launch.argv)
            assert all(f"-e {name} " in " ".join(argv) for name in UNLISTED)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"docker_config": {"image": "i", "extra_args": ["--env=WANDB_API_KEY=k-123"]}}, "docker_config.extra_args[0]"),
        ({"docker_config": {"image": "i", "extra_args": ["-e", "HF_TOKEN=k-123"]}}, "docker_config.extra_args[1]"),
        ({"docker_config": {"image": "i", "extra_args": [f"--env=X={UNLISTED['MY_SETTING']}"]}}, "extra_args[0]"),
        ({"runner_type": "slurm", "slurm_config": {"extra_args": ["--export=ALL,HF_TOKEN=k-123"]}}, "extra_args[0]"),
        ({"script_args": ["--lr", "0.1", "--hf-token=k-123"]}, "script_args[2]"),
        ({"env": {"MY_SETTING": UNLISTED["MY_SETTING"]}}, "looks like a secret by its value"),
    ],
)
def test_secret_assignments_in_arguments_are_refused_without_showing_them(overrides, field):
    base = {"runner_type": "pdsh_docker", "script": "/app/train.py", "run_id": "rid"}
    with pytest.raises(ValueError) as info:
        RunnerConfig(**{**base, **overrides})
    text = str(info.value)
    assert field in text and "env_forward" in text
    assert "k-123" not in text and UNLISTED["MY_SETTING"] not in text


def test_cli_refuses_a_secret_in_extra_args_before_writing_anything(tmp_path, worker_script):
    config = tmp_path / "c.yml"
    config.write_text(
        f"runner:\n  runner_type: slurm\n  script: {worker_script}\n  payload_dir: {tmp_path / 'runs'}\n"
        f"  slurm_config:\n    extra_args: ['--export=ALL,HF_TOKEN={SECRET}']\nsteps: 3\n"
    )
    out = subprocess.run([SCALING_RUN, str(config), "--dry-run"], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "slurm_config.extra_args[0] assigns 'HF_TOKEN'" in out.stderr
    assert_no_secret(out.stdout, out.stderr)
    assert not (tmp_path / "runs").exists()


def test_the_sbatch_waiter_queries_the_cluster_sbatch_named(shims, tmp_path, monkeypatch, capsys):
    from scaling.runner import sbatch

    read = shims("sbatch", "scontrol")
    monkeypatch.setenv("SHIM_SBATCH_OUT", "77;cluster-b")  # what --parsable prints on a multi-cluster setup
    monkeypatch.setenv("SHIM_CLUSTER", "cluster-b")
    assert sbatch.main(["job.sbatch"]) == 0
    assert [r["argv"] for r in read() if r["name"] == "scontrol"] == [["-M", "cluster-b", "-o", "show", "job", "77"]]
    assert "Submitted batch job 77 on cluster cluster-b" in capsys.readouterr().out


def test_the_sbatch_waiter_gives_up_on_a_job_it_never_sees(shims, monkeypatch, capsys):
    from scaling.runner import sbatch

    shims("sbatch", "scontrol")
    monkeypatch.setenv("SHIM_JOB_UNKNOWN", "1")
    monkeypatch.setattr(sbatch, "UNKNOWN_TIMEOUT_S", 0.5)
    monkeypatch.setattr(sbatch, "_POLL_S", 0.1)
    assert sbatch.main(["job.sbatch"]) == 1
    err = capsys.readouterr().err
    assert "job 77 has been unknown to `scontrol show job` for 0 s; giving up" in err and "sacct -j 77" in err


def test_a_missing_slurm_command_is_one_line(tmp_path, monkeypatch, capsys):
    from scaling.runner import sbatch

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    assert sbatch.main(["job.sbatch"]) == 127
    err = capsys.readouterr().err
    assert err.startswith("scaling-run: sbatch not found on PATH: runner_type='slurm' needs SLURM's client")
    assert len(err.splitlines()) == 1


def test_a_free_port_is_below_the_ephemeral_range_and_bindable():
    # The kernel's own pick comes from the ephemeral range, where an outgoing connection can take
    # it again before the rendezvous binds it (a SLURM run in CI failed with EADDRINUSE so).
    import socket

    from scaling.runner import free_port
    from scaling.runner._commands import _ephemeral_low

    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert 20_000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
