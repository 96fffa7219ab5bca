"""A loss/accuracy plot of a finished run, as PNG (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaling.config import Metrics


def plot_history(history: list[Metrics], path: Path) -> Path:
    """Training loss, evaluation loss and evaluation accuracy against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(m["step"], m["training/loss"]) for m in history if "training/loss" in m]
    evals = [m for m in history if "evaluation/loss" in m]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    if train:
        ax_loss.plot(*zip(*train), label="training loss")
    if evals:
        ax_loss.plot([m["step"] for m in evals], [m["evaluation/loss"] for m in evals], "o-", label="evaluation loss")
        if "evaluation/accuracy" in evals[0]:
            ax_acc.plot([m["step"] for m in evals], [m["evaluation/accuracy"] for m in evals], "o-", color="C2")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("evaluation accuracy")
    ax_acc.set_ylim(top=1.0)  # the curve's own range below: a 0-1 axis lays a 0.95-0.99 curve flat
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def read_metrics(path: Path) -> list[Metrics]:
    """The rows of a ``metrics.jsonl`` (every attempt of a resumed run), in file order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
