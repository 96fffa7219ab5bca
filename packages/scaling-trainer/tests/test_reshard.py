"""BaseTrainer checkpoints across layouts: state bitwise equal, logits within 1e-6 (fp32).

A trainer trains a few steps at one (dp, tp, pp, zero) layout and saves; trainers at
other layouts load that checkpoint (BaseTrainer(load_dir=...)) and save it again, and
the first layout loads it back. At every stop the gathered (full) model and optimizer state
must equal the saved one bit for bit, and the logits of the parallel model on a fixed
batch must match the original layout's within 1e-6.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from trainer_model import Batch, Blobs, build_trainer, loss_function

from scaling.testing import run_distributed
from scaling.trainer import BaseTrainer, committed_steps, evaluation_step
from scaling.trainer.checkpoint import model_state_dict

TIMEOUT = 240
STEPS = 2


def _full(value: Any) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def _gathered_state(trainer: BaseTrainer[Any]) -> dict[str, Any]:
    """This stage's full (TP- and ZeRO-gathered) model and optimizer state (collective)."""
    module, topology = trainer.parallel_module, trainer.context.topology
    with trainer.whole_parameters():  # ZeRO-3 gathers them
        model = {k: _full(v) for k, v in model_state_dict(list(module.named_parameters_with_meta()), topology).items()}
    opt = trainer.optimizer.state_dict()
    return {
        "model": model,
        "optimizer": {f"{k}.{name}": _full(v) for k, entry in opt["params"].items() for name, v in entry.items()},
        "optimizer_scalars": {"step": opt["step"], "loss_scaler": opt["loss_scaler"], "groups": opt["groups"]},
        "iterations": trainer.context.iterations,
    }


def _logits(trainer: BaseTrainer[Any]) -> list[torch.Tensor] | None:
    """Logits of the parallel model on a fixed batch, gathered on rank 0 (None elsewhere)."""
    data = Blobs()
    batch = data.collate([data[i] for i in range(8)])
    captured: list[torch.Tensor] = []

    def capture(out: Any, target: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        captured.append(out.h.detach().clone())
        return loss_function(out, target)

    # Forward only (dropout off); the loss function runs on the last stage only.
    evaluation_step(
        trainer.parallel_module, [batch], capture, sync_batch_to_model_parallel=trainer.sync_batch_to_model_parallel
    )
    mine = captured[0] if captured else None
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    return [t for t in gathered if t is not None]


def reshard_worker(
    tp: int, pp: int, zero: int, shard: int | None, load_dir: str | None, save_dir: str
) -> dict[str, Any]:
    """Train ``STEPS`` steps and save (no ``load_dir``), or load and save again; return state and logits."""
    if load_dir is None:
        trainer = build_trainer(tp, pp, {"train_iterations": STEPS, "save_dir": save_dir}, zero_stage=zero, shard=shard)
        trainer.run_training()
    else:
        settings = {"train_iterations": STEPS, "load_dir": load_dir}
        trainer = build_trainer(tp, pp, settings, zero_stage=zero, shard=shard)
        trainer.checkpointer.save(Path(save_dir))
        trainer.checkpointer.wait()
    return {"state": _gathered_state(trainer), "logits": _logits(trainer)}


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One full state from every rank's stage state; replicas must agree bitwise."""
    merged: dict[str, Any] = {"model": {}, "optimizer": {}}
    for r in results:
        for part in ("model", "optimizer"):
            for k, v in r["state"][part].items():
                if k in merged[part]:
                    assert torch.equal(merged[part][k], v), f"replicas disagree on {part} {k}"
                merged[part][k] = v
        for key in ("optimizer_scalars", "iterations"):
            assert merged.setdefault(key, r["state"][key]) == r["state"][key], key
    return merged


def _assert_same(before: dict[str, Any], after: dict[str, Any], where: str) -> None:
    for part in ("model", "optimizer"):
        assert set(after[part]) == set(before[part]), f"{where}: {part} keys differ"
        for k, v in before[part].items():
            assert torch.equal(after[part][k], v), f"{where}: {part} {k} differs"
    assert after["optimizer_scalars"] == before["optimizer_scalars"], where
    assert after["iterations"] == before["iterations"] == STEPS, where


def _assert_logits(reference: torch.Tensor, results: list[dict[str, Any]], where: str) -> None:
    logits = results[0]["logits"]
    assert logits, f"{where}: no logits reached rank 0"
    for t in logits:
        torch.testing.assert_close(t, reference, atol=1e-6, rtol=0, msg=lambda m: f"{where}: {m}")


Layout = tuple[int, int, int, int, int | None]  # (world, tp, pp, zero stage, HSDP shard size)


def _round_trip(tmp_path: Path, a: Layout, *others: Layout) -> None:
    """Save at layout ``a``, load and save at each of ``others`` in turn, load back at ``a``."""
    chain = [*others, a]
    dirs = [str(tmp_path / f"step{i}") for i in range(len(chain) + 1)]
    first = run_distributed(reshard_worker, a[0], *a[1:], None, dirs[0], timeout_seconds=TIMEOUT)
    assert committed_steps(dirs[0]) == [STEPS]
    reference_state = _merge(first)
    # The model has two layers of which each pipeline stage holds one: every key is here.
    assert len(reference_state["model"]) == 4 and len(reference_state["optimizer"]) >= 8
    reference_logits = first[0]["logits"][0]
    assert reference_logits.shape == (8, 4)
    _assert_logits(reference_logits, first, "saving layout")
    where = f"{a}"
    for i, layout in enumerate(chain):
        where += f" -> {layout}"
        results = run_distributed(reshard_worker, layout[0], *layout[1:], dirs[i], dirs[i + 1], timeout_seconds=TIMEOUT)
        _assert_same(reference_state, _merge(results), where)
        _assert_logits(reference_logits, results, where)


@pytest.mark.distributed
@pytest.mark.slow
def test_dp2_tp2_to_pp2_and_back(tmp_path):
    # (dp2, tp2, pp1) on 4 ranks -> (dp1, tp1, pp2) on 2 ranks -> (dp2, tp2, pp1).
    _round_trip(tmp_path, (4, 2, 1, 1, None), (2, 1, 2, 1, None))


@pytest.mark.distributed
@pytest.mark.slow
def test_dp4_to_tp2_pp2_and_back(tmp_path):
    # (dp4, tp1, pp1) -> (dp1, tp2, pp2) -> (dp4, tp1, pp1), all on 4 ranks.
    _round_trip(tmp_path, (4, 1, 1, 1, None), (4, 2, 2, 1, None))


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_pp2_to_zero1_dp2_to_one_process_and_back(tmp_path):
    # (dp2, pp2, ZeRO-3) on 4 ranks -> (dp2, ZeRO-1) on 2 -> one process -> (dp2, pp2, ZeRO-3).
    _round_trip(tmp_path, (4, 1, 2, 3, None), (2, 1, 1, 1, None), (1, 1, 1, 0, None))


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_to_plain_dp_and_back(tmp_path):
    # (dp4 as shard 2 × replicate 2, ZeRO-3) -> (dp4, ZeRO-0) -> (dp2, tp2, ZeRO-3) -> HSDP.
    _round_trip(tmp_path, (4, 1, 1, 3, 2), (4, 1, 1, 0, None), (4, 2, 1, 3, None))


def weights_only_worker(zero: int, load_dir: str | None, save_dir: str | None) -> dict[str, torch.Tensor]:
    """Train and save, or load the model weights only (``load_optimizer_states=False``); the gathered model."""
    if load_dir is None:
        trainer = build_trainer(2, 1, {"train_iterations": STEPS, "save_dir": save_dir}, zero_stage=zero)
        trainer.run_training()
    else:
        settings = {"train_iterations": STEPS, "load_dir": load_dir, "load_optimizer_states": False}
        trainer = build_trainer(2, 1, settings, zero_stage=zero)
    return _gathered_state(trainer)["model"]


@pytest.mark.distributed
def test_weights_only_load_reaches_the_zero3_shards(tmp_path):
    # Under ZeRO-3 the optimizer's parameter shards are the only lasting copy of the weights:
    # a load that skips the optimizer state must still put the loaded weights there.
    saved = run_distributed(weights_only_worker, 4, 3, None, str(tmp_path), timeout_seconds=TIMEOUT)
    loaded = run_distributed(weights_only_worker, 4, 3, str(tmp_path), None, timeout_seconds=TIMEOUT)
    for before, after in zip(saved, loaded):
        assert set(after) == set(before)
        for key, value in before.items():
            assert torch.equal(after[key], value), key
