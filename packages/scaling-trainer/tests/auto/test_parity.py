"""Parity: unmodified tiny Llama / GPT-2 trained with the plain loop, dp2·tp2 and pp2·dp2 vs one process."""

from __future__ import annotations

import pytest
import torch
from auto_models import MODELS, TokenDataset, lr_scheduler_fn, optimizer_fn

from scaling.testing import run_distributed
from scaling.trainer.auto import deferred_init, generate_plan, materialize, parallelize

STEPS, GLOBAL_BATCH = 10, 4


def reference_losses(name: str) -> list[float]:
    cls, config = MODELS[name]
    model = materialize(deferred_init(cls, config()), seed=7)
    optimizer = optimizer_fn(model)
    scheduler = lr_scheduler_fn(optimizer)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=GLOBAL_BATCH)
    losses = []
    for _, batch in zip(range(STEPS), loader):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def train_worker(name: str, constraints: dict) -> list[float]:
    cls, config = MODELS[name]
    model = deferred_init(cls, config())
    plan = generate_plan(model, {**constraints, "global_batch_size": GLOBAL_BATCH, "seed": 7})
    model, optimizer, scheduler, loader = parallelize(plan, model, optimizer_fn, lr_scheduler_fn, TokenDataset())
    losses = []
    for _, batch in zip(range(STEPS), loader):
        optimizer.zero_grad()
        loss = model(batch)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())
    # the loss each DP rank prints is its own shard's; the global loss is their mean
    stacked = torch.stack(losses)
    torch.distributed.all_reduce(stacked, group=model.topology.data_parallel_group)
    return (stacked / model.topology.data_parallel_size).tolist()


LAYOUTS = {
    "dp2_tp2": {"data_parallel_size": 2, "tensor_parallel.size": 2},
    # GPT-2's LM head is tied to the input embedding: held by both stages, gradients summed
    "pp2_dp2": {"data_parallel_size": 2, "pipeline_parallel.size": 2, "pipeline_parallel.num_micro_batches": 2},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_layout_matches_one_process(name: str, layout: str) -> None:
    expected = reference_losses(name)
    results = run_distributed(train_worker, 4, name, LAYOUTS[layout], timeout_seconds=420)
    for losses in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0.0)
    assert expected[-1] < expected[0]  # it trains
