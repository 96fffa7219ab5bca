"""BaseTrainer checkpoints across layouts: state bitwise equal, logits within 1e-6 (fp32).

A trainer trains a few steps at one (dp, tp, pp) layout and saves; trainers at other
layouts load that checkpoint (BaseTrainer(load_dir=...)) and save it again, and the
first layout loads it back. At every stop the gathered (full) model and optimizer state
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
    model = model_state_dict(list(module.named_parameters_with_meta()), topology)
    opt = trainer.optimizer.state_dict()
    return {
        "model": {k: _full(v) for k, v in model.items()},
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


def reshard_worker(tp: int, pp: int, load_dir: str | None, save_dir: str) -> dict[str, Any]:
    """Train ``STEPS`` steps and save (no ``load_dir``), or load and save again; return state and logits."""
    if load_dir is None:
        trainer = build_trainer(tp, pp, {"train_iterations": STEPS, "save_dir": save_dir})
        trainer.run_training()
    else:
        trainer = build_trainer(tp, pp, {"train_iterations": STEPS, "load_dir": load_dir})
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


def _round_trip(tmp_path: Path, a: tuple[int, int, int], b: tuple[int, int, int]) -> None:
    """Save at layout ``a`` = (world, tp, pp), load at ``b`` and save, load back at ``a``."""
    dirs = [str(tmp_path / name) for name in ("a", "b", "a2")]
    first = run_distributed(reshard_worker, a[0], a[1], a[2], None, dirs[0], timeout_seconds=TIMEOUT)
    assert committed_steps(dirs[0]) == [STEPS]
    reference_state = _merge(first)
    # The model has two layers of which each pipeline stage holds one: every key is here.
    assert len(reference_state["model"]) == 4 and len(reference_state["optimizer"]) >= 8
    reference_logits = first[0]["logits"][0]
    assert reference_logits.shape == (8, 4)
    _assert_logits(reference_logits, first, "saving layout")
    second = run_distributed(reshard_worker, b[0], b[1], b[2], dirs[0], dirs[1], timeout_seconds=TIMEOUT)
    _assert_same(reference_state, _merge(second), f"{a} -> {b}")
    _assert_logits(reference_logits, second, f"{a} -> {b}")
    back = run_distributed(reshard_worker, a[0], a[1], a[2], dirs[1], dirs[2], timeout_seconds=TIMEOUT)
    _assert_same(reference_state, _merge(back), f"{a} -> {b} -> {a}")
    _assert_logits(reference_logits, back, f"{a} -> {b} -> {a}")


@pytest.mark.distributed
@pytest.mark.slow
def test_dp2_tp2_to_pp2_and_back(tmp_path):
    # (dp2, tp2, pp1) on 4 ranks -> (dp1, tp1, pp2) on 2 ranks -> (dp2, tp2, pp1).
    _round_trip(tmp_path, (4, 2, 1), (2, 1, 2))


@pytest.mark.distributed
@pytest.mark.slow
def test_dp4_to_tp2_pp2_and_back(tmp_path):
    # (dp4, tp1, pp1) -> (dp1, tp2, pp2) -> (dp4, tp1, pp1), all on 4 ranks.
    _round_trip(tmp_path, (4, 1, 1), (4, 2, 2))
