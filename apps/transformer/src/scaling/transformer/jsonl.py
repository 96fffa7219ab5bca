"""Prompt/completion fine-tuning data: one ``{"prompt": ..., "completion": ...}`` object per JSONL line.

Each example becomes one window of ``sequence_length`` inputs: ``prompt + completion + <eod>``
tokens (``<|endoftext|>`` when the tokenizer has it), right-padded with ``<eod>`` (or id 0). Targets are the inputs shifted by one; a target's loss
weight is 1 when it is a completion token (or the closing ``<eod>``) and 0 for prompt tokens
and padding, so the loss is the cross-entropy over the completion only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaling.data import BaseDataset, LMPackingItem, segment_positions, stack_windows
from scaling.transformer.corpus import EOD_TOKEN
from scaling.transformer.data import TransformerBatch


@dataclass
class PromptCompletionItem(LMPackingItem):
    """An :class:`LMPackingItem` plus ``loss_weights`` (``[s]`` float32, 1 on completion targets)."""

    loss_weights: np.ndarray


def read_prompt_completion(path: str | Path) -> list[tuple[str, str]]:
    """``(prompt, completion)`` of every non-blank line of ``path``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: naming the file and line for invalid JSON or a missing / non-string field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.finetuning_jsonl={str(path)!r} does not exist")
    pairs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err}); write one JSON object per line") from err
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a {type(record).__name__}, expected an object with prompt/completion")
        for field in ("prompt", "completion"):
            if not isinstance(record.get(field), str):
                raise ValueError(
                    f"{path}:{number}: field {field!r} is {record.get(field)!r}; every line needs string "
                    'fields "prompt" and "completion"'
                )
        pairs.append((record["prompt"], record["completion"]))
    if not pairs:
        raise ValueError(f"{path}: no examples; write one {{'prompt': ..., 'completion': ...}} object per line")
    return pairs


class PromptCompletionDataset(BaseDataset[PromptCompletionItem, TransformerBatch]):
    """Prompt/completion examples, one per window, loss on the completion tokens only.

    Args:
        path: the JSONL file.
        tokenizer: a ``tokenizers.Tokenizer`` (the app's BPE; ``<|endoftext|>`` ends each example).
        sequence_length: inputs per window; longer examples are cut at the end.
        vocab_size: the model's vocabulary (token ids must stay below it).

    Raises:
        ValueError: when an example's prompt fills the whole window (no completion token would be
            trained) or the tokenizer's ids exceed ``vocab_size``.
    """

    # Any: a tokenizers.Tokenizer (optional package, no type information).
    def __init__(self, path: str | Path, tokenizer: Any, sequence_length: int, vocab_size: int) -> None:
        self.path, self.sequence_length = Path(path), sequence_length
        eod = tokenizer.token_to_id(EOD_TOKEN)
        self.pad_id = 0 if eod is None else int(eod)
        self.examples: list[tuple[list[int], list[int]]] = []
        for number, (prompt, completion) in enumerate(read_prompt_completion(path), 1):
            p_ids = tokenizer.encode(prompt).ids
            c_ids = tokenizer.encode(completion).ids + ([] if eod is None else [eod])
            if len(p_ids) >= sequence_length:
                raise ValueError(
                    f"{path}: example {number} has a {len(p_ids)}-token prompt, which fills data.sequence_length="
                    f"{sequence_length} and leaves no completion token; raise sequence_length or shorten it"
                )
            largest = max(p_ids + c_ids, default=0)
            if largest >= vocab_size:
                raise ValueError(
                    f"{path}: example {number} has token id {largest} but transformer_architecture.vocab_size="
                    f"{vocab_size}; set vocab_size to the tokenizer's vocabulary size"
                )
            self.examples.append((p_ids, c_ids))

    def ident(self) -> str:
        return f"prompt_completion:{self.path}:s{self.sequence_length}"

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> PromptCompletionItem:
        s = self.sequence_length
        p_ids, c_ids = self.examples[int(index)]
        ids = (p_ids + c_ids)[: s + 1]
        real = len(ids)
        window = np.full(s + 1, self.pad_id, dtype=np.int64)
        window[:real] = ids
        # Target j is token j + 1: a completion token when j + 1 >= len(prompt), real when j + 1 < real.
        j = np.arange(s)
        weights = ((j + 1 >= len(p_ids)) & (j + 1 < real)).astype(np.float32)
        # Padding after the example is its own segment, so bidirectional models do not see it either.
        cu = np.array([0, real, s] if real < s else [0, s], dtype=np.int32)
        return PromptCompletionItem(window[:-1], window[1:], segment_positions(cu), cu, weights)

    def collate(self, items: list[PromptCompletionItem]) -> TransformerBatch:
        return TransformerBatch(
            **stack_windows(items, self.sequence_length),
            loss_weights=torch.from_numpy(np.stack([it.loss_weights for it in items])),
        )
