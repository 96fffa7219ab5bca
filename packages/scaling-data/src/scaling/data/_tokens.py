"""MMapTokenDataset: read-only, memory-mapped documents of token ids."""

from __future__ import annotations

import os
import zlib
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from scaling.data._mmap import HEADER_SIZE, TokenFileError, paths, read_header, token_dtype

if TYPE_CHECKING:
    from scaling.config import StateDict

_CRC_CHUNK = 1 << 24


class MMapTokenDataset:
    """The documents of a ``.bin`` / ``.idx`` pair, memory-mapped (nothing is read up front).

    ``dataset[d]`` is document ``d`` as a numpy view; :meth:`tokens` slices the
    concatenation of all documents. Pickling stores only the path, so worker processes
    re-open the files instead of copying them.

    Args:
        prefix: path without ``.bin`` / ``.idx``.
        dtype: the dtype the caller expects; ``None`` accepts the file's.
        verify_data: also check the CRC-32 of the whole ``.bin`` (reads every byte once).

    Raises:
        TokenFileError: (a ``ValueError``) when either file is missing, truncated,
            corrupted, or of another dtype than ``dtype``; the message names the file.
    """

    def __init__(
        self, prefix: str | os.PathLike[str], dtype: npt.DTypeLike | None = None, verify_data: bool = False
    ) -> None:
        self.prefix = str(prefix)
        self._expected_dtype = None if dtype is None else token_dtype(dtype)
        self._verify_data = verify_data
        self._open()

    def _open(self) -> None:
        bin_path, idx_path = paths(self.prefix)
        header = read_header(idx_path)
        self.dtype: np.dtype = header["dtype"]
        if self._expected_dtype is not None and self._expected_dtype != self.dtype:
            raise TokenFileError(
                f"{idx_path}: dtype mismatch: the file holds {self.dtype} tokens but dtype={self._expected_dtype} "
                f"was asked for; pass dtype={self.dtype} (or None) or rebuild the file"
            )
        num_docs, num_tokens = header["num_documents"], header["num_tokens"]
        offsets = np.fromfile(idx_path, dtype="<i8", offset=HEADER_SIZE, count=num_docs + 1)
        if zlib.crc32(offsets.tobytes()) != header["offsets_crc32"]:
            raise TokenFileError(f"{idx_path}: corrupted: the document offsets do not match their CRC-32")
        if offsets[0] != 0 or offsets[-1] != num_tokens or (num_docs and np.any(np.diff(offsets) < 0)):
            raise TokenFileError(
                f"{idx_path}: corrupted: offsets must rise from 0 to num_tokens={num_tokens}, "
                f"got {offsets[0]} .. {offsets[-1]}"
            )
        if not bin_path.is_file():
            raise TokenFileError(f"{bin_path}: no such token file (its index {idx_path} exists)")
        size, expected = bin_path.stat().st_size, num_tokens * self.dtype.itemsize
        if size != expected:
            what = "truncated" if size < expected else "corrupted (trailing bytes)"
            raise TokenFileError(
                f"{bin_path}: {what}: {size} bytes, but {idx_path.name} says {num_tokens} tokens of "
                f"{self.dtype} = {expected} bytes; rebuild the pair"
            )
        self.document_offsets: np.ndarray = offsets
        self._offsets_crc32: int = header["offsets_crc32"]
        # np.memmap refuses empty files; an empty dataset is a valid (if useless) pair.
        self._data = (
            np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(num_tokens,))
            if num_tokens
            else np.empty(0, dtype=self.dtype)
        )
        if self._verify_data:
            crc = 0
            for start in range(0, num_tokens, _CRC_CHUNK):
                crc = zlib.crc32(np.ascontiguousarray(self._data[start : start + _CRC_CHUNK]).tobytes(), crc)
            if crc != header["data_crc32"]:
                raise TokenFileError(
                    f"{bin_path}: corrupted: the token data do not match the CRC-32 in {idx_path.name}"
                )

    @property
    def num_documents(self) -> int:
        return len(self.document_offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.document_offsets[-1])

    @property
    def document_lengths(self) -> np.ndarray:
        """Tokens per document (int64)."""
        return np.diff(self.document_offsets)

    def __len__(self) -> int:
        return self.num_documents

    def __getitem__(self, index: int) -> np.ndarray:
        if not -self.num_documents <= index < self.num_documents:
            raise IndexError(f"document index {index} out of range for {self.num_documents} documents")
        index %= self.num_documents
        return self._data[self.document_offsets[index] : self.document_offsets[index + 1]]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the concatenated documents (a view)."""
        return self._data[start:stop]

    def ident(self) -> str:
        """Name and content fingerprint (not the directory: moved files keep their ident)."""
        name = os.path.basename(self.prefix)
        return f"mmap:{name}:{self.num_documents}d:{self.num_tokens}t:{self._offsets_crc32:08x}"

    def __getstate__(self) -> StateDict:
        return {"prefix": self.prefix, "dtype": self._expected_dtype}

    def __setstate__(self, state: StateDict) -> None:
        self.prefix, self._expected_dtype, self._verify_data = state["prefix"], state["dtype"], False
        self._open()

    def __repr__(self) -> str:
        return (
            f"MMapTokenDataset({self.prefix!r}, dtype={self.dtype}, num_documents={self.num_documents}, "
            f"num_tokens={self.num_tokens})"
        )
