"""MetricsLogger: one call per step fans the metrics out to the configured sinks (rank 0)."""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from scaling.trainer.loggers._config import LoggerConfig
from scaling.trainer.loggers._sinks import ConsoleSink, JsonlSink, Sink, TensorBoardSink, WandbSink, duration

if TYPE_CHECKING:
    from scaling.config import JsonMapping
    from scaling.topology import Topology

LOGGER_NAME = "scaling.trainer.metrics"


def _to_float(key: str, value: object) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor of shape {list(value.shape)}; log a scalar")
        return float(value.detach().float().item())
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} has type {type(value).__name__}; metrics must be numbers or 1-element tensors")


class MetricsLogger:
    """Writes metrics to a console line, JSONL, TensorBoard and W&B from global rank 0.

    Args:
        config: the sinks; ``None`` = a console line only.
        topology: decides the writing rank (``None`` = this process writes).
        run_config: a JSON-able dict stored with the W&B run (e.g. ``config.as_dict()``,
            which leaves secrets out).

    Example::

        logger = MetricsLogger(LoggerConfig(log_dir="runs/1", use_tensorboard=True), topology=topo)
        logger.log({"loss": 2.3, "learning_rate": 1e-3}, step=10)
        logger.close()
    """

    def __init__(
        self,
        config: LoggerConfig | None = None,
        topology: Topology | None = None,
        run_config: JsonMapping | None = None,
    ) -> None:
        self.config = config or LoggerConfig()
        self.is_writer = topology is None or topology.global_rank == 0
        self.logger = logging.getLogger(LOGGER_NAME)
        self.logger.setLevel(self.config.log_level)
        if not self.logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
            self.logger.addHandler(handler)
            self.logger.propagate = False
        self.sinks: list[Sink] = []
        self._origin: tuple[int, int, float] | None = None  # (first step, last step, when), set by start()
        if not self.is_writer:
            return
        self.sinks.append(ConsoleSink(self.logger, brief=self.config.console == "brief"))
        cfg, log_dir = self.config, self.config.log_dir
        if log_dir is None:
            if cfg.use_tensorboard or cfg.use_wandb:
                raise ValueError("LoggerConfig.log_dir=None but use_tensorboard/use_wandb is set; set log_dir")
            return
        if cfg.use_jsonl:
            self.sinks.append(JsonlSink(log_dir / "metrics.jsonl"))
        if cfg.use_tensorboard:
            self.sinks.append(TensorBoardSink(log_dir / "tensorboard"))
        if cfg.use_wandb:
            self.sinks.append(
                WandbSink(
                    log_dir,
                    cfg.wandb_project,
                    cfg.wandb_entity,
                    cfg.wandb_mode,
                    cfg.wandb_run_name,
                    dict(run_config or {}),
                )
            )

    def log(self, metrics: JsonMapping, step: int) -> None:
        """Log scalar ``metrics`` at ``step`` to every sink (no-op off rank 0).

        Non-numeric entries (e.g. a ``"step"`` counter) are dropped from the sinks.

        Raises:
            ValueError/TypeError: a metric is a multi-element tensor / not a number.
        """
        if not self.is_writer:
            return
        values = {k: _to_float(k, v) for k, v in metrics.items() if k != "step" and not isinstance(v, (str, bool))}
        for sink in self.sinks:
            sink.log(step, values)

    def start(self, step: int, total: int) -> None:
        """Training runs from ``step`` to ``total`` now: the console says ``step N/total`` and an ETA."""
        self._origin = (step, total, time.monotonic())
        for sink in self.sinks:
            if isinstance(sink, ConsoleSink):
                sink.start(step, total)

    def finish(self, step: int, history: Sequence[JsonMapping], checkpoint: Path | None = None) -> None:
        """The closing console line after :meth:`start`: steps and time, the last figures of ``history``
        (the logged metrics), and what was written, e.g. ``done: step 300/300 (300 trained in 1m25s) |
        loss 0.05 | eval loss 0.09 | eval acc 0.98 | checkpoint runs/mlp/checkpoints/step_00000300 |
        metrics runs/mlp/metrics.jsonl``."""
        if self._origin is None:
            return
        first, total, at = self._origin
        parts = [f"done: step {step}/{total} ({step - first} trained in {duration(time.monotonic() - at)})"]
        last = {k: v for m in history for k, v in m.items() if isinstance(v, float)}
        for label, key in (
            ("loss", "training/loss"),
            ("eval loss", "evaluation/loss"),
            ("eval acc", "evaluation/accuracy"),
        ):
            if key in last:
                parts.append(f"{label} {last[key]:.4g}")
        if checkpoint is not None:
            parts.append(f"checkpoint {checkpoint}")
        if self.config.log_dir is not None and self.config.use_jsonl:
            parts.append(f"metrics {self.config.log_dir / 'metrics.jsonl'}")
        self.console(" | ".join(parts))

    def resumed_at(self, step: int) -> None:
        """The run resumed from ``step``: sinks that can drop what was logged after it do
        (``metrics.jsonl``'s rows, TensorBoard's events), since those steps run again."""
        for sink in self.sinks:
            resume = getattr(sink, "resume", None)
            if resume is not None:
                resume(step)

    def console(self, message: str) -> None:
        """Print a one-off message on the writing rank (e.g. the MFU formula, a signal)."""
        if self.is_writer:
            self.logger.info(message)

    def close(self) -> None:
        """Flush and close every sink (finishes the W&B run); safe to call twice."""
        for sink in self.sinks:
            sink.close()
        self.sinks = []
