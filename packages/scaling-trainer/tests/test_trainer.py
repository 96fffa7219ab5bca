"""BaseTrainer end to end on real gloo ranks: bitwise resume, SIGTERM, config errors."""

import pytest
from pydantic import ValidationError
from trainer_model import train_worker

from scaling.testing import run_distributed
from scaling.trainer import TrainerConfig, committed_steps, exit_code_for

LAYOUTS = [pytest.param(2, 1, id="dp2-tp2"), pytest.param(1, 2, id="pp2-dp2")]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_bitwise_resume_with_dropout_and_zero1(tmp_path, tp, pp):
    ckpt = str(tmp_path / "ckpt")
    continuous = run_distributed(train_worker, 4, tp, pp, {"train_iterations": 10}, timeout_seconds=240)
    # Saved asynchronously (staged into the trainer's kept CPU buffers), every 3 steps: steps 4-6
    # change the parameters while step 3's files are written.
    saving = {"train_iterations": 6, "save_dir": ckpt, "save_interval": 3, "async_save": True}
    run_distributed(train_worker, 4, tp, pp, saving, timeout_seconds=240)
    assert committed_steps(ckpt) == [3, 6]
    resumed = run_distributed(train_worker, 4, tp, pp, {"train_iterations": 10, "load_dir": ckpt}, timeout_seconds=240)
    for rank in range(4):
        assert resumed[rank]["losses"] == continuous[rank]["losses"][6:], f"rank {rank}"
        assert resumed[rank]["hash"] == continuous[rank]["hash"], f"rank {rank}"
    # Dropout is on and seeded: another seed gives other parameters.
    other = run_distributed(train_worker, 4, tp, pp, {"train_iterations": 10, "seed": 7}, timeout_seconds=240)
    assert other[0]["hash"] != continuous[0]["hash"]


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_on_one_rank_saves_and_continues_bitwise(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    continuous = run_distributed(train_worker, 4, 2, 1, {"train_iterations": 8}, timeout_seconds=240)
    stopped = run_distributed(
        train_worker, 4, 2, 1, {"train_iterations": 8, "save_dir": ckpt}, sigterm_at=(3, 3), timeout_seconds=240
    )
    # Every rank stopped after the same step, with the documented code.
    assert [r["exit_code"] for r in stopped] == [exit_code_for(15)] * 4 == [143] * 4
    assert [r["step"] for r in stopped] == [3] * 4
    assert committed_steps(ckpt) == [3]
    resumed = run_distributed(train_worker, 4, 2, 1, {"train_iterations": 8, "load_dir": ckpt}, timeout_seconds=240)
    for rank in range(4):
        assert resumed[rank]["losses"] == continuous[rank]["losses"][3:]
        assert resumed[rank]["hash"] == continuous[rank]["hash"]


def test_trainer_config_errors():
    with pytest.raises(ValidationError, match=r"trainer.save_interval=5 needs trainer.save_dir"):
        TrainerConfig(save_interval=5)
    with pytest.raises(ValidationError, match=r"train_iterations\n  Input should be greater than or equal to 1"):
        TrainerConfig(train_iterations=0)


@pytest.mark.distributed
def test_fine_tune_from_weights_only(tmp_path):
    """load_optimizer_states=False and load_context=False: weights load, counters start at 0."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_worker, 2, 1, 1, {"train_iterations": 3, "save_dir": ckpt}, timeout_seconds=180)
    out = run_distributed(
        train_worker,
        2,
        1,
        1,
        {"train_iterations": 2, "load_dir": ckpt, "load_optimizer_states": False, "load_context": False},
        timeout_seconds=180,
    )
    fresh = run_distributed(train_worker, 2, 1, 1, {"train_iterations": 2}, timeout_seconds=180)
    assert [r["step"] for r in out] == [2, 2]
    # Trained weights were loaded: the first loss differs from a fresh start's.
    assert out[0]["losses"][0] != fresh[0]["losses"][0]
