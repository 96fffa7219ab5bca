"""Parameter bytes per rank of a small transformer block at TP = 1, 2, 4, against theory.

Run: python bench/param_bytes.py [--hidden 64] [--vocab 1001]

Each TP rank builds the same model (vocab-parallel embedding over an odd vocabulary, two
blocks of RMSNorm + GQA attention + RMSNorm + SwiGLU MLP, final norm) and sums the bytes
of its local parameters. Theory, from the parameter metas alone:

    per_rank = split_total / tp + replicated

where ``split_total`` counts TP-split parameters at their padded size (the vocabulary is
padded to a multiple of tp) and ``replicated`` counts the parameters every TP rank keeps
(norms, row-parallel biases, and the key/value projections when there are fewer kv heads
than TP ranks). The two must match exactly; the ratio to TP = 1 is printed too.
"""

from __future__ import annotations

import argparse
import math

import torch

from scaling.nn import (
    AttentionConfig,
    ParallelSelfAttention,
    ParallelSwiGLUMLP,
    RMSNorm,
    VocabParallelEmbedding,
    get_parameter_meta,
)
from scaling.testing import make_topology, run_distributed


def build(topology, hidden: int, vocab: int, kv_heads: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [VocabParallelEmbedding(vocab, hidden, topology=topology)]
    for _ in range(2):
        layers += [
            RMSNorm(hidden, topology=topology),
            ParallelSelfAttention(AttentionConfig(hidden, 8, kv_heads, fused_qkv=False), topology=topology),
            RMSNorm(hidden, topology=topology),
            ParallelSwiGLUMLP(hidden, 4 * hidden, topology=topology),
        ]
    layers.append(RMSNorm(hidden, topology=topology))
    return torch.nn.ModuleList(layers)


def measure(tp: int, hidden: int, vocab: int, kv_heads: int) -> dict[str, int]:
    topo = make_topology(model_parallel_size=tp)
    model = build(topo, hidden, vocab, kv_heads)
    local = split_total = replicated = 0
    for p in model.parameters():
        meta = get_parameter_meta(p)
        nbytes = p.numel() * p.element_size()
        local += nbytes
        if meta.parallel_dim is None or tp == 1:
            replicated += nbytes
        else:
            # From the meta, not the local tensor: the logical shape with the split dim
            # padded to a multiple of tp (only the vocabulary ever needs padding).
            shape = list(meta.logical_shape)
            shape[meta.parallel_dim] = -(-shape[meta.parallel_dim] // tp) * tp
            split_total += math.prod(shape) * p.element_size()
    return {"local": local, "split_total": split_total, "replicated": replicated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1001)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args()
    print(f"hidden={args.hidden} vocab={args.vocab} heads=8 kv_heads={args.kv_heads} fp32")
    print(f"{'tp':>3} {'bytes/rank':>12} {'split/tp+replicated':>20} {'replicated':>11} {'exact':>6} {'vs tp=1':>8}")
    base = None
    for tp in (1, 2, 4):
        results = run_distributed(measure, tp, tp, args.hidden, args.vocab, args.kv_heads, timeout_seconds=120)
        local = max(r["local"] for r in results)
        r0 = results[0]
        theory = r0["split_total"] // tp + r0["replicated"] if tp > 1 else r0["replicated"]
        base = base or local
        exact = all(r["local"] == theory for r in results)
        print(f"{tp:>3} {local:>12,} {theory:>20,} {r0['replicated']:>11,} {exact!s:>6} {local / base:>8.3f}")


if __name__ == "__main__":
    main()
