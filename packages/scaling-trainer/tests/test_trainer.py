"""BaseTrainer end to end on real gloo ranks: bitwise resume, SIGTERM, config errors."""

import gc
import os
import time

import pytest
import torch
from pydantic import ValidationError
from trainer_model import build_trainer, loss_function, train_worker

from scaling.testing import run_distributed
from scaling.trainer import TrainerConfig, committed_steps, exit_code_for

LAYOUTS = [pytest.param(2, 1, id="dp2-tp2"), pytest.param(1, 2, id="pp2-dp2")]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_bitwise_resume_with_dropout_and_zero1(tmp_path, tp, pp):
    ckpt = str(tmp_path / "ckpt")
    continuous = run_distributed(train_worker, 4, tp, pp, {"train_iterations": 10}, timeout_seconds=240)
    # Saved asynchronously (staged into the trainer's kept CPU buffers), every 3 steps: steps 4-6
    # change the parameters while step 3's files are written.
    saving = {"train_iterations": 6, "save_dir": ckpt, "save_interval": 3, "async_save": True}
    run_distributed(train_worker, 4, tp, pp, saving, timeout_seconds=240)
    assert committed_steps(ckpt) == [3, 6]
    resumed = run_distributed(train_worker, 4, tp, pp, {"train_iterations": 10, "load_dir": ckpt}, timeout_seconds=240)
    for rank in range(4):
        assert resumed[rank]["losses"] == continuous[rank]["losses"][6:], f"rank {rank}"
        assert resumed[rank]["hash"] == continuous[rank]["hash"], f"rank {rank}"
    # Dropout is on and seeded: another seed gives other parameters.
    other = run_distributed(train_worker, 4, tp, pp, {"train_iterations": 10, "seed": 7}, timeout_seconds=240)
    assert other[0]["hash"] != continuous[0]["hash"]


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_on_one_rank_saves_and_continues_bitwise(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    continuous = run_distributed(train_worker, 4, 2, 1, {"train_iterations": 8}, timeout_seconds=240)
    stopped = run_distributed(
        train_worker, 4, 2, 1, {"train_iterations": 8, "save_dir": ckpt}, sigterm_at=(3, 3), timeout_seconds=240
    )
    # Every rank stopped after the same step, with the documented code.
    assert [r["exit_code"] for r in stopped] == [exit_code_for(15)] * 4 == [143] * 4
    assert [r["step"] for r in stopped] == [3] * 4
    assert committed_steps(ckpt) == [3]
    resumed = run_distributed(train_worker, 4, 2, 1, {"train_iterations": 8, "load_dir": ckpt}, timeout_seconds=240)
    for rank in range(4):
        assert resumed[rank]["losses"] == continuous[rank]["losses"][3:]
        assert resumed[rank]["hash"] == continuous[rank]["hash"]


def gc_worker(trainer: dict, thawed: bool = False) -> dict:
    """Train recording the collector's passes, (step, generation, automatic), and whether it was on in each loss.

    ``thawed``: start with nothing frozen, as in a fresh process (pooled workers freeze what they
    import), and freeze it again afterwards.
    """
    on_in_loss: list[bool] = []
    frozen_in_loss: list[int] = []

    def loss(*args):
        on_in_loss.append(gc.isenabled())
        frozen_in_loss.append(gc.get_freeze_count())
        return loss_function(*args)

    trainer_obj = build_trainer(1, 1, trainer, loss=loss)
    passes: list[tuple[int, int, bool]] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":  # an automatic pass runs with the collector enabled, a gc.collect() call without
            passes.append((trainer_obj.context.iterations, info["generation"], gc.isenabled()))

    frozen_before = gc.get_freeze_count()
    if thawed:
        gc.unfreeze()
    gc.callbacks.append(record)
    try:
        trainer_obj.run_training()
    finally:
        gc.callbacks.remove(record)
    frozen_after = gc.get_freeze_count()
    if thawed:
        gc.freeze()
    return {
        "passes": passes,
        "on_in_loss": on_in_loss,
        "enabled_after": gc.isenabled(),
        "frozen": (frozen_before, frozen_in_loss, frozen_after),
    }


@pytest.mark.distributed
def test_garbage_collection_runs_only_between_steps(tmp_path):
    # 7 steps, a young pass every 2, evaluation at 3 and a save at the end: full passes there.
    trainer = {"train_iterations": 7, "gc_interval": 2, "eval_interval": 3, "save_dir": str(tmp_path / "ckpt")}
    for out in run_distributed(gc_worker, 2, trainer, True, timeout_seconds=120):
        passes = out["passes"]
        manual = [i for i, (_, _, automatic) in enumerate(passes) if not automatic]
        assert [passes[i][:2] for i in manual] == [(0, 2), (2, 1), (3, 2), (4, 1), (6, 2), (7, 2)], passes
        # Off inside every step: no automatic pass from the first manual one to the last (before
        # and after the loop the collector is on, and may run while run_training sets up or ends).
        assert out["on_in_loss"] and not any(out["on_in_loss"])
        assert not any(automatic for _, _, automatic in passes[manual[0] : manual[-1] + 1]), passes
        assert out["enabled_after"]
        # The trainer freezes nothing.
        _, frozen_in_loss, frozen_after = out["frozen"]
        assert set(frozen_in_loss) == {0} and frozen_after == 0, out["frozen"]
    # Objects the caller froze stay frozen (the count only drops, as frozen objects are freed).
    for out in run_distributed(gc_worker, 2, {"train_iterations": 2, "gc_interval": 1}, timeout_seconds=120):
        frozen_before, frozen_in_loss, frozen_after = out["frozen"]
        assert all(0 < count <= frozen_before for count in [*frozen_in_loss, frozen_after]), out["frozen"]
    # gc_interval=None leaves the collector alone: on inside the steps, never called by the trainer.
    for out in run_distributed(gc_worker, 2, {"train_iterations": 3, "gc_interval": None}, True, timeout_seconds=120):
        assert out["on_in_loss"] and all(out["on_in_loss"])
        assert all(automatic for _, _, automatic in out["passes"]), out["passes"]
        assert out["enabled_after"]
        assert set(out["frozen"][1]) == {0}


def test_trainer_config_errors():
    with pytest.raises(ValidationError, match=r"trainer.save_interval=5 needs trainer.save_dir"):
        TrainerConfig(save_interval=5)
    with pytest.raises(ValidationError, match=r"train_iterations\n  Input should be greater than or equal to 1"):
        TrainerConfig(train_iterations=0)
    with pytest.raises(ValidationError, match=r"gc_interval\n  Input should be greater than or equal to 1"):
        TrainerConfig(gc_interval=0)


@pytest.mark.distributed
def test_fine_tune_from_weights_only(tmp_path):
    """load_optimizer_states=False and load_context=False: weights load, counters start at 0."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_worker, 2, 1, 1, {"train_iterations": 3, "save_dir": ckpt}, timeout_seconds=180)
    out = run_distributed(
        train_worker,
        2,
        1,
        1,
        {"train_iterations": 2, "load_dir": ckpt, "load_optimizer_states": False, "load_context": False},
        timeout_seconds=180,
    )
    fresh = run_distributed(train_worker, 2, 1, 1, {"train_iterations": 2}, timeout_seconds=180)
    assert [r["step"] for r in out] == [2, 2]
    # Trained weights were loaded: the first loss differs from a fresh start's.
    assert out[0]["losses"][0] != fresh[0]["losses"][0]


@pytest.mark.distributed
def test_the_same_command_again_resumes_then_finds_the_run_finished(tmp_path):
    """trainer.resume=auto (the default): a run into a save_dir holding committed checkpoints
    continues the latest bitwise; run once more it trains nothing and returns; resume=fresh deletes
    them and starts at step 0; load_dir elsewhere is refused before training."""
    ckpt = str(tmp_path / "ckpt")
    continuous = run_distributed(train_worker, 2, 1, 1, {"train_iterations": 6}, timeout_seconds=180)
    run_distributed(train_worker, 2, 1, 1, {"train_iterations": 3, "save_dir": ckpt}, timeout_seconds=180)
    again = {"train_iterations": 6, "save_dir": ckpt}
    second = run_distributed(train_worker, 2, 1, 1, again, timeout_seconds=180)
    assert [r["losses"] for r in second] == [r["losses"][3:] for r in continuous]
    assert [r["hash"] for r in second] == [r["hash"] for r in continuous]
    finished = run_distributed(train_worker, 2, 1, 1, again, timeout_seconds=180)
    assert [(r["losses"], r["step"], r["hash"]) for r in finished] == [([], 6, r["hash"]) for r in continuous]
    assert committed_steps(ckpt) == [3, 6]
    fresh = run_distributed(train_worker, 2, 1, 1, {**again, "resume": "fresh"}, timeout_seconds=180)
    assert [r["losses"] for r in fresh] == [r["losses"] for r in continuous]
    assert committed_steps(ckpt) == [6]
    elsewhere = {**again, "load_dir": str(tmp_path / "other")}
    with pytest.raises(Exception, match=r"already holds committed checkpoints \(steps 6..6\).*trainer.resume=fresh"):
        run_distributed(train_worker, 2, 1, 1, elsewhere, timeout_seconds=180)


def _late_rank_1_worker(trainer):
    if os.environ["RANK"] == "1":
        time.sleep(3)  # rank 0 has deleted the checkpoints (resume=fresh) by the time rank 1 looks
    return train_worker(1, 1, trainer)


@pytest.mark.distributed
def test_resume_fresh_with_a_late_rank_agrees_on_what_was_there(tmp_path):
    """Every rank acts on rank 0's one reading of save_dir: a rank reading for itself after rank 0's
    deletion saw no checkpoint, skipped the barrier after the deletion and left rank 0 waiting in it."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_worker, 2, 1, 1, {"train_iterations": 2, "save_dir": ckpt}, timeout_seconds=180)
    fresh = {"train_iterations": 2, "save_dir": ckpt, "resume": "fresh"}
    again = run_distributed(_late_rank_1_worker, 2, fresh, timeout_seconds=60)
    assert [len(r["losses"]) for r in again] == [2, 2]
    assert committed_steps(ckpt) == [2]


def _deterministic_context_worker(deterministic):
    from scaling.topology import Topology, TopologyConfig, use_deterministic_algorithms
    from scaling.trainer import BaseContext, TrainerConfig, TrainingAppConfig

    config = TrainingAppConfig(
        topology=TopologyConfig(world_size=1, device="cpu"), trainer=TrainerConfig(deterministic=deterministic)
    )
    try:
        BaseContext(config=config, topology=Topology(config.topology, 0)).initialize(seed=1)
        return torch.are_deterministic_algorithms_enabled()
    finally:
        use_deterministic_algorithms(False)


@pytest.mark.distributed
def test_the_context_chooses_deterministic_kernels_before_the_model_is_built():
    """`trainer.deterministic` takes effect at `context.initialize`, before any model or product exists."""
    assert run_distributed(_deterministic_context_worker, 1, True) == [True]
    assert run_distributed(_deterministic_context_worker, 1, False) == [False]


def test_an_app_config_describes_its_launch_in_one_line():
    from scaling.topology import TopologyConfig
    from scaling.trainer import TrainingAppConfig
    from scaling.trainer.loggers import LoggerConfig

    topology = TopologyConfig(model_parallel_size=2, pipe_parallel_size=2, data_parallel_size=4, expert_parallel_size=2)
    config = TrainingAppConfig(
        topology=topology,
        logger=LoggerConfig(log_dir="runs/x"),
        trainer=TrainerConfig(train_iterations=300, save_dir="runs/x/ckpt"),
    )
    assert config.describe_launch() == (
        "16 rank(s) (tp 2 x pp 2 x dp 4, experts over ep 2 of dp), 300 steps; metrics in runs/x, "
        "checkpoints in runs/x/ckpt"
    )
    alone = TrainingAppConfig(topology=TopologyConfig(world_size=1), trainer=TrainerConfig(train_iterations=5))
    assert alone.describe_launch() == "1 rank(s) (one process), 5 steps"
