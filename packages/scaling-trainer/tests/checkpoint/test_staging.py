"""Asynchronous saves that reuse their staging buffers still write the values of their own step."""

from __future__ import annotations

import torch

from scaling.trainer.checkpoint import StagingBuffers, load_checkpoint, save_checkpoint


def _template() -> dict:
    return {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.float64)}}


def test_async_saves_reuse_staging_buffers_and_each_writes_its_own_step(tmp_path) -> None:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.float64)}}
    staging = StagingBuffers()
    expected = {}
    for step in (1, 2, 3):
        expected[step] = {k: v.clone() for k, v in state["model"].items()}
        pending = save_checkpoint(tmp_path, step, state, None, async_save=True, staging=staging)
        with torch.no_grad():  # training goes on at once: these changes must not reach the files
            state["model"]["w"].add_(100.0)
            state["model"]["b"].mul_(3.0)
        pending.wait()
        if step == 1:
            first_buffers = {k: v.data_ptr() for k, v in staging._buffers.items()}
    assert {k: v.data_ptr() for k, v in staging._buffers.items()} == first_buffers  # reused, not reallocated
    for step, values in expected.items():
        loaded = load_checkpoint(tmp_path, _template(), None, step=step)
        for key, value in values.items():
            assert torch.equal(loaded.state["model"][key], value), (step, key)

    # A state of another shape gets new buffers.
    state["model"]["w"] = torch.ones(5)
    save_checkpoint(tmp_path, 4, state, None, async_save=True, staging=staging).wait()
    assert staging._buffers["model.w"].shape == (5,)
