"""Tokenise ``.jsonl`` / ``.txt`` files into a ``.bin`` / ``.idx`` pair, in parallel."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from scaling.data._mmap import MMapTokenBuilder, smallest_dtype, token_dtype
from scaling.data._tokens import MMapTokenDataset

_SUFFIXES = (".jsonl", ".txt")


class _Encoding(Protocol):
    ids: list[int]


class _Tokenizer(Protocol):
    """The part of a ``tokenizers.Tokenizer`` the build uses (the package is optional)."""

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[_Encoding]: ...


class _Progress(Protocol):
    def update(self, n: int = 1) -> object: ...


_tokenizer: _Tokenizer | None = None  # one per worker process, loaded by _init_worker


def _require(module: str) -> types.ModuleType:
    try:
        return __import__(module)
    except ImportError as err:
        raise ImportError(
            f"`scaling-data build` needs the '{module}' package; install it with pip install 'scaling-data[build]'"
        ) from err


def _decode(data: bytes, path: Path, first_line: int) -> str:
    """``data`` (a line, or a whole file from ``first_line`` 1) as UTF-8; else a ValueError naming the line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        raise ValueError(f"{path}:{line}: not valid UTF-8 ({err.reason}); convert the file to UTF-8") from None


def load_tokenizer(path: str | os.PathLike[str]) -> Any:  # Any: tokenizers has no type information
    """A ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``).

    Raises:
        ValueError: the file is not a tokenizers JSON file (naming it and tokenizers' reason).
        ImportError: tokenizers is missing (the ``[build]`` extra).
    """
    tokenizer_class = _require("tokenizers").Tokenizer
    try:
        return tokenizer_class.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own untyped exceptions
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"tokenizer {str(path)!r} is not a tokenizers JSON file ({reason}); give a tokenizer.json"
        ) from None


def _read_documents(path: Path, text_key: str, whole_file: bool) -> Iterator[tuple[str, int]]:
    """Yield ``(text, bytes consumed)`` per document of one input file."""
    if path.suffix == ".txt" and whole_file:
        data = path.read_bytes()
        yield _decode(data, path, 1), len(data)
        return
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            line = _decode(raw, path, line_number)
            size = len(raw)
            if not line.strip():
                continue
            if path.suffix == ".txt":
                yield line.rstrip("\n"), size
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{line_number}: not valid JSON ({err.msg}); each line must be one object"
                ) from err
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise ValueError(
                    f"{path}:{line_number}: no string field {text_key!r} (keys: {sorted(record) if isinstance(record, dict) else type(record).__name__}); "
                    "pass --text-key with the field that holds the text"
                )
            yield record[text_key], size


def _chunks(paths: Sequence[Path], text_key: str, whole_file: bool, chunk_size: int) -> Iterator[tuple[list[str], int]]:
    texts: list[str] = []
    consumed = 0
    for path in paths:
        for text, size in _read_documents(path, text_key, whole_file):
            texts.append(text)
            consumed += size
            if len(texts) == chunk_size:
                yield texts, consumed
                texts, consumed = [], 0
    if texts:
        yield texts, consumed


def _init_worker(tokenizer_path: str) -> None:
    global _tokenizer
    _tokenizer = load_tokenizer(tokenizer_path)


def _encode(chunk: tuple[list[str], int]) -> tuple[list[np.ndarray], int]:
    texts, consumed = chunk
    assert _tokenizer is not None  # _init_worker ran in this process
    encodings = _tokenizer.encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int64) for e in encodings], consumed


def tokenize_files(
    inputs: Sequence[str | os.PathLike[str]],
    tokenizer_path: str | os.PathLike[str],
    output_prefix: str | os.PathLike[str],
    *,
    dtype: npt.DTypeLike | None = None,
    num_workers: int = 1,
    text_key: str = "text",
    txt_whole_file: bool = False,
    eod_token: str | None = None,
    chunk_size: int = 256,
    progress: bool = True,
) -> MMapTokenDataset:
    """Tokenise text files with a Hugging Face ``tokenizers`` file into ``output_prefix.bin/.idx``.

    ``.jsonl``: one document per line, its text in ``text_key``. ``.txt``: one document
    per non-empty line, or the whole file with ``txt_whole_file``. Documents keep the
    input order whatever ``num_workers`` is, so the output is reproducible.

    Args:
        inputs: the files to read, in order.
        tokenizer_path: a ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``).
        output_prefix: where to write ``.bin`` and ``.idx``.
        dtype: token dtype; ``None`` = the smallest that holds the vocabulary.
        num_workers: tokenising processes (1 = in this process).
        text_key: the JSON field holding the text.
        txt_whole_file: read each ``.txt`` as one document.
        eod_token: a token appended to every document (e.g. ``"</s>"``).
        chunk_size: documents per task sent to a worker.
        progress: show a tqdm bar (in input bytes).

    Returns:
        The written dataset, opened.

    Raises:
        FileNotFoundError: for a missing input.
        ValueError: for an unsupported suffix, a bad JSON line or an unknown ``eod_token``.
    """
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input {p} does not exist")
        if p.suffix not in _SUFFIXES:
            raise ValueError(f"input {p}: suffix {p.suffix!r} is not supported; use one of {', '.join(_SUFFIXES)}")
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers} must be >= 1")
    tqdm = _require("tqdm").tqdm
    tokenizer = load_tokenizer(tokenizer_path)
    dt = smallest_dtype(tokenizer.get_vocab_size()) if dtype is None else token_dtype(dtype)
    eod: list[int] = []
    if eod_token is not None:
        eod_id = tokenizer.token_to_id(eod_token)
        if eod_id is None:
            raise ValueError(f"eod_token={eod_token!r} is not in the vocabulary of {tokenizer_path}")
        eod = [eod_id]
    chunks = _chunks(paths, text_key, txt_whole_file, chunk_size)
    total = sum(p.stat().st_size for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not progress) as bar:
        with MMapTokenBuilder(output_prefix, dtype=dt) as builder:
            if num_workers == 1:
                _init_worker(str(tokenizer_path))
                results: Iterator[tuple[list[np.ndarray], int]] = map(_encode, chunks)
                _write(builder, results, eod, bar)
            else:
                # fork is cheap (no re-import of torch per worker) and safe here: this
                # process has not encoded anything, so tokenizers' thread pool has not started.
                method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
                ctx = mp.get_context(method)
                with ctx.Pool(num_workers, initializer=_init_worker, initargs=(str(tokenizer_path),)) as pool:
                    _write(builder, pool.imap(_encode, chunks), eod, bar)
    return MMapTokenDataset(output_prefix, dtype=dt)


def _write(
    builder: MMapTokenBuilder, results: Iterator[tuple[list[np.ndarray], int]], eod: list[int], bar: _Progress
) -> None:
    for docs, consumed in results:
        for ids in docs:
            builder.add_document(np.concatenate([ids, np.asarray(eod, dtype=np.int64)]) if eod else ids)
        bar.update(consumed)
