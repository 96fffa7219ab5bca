"""Token data for the transformer: packed LM windows with optional per-token loss weights."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from scaling.data import LMPackingBatch, LMPackingDataset, LMPackingItem, MMapTokenDataset

if TYPE_CHECKING:
    from scaling.transformer.config import TransformerConfig


@dataclass
class TransformerBatch(LMPackingBatch):
    """An :class:`LMPackingBatch` plus ``loss_weights`` (``[b, s]`` float or None = all 1).

    A weight of 0 removes a target from the loss (e.g. prompt tokens when fine-tuning on
    completions); the loss is ``sum(w * ce) / sum(w)``.
    """

    loss_weights: torch.Tensor | None = None


class TransformerDataset(LMPackingDataset):
    """:class:`LMPackingDataset` whose batches are :class:`TransformerBatch` es."""

    def collate(self, items: list[LMPackingItem]) -> TransformerBatch:
        batch = super().collate(items)
        return TransformerBatch(**{f.name: getattr(batch, f.name) for f in fields(batch)})


def open_tokens(prefix: str | Path, vocab_size: int, field: str) -> MMapTokenDataset:
    """Open memory-mapped tokens and check every id is below the model's ``vocab_size``.

    Raises:
        ValueError: naming ``field`` when the files hold an id ``>= vocab_size``.
    """
    tokens = MMapTokenDataset(prefix)
    if tokens.num_tokens:
        largest = int(np.max(tokens.tokens(0, tokens.num_tokens)))
        if largest >= vocab_size:
            raise ValueError(
                f"{field}={str(prefix)!r} holds token id {largest} but transformer_architecture.vocab_size="
                f"{vocab_size}; set vocab_size to at least {largest + 1} (the tokenizer's vocabulary size)"
            )
    return tokens


def tokenizer_path(config: TransformerConfig) -> Path:
    """``data.tokenizer_path``, or the tokenizer next to the default corpus."""
    from scaling.transformer.corpus import default_paths

    return Path(config.data.tokenizer_path or default_paths(config.data.default_corpus_dir)["tokenizer"])
