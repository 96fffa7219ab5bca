"""LMPackingDataset: fixed-length language-model windows over memory-mapped documents."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from scaling.data._base import BaseDataset, BaseDatasetBatch, BaseDatasetItem, _map_tensors
from scaling.data._tokens import MMapTokenDataset
from scaling.topology import split_sequence


@dataclass
class LMPackingItem(BaseDatasetItem):
    """One window: ``sequence_length`` inputs and their next-token targets.

    ``cumulative_seq_lengths`` are the document boundaries inside the window
    (``[0, ..., sequence_length]``, int32), as ``flash_attn_varlen`` expects them;
    ``position_ids`` restart at 0 at the window start and at every document start.
    """

    input_token_ids: np.ndarray
    target_token_ids: np.ndarray
    position_ids: np.ndarray
    cumulative_seq_lengths: np.ndarray


@dataclass
class LMPackingBatch(BaseDatasetBatch):
    """A micro-batch of windows (``b`` = batch, ``s`` = sequence length).

    Attributes:
        input_token_ids: ``[b, s]`` int64.
        target_token_ids: ``[b, s]`` int64, the inputs shifted left by one token.
        position_ids: ``[b, s]`` int64, restarting at each document.
        cumulative_seq_lengths: ``[num_segments + 1]`` int32 over the flattened batch
            (window ``i`` starts at ``i * s``), for document-masked (varlen) attention.
    """

    input_token_ids: torch.Tensor | None
    target_token_ids: torch.Tensor | None
    position_ids: torch.Tensor | None
    cumulative_seq_lengths: torch.Tensor | None

    def only_inputs(self) -> LMPackingBatch:
        return replace(self, target_token_ids=None)

    def only_targets(self) -> LMPackingBatch:
        return replace(self, input_token_ids=None, position_ids=None, cumulative_seq_lengths=None)

    def context_parallel_split(self, rank: int, size: int) -> LMPackingBatch:
        """Every ``[b, s, ...]`` tensor field cut to CP rank ``rank``'s zigzag slice of the sequence.

        ``cumulative_seq_lengths`` stays whole: attention needs every document boundary of
        the whole sequences. Fields a subclass adds (``[b, s]`` loss weights, say) are cut too.
        """
        return _map_tensors(self, lambda t: split_sequence(t, 1, rank, size) if t.dim() >= 2 else t)


def segment_positions(cumulative_seq_lengths: np.ndarray) -> np.ndarray:
    """Position ids of a window that restart at 0 at every segment start.

    ``cumulative_seq_lengths`` are the window's segment boundaries ``[0, ..., s]``; the result
    is ``[s]`` int64.
    """
    cu = cumulative_seq_lengths.astype(np.int64)
    return np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], np.diff(cu))


def stack_windows(items: Sequence[LMPackingItem], sequence_length: int) -> dict[str, torch.Tensor]:
    """The :class:`LMPackingBatch` fields of ``items`` (windows of ``sequence_length``) stacked.

    Inputs, targets and position ids become ``[b, s]``; every window's segment boundaries
    are offset by its start in the flattened batch (``i * s``) and joined into one
    ``cumulative_seq_lengths``. Datasets whose items extend :class:`LMPackingItem` build
    their batch from this plus their own fields.
    """
    s = sequence_length
    cu = [np.zeros(1, dtype=np.int32)] + [it.cumulative_seq_lengths[1:] + i * s for i, it in enumerate(items)]
    return {
        "input_token_ids": torch.from_numpy(np.stack([it.input_token_ids for it in items])),
        "target_token_ids": torch.from_numpy(np.stack([it.target_token_ids for it in items])),
        "position_ids": torch.from_numpy(np.stack([it.position_ids for it in items])),
        "cumulative_seq_lengths": torch.from_numpy(np.concatenate(cu).astype(np.int32)),
    }


class LMPackingDataset(BaseDataset[LMPackingItem, LMPackingBatch]):
    """Fixed-length windows over the concatenation of a token dataset's documents.

    Window ``i`` reads ``sequence_length + 1`` tokens (inputs and the shifted targets).
    By default windows tile the concatenated stream and may span documents; position
    ids and cumulative sequence lengths mark where each document starts, so attention
    can be masked per document. With ``within_document_only=True`` windows tile each
    document separately and never cross a boundary (short documents and tails that do
    not fill a window are dropped).

    Args:
        tokens: the memory-mapped documents.
        sequence_length: tokens per window (inputs; targets are shifted by one).
        within_document_only: keep only windows inside one document.

    Raises:
        ValueError: when ``sequence_length < 1`` or the data holds no complete window.
    """

    def __init__(self, tokens: MMapTokenDataset, sequence_length: int, within_document_only: bool = False) -> None:
        if isinstance(sequence_length, bool) or not isinstance(sequence_length, int) or sequence_length < 1:
            raise ValueError(f"sequence_length={sequence_length!r} must be an int >= 1")
        self.tokens = tokens
        self.sequence_length = sequence_length
        self.within_document_only = within_document_only
        self._offsets = tokens.document_offsets
        if within_document_only:
            lengths = tokens.document_lengths
            per_doc = np.maximum(lengths - 1, 0) // sequence_length
            doc_of_window = np.repeat(np.arange(len(lengths)), per_doc)
            first_window = np.cumsum(per_doc) - per_doc
            k = np.arange(int(per_doc.sum())) - first_window[doc_of_window]
            self._starts: np.ndarray | None = self._offsets[doc_of_window] + k * sequence_length
            self._num_windows = len(self._starts)
        else:
            self._starts = None
            self._num_windows = max(tokens.num_tokens - 1, 0) // sequence_length
        if self._num_windows == 0:
            mode = "inside one document" if within_document_only else "in the concatenated documents"
            raise ValueError(
                f"LMPackingDataset: {tokens.prefix} holds no window of sequence_length={sequence_length} {mode} "
                f"(needs sequence_length + 1 tokens; {tokens.num_tokens} tokens in {tokens.num_documents} documents); "
                "use a shorter sequence_length or more data"
            )

    def ident(self) -> str:
        mode = "doc" if self.within_document_only else "concat"
        return f"pack:{self.tokens.ident()}:s{self.sequence_length}:{mode}"

    def __len__(self) -> int:
        return self._num_windows

    def window_start(self, index: int) -> int:
        """Position of window ``index``'s first token in the concatenated documents."""
        if not 0 <= index < self._num_windows:
            raise IndexError(f"window index {index} out of range for {self._num_windows} windows")
        return int(self._starts[index]) if self._starts is not None else index * self.sequence_length

    def __getitem__(self, index: int) -> LMPackingItem:
        s = self.sequence_length
        start = self.window_start(int(index))
        window = self.tokens.tokens(start, start + s + 1).astype(np.int64)
        # Document starts strictly inside the input window; empty documents repeat an
        # offset, hence unique().
        lo = np.searchsorted(self._offsets, start, side="right")
        hi = np.searchsorted(self._offsets, start + s, side="left")
        inner = np.unique(self._offsets[lo:hi]) - start
        cu = np.concatenate(([0], inner, [s])).astype(np.int32)
        return LMPackingItem(window[:-1], window[1:], segment_positions(cu), cu)

    def collate(self, items: list[LMPackingItem]) -> LMPackingBatch:
        return LMPackingBatch(**stack_windows(items, self.sequence_length))
