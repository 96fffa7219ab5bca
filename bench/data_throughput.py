"""Tokens per second of LMPackingDataset + DataLoader, as a multiple of a training step's consumption.

The reference consumer is measured in the same run: a tiny GPT-like decoder (plain
PyTorch, CPU, same sequence length and micro-batch size) doing forward + backward +
AdamW step. The transformer app does not exist yet; this stands in for it, and a real
model consumes tokens far more slowly, so the multiple here is a lower bound.

    python bench/data_throughput.py                       # defaults below
    python bench/data_throughput.py --sequence-length 2048 --workers 0 2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from scaling.data import DataLoader, LMPackingDataset, MMapTokenBuilder, MMapTokenDataset


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


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(x)


def consumer_tokens_per_second(args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    s, b = args.sequence_length, args.micro_batch_size
    model = TinyGPT(args.vocab_size, args.hidden, args.layers, args.heads, s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab_size, (b, s + 1))
    pos = torch.arange(s).expand(b, s)

    def step() -> None:
        logits = model(ids[:, :-1], pos)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(args.model_steps):
        step()
    return args.model_steps * b * s / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-tokens", type=int, default=4_000_000, help="synthetic corpus size")
    p.add_argument("--vocab-size", type=int, default=32_000)
    p.add_argument("--sequence-length", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--loader-steps", type=int, default=300)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--hidden", type=int, default=128, help="consumer: hidden size")
    p.add_argument("--layers", type=int, default=2, help="consumer: decoder layers")
    p.add_argument("--heads", type=int, default=4, help="consumer: attention heads")
    p.add_argument("--model-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tokens = build_corpus(Path(tmp) / "corpus", args.num_tokens, args.vocab_size)
        consumer = consumer_tokens_per_second(args)
        print(
            f"consumer: TinyGPT d={args.hidden} layers={args.layers} heads={args.heads} vocab={args.vocab_size} "
            f"seq={args.sequence_length} batch={args.micro_batch_size}, forward+backward+AdamW on CPU "
            f"({args.threads} threads): {consumer:,.0f} tokens/s"
        )
        print(f"corpus: {tokens.num_tokens:,} tokens in {tokens.num_documents:,} documents (uint16)")
        print(f"{'loader':<28}{'tokens/s':>14}{'x consumer':>12}")
        for workers in args.workers:
            rate = loader_tokens_per_second(tokens, args, workers)
            print(f"{f'LMPackingDataset workers={workers}':<28}{rate:>14,.0f}{rate / consumer:>11.1f}x")


if __name__ == "__main__":
    main()
