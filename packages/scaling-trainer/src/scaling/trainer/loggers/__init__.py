"""scaling.trainer.loggers: metric sinks (console, JSONL, TensorBoard, Weights & Biases)."""

from scaling.trainer.loggers._config import LoggerConfig
from scaling.trainer.loggers._logger import MetricsLogger
from scaling.trainer.loggers._process_logger import ScalingLogger, logger
from scaling.trainer.loggers._sinks import console_line

__all__ = ["LoggerConfig", "MetricsLogger", "ScalingLogger", "console_line", "logger"]
