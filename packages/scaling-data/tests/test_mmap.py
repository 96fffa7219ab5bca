import pickle

import numpy as np
import pytest

from scaling.data import MMapTokenBuilder, MMapTokenDataset, TokenFileError

DOCS = [[1, 2, 3], [], [40000, 5], [7] * 10]


def build(tmp_path, docs=DOCS, dtype=np.uint16, name="corpus"):
    prefix = tmp_path / name
    with MMapTokenBuilder(prefix, dtype=dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
    return prefix


def test_round_trip_and_pickle(tmp_path):
    prefix = build(tmp_path)
    ds = MMapTokenDataset(prefix, dtype=np.uint16, verify_data=True)
    assert len(ds) == 4 and ds.num_tokens == 15 and ds.dtype == np.uint16
    assert [d.tolist() for d in ds] == DOCS
    assert ds.document_lengths.tolist() == [3, 0, 2, 10]
    assert ds.tokens(2, 6).tolist() == [3, 40000, 5, 7]
    again = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 500  # the path travels, not the tokens
    assert [d.tolist() for d in again] == DOCS
    with pytest.raises(IndexError, match="document index 4 out of range for 4 documents"):
        ds[4]


def test_empty_dataset(tmp_path):
    ds = MMapTokenDataset(build(tmp_path, docs=[]))
    assert len(ds) == 0 and ds.num_tokens == 0


def test_failed_build_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"token ids span \[0, 70000\] but dtype=uint16 holds \[0, 65535\]"):
        build(tmp_path, docs=[[0, 70000]])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match=r"not a supported token dtype; choose one of uint8, uint16, int32"):
        MMapTokenBuilder(tmp_path / "x", dtype=np.float32)


def test_missing_files(tmp_path):
    with pytest.raises(TokenFileError, match=r"nope\.idx: no such index file"):
        MMapTokenDataset(tmp_path / "nope")
    prefix = build(tmp_path)
    (tmp_path / "corpus.bin").unlink()
    with pytest.raises(TokenFileError, match=r"corpus\.bin: no such token file"):
        MMapTokenDataset(prefix)


def test_truncated_bin(tmp_path):
    prefix = build(tmp_path)
    data = (tmp_path / "corpus.bin").read_bytes()
    (tmp_path / "corpus.bin").write_bytes(data[:-4])
    with pytest.raises(
        TokenFileError, match=r"corpus\.bin: truncated: 26 bytes, but corpus\.idx says 15 tokens of uint16 = 30"
    ):
        MMapTokenDataset(prefix)


def test_truncated_idx(tmp_path):
    prefix = build(tmp_path)
    idx = (tmp_path / "corpus.idx").read_bytes()
    (tmp_path / "corpus.idx").write_bytes(idx[:-8])
    with pytest.raises(
        TokenFileError, match=r"corpus\.idx: truncated: 72 bytes, but the header's num_documents=4 needs 80"
    ):
        MMapTokenDataset(prefix)
    (tmp_path / "corpus.idx").write_bytes(idx[:10])
    with pytest.raises(TokenFileError, match=r"corpus\.idx: truncated: 10 bytes, the header alone needs 40"):
        MMapTokenDataset(prefix)


def test_corrupted_idx(tmp_path):
    prefix = build(tmp_path)
    idx = bytearray((tmp_path / "corpus.idx").read_bytes())
    bad = bytearray(idx)
    bad[0:8] = b"GARBAGE!"
    (tmp_path / "corpus.idx").write_bytes(bad)
    with pytest.raises(TokenFileError, match=r"corpus\.idx: not a Scaling token index \(magic b'GARBAGE!'"):
        MMapTokenDataset(prefix)
    bad = bytearray(idx)
    bad[50] ^= 0xFF  # inside the offsets
    (tmp_path / "corpus.idx").write_bytes(bad)
    with pytest.raises(TokenFileError, match=r"corpus\.idx: corrupted: the document offsets do not match their CRC-32"):
        MMapTokenDataset(prefix)
    bad = bytearray(idx)
    bad[12] = 99  # dtype code
    (tmp_path / "corpus.idx").write_bytes(bad)
    with pytest.raises(TokenFileError, match=r"corpus\.idx: corrupted header: dtype code 99"):
        MMapTokenDataset(prefix)
    bad = bytearray(idx)
    bad[8] = 7  # version
    (tmp_path / "corpus.idx").write_bytes(bad)
    with pytest.raises(TokenFileError, match=r"format version 7 is not supported"):
        MMapTokenDataset(prefix)
    (tmp_path / "corpus.idx").write_bytes(bytes(idx) + b"\0")
    with pytest.raises(TokenFileError, match=r"corpus\.idx: corrupted \(trailing bytes\)"):
        MMapTokenDataset(prefix)


def test_corrupted_bin_detected_by_verify(tmp_path):
    prefix = build(tmp_path)
    data = bytearray((tmp_path / "corpus.bin").read_bytes())
    data[3] ^= 0x01
    (tmp_path / "corpus.bin").write_bytes(data)
    MMapTokenDataset(prefix)  # sizes still agree: only the data CRC can tell
    with pytest.raises(TokenFileError, match=r"corpus\.bin: corrupted: the token data do not match the CRC-32"):
        MMapTokenDataset(prefix, verify_data=True)


def test_mismatched_dtype(tmp_path):
    prefix = build(tmp_path, dtype=np.uint16)
    with pytest.raises(
        TokenFileError, match=r"corpus\.idx: dtype mismatch: the file holds uint16 tokens but dtype=int32"
    ):
        MMapTokenDataset(prefix, dtype=np.int32)


def test_mismatched_pair(tmp_path):
    a = build(tmp_path, name="a")
    build(tmp_path, docs=[[1, 2]], name="b")
    (tmp_path / "b.bin").replace(tmp_path / "a.bin")
    with pytest.raises(TokenFileError, match=r"a\.bin: truncated: 4 bytes, but a\.idx says 15 tokens"):
        MMapTokenDataset(a)
