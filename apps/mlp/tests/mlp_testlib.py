"""Shared pieces of the MLP app tests: a small config, a training worker, MNIST IDX writers."""

from __future__ import annotations

import copy
import gzip
import struct
from typing import Any

import numpy as np
import yaml

from scaling.mlp import train
from scaling.mlp.__main__ import DEFAULT_CONFIG


def small_config(tp: int = 1, pp: int = 1, dp: int = 1, steps: int = 20, **sections: dict[str, Any]) -> dict[str, Any]:
    """The bundled config at another layout and length, with no saving or evaluation."""
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg["topology"].update(model_parallel_size=tp, pipe_parallel_size=pp, data_parallel_size=dp)
    cfg["topology"].update(global_batch_size=60, micro_batch_size=30 // dp if dp <= 2 else 5, timeout_seconds=60)
    cfg["runner"]["nproc_per_node"] = tp * pp * dp
    cfg["trainer"].update(
        train_iterations=steps, eval_interval=None, save_dir=None, save_interval=None, log_interval=10
    )
    cfg["logger"].update(log_dir=None)
    cfg["learning_rate_scheduler"].update(
        learning_rate_decay_iters=steps, learning_rate_warmup_steps=min(10, steps // 2)
    )
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return copy.deepcopy(cfg)


def train_worker(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs on every rank of scaling.testing.run_distributed; returns the metric history."""
    return train.main(cfg)


def losses(history: list[dict[str, Any]]) -> list[float]:
    return [m["training/loss"] for m in history if "training/loss" in m]


def final_accuracy(history: list[dict[str, Any]]) -> float:
    return [m["evaluation/accuracy"] for m in history if "evaluation/accuracy" in m][-1]


def write_idx(path, array, code=0x08):
    header = struct.pack(">BBBB", 0, 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(">u1" if code == 0x08 else array.dtype).tobytes()
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def write_mnist(folder, n_train=12, n_test=6, gz=False):
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", rng.integers(0, 10, (n,), dtype=np.uint8))
