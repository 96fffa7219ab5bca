"""Token data for the transformer: packed LM windows with optional per-token loss weights."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from scaling.data import BaseDataset, BlendedDataset, LMPackingBatch, LMPackingDataset, LMPackingItem, MMapTokenDataset

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


def build_datasets(config: TransformerConfig) -> tuple[BaseDataset[Any, Any], BaseDataset[Any, Any] | None]:
    """The training and (optional) evaluation datasets the ``data`` section describes.

    ``data.finetuning_jsonl``: prompt/completion examples; ``data.blend``: token datasets mixed by
    weight (``trainer.train_iterations * topology.global_batch_size`` samples); ``data.data_prefix``:
    one token dataset; none of them: the default corpus built by ``preprocess``.
    """
    from scaling.transformer.corpus import default_paths

    data, vocab, seq = config.data, config.transformer_architecture.vocab_size, config.data.sequence_length
    if data.finetuning_jsonl is not None:
        from tokenizers import Tokenizer

        from scaling.transformer.jsonl import PromptCompletionDataset

        path = tokenizer_path(config)
        if not path.is_file():
            raise FileNotFoundError(
                f"data.tokenizer_path={str(path)!r} does not exist; data.finetuning_jsonl needs the tokenizer "
                "(set data.tokenizer_path or run `scaling-transformer preprocess`)"
            )
        tokenizer = Tokenizer.from_file(str(path))
        evaluation = data.finetuning_jsonl_evaluation
        return PromptCompletionDataset(data.finetuning_jsonl, tokenizer, seq, vocab), (
            None if evaluation is None else PromptCompletionDataset(evaluation, tokenizer, seq, vocab)
        )
    eval_prefix = data.evaluation_prefix
    if data.blend:
        sources = [
            TransformerDataset(open_tokens(s.prefix, vocab, f"data.blend[{i}].prefix"), seq)
            for i, s in enumerate(data.blend)
        ]
        batch = config.topology.global_batch_size
        assert batch is not None  # TopologyConfig derives every size it was not given
        num_samples = config.trainer.train_iterations * batch
        dataset: BaseDataset[Any, Any] = BlendedDataset(
            sources, [s.weight for s in data.blend], num_samples, seed=config.trainer.seed
        )
    else:
        train_prefix = data.data_prefix
        if train_prefix is None:
            paths = default_paths(data.default_corpus_dir)
            train_prefix = paths["train"]
            eval_prefix = eval_prefix or paths["validation"]
        dataset = TransformerDataset(open_tokens(train_prefix, vocab, "data.data_prefix"), seq)
    dataset_evaluation = None
    if eval_prefix is not None:
        dataset_evaluation = TransformerDataset(open_tokens(eval_prefix, vocab, "data.evaluation_prefix"), seq)
    return dataset, dataset_evaluation
