"""save with dp2·tp2 (world 4), load into tp2 and dp1 layouts: training continues identically."""

from __future__ import annotations

import torch
from auto_models import MODELS, TokenDataset, lr_scheduler_fn, optimizer_fn

from scaling.testing import run_distributed
from scaling.trainer.auto import deferred_init, generate_plan, load, parallelize, save


def _build(name: str, constraints: dict):
    cls, config = MODELS[name]
    model = deferred_init(cls, config())
    plan = generate_plan(model, {**constraints, "seed": 3})
    return (plan, *parallelize(plan, model, optimizer_fn, lr_scheduler_fn, TokenDataset()))


def _step(model, optimizer, scheduler, batch) -> float:
    optimizer.zero_grad()
    loss = model(batch)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def save_worker(name: str, path: str) -> float:
    plan, model, optimizer, scheduler, _ = _build(
        name, {"data_parallel_size": 2, "tensor_parallel.size": 2, "global_batch_size": 4}
    )
    batch = TokenDataset()[0:4]
    dp = model.topology.data_parallel_rank
    shard = {k: v[2 * dp : 2 * dp + 2] for k, v in batch.items()}
    _step(model, optimizer, scheduler, shard)
    save(path, {"plan": plan, "model": model, "optimizer": optimizer, "lr_scheduler": scheduler}, step=1)
    # the next step's loss over the global batch (mean of the two DP halves)
    loss = torch.tensor(_step(model, optimizer, scheduler, shard))
    torch.distributed.all_reduce(loss, group=model.topology.data_parallel_group)
    return loss.item() / 2


def load_worker(name: str, path: str, constraints: dict) -> tuple[float, dict]:
    plan, model, optimizer, scheduler, _ = _build(name, constraints)
    saved_plan = load(path, {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler})
    batch = TokenDataset()[0:4]
    return _step(model, optimizer, scheduler, batch), saved_plan.to_dict()


def test_save_dp2_tp2_load_tp2_and_one_rank(tmp_path) -> None:
    for name in ("gpt2", "llama"):
        path = str(tmp_path / name)
        expected = run_distributed(save_worker, 4, name, path, timeout_seconds=180)[0]
        for world, constraints in ((2, {"tensor_parallel.size": 2}), (1, {})):
            results = run_distributed(load_worker, world, name, path, constraints, timeout_seconds=180)
            for loss, saved_plan in results:
                assert abs(loss - expected) <= 1e-5 * abs(expected)
                assert saved_plan["model_parallel_size"] == 2 and saved_plan["data_parallel_size"] == 2
