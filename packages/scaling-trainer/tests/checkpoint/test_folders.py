"""Step folders that cannot be turned against a run: links inside save_dir are never followed,
pruning never deletes the step just committed, and deleting a run's checkpoints (one process)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

from scaling.trainer.checkpoint import CheckpointError, committed_steps, delete_checkpoints, save_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from test_integrity import _load, _save, _state  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _tree(folder):
    """Every file under ``folder`` with its bytes."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_pruning_never_follows_a_step_folder_that_is_a_link(tmp_path):
    """A link ``step_00000001`` into another run's checkpoint: keeping the last one prunes the run's
    own step 2 at step 3, and the other run's files, its commit marker included, are untouched."""
    other, run = tmp_path / "other", tmp_path / "run"
    _save(other, 1)
    before = _tree(other)
    run.mkdir()
    (run / "step_00000001").symlink_to(other / "step_00000001")
    _save(run, 2, keep_last=1)
    _save(run, 3, keep_last=1)
    assert committed_steps(run) == [3]
    assert _tree(other) == before
    assert (run / "step_00000001").is_symlink()


def test_saving_through_a_step_folder_that_is_a_link_is_refused(tmp_path):
    """Saving step 4 where ``step_00000004`` links to a folder outside the run writes nothing there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / "step_00000004").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"step_00000004 is a symbolic link .*remove the link or save elsewhere"):
        save_checkpoint(run, 4, _state(), None)
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]


def test_latest_naming_a_linked_step_folder_is_refused(tmp_path):
    other, run = tmp_path / "other", tmp_path / "run"
    _save(other, 7)
    run.mkdir()
    (run / "step_00000007").symlink_to(other / "step_00000007")
    (run / "latest").write_text("step_00000007\n")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        _load(run)


def test_pruning_keeps_the_step_just_committed_below_an_earlier_runs_steps(tmp_path):
    """A folder holding an earlier run's step 100: a save of step 5 with keep_last=1 keeps step 5,
    which ``latest`` names and which loads (it used to prune its own new checkpoint)."""
    _save(tmp_path, 100)
    _save(tmp_path, 5, scale=2.0, keep_last=1)
    assert 5 in committed_steps(tmp_path)
    assert (tmp_path / "latest").read_text().strip() == "step_00000005"
    assert _load(tmp_path).step == 5


def test_delete_checkpoints_removes_the_run_and_leaves_links_alone(tmp_path):
    other, run = tmp_path / "other", tmp_path / "run"
    _save(other, 1)
    for step in (1, 2):
        _save(run, step)
    (run / "step_00000003").symlink_to(other / "step_00000001")
    assert delete_checkpoints(run) == [1, 2]
    assert committed_steps(run) == [] and not (run / "latest").exists()
    assert committed_steps(other) == [1]
