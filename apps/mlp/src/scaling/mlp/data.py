"""Data for the MLP app: the digits that ship with scikit-learn, or MNIST IDX files.

The default needs no download: the digits that scikit-learn ships for
``sklearn.datasets.load_digits`` (1,797 8×8 images of handwritten digits, 10 classes), read
straight from its ``digits.csv.gz`` (importing scikit-learn costs each rank ~1.3 s of CPU,
reading the file ~0.04 s), with a fixed 80/20 train/test split. With
``data.mnist_path`` set, MNIST in its IDX format is read from that folder
(``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-...``; ``.gz`` too).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaling.data import BaseDataset, BaseDatasetBatch, BaseDatasetItem

_IDX_DTYPES: dict[int, np.dtype[Any]] = {  # Any: numpy's dtype parameter (the types differ)
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


@dataclass
class MNISTDatasetItem(BaseDatasetItem):
    input: torch.Tensor
    target: torch.Tensor


@dataclass
class MNISTDatasetBatch(BaseDatasetBatch):
    inputs: torch.Tensor | None
    targets: torch.Tensor | None

    def only_inputs(self) -> MNISTDatasetBatch:
        return MNISTDatasetBatch(inputs=self.inputs, targets=None)

    def only_targets(self) -> MNISTDatasetBatch:
        return MNISTDatasetBatch(inputs=None, targets=self.targets)


class MNISTDataset(BaseDataset[MNISTDatasetItem, MNISTDatasetBatch]):
    """Images as float vectors in [0, 1] and integer labels.

    Args:
        train: the training split (else the test split).
        mnist_path: folder of MNIST IDX files; None = scikit-learn's digits.
    """

    def __init__(self, train: bool = True, mnist_path: str | Path | None = None) -> None:
        self.train = train
        self.mnist_path = None if mnist_path is None else Path(mnist_path)
        if self.mnist_path is None:
            images, labels = _load_digits(train)
        else:
            images, labels = _load_mnist(self.mnist_path, train)
        self.images = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32))
        self.labels = torch.from_numpy(labels.astype(np.int64))

    @property
    def num_features(self) -> int:
        return int(self.images.shape[1])

    def ident(self) -> str:
        source = "digits" if self.mnist_path is None else f"mnist:{self.mnist_path}"
        return f"{source}:{'train' if self.train else 'test'}"

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> MNISTDatasetItem:
        return MNISTDatasetItem(input=self.images[index], target=self.labels[index])

    def collate(self, items: list[MNISTDatasetItem]) -> MNISTDatasetBatch:
        return MNISTDatasetBatch(
            inputs=torch.stack([i.input for i in items]), targets=torch.stack([i.target for i in items])
        )


@functools.cache
def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, exactly as ``load_digits()`` gives ``images`` and ``target``.

    The file is found without importing scikit-learn; where it is not at its usual place
    (``sklearn/datasets/data/digits.csv.gz``: 64 pixel columns, then the label), through
    ``load_digits`` itself.
    """
    spec = importlib.util.find_spec("sklearn")
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


def _load_digits(train: bool) -> tuple[np.ndarray, np.ndarray]:
    images, labels = read_digits()
    images = images.astype(np.float32) / 16.0
    # A fixed split: a seeded permutation, the first 80% for training.
    order = np.random.default_rng(0).permutation(len(labels))
    cut = int(0.8 * len(labels))
    idx = order[:cut] if train else order[cut:]
    return images[idx], labels[idx]


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped).

    Raises:
        ValueError: naming the file when the magic number, the dtype code or the size
            does not match the header.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (the first two bytes of the magic number must be zero)")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise ValueError(
            f"{path}: unknown IDX dtype code 0x{code:02x}; expected one of {[hex(c) for c in _IDX_DTYPES]}"
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated header ({len(data)} bytes, need {header})")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(
            f"{path}: header says shape {list(shape)} ({expected} bytes of data) but the file holds "
            f"{len(data) - header}; the file is truncated or corrupt"
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)


def _find(folder: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(
        f"data.mnist_path={str(folder)!r}: missing {stem} (or {stem}.gz); download MNIST's IDX files there "
        "or set data.mnist_path to null to use the bundled scikit-learn digits"
    )


def _load_mnist(folder: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
    if not folder.is_dir():
        raise FileNotFoundError(
            f"data.mnist_path={str(folder)!r} is not a directory; set it to the folder holding MNIST's IDX files "
            "or to null to use the bundled scikit-learn digits"
        )
    prefix = "train" if train else "t10k"
    images = read_idx(_find(folder, f"{prefix}-images-idx3-ubyte")).astype(np.float32) / 255.0
    labels = read_idx(_find(folder, f"{prefix}-labels-idx1-ubyte"))
    if len(images) != len(labels):
        raise ValueError(f"{folder}: {len(images)} {prefix} images but {len(labels)} labels")
    return images, labels
