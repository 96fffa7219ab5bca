"""The trainer's collective diagnostics: where the files go, the step they carry, the watchdog's file."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trainer_model

from scaling.collectives import get_recorder
from scaling.testing import run_distributed
from scaling.trainer import TrainerConfig


def test_diagnostics_dir_defaults_to_save_dir_and_can_be_set():
    assert TrainerConfig().resolved_diagnostics_dir() is None
    assert TrainerConfig(save_dir="/ckpt").resolved_diagnostics_dir() == Path("/ckpt/diagnostics")
    assert TrainerConfig(save_dir="/ckpt", diagnostics_dir="/diag").resolved_diagnostics_dir() == Path("/diag")


def _spy_worker(diagnostics_dir):
    seen = []
    real = trainer_model.loss_function

    def spy(out, batch):
        recorder = get_recorder()
        seen.append((recorder.step, str(recorder.diagnostics_dir), recorder.rank))
        return real(out, batch)

    trainer_model.loss_function = spy  # train_worker's loss looks the name up at call time
    try:
        trainer_model.train_worker(1, 1, {"train_iterations": 2, "diagnostics_dir": diagnostics_dir})
    finally:
        trainer_model.loss_function = real
    after = get_recorder()
    return sorted(set(seen)), after.step, after.diagnostics_dir


@pytest.mark.slow
@pytest.mark.distributed
def test_run_training_sets_the_directory_rank_and_step(tmp_path):
    out = run_distributed(_spy_worker, 2, str(tmp_path), timeout_seconds=180)
    for rank, (seen, step_after, dir_after) in enumerate(out):
        # Every micro-batch's loss ran with the step being trained and this rank's file location.
        assert seen == [(1, str(tmp_path), rank), (2, str(tmp_path), rank)]
        # The process-wide recorder is handed back as it was found.
        assert (step_after, dir_after) == (None, None)


def _flight_recorder_worker(diagnostics_dir):
    """run_training points NCCL's flight-recorder dumps at its diagnostics folder. This gloo rank
    answers as if its backend were NCCL's (the real function, told "nccl"); the environment is
    handed back afterwards, since the pooled worker runs other tests."""
    import os

    from scaling.topology import set_flight_recorder_folder
    from scaling.trainer import _trainer

    saved = dict(os.environ)
    calls = []

    def as_if_nccl(backend, folder):
        calls.append((backend, str(folder)))
        return set_flight_recorder_folder("nccl", folder)

    from scaling.topology._flight_recorder import BUFFER_SIZE, DUMP_FILE, _read

    os.environ[_read(BUFFER_SIZE)] = "2000"  # what initialize_distributed sets on NCCL
    os.environ.pop(_read(DUMP_FILE), None)
    _trainer.set_flight_recorder_folder = as_if_nccl
    try:
        trainer_model.train_worker(1, 1, {"train_iterations": 1, "diagnostics_dir": diagnostics_dir})
        return calls, os.environ.get(_read(DUMP_FILE))
    finally:
        _trainer.set_flight_recorder_folder = set_flight_recorder_folder
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.distributed
def test_run_training_sends_the_flight_records_to_its_diagnostics_folder(tmp_path):
    ((calls, prefix),) = run_distributed(_flight_recorder_worker, 1, str(tmp_path / "diag"), timeout_seconds=120)
    assert calls == [("gloo", str(tmp_path / "diag"))]
    assert prefix == str(tmp_path / "diag" / "flight_recorder_rank_")
    assert (tmp_path / "diag").is_dir()


def _agreement_worker():
    import signal as signals

    import torch
    import torch.distributed as dist

    from scaling.trainer._signals import SignalWatcher

    watcher = SignalWatcher(torch.device("cpu"), grace_seconds=60)
    if dist.get_rank() == 1:
        watcher.received = signals.SIGTERM  # as its handler would set it
    agreed = watcher.agreed_signal()
    last = get_recorder().records(dist.group.WORLD)[-1]
    return agreed, last.op, last.group, last.ranks


@pytest.mark.distributed
def test_the_ranks_agree_on_a_signal_through_a_recorded_collective():
    """The step boundary's agreement (any rank's signal, on every rank) goes through
    scaling.collectives, so a rank that never reaches it is named like any other absent rank."""
    for agreed, op, group, ranks in run_distributed(_agreement_worker, 2, timeout_seconds=60):
        assert (agreed, op, group, ranks) == (signal.SIGTERM, "all_reduce", "world", (0, 1))


WATCHDOG = """
import os, signal, sys, time
import torch
from scaling.collectives import get_recorder
from scaling.trainer._signals import SignalWatcher

recorder = get_recorder()
recorder.configure(diagnostics_dir=sys.argv[1], rank=5)
recorder.step = 7
recorder.record("send", None, (torch.ones(2, 3),), peer=4)  # the p2p ring needs no process group
SignalWatcher(torch.device("cpu"), grace_seconds=0.5).install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)  # stuck: never reaches a step boundary
"""


@pytest.mark.slow
def test_watchdog_writes_the_diagnostics_file_before_it_ends_a_stuck_rank(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WATCHDOG), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    path = tmp_path / "rank_5.json"
    assert f"diagnostics: {path}" in proc.stderr
    report = json.loads(path.read_text())
    assert (report["rank"], report["step"]) == (5, 7)
    assert report["reason"].startswith("signal 15 received but the ranks did not reach a step boundary")
    last = report["last_collectives"][-1]
    assert (last["op"], last["group"], last["shapes"], last["peer"]) == ("send", "p2p", [[2, 3]], 4)
    assert report["bytes_by_op_and_group"] == {"send/p2p": 24}
    assert not list(tmp_path.glob("*.tmp"))  # written atomically: no temporary file left
