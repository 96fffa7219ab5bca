"""What a trainer checkpoint holds, and saving/loading it through scaling.trainer.checkpoint.

Sharded, layout-independent state (model parameters and optimizer state as DTensors
keyed by ``meta.key``) goes to DCP shards, so it reshards on load. Counters, the
data-loader position and the config go to ``extra.json``; RNG states are per rank and
restored only when the world size is unchanged (another layout has other streams).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from scaling.data import DataLoader
from scaling.trainer import checkpoint as ckpt
from scaling.trainer._config import TrainerConfig
from scaling.trainer._context import BaseContext
from scaling.trainer.checkpoint._marker import step_dir_name
from scaling.trainer.loggers import MetricsLogger

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scaling.config import StateDict
    from scaling.optim import Optimizer
    from scaling.pipeline import ParallelModule
    from scaling.trainer.checkpoint import PendingSave, StagingBuffers


class CheckpointedTrainer(Protocol):
    """The parts of a trainer whose state a checkpoint holds (``BaseTrainer`` has them)."""

    config: TrainerConfig
    parallel_module: ParallelModule
    optimizer: Optimizer
    loader: DataLoader[Any]  # Any: the batches are the user's dataset's (BaseTrainer is not generic in them)
    metrics_logger: MetricsLogger

    @property
    # Read-only: BaseTrainer's is a BaseContext subclass. Any: the config type is the app's.
    def context(self) -> BaseContext[Any]: ...

    def wait_for_parameters(self) -> None: ...

    def whole_parameters(self) -> AbstractContextManager[None]: ...

    def parameters_loaded(self) -> None: ...


class TrainerCheckpointer:
    """Saves and restores one trainer's full state."""

    def __init__(self, trainer: CheckpointedTrainer) -> None:
        self.trainer = trainer
        self._pending: PendingSave | None = None
        self._group: ProcessGroup | None = None
        self._staging: StagingBuffers | None = None  # made by the first asynchronous save, then reused
        self.last_loaded_step: int | None = None
        self.last_saved_step: int | None = None

    def _state(self) -> StateDict:
        t = self.trainer
        t.wait_for_parameters()  # the last step's gathers may still be in flight
        return {
            "model": ckpt.model_state_dict(list(t.parallel_module.named_parameters_with_meta()), t.context.topology),
            "optimizer": t.optimizer.state_dict(),
        }

    def _extra(self) -> StateDict:
        t = self.trainer
        return {
            "context": t.context.state_dict(),
            "data_loader": t.loader.state_dict(),
            "world_size": t.context.topology.world_size,
            "config": t.context.config.as_dict(),
        }

    def save(self, save_dir: Path) -> None:
        """Save the current step (once); the previous asynchronous save is finished first."""
        t = self.trainer
        if self.last_saved_step == t.context.iterations:
            return
        self.wait()
        if t.config.async_save:
            if self._group is None and dist.is_initialized():
                self._group = ckpt.new_checkpoint_group()
            if self._staging is None:
                self._staging = ckpt.StagingBuffers()
        # ZeRO-3 parameters are whole while the save reads them (an asynchronous save has
        # copied them into its staging buffers when save_checkpoint returns).
        with t.whole_parameters():
            self._pending = ckpt.save_checkpoint(
                save_dir,
                t.context.iterations,
                self._state(),
                t.context.topology,
                extra=self._extra(),
                rank_state=t.context.rng_state(),
                keep_last=t.config.keep_last_n_checkpoints,
                async_save=t.config.async_save,
                process_group=self._group,
                staging=self._staging,
            )
        self.last_saved_step = t.context.iterations
        if not t.config.async_save:
            self.wait()

    def last_saved_path(self) -> Path | None:
        """The folder of the checkpoint this run saved last, or None."""
        save_dir, step = self.trainer.config.save_dir, self.last_saved_step
        return None if save_dir is None or step is None else save_dir / step_dir_name(step)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def start(self) -> None:
        """Load what the run starts from, by ``trainer.load_dir`` and ``trainer.resume``.

        With ``resume="auto"`` and no ``load_dir``, committed checkpoints in ``save_dir`` are
        resumed from (a second run of the same command continues the first). ``load_dir``
        elsewhere while ``save_dir`` already holds committed checkpoints is refused before
        training: the new run's saves would collide with them or be pruned in their favour.
        ``resume="fresh"`` deletes them (rank 0, then a barrier) and says what it deleted.

        Raises:
            CheckpointError: ``save_dir`` holds another run's checkpoints and ``load_dir``
                names another folder (``resume="auto"``).
        """
        t = self.trainer
        cfg = t.config
        save_dir, load_dir = cfg.save_dir, cfg.load_dir
        steps = self._committed_steps_seen_by_rank_0(save_dir)
        if steps:
            assert save_dir is not None
            if cfg.resume == "fresh":
                t.metrics_logger.console(
                    f"trainer.resume=fresh: deleting the {len(steps)} committed checkpoint(s) in {save_dir} "
                    f"(steps {steps[0]}..{steps[-1]}) before training"
                )
                if t.context.topology.global_rank == 0:
                    ckpt.delete_checkpoints(save_dir)
                if dist.is_initialized():
                    dist.barrier()
            elif load_dir is None:
                load_dir = save_dir
            elif load_dir.resolve() != save_dir.resolve():
                raise ckpt.CheckpointError(
                    f"trainer.save_dir={save_dir} already holds committed checkpoints (steps {steps[0]}..{steps[-1]}) "
                    f"while trainer.load_dir={load_dir} is another folder: this run's saves would collide with them. "
                    "Save into a new folder, resume from it (trainer.load_dir=null), or delete them first with "
                    "trainer.resume=fresh"
                )
        if load_dir is not None:
            self.load(load_dir)

    def _committed_steps_seen_by_rank_0(self, save_dir: Path | None) -> list[int]:
        """The committed steps of ``save_dir``, read once by global rank 0 and sent to every rank: each
        rank acts on one view (a slower rank reading for itself could find rank 0's resume=fresh
        deletion done, skip the barrier after it and leave rank 0 waiting there)."""
        if save_dir is None:
            return []
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return ckpt.committed_steps(save_dir)
        box: list[list[int] | None] = [ckpt.committed_steps(save_dir) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        return box[0]

    def load(self, load_dir: Path) -> None:
        """Restore the latest committed checkpoint in ``load_dir`` (layout may differ)."""
        t = self.trainer
        cfg = t.config
        with t.whole_parameters():  # ZeRO-3: DCP loads into the gathered parameters
            template = self._state()
            if not cfg.load_optimizer_states:
                template.pop("optimizer")
            loaded = ckpt.load_checkpoint(
                load_dir,
                template,
                t.context.topology,
                fallback_to_previous=cfg.fallback_to_previous_checkpoint,
                allowed_missing=cfg.allowed_missing_keys_in_checkpoint,
                allowed_unexpected=cfg.allowed_unexpected_keys_in_checkpoint,
                # Without optimizer states the checkpoint's optimizer keys are simply not read.
                ignored=[*cfg.ignore_keys_in_checkpoint, *([] if cfg.load_optimizer_states else [r"optimizer\..*"])],
            )
            ckpt.load_model_state_dict(list(t.parallel_module.named_parameters_with_meta()), loaded.state["model"])
            # The optimizer's master weights / ZeRO-3 shards start from the loaded parameters
            # (its own state, loaded next, overrides them where it has them).
            t.parameters_loaded()
        if "optimizer" in template:
            t.optimizer.load_state_dict(loaded.state["optimizer"])
        extra = loaded.extra
        if cfg.load_context:
            t.context.load_state_dict(extra["context"])
            t.loader.load_state_dict(extra["data_loader"])
            if extra.get("world_size") == t.context.topology.world_size and loaded.rank_state is not None:
                t.context.load_rng_state(loaded.rank_state)
        self.last_loaded_step = loaded.step
        t.metrics_logger.console(f"loaded checkpoint step {loaded.step} from {loaded.path}")
        t.metrics_logger.resumed_at(t.context.iterations)
