"""Gradient accumulation in the plain loop: ``model.no_sync()`` reduces over DP once per step, as DDP's does."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from auto_models import GLOBAL_BATCH, MODELS, STEPS, TokenDataset, lr_scheduler_fn, optimizer_fn, reference_losses

from scaling.collectives import get_recorder
from scaling.testing import run_distributed
from scaling.trainer.auto import deferred_init, generate_plan, parallelize


def accumulating_worker(zero_stage: int, use_no_sync: bool) -> tuple[list[float], int, int]:
    """Each step's local batch in two micro-batches; the first one's backward inside ``no_sync``."""
    cls, config = MODELS["llama"]
    model = deferred_init(cls, config())
    constraints = {"data_parallel_size": 2, "zero_stage": zero_stage, "global_batch_size": GLOBAL_BATCH, "seed": 7}
    model, optimizer, scheduler, loader = parallelize(
        generate_plan(model, constraints), model, optimizer_fn, lr_scheduler_fn, TokenDataset()
    )
    recorder = get_recorder()
    recorder.reset_counters()
    losses = []
    for _, batch in zip(range(STEPS), loader):
        optimizer.zero_grad()
        halves = [{k: v.chunk(2)[i] for k, v in batch.items()} for i in range(2)]
        step_loss = torch.zeros(())
        for i, half in enumerate(halves):
            with model.no_sync() if use_no_sync and i == 0 else contextlib.nullcontext():
                loss = model(half) / 2
                loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        scheduler.step()
        losses.append(model.global_loss(step_loss))
    dp = recorder.group_name(model.topology.axis("dp").group)
    calls = recorder.calls_by_op_and_group()
    reductions = calls.get(("all_reduce", dp), 0) + calls.get(("reduce_scatter", dp), 0)
    reducer: Any = optimizer.reducer if optimizer.engine is None else optimizer.engine.data_parallel.spaces[0].reducer
    return losses, reductions, len(reducer.buckets)


@pytest.mark.slow  # the quick tier stays under 2 minutes
@pytest.mark.parametrize("zero_stage", [0, 1], ids=["torch-optimizer", "zero1"])
def test_no_sync_reduces_once_per_step_and_matches_one_process(zero_stage: int) -> None:
    expected = reference_losses("llama")
    synced = run_distributed(accumulating_worker, 2, zero_stage, False, timeout_seconds=420)
    unsynced = run_distributed(accumulating_worker, 2, zero_stage, True, timeout_seconds=420)
    for (losses, reductions, buckets), (no_sync_losses, no_sync_reductions, _) in zip(synced, unsynced):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0.0)
        torch.testing.assert_close(torch.tensor(no_sync_losses), torch.tensor(expected), rtol=1e-5, atol=0.0)
        # Without no_sync each micro-batch's backward reduces every bucket; with it, only the last does.
        assert reductions - no_sync_reductions == STEPS * buckets, (reductions, no_sync_reductions, buckets)
