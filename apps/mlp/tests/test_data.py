import importlib.util

import numpy as np
import pytest
import torch
from mlp_testlib import write_mnist

from scaling.mlp.data import MNISTDataset, MNISTDatasetBatch, read_digits, read_idx


def test_digits_split_is_fixed_and_disjoint():
    train, test = MNISTDataset(train=True), MNISTDataset(train=False)
    assert (len(train), len(test)) == (1437, 360)
    assert train.num_features == 64
    assert float(train.images.max()) <= 1.0 and float(train.images.min()) >= 0.0
    assert torch.equal(MNISTDataset(train=False).labels, test.labels)
    train_rows = {tuple(r.tolist()) for r in train.images}
    overlap = sum(tuple(r.tolist()) in train_rows for r in test.images)
    assert overlap < 5  # the digits set holds a handful of duplicate images, not a shared split


def test_digits_are_scikit_learns():
    from sklearn.datasets import load_digits

    images, labels = read_digits()
    digits = load_digits()
    assert images.dtype == digits.images.dtype and np.array_equal(images, digits.images)
    assert labels.dtype == digits.target.dtype and np.array_equal(labels, digits.target)


def test_digits_fall_back_to_load_digits_where_the_file_is_not_found(monkeypatch):
    expected = read_digits()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    read_digits.cache_clear()
    try:
        images, labels = read_digits()
    finally:
        read_digits.cache_clear()
    assert np.array_equal(images, expected[0]) and np.array_equal(labels, expected[1])


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_reader(tmp_path, gz):
    write_mnist(tmp_path, gz=gz)
    train = MNISTDataset(train=True, mnist_path=tmp_path)
    test = MNISTDataset(train=False, mnist_path=tmp_path)
    assert (len(train), len(test), train.num_features) == (12, 6, 784)
    suffix = ".gz" if gz else ""
    raw = read_idx(tmp_path / f"train-images-idx3-ubyte{suffix}")
    assert torch.allclose(train.images[3], torch.from_numpy(raw[3].reshape(-1).astype(np.float32) / 255.0))
    batch = train.collate([train[i] for i in range(4)])
    assert isinstance(batch, MNISTDatasetBatch) and batch.inputs.shape == (4, 784)
    assert batch.only_inputs().targets is None and batch.only_targets().inputs is None


def test_missing_mnist_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.mnist_path='.*nope' is not a directory"):
        MNISTDataset(mnist_path=tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"missing train-images-idx3-ubyte \(or train-images-idx3-ubyte\.gz\)"):
        MNISTDataset(mnist_path=tmp_path)


def test_corrupt_idx_files_are_refused(tmp_path):
    write_mnist(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(
        ValueError, match=r"train-images-idx3-ubyte: header says shape \[12, 28, 28\].*truncated or corrupt"
    ):
        MNISTDataset(mnist_path=tmp_path)
    path.write_bytes(b"\x01\x02" + data[2:])
    with pytest.raises(ValueError, match="not an IDX file"):
        MNISTDataset(mnist_path=tmp_path)
    path.write_bytes(data[:2] + b"\x42" + data[3:])
    with pytest.raises(ValueError, match="unknown IDX dtype code 0x42"):
        MNISTDataset(mnist_path=tmp_path)
