"""scaling.trainer: BaseTrainer, BaseContext, checkpoints, metrics loggers, signal handling."""

from scaling.trainer._config import TrainerConfig
from scaling.trainer._context import BaseContext
from scaling.trainer._profiler import ProfilerConfig, StepProfiler
from scaling.trainer._signals import HANDLED_SIGNALS, exit_code_for
from scaling.trainer._trainer import BaseTrainer
from scaling.trainer.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    PendingSave,
    committed_steps,
    load_checkpoint,
    load_model_state_dict,
    model_state_dict,
    new_checkpoint_group,
    save_checkpoint,
)
from scaling.trainer.loggers import LoggerConfig, MetricsLogger, logger

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
    "TrainerConfig",
    "committed_steps",
    "exit_code_for",
    "load_checkpoint",
    "load_model_state_dict",
    "model_state_dict",
    "new_checkpoint_group",
    "logger",
    "save_checkpoint",
]
