"""Shared pieces of the transformer app tests: a tiny corpus, a tiny config, a training worker."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from scaling.topology import Topology, use_deterministic_algorithms
from scaling.transformer import train
from scaling.transformer.__main__ import DEFAULT_CONFIG
from scaling.transformer.config import TransformerConfig
from scaling.transformer.corpus import preprocess
from scaling.transformer.data import TransformerBatch

TINY_MODULES = ("colorsys", "bisect", "heapq", "fnmatch", "getopt", "glob", "quopri", "sched", "numbers", "shlex")
TINY_VOCAB = 300


def build_tiny_corpus(root: Path) -> Path:
    """A ~10-module corpus with a 300-token BPE (a few seconds)."""
    preprocess(root, vocab_size=TINY_VOCAB, modules=TINY_MODULES)
    return root


def tiny_config(
    corpus: Path, tp: int = 1, pp: int = 1, dp: int = 1, steps: int = 10, cp: int = 1, **sections: dict[str, Any]
) -> dict[str, Any]:
    """The bundled config shrunk: hidden 32, 2 layers, GQA 4/2 heads, sequence 16, no saving."""
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg["topology"] = dict(
        model_parallel_size=tp,
        pipe_parallel_size=pp,
        data_parallel_size=dp,
        context_parallel_size=cp,
        global_batch_size=8,
        micro_batch_size=2,
        device="cpu",
        timeout_seconds=60,
    )
    cfg["runner"]["nproc_per_node"] = tp * pp * dp * cp
    cfg["trainer"].update(
        train_iterations=steps, eval_interval=None, save_dir=None, save_interval=None, log_interval=steps
    )
    cfg["logger"].update(log_dir=None)
    cfg["learning_rate_scheduler"].update(learning_rate_decay_iters=max(steps, 4), learning_rate_warmup_steps=2)
    cfg["transformer_architecture"] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        max_sequence_length=64,
    )
    cfg["data"] = dict(sequence_length=16, default_corpus_dir=str(corpus))
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return copy.deepcopy(cfg)


def train_worker(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs on every rank of scaling.testing.run_distributed; returns the metric history.

    A config that chose ``trainer.deterministic`` has torch's deterministic kernels switched
    off again afterwards: the pooled worker runs other tests next."""
    try:
        return train.main(cfg)
    finally:
        if cfg.get("trainer", {}).get("deterministic"):
            use_deterministic_algorithms(False)


def losses(history: list[dict[str, Any]], key: str = "training/loss") -> list[float]:
    return [m[key] for m in history if key in m]


def logits_worker(cfg: dict[str, Any], ids: torch.Tensor) -> torch.Tensor | None:
    """Runs on every rank: the model of ``cfg`` at its layout, loaded from ``trainer.load_dir``, on the
    plain batch ``ids`` (forward-only schedule). Returns the whole-vocabulary logits ``[b, s, V]`` on
    the last pipeline stage (gathered over TP), None elsewhere."""
    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    try:
        trainer = train.build_trainer(config, topology)
        batch = TransformerBatch(ids, ids, None, None)
        seen: list[torch.Tensor] = []

        def keep(output: Any, targets: Any) -> tuple[torch.Tensor, dict[str, float]]:
            seen.append(output.logits.detach())
            return output.logits.sum() * 0, {}

        trainer.parallel_module.eval()
        trainer.parallel_module.run_schedule([batch], keep, forward_only=True)
        if not seen:
            return None
        tp, logits = topology.axis("tp"), seen[0].contiguous()
        if tp.size > 1:
            blocks = [torch.empty_like(logits) for _ in range(tp.size)]
            dist.all_gather(blocks, logits, group=tp.group)
            logits = torch.cat(blocks, -1)
        return logits[..., : config.transformer_architecture.vocab_size]
    finally:
        topology.destroy()
