"""In-memory checkpoints without a launcher: a failed attempt's copies, read by the next (#51).

The workers get torchrun's variables from the harness (``TORCHELASTIC_MAX_RESTARTS=1``, then
``TORCHELASTIC_RESTART_COUNT`` 0 and 1), so ``trainer_model``'s classifier copies its state
to memory every step; the first attempt fails in step 5, the second resumes from step 4 and
ends where an uninterrupted run ends, bit for bit. The launched version (torchrun restarting
the workers after a SIGKILL) is ``tests/reliability/test_memory_restart.py``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from trainer_model import build_trainer, loss_function

from scaling.testing import run_distributed
from scaling.trainer.checkpoint import MemoryCheckpoints

STEPS = 6


def memory_worker(tp: int, pp: int, zero_stage: int, trainer: dict[str, Any], fail_at: int | None) -> dict[str, Any]:
    trainer_obj = build_trainer(tp, pp, trainer, zero_stage, loss_function)
    next_step = trainer_obj.loader.next_step

    def failing_next_step() -> Any:  # every rank fails at the start of the step, as one
        if trainer_obj.context.iterations + 1 == fail_at:
            raise RuntimeError(f"injected failure in step {fail_at}")
        return next_step()

    trainer_obj.loader.next_step = failing_next_step  # type: ignore[method-assign]
    try:
        history = trainer_obj.run_training(return_metrics=True) or []
    except RuntimeError as exc:
        assert "injected failure" in str(exc)
        return {"failed_at": trainer_obj.context.iterations + 1}
    digest = hashlib.sha256()
    with trainer_obj.whole_parameters():  # ZeRO-3 holds shards between steps
        for _, p, _ in trainer_obj.parallel_module.named_parameters_with_meta():
            digest.update(p.detach().clone().numpy().tobytes())  # a copy: numpy would pin the storage
    return {
        "resumed_from": trainer_obj.checkpointer.last_loaded_step,
        "losses": {m["step"]: m["training/loss"] for m in history},
        "hash": digest.hexdigest(),
    }


def _attempt(restart: int) -> dict[str, str]:
    return {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": str(restart)}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "tp, pp, zero_stage",
    [(1, 1, 3), pytest.param(1, 2, 1, marks=pytest.mark.slow), pytest.param(2, 1, 2, marks=pytest.mark.slow)],
    ids=["zero3-dp2", "pp2-zero1", "tp2-zero2"],
)
def test_the_next_attempt_resumes_from_the_copies_in_memory_bitwise(tmp_path, tp, pp, zero_stage):
    memory = tmp_path / "memory"
    trainer = {"train_iterations": STEPS, "memory_checkpoint_interval": 1, "memory_checkpoint_dir": str(memory)}
    args = (tp, pp, zero_stage)
    plain = run_distributed(memory_worker, 2, *args, trainer, None, timeout_seconds=120)
    assert not memory.exists()  # without a launcher that restarts, no copies
    failed = run_distributed(memory_worker, 2, *args, trainer, 5, env=_attempt(0), timeout_seconds=120)
    assert [r["failed_at"] for r in failed] == [5, 5]
    for rank in (0, 1):  # the two newest steps of every rank, each in its own slot
        assert MemoryCheckpoints(memory, rank).held_steps() == [3, 4]
        assert sorted(p.name for p in (memory / f"rank_{rank}").iterdir()) == [
            "slot_0.bin",
            "slot_0.json",
            "slot_1.bin",
            "slot_1.json",
        ]
    resumed = run_distributed(memory_worker, 2, *args, trainer, None, env=_attempt(1), timeout_seconds=120)
    for again, reference in zip(resumed, plain):
        assert again["resumed_from"] == 4
        assert again["losses"] == {s: v for s, v in reference["losses"].items() if s > 4}
        assert again["hash"] == reference["hash"]
    assert not memory.exists()  # the finished run removed them


@pytest.mark.distributed
def test_a_first_attempt_drops_copies_an_earlier_job_left(tmp_path):
    memory = tmp_path / "memory"
    trainer = {"train_iterations": STEPS, "memory_checkpoint_interval": 1, "memory_checkpoint_dir": str(memory)}
    run_distributed(memory_worker, 2, 1, 1, 1, trainer, 5, env=_attempt(0), timeout_seconds=120)
    assert memory.exists()
    fresh = run_distributed(memory_worker, 2, 1, 1, 1, trainer, None, env=_attempt(0), timeout_seconds=120)
    assert [r["resumed_from"] for r in fresh] == [None, None]
    assert sorted(fresh[0]["losses"]) == list(range(1, STEPS + 1))
