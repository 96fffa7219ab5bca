"""How a sequence is laid out over the context-parallel ranks: the zigzag split.

The sequence is cut into ``2 * cp`` equal chunks and CP rank ``r`` holds chunks ``r``
and ``2 cp - 1 - r``, in that order. Under a causal mask every rank then has the same
amount of attention work: an early chunk, which sees little, with a late one, which
sees much (Megatron-Core's load balancing).
"""

from __future__ import annotations

import torch


def zigzag_indices(seq_len: int, rank: int, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of CP rank ``rank``'s tokens: chunks ``rank`` and ``2 size - 1 - rank`` of ``2 size``.

    Raises:
        ValueError: when ``seq_len`` is not a multiple of ``2 * size``.
    """
    if seq_len % (2 * size):
        raise ValueError(
            f"context parallelism: sequence length {seq_len} is not divisible by 2 × context_parallel_size = "
            f"{2 * size} (the zigzag split); choose a sequence length that is a multiple of {2 * size}"
        )
    if size == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat((first, first + (2 * size - 1 - 2 * rank) * chunk))


def split_sequence(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """CP rank ``rank``'s tokens of ``x`` along ``dim`` (the zigzag split), a new tensor; ``x`` when ``size`` is 1.

    Raises:
        ValueError: when ``x.shape[dim]`` is not a multiple of ``2 * size``.
    """
    if size == 1:
        return x
    n = x.shape[dim]
    zigzag_indices(n, rank, size)  # validates the length
    chunk = n // (2 * size)
    return torch.cat((x.narrow(dim, rank * chunk, chunk), x.narrow(dim, (2 * size - 1 - rank) * chunk, chunk)), dim)
