"""Stop an 8-process run, resume it with 4 processes (another layout), finish as if uninterrupted."""

import pytest
from mlp_testlib import final_accuracy, losses, small_config, train_worker

from scaling.testing import assert_parity, run_distributed
from scaling.trainer import committed_steps

STEPS = 40
EVAL = {"eval_interval": STEPS, "eval_iterations": 6}


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_from_dp2_pp2_tp2_at_dp1_pp2_tp2(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    (reference,) = run_distributed(train_worker, 1, small_config(steps=STEPS, trainer=EVAL), timeout_seconds=240)

    first = small_config(2, 2, 2, steps=STEPS, trainer={**EVAL, "save_dir": ckpt, "save_interval": 20})
    first["trainer"]["train_iterations"] = 20  # stop half way; the schedule still spans STEPS
    run_distributed(train_worker, 8, first, timeout_seconds=300)
    assert committed_steps(ckpt) == [20]

    second = small_config(2, 2, 1, steps=STEPS, trainer={**EVAL, "load_dir": ckpt})
    resumed = run_distributed(train_worker, 4, second, timeout_seconds=300)[0]

    assert_parity(losses(resumed), losses(reference)[20:], rtol=1e-5, name="losses after the reshard")
    assert abs(final_accuracy(resumed) - final_accuracy(reference)) <= 0.005
