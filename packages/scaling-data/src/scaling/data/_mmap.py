"""Memory-mapped tokens: a ``.bin`` of raw token ids and a ``.idx`` with a checked header.

``.idx`` layout (little-endian)::

    magic        8 bytes  b"SCLTOKI\\0"
    version      uint32   1
    dtype code   uint8    (+ 3 bytes padding) see _DTYPES
    num_documents uint64
    num_tokens   uint64
    offsets_crc32 uint32  CRC-32 of the offsets array
    data_crc32   uint32   CRC-32 of the whole .bin (checked with verify_data=True)
    offsets      int64[num_documents + 1]   document d is tokens[offsets[d]:offsets[d + 1]]

``.bin`` is ``num_tokens`` ids of that dtype. Every open checks sizes, magic, version,
dtype, the offsets' CRC and monotonicity, so a truncated, corrupted or mismatched pair
raises :class:`TokenFileError` instead of returning garbage.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from scaling.config import JsonDict

MAGIC = b"SCLTOKI\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIB3xQQII")
HEADER_SIZE = _HEADER.size
_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    3: np.dtype(np.int32),
    4: np.dtype(np.uint32),
    5: np.dtype(np.int64),
}
_CODES = {dt: code for code, dt in _DTYPES.items()}
_CHOICES = ", ".join(str(dt) for dt in _DTYPES.values())


class TokenFileError(ValueError):
    """A ``.bin`` / ``.idx`` pair is missing, truncated, corrupted or of another dtype."""


def paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``(prefix.bin, prefix.idx)``."""
    p = str(prefix)
    return Path(p + ".bin"), Path(p + ".idx")


def token_dtype(dtype: npt.DTypeLike) -> np.dtype:
    """Normalise ``dtype`` to one of the supported token dtypes.

    Raises:
        TypeError: for an unsupported dtype (the message lists the choices).
    """
    try:
        dt = np.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"dtype={dtype!r} is not a numpy dtype; choose one of {_CHOICES}") from err
    if dt not in _CODES:
        raise TypeError(f"dtype={dt} is not a supported token dtype; choose one of {_CHOICES}")
    return dt


def smallest_dtype(vocab_size: int) -> np.dtype:
    """The smallest supported dtype that holds ids ``0 .. vocab_size - 1``."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


class MMapTokenBuilder:
    """Write documents of token ids into ``prefix.bin`` / ``prefix.idx``.

    Files are written under temporary names and renamed by :meth:`finalize`, so a
    crashed build never leaves a pair that looks complete. Use as a context manager.

    Args:
        prefix: output path without suffix.
        dtype: token dtype (``uint16`` holds vocabularies up to 65,536).

    Example::

        with MMapTokenBuilder("data/train", dtype=np.uint16) as builder:
            builder.add_document([5, 17, 2])
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: npt.DTypeLike = np.uint16) -> None:
        self.dtype = token_dtype(dtype)
        self.bin_path, self.idx_path = paths(prefix)
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._file: BinaryIO = open(self._tmp_bin, "wb")  # noqa: SIM115  (closed in finalize/abort)
        self._offsets = [0]
        self._crc = 0
        self._info = np.iinfo(self.dtype)

    def add_document(self, tokens: npt.ArrayLike) -> None:
        """Append one document (a sequence or array of ints).

        Raises:
            ValueError: when an id does not fit the dtype.
        """
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TypeError(f"add_document: tokens must be a 1-D sequence of ints, got shape {arr.shape} {arr.dtype}")
        if arr.size and (int(arr.min()) < self._info.min or int(arr.max()) > self._info.max):
            raise ValueError(
                f"add_document: token ids span [{int(arr.min())}, {int(arr.max())}] but dtype={self.dtype} holds "
                f"[{self._info.min}, {self._info.max}]; build with a wider dtype (e.g. uint32)"
            )
        data = arr.astype(self.dtype, copy=False).tobytes()
        self._file.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._offsets.append(self._offsets[-1] + arr.size)

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._file.close()
        offsets = np.asarray(self._offsets, dtype="<i8")
        header = _HEADER.pack(
            MAGIC,
            VERSION,
            _CODES[self.dtype],
            len(offsets) - 1,
            int(offsets[-1]),
            zlib.crc32(offsets.tobytes()),
            self._crc,
        )
        tmp_idx = self.idx_path.with_name(self.idx_path.name + ".tmp")
        with open(tmp_idx, "wb") as f:
            f.write(header)
            f.write(offsets.tobytes())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, self.idx_path)

    def abort(self) -> None:
        """Close and delete the partial output."""
        self._file.close()
        self._tmp_bin.unlink(missing_ok=True)

    def __enter__(self) -> MMapTokenBuilder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def read_header(idx_path: Path) -> JsonDict:
    """Parse and check the ``.idx`` header; raise :class:`TokenFileError` naming the file."""
    if not idx_path.is_file():
        raise TokenFileError(f"{idx_path}: no such index file; build it with MMapTokenBuilder or `scaling-data build`")
    size = idx_path.stat().st_size
    if size < _HEADER.size:
        raise TokenFileError(f"{idx_path}: truncated: {size} bytes, the header alone needs {_HEADER.size}")
    with open(idx_path, "rb") as f:
        magic, version, code, num_docs, num_tokens, offsets_crc, data_crc = _HEADER.unpack(f.read(_HEADER.size))
    if magic != MAGIC:
        raise TokenFileError(f"{idx_path}: not a Scaling token index (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise TokenFileError(f"{idx_path}: format version {version} is not supported (this reader reads {VERSION})")
    if code not in _DTYPES:
        raise TokenFileError(f"{idx_path}: corrupted header: dtype code {code} is none of {sorted(_DTYPES)}")
    expected = _HEADER.size + 8 * (num_docs + 1)
    if size != expected:
        what = "truncated" if size < expected else "corrupted (trailing bytes)"
        raise TokenFileError(
            f"{idx_path}: {what}: {size} bytes, but the header's num_documents={num_docs} needs {expected}"
        )
    return {
        "dtype": _DTYPES[code],
        "num_documents": num_docs,
        "num_tokens": num_tokens,
        "offsets_crc32": offsets_crc,
        "data_crc32": data_crc,
    }
