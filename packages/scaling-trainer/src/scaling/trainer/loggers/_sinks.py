"""Metric sinks: console line, JSONL, TensorBoard, Weights & Biases (imported lazily)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from scaling.config import JsonMapping

# Keys shown first, in this order, on the console line; the rest follow sorted.
_CONSOLE_ORDER = (
    "loss",
    "evaluation/loss",
    "learning_rate",
    "grad_norm",
    "loss_scale",
    "step_duration",
    "samples_per_second",
    "tokens_per_second",
)


def _fmt(value: float) -> str:
    if value == 0 or (1e-3 <= abs(value) < 1e5):
        return f"{value:.4g}"
    return f"{value:.3e}"


def console_line(step: int, metrics: dict[str, float]) -> str:
    keys = [k for k in _CONSOLE_ORDER if k in metrics] + sorted(k for k in metrics if k not in _CONSOLE_ORDER)
    return f"step {step} | " + " | ".join(f"{k} {_fmt(metrics[k])}" for k in keys)


class Sink(Protocol):
    """Where a logged step's metrics go."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logger.info(console_line(step, metrics))

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per log call, each with ``run``: the attempt that wrote it.

    ``run`` is the UTC time the logger was made (``20261128T101500Z``): a resumed run appends
    under a new one, and :meth:`resume` first drops the rows after the step it resumed from,
    which the new attempt trains again (TensorBoard's ``purge_step``), so the file holds one
    training row per step.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.run = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.file = open(path, "a")  # noqa: SIM115 - lives as long as the logger

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, "run": self.run, **clean}, sort_keys=True) + "\n")
        self.file.flush()

    def resume(self, step: int) -> None:
        """Drop the rows of steps after ``step`` (rewritten atomically), then append as before."""
        self.file.close()
        kept = [line for line in self.path.read_text().splitlines(keepends=True) if _row_step(line) <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)
        self.file = open(self.path, "a")  # noqa: SIM115 - lives as long as the logger

    def close(self) -> None:
        self.file.close()


def _row_step(line: str) -> float:
    """The step of one JSONL row (a row that does not parse counts as after every step)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def resume(self, step: int) -> None:
        """Hide the events of steps after ``step`` from TensorBoard (its ``purge_step``)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run. The API key is read by wandb from the environment; we never touch it."""

    def __init__(
        self,
        log_dir: Path,
        project: str,
        entity: str | None,
        mode: Literal["online", "offline"],
        name: str | None,
        config: JsonMapping | None,
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("use_wandb=True needs wandb: pip install 'scaling-trainer[wandb]'") from e
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            entity=entity,
            mode=mode,
            name=name,
            dir=str(log_dir),
            config=None if config is None else dict(config),
            reinit="create_new",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()
