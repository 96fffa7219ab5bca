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

# The console's brief line: (label, metric key) in this order; the first lr_ key stands for the LR.
_BRIEF = (
    ("loss", "training/loss"),
    ("acc", "training/accuracy"),
    ("eval loss", "evaluation/loss"),
    ("eval acc", "evaluation/accuracy"),
    ("lr", "training/lr_*"),
    ("gnorm", "training/global_grad_norm"),
    ("tok/s", "runtime/tokens_per_second"),
    ("samples/s", "runtime/samples_per_second"),
    ("mfu", "runtime/mfu"),
    ("s/step", "runtime/step_duration"),
)
CONSOLE_WIDTH = 120  # characters of a brief line, its time stamp included
_STAMP = len("07:49:30 ")


def _fmt(value: float) -> str:
    if value == 0 or (1e-3 <= abs(value) < 1e5):
        return f"{value:.4g}"
    return f"{value:.3e}"


def duration(seconds: float) -> str:
    """``95`` as ``1m35s``, ``4000`` as ``1h06m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def console_line(
    step: int,
    metrics: dict[str, float],
    total: int | None = None,
    eta_s: float | None = None,
    brief: bool = False,
) -> str:
    """``step 20/300 | loss 2.299 | ... | eta 1m05s``.

    ``brief``: the few figures a person follows (loss, accuracy, LR, gradient norm, throughput,
    MFU, step time), cut to :data:`CONSOLE_WIDTH` with the ETA kept; else every metric, sorted.
    """
    head = f"step {step}/{total}" if total is not None else f"step {step}"
    tail = [f"eta {duration(eta_s)}"] if eta_s is not None else []
    if not brief:
        return " | ".join([head, *(f"{k} {_fmt(metrics[k])}" for k in sorted(metrics)), *tail])
    parts = []
    for label, key in _BRIEF:
        if key.endswith("*"):
            key = next((k for k in sorted(metrics) if k.startswith(key[:-1])), "")
        if key not in metrics or (label == "samples/s" and "runtime/tokens_per_second" in metrics):
            continue
        value = metrics[key]
        if label == "mfu":
            parts.append(f"mfu {value:.1%}")
        elif label.endswith("/s") and value >= 100:
            parts.append(f"{label} {value:.0f}")
        else:
            parts.append(f"{label} {_fmt(value)}")
    while parts and len(" | ".join([head, *parts, *tail])) > CONSOLE_WIDTH - _STAMP:
        parts.pop()
    return " | ".join([head, *parts, *tail])


class Sink(Protocol):
    """Where a logged step's metrics go."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """One line per logged step on the console; after :meth:`start`, ``step N/total`` and an ETA."""

    def __init__(self, logger: logging.Logger, brief: bool = True) -> None:
        self.logger = logger
        self.brief = brief
        self.total: int | None = None
        self._origin: tuple[int, float] | None = None

    def start(self, step: int, total: int) -> None:
        """Training runs from ``step`` to ``total``: lines say ``step N/total`` and estimate the rest."""
        self.total, self._origin = total, (step, time.monotonic())

    def log(self, step: int, metrics: dict[str, float]) -> None:
        eta = None
        if self._origin is not None and self.total is not None and self._origin[0] < step < self.total:
            first, at = self._origin
            eta = (time.monotonic() - at) / (step - first) * (self.total - step)
        self.logger.info(console_line(step, metrics, self.total, eta, self.brief))

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
