"""scaling.trainer: the training step, BaseTrainer, BaseContext, checkpoints, metrics loggers, signal handling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scaling.trainer import checkpoint
from scaling.trainer._app_config import TrainingAppConfig
from scaling.trainer._config import TrainerConfig
from scaling.trainer._context import BaseContext
from scaling.trainer._profiler import ProfilerConfig, StepProfiler, device_peak_flops
from scaling.trainer._signals import HANDLED_SIGNALS, exit_code_for
from scaling.trainer._step import TrainStepOutput, evaluation_step, train_step
from scaling.trainer._trainer import BaseTrainer
from scaling.trainer.checkpoint import CheckpointError, committed_steps
from scaling.trainer.loggers import LoggerConfig, MetricsLogger, logger

if TYPE_CHECKING:
    from scaling.trainer.checkpoint import (
        LoadedCheckpoint,
        PendingSave,
        load_checkpoint,
        load_model_state_dict,
        model_state_dict,
        new_checkpoint_group,
        save_checkpoint,
    )


# Any: a module __getattr__ returns whichever name was asked for (mypy types each name
# from its definition; this is only the fallback for imports at run time).
def __getattr__(name: str) -> Any:
    """The checkpoint names that need DCP, imported on first use (see scaling.trainer.checkpoint)."""
    if name in checkpoint.__all__:
        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HANDLED_SIGNALS",
    "BaseContext",
    "BaseTrainer",
    "CheckpointError",
    "LoadedCheckpoint",
    "LoggerConfig",
    "MetricsLogger",
    "PendingSave",
    "ProfilerConfig",
    "StepProfiler",
    "TrainStepOutput",
    "TrainerConfig",
    "TrainingAppConfig",
    "committed_steps",
    "device_peak_flops",
    "evaluation_step",
    "exit_code_for",
    "load_checkpoint",
    "load_model_state_dict",
    "model_state_dict",
    "new_checkpoint_group",
    "logger",
    "save_checkpoint",
    "train_step",
]
