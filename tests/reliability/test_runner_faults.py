"""Runner exit codes: bad config, missing checkpoint, invalid pointer, failing ranks and nodes (docs/reliability.md 14).

Every failure is a non-zero exit of ``runner_main`` / ``scaling-run``, and a run whose
ranks fail returns the worst exit code of a rank that failed on its own.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from reliability_testlib import SCRIPT, cli_config, config, launch, reap, steps

from scaling.runner import RunnerConfig, free_port, main, runner_main

pytestmark = [pytest.mark.distributed]


def _pids(out: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in out.glob("rank*.json")]


def test_bad_runner_config_exits_2_before_anything_starts(tmp_path, capfd):
    out = tmp_path / "out"
    path = cli_config(tmp_path / "run.json", config(tmp_path, tp=1, dp=2), out)
    assert main([str(path), "runner.nproc_per_node=0"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("scaling-run: ") and "nproc_per_node" in err, err
    assert not list(out.iterdir())  # no process ran


@pytest.mark.slow
def test_bad_training_config_fails_every_rank_before_any_process_group(tmp_path, capfd):
    out = tmp_path / "out"
    code = launch(config(tmp_path, tp=1, dp=2, trainer={"train_iterations": 0}), out)
    err = capfd.readouterr().err
    assert code == 1
    assert "train_iterations" in err and "scaling-run: the run failed with exit code 1" in err, err[-3000:]
    assert not list(out.glob("rank*.json"))  # each rank stopped at the config, before Topology.from_env


@pytest.mark.slow
def test_invalid_checkpoint_pointer_exits_non_zero_naming_the_file(tmp_path, capfd):
    # `latest` points to a folder a crash left uncommitted. The three bad-pointer messages
    # (missing, uncommitted, garbled) come from one function, checked one by one in
    # scaling-trainer's tests/checkpoint/test_integrity.py; this launch checks the path from
    # that error to the ranks' exit and the runner's code.
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    (ckpt / "step_00000010").mkdir(parents=True)
    (ckpt / "latest").write_text("step_00000010\n")
    expected = "points to 'step_00000010', which is not a committed checkpoint"
    code = launch(config(tmp_path, tp=1, dp=2, trainer={"load_dir": str(ckpt)}), out)
    err = capfd.readouterr().err
    try:
        assert code == 1, err[-3000:]
        assert "scaling-run: the run failed with exit code 1" in err
        files = [out / f"error_rank{rank}.txt" for rank in range(2)]
        messages = [f.read_text() for f in files if f.exists()]
        assert messages, err[-3000:]  # the first rank to reach the load names the file
        for message in messages:
            assert message.startswith("CheckpointError: ") and str(ckpt / "latest") in message, message
            assert expected in message, message
        if len(messages) < len(files):
            # A rank slower to get there was stopped by torchrun when the first one failed
            # (seen on torch 2.6, whose CUDA build imports slower); it never trained either.
            assert "killed by signal 15 (SIGTERM)" in err, err[-3000:]
        assert not steps(out, 0)  # nothing trained from scratch behind the user's back
    finally:
        reap(_pids(out))


@pytest.mark.slow
def test_runner_returns_the_worst_rank_code_when_the_other_rank_succeeded(tmp_path, capfd):
    out = tmp_path / "out"
    # Rank 1 exits 3 after training finished; rank 0 exits 0.
    code = launch(config(tmp_path, steps=2, tp=1, dp=2), out, [{"kind": "exit", "rank": 1, "step": 99, "code": 3}])
    err = capfd.readouterr().err
    assert code == 3, err[-3000:]
    assert "rank 1 (local_rank 1 on " in err and "exited with code 3" in err
    assert [r["step"] for r in steps(out, 0)] == [1, 2] == [r["step"] for r in steps(out, 1)]


def _free_port() -> int:
    return free_port()  # below the ephemeral range: no outgoing connection takes it before torchrun binds


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pdsh") is None, reason="pdsh is not installed; apt-get install -y pdsh")
@pytest.mark.parametrize(
    ("fault", "expected", "described"),
    [
        ({"kind": "exit", "code": 3}, 3, "exited with code 3"),
        ({"kind": "signal", "signum": int(signal.SIGKILL)}, 128 + signal.SIGKILL, "was killed by signal 9 (SIGKILL)"),
    ],
    ids=["exit3", "sigkill"],
)
def test_failing_remote_node_under_pdsh_gives_the_worst_rank_code(tmp_path, capfd, fault, expected, described):
    # Two "nodes" on this machine through pdsh's exec module; the rank on node2 fails at step 2,
    # its peer on node1 then fails with a lost connection (exit 1): the runner returns the worse code.
    out = tmp_path / "out"
    out.mkdir()
    runner = RunnerConfig(
        runner_type="pdsh", pdsh_rcmd="exec", script=SCRIPT, hosts=["node1 slots=1", "node2 slots=1"],
        master_addr="127.0.0.1", master_port=_free_port(), teardown_timeout_s=10,
    )  # fmt: skip
    payload = {"config": config(tmp_path, steps=50, tp=1, dp=2, timeout_s=10.0), "out_dir": str(out)}
    payload["faults"] = [{**fault, "rank": 1, "step": 2}]
    code = runner_main(runner, payload, exit_on_failure=False)
    captured = capfd.readouterr()
    try:
        assert code == expected, captured.err[-3000:]
        assert f"scaling-run: the run failed with exit code {expected}" in captured.err
        assert "rank 1 (local_rank 0 on " in captured.err and described in captured.err
        assert max(r["step"] for r in steps(out, 0)) < 50  # node1's rank did not go on alone
    finally:
        reap(_pids(out))
