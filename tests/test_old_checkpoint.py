"""A checkpoint written before the engine's redesign (commit 6725ba9, issue 48) still loads and
training continues from it as if it had never stopped: at its own layout (dp2·tp2, ZeRO-1,
every rank's RNG restored) and resharded into one process. The fixture and the script that
wrote it: ``tests/fixtures/checkpoint_6725ba9``."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from scaling.testing import assert_parity, run_distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_6725ba9"
sys.path.insert(0, str(FIXTURE))
from fixture_config import SAVED_AT, STEPS, fixture_config  # noqa: E402


def _train(cfg: dict) -> list[dict]:
    from scaling.mlp import train

    return train.main(cfg)


def _losses(history: list[dict]) -> dict[int, float]:
    return {m["step"]: m["training/loss"] for m in history if "training/loss" in m}


@pytest.fixture(scope="module")
def uninterrupted() -> dict[int, float]:
    """Today's code, one process, all 20 steps."""
    return _losses(run_distributed(_train, 1, fixture_config(), timeout_seconds=240)[0])


@pytest.mark.distributed
@pytest.mark.parametrize(("dp", "tp"), [(2, 2), (1, 1)], ids=["same-layout", "one-process"])
def test_a_checkpoint_of_6725ba9_loads_and_training_continues(tmp_path, uninterrupted, dp, tp):
    folder = tmp_path / "checkpoints"
    shutil.copytree(FIXTURE / "checkpoints", folder)
    cfg = fixture_config(dp=dp, tp=tp, load_dir=str(folder))
    resumed = _losses(run_distributed(_train, dp * tp, cfg, timeout_seconds=240)[0])
    assert sorted(resumed) == list(range(SAVED_AT + 1, STEPS + 1))
    later = [uninterrupted[step] for step in sorted(resumed)]
    assert_parity([resumed[step] for step in sorted(resumed)], later, rtol=1e-5, name="losses after step 10")
