"""Non-finite gradients on a pipeline stage that does not own the loss (docs/reliability.md 8).

pp2 on 2 ranks: rank 0 is stage 0 (the first layer), rank 1 stage 1 (the head and the loss);
pp2·dp2 on 4 ranks: ranks 0, 1 are stage 0 (two DP replicas), ranks 2, 3 stage 1. An Inf is
written into the gradient of rank 0's first weight at step 5 of an AdamW run, so the
optimizer already holds moments when the step is skipped or fails.

Each rank runs ``fault_train.run``, the training the launch tests start through the runner,
on a pooled gloo rank: what is checked here is how the trainer and the optimizer agree across
stages and replicas, not the launch (the runner's exit code for failing ranks is row 14's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reliability_testlib import config, pooled, steps

pytestmark = pytest.mark.distributed

BAD_STEP = 5
FAULTS = [{"kind": "inf_grad", "rank": 0, "step": BAD_STEP}]


def _run(tmp: Path, policy: str, dp: int = 1) -> tuple[list[str | None], Path]:
    cfg = config(tmp, steps=8, tp=1, pp=2, dp=dp, timeout_s=10.0, optimizer={"non_finite_policy": policy})
    return pooled(cfg, tmp / "out", FAULTS), tmp / "out"


def test_inf_grad_on_stage_without_loss_skips_the_same_step_everywhere(tmp_path):
    # pp2·dp2: the Inf reaches neither the loss's stage nor the other DP replica directly,
    # so the verdict has to travel over both (pp2 alone is the fail-policy test below).
    dp = 2
    errors, out = _run(tmp_path, "skip", dp)
    assert errors == [None] * 2 * dp
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2 * dp)]
    # The Inf is on stage 0 (rank 0 only), the loss on stage 1.
    assert [r["pipe_rank"] for r in ranks] == [0] * dp + [1] * dp
    for rank in range(2 * dp):
        records = {r["step"]: r for r in steps(out, rank)}
        assert sorted(records) == list(range(1, 9))
        # Only the bad step is skipped, on every rank ...
        assert [s for s, r in records.items() if r["skipped"]] == [BAD_STEP], rank
        # ... with parameters and optimizer state (AdamW moments) bitwise unchanged ...
        assert records[BAD_STEP]["hash"] == records[BAD_STEP - 1]["hash"], rank
        # ... and training goes on afterwards.
        assert records[BAD_STEP + 1]["hash"] != records[BAD_STEP]["hash"], rank


def test_inf_grad_on_stage_without_loss_fails_every_rank_naming_the_step(tmp_path):
    errors, out = _run(tmp_path, "fail")
    for rank, error in enumerate(errors):
        # Each rank raised on its own (not stopped because its peer died), after the steps before it.
        assert error is not None and error.startswith(
            f"FloatingPointError: non-finite loss or gradient at step {BAD_STEP} "
        ), (rank, error)
        assert (out / f"error_rank{rank}.txt").read_text() == error
        assert [r["step"] for r in steps(out, rank)] == list(range(1, BAD_STEP))


def test_a_nan_loss_stops_every_rank_by_default_and_saves_nothing_after_the_last_good_step(tmp_path):
    # No optimizer section: the default policy. pp2, the loss on stage 1 (rank 1); a checkpoint every step.
    save = tmp_path / "ckpt"
    cfg = config(
        tmp_path, steps=8, tp=1, pp=2, dp=1, timeout_s=10.0, trainer={"save_dir": str(save), "save_interval": 1}
    )
    errors = pooled(cfg, tmp_path / "out", [{"kind": "nan_loss", "rank": 1, "step": BAD_STEP}])
    for rank, error in enumerate(errors):
        assert error is not None and error.startswith(
            f"FloatingPointError: non-finite loss or gradient at step {BAD_STEP} "
        ), (
            rank,
            error,
        )
        assert [r["step"] for r in steps(tmp_path / "out", rank)] == list(range(1, BAD_STEP))
    # The last good step is the newest checkpoint; nothing of the bad step was written.
    assert sorted(p.name for p in save.glob("step_*")) == [f"step_{s:08d}" for s in range(1, BAD_STEP)]
    assert (save / "latest").read_text().strip() == f"step_{BAD_STEP - 1:08d}"
