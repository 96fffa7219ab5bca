"""Tokens per second of LMPackingDataset + DataLoader, as a multiple of a training step's consumption.

The consumer is measured in the same run: one training step of the transformer app
(scaling.transformer) in one CPU process, built from its bundled config.yml (model shape,
optimizer, weight decay groups, document masking): ``scaling.trainer.train_step`` with the
app's loss and ``scaling.optim.Optimizer``, on batches of the same packing dataset. The
loader runs at the config's sequence length and micro-batch size, so both sides move
the same batches.

    python bench/data_throughput.py                       # the bundled config's seq 128, batch 16
    python bench/data_throughput.py --sequence-length 1024 --micro-batch-size 8 --workers 0 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from scaling.data import DataLoader, LMPackingDataset, MMapTokenBuilder, MMapTokenDataset
from scaling.optim import Optimizer
from scaling.pipeline import ParallelModule
from scaling.topology import Topology
from scaling.trainer import train_step
from scaling.transformer.__main__ import DEFAULT_CONFIG
from scaling.transformer.config import TransformerConfig
from scaling.transformer.data import TransformerDataset
from scaling.transformer.model import TransformerLoss, layer_specs
from scaling.transformer.train import parameter_groups


def build_corpus(prefix: Path, num_tokens: int, vocab_size: int) -> MMapTokenDataset:
    rng = np.random.default_rng(0)
    written = 0
    with MMapTokenBuilder(prefix, dtype=np.uint16) as builder:
        while written < num_tokens:
            n = int(rng.geometric(1 / 800))  # documents of ~800 tokens, some long, many short
            builder.add_document(rng.integers(0, vocab_size, size=n, dtype=np.int64))
            written += n
    return MMapTokenDataset(prefix)


def loader_tokens_per_second(tokens: MMapTokenDataset, args: argparse.Namespace, workers: int) -> float:
    ds = LMPackingDataset(tokens, args.sequence_length)
    loader = DataLoader(
        ds,
        seed=0,
        global_batch_size=args.micro_batch_size,
        micro_batch_size=args.micro_batch_size,
        data_parallel_rank=0,
        data_parallel_size=1,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
    )
    for _ in range(3):  # warm-up: start workers, fill the prefetch queue, first epoch permutation
        next(loader)
    start = time.perf_counter()
    for _ in range(args.loader_steps):
        next(loader)
    return args.loader_steps * args.micro_batch_size * args.sequence_length / (time.perf_counter() - start)


def app_config(args: argparse.Namespace) -> TransformerConfig:
    """The bundled config, at the bench's sequence length and micro-batch size (one process, CPU)."""
    overrides = [
        f"data.sequence_length={args.sequence_length}",
        f"topology.global_batch_size={args.micro_batch_size}",
        f"topology.micro_batch_size={args.micro_batch_size}",
        "topology.device=cpu",
    ]
    if args.sequence_length > 1024:  # the bundled max_sequence_length; positions must cover the window
        overrides.append(f"transformer_architecture.max_sequence_length={args.sequence_length}")
    return TransformerConfig.from_yaml(DEFAULT_CONFIG, overrides=overrides)


def consumer_tokens_per_second(cfg: TransformerConfig, tokens: MMapTokenDataset, args: argparse.Namespace) -> float:
    """Tokens/s of the app's training step (median step time); batches are collated before timing."""
    arch = cfg.transformer_architecture
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a bench is its own runner
    with tempfile.TemporaryDirectory() as rdzv:
        topo = Topology(cfg.topology, 0).initialize_distributed(f"file://{rdzv}/rdzv")
        try:
            module = ParallelModule(
                layer_specs(arch, topo), topo, schedule=cfg.training.schedule, seed=cfg.trainer.seed
            )
            optimizer = Optimizer(config=cfg.optimizer, parameter_groups=parameter_groups(module, cfg), topology=topo)
            loss_fn = TransformerLoss(arch.vocab_size, topo)
            ds = TransformerDataset(tokens, args.sequence_length)
            b = args.micro_batch_size
            batches = [ds.collate([ds[i * b + j] for j in range(b)]) for i in range(args.model_steps + 1)]

            def step(batch: object) -> None:
                train_step(
                    module, [batch], optimizer, loss_fn, sync_batch_to_model_parallel=ds.sync_batch_to_model_parallel
                )

            step(batches[0])  # warm-up
            times = []
            for batch in batches[1:]:
                start = time.perf_counter()
                step(batch)
                times.append(time.perf_counter() - start)
        finally:
            topo.destroy()
    # The median: on a shared machine a few steps stall behind other processes; the faster
    # consumer this gives makes the printed multiple the conservative one.
    return b * args.sequence_length / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-tokens", type=int, default=4_000_000, help="synthetic corpus size")
    p.add_argument("--sequence-length", type=int, default=None, help="default: the bundled config's")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the bundled config's")
    p.add_argument("--loader-steps", type=int, default=1000)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--model-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bundled = TransformerConfig.from_yaml(DEFAULT_CONFIG)
    args.sequence_length = args.sequence_length or bundled.data.sequence_length
    args.micro_batch_size = args.micro_batch_size or bundled.topology.micro_batch_size
    cfg = app_config(args)
    arch = cfg.transformer_architecture

    with tempfile.TemporaryDirectory() as tmp:
        tokens = build_corpus(Path(tmp) / "corpus", args.num_tokens, arch.vocab_size)
        consumer = consumer_tokens_per_second(cfg, tokens, args)
        print(
            f"consumer: scaling.transformer train step, bundled config (hidden {arch.hidden_size}, "
            f"{arch.num_layers} layers, {arch.num_attention_heads} heads, {arch.mlp_type}, vocab {arch.vocab_size}, "
            f"document_masking={arch.document_masking}), seq {args.sequence_length}, batch {args.micro_batch_size}, "
            f"1 process on CPU ({args.threads} threads): {consumer:,.0f} tokens/s"
        )
        print(f"corpus: {tokens.num_tokens:,} tokens in {tokens.num_documents:,} documents (uint16)")
        print(f"{'loader':<28}{'tokens/s':>14}{'x consumer':>12}")
        for workers in args.workers:
            rate = loader_tokens_per_second(tokens, args, workers)
            print(f"{f'LMPackingDataset workers={workers}':<28}{rate:>14,.0f}{rate / consumer:>11.1f}x")


if __name__ == "__main__":
    main()
