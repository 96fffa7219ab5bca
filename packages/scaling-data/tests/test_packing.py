import numpy as np
import pytest
import torch

from scaling.data import (
    LMPackingDataset,
    LMPackingItem,
    MMapTokenBuilder,
    MMapTokenDataset,
    segment_positions,
    stack_windows,
)

DOC_LENGTHS = [5, 1, 0, 9, 3, 12, 2]


@pytest.fixture
def tokens(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=n) for n in DOC_LENGTHS]
    with MMapTokenBuilder(tmp_path / "c", dtype=np.uint16) as b:
        for d in docs:
            b.add_document(d)
    return MMapTokenDataset(tmp_path / "c"), docs


def reference_windows(docs, s):
    """Brute force: the stream, the document of every position, then windows of s + 1 tokens."""
    stream = [int(t) for d in docs for t in d]
    doc_of = [i for i, d in enumerate(docs) for _ in d]
    out = []
    for w in range((len(stream) - 1) // s):
        a = w * s
        pos, cu = [], [0]
        for j in range(s):
            new_doc = j > 0 and doc_of[a + j] != doc_of[a + j - 1]
            if new_doc:
                cu.append(j)
            pos.append(0 if j == 0 or new_doc else pos[-1] + 1)
        out.append((stream[a : a + s], stream[a + 1 : a + s + 1], pos, cu + [s]))
    return out


@pytest.mark.parametrize("s", [1, 4, 7])
def test_packed_windows_match_reference(tokens, s):
    mm, docs = tokens
    ds = LMPackingDataset(mm, s)
    ref = reference_windows(docs, s)
    assert len(ds) == len(ref) == (sum(DOC_LENGTHS) - 1) // s
    for i, (inp, tgt, pos, cu) in enumerate(ref):
        item = ds[i]
        assert item.input_token_ids.tolist() == inp
        assert item.target_token_ids.tolist() == tgt
        assert item.position_ids.tolist() == pos, i
        assert item.cumulative_seq_lengths.tolist() == cu, i


def test_within_document_only(tokens):
    mm, docs = tokens
    ds = LMPackingDataset(mm, 4, within_document_only=True)
    expected = [d[k * 4 : k * 4 + 5].tolist() for d in docs for k in range(max(len(d) - 1, 0) // 4)]
    assert len(ds) == len(expected) == 1 + 2 + 2  # docs of 5, 9 and 12 tokens
    for i, window in enumerate(expected):
        item = ds[i]
        assert item.input_token_ids.tolist() + item.target_token_ids.tolist()[-1:] == window
        assert item.position_ids.tolist() == [0, 1, 2, 3]
        assert item.cumulative_seq_lengths.tolist() == [0, 4]


def test_collate_and_only_inputs_targets(tokens):
    mm, _ = tokens
    ds = LMPackingDataset(mm, 4)
    items = [ds[0], ds[1], ds[2]]
    batch = ds.collate(items)
    assert batch.input_token_ids.shape == (3, 4) and batch.input_token_ids.dtype == torch.int64
    assert batch.cumulative_seq_lengths.dtype == torch.int32
    expected_cu = [0]
    for i, it in enumerate(items):
        expected_cu += [int(c) + 4 * i for c in it.cumulative_seq_lengths[1:]]
    assert batch.cumulative_seq_lengths.tolist() == expected_cu
    assert torch.equal(batch.target_token_ids[:, :-1], batch.input_token_ids[:, 1:])
    inputs, targets = batch.only_inputs(), batch.only_targets()
    assert inputs.target_token_ids is None and inputs.input_token_ids is batch.input_token_ids
    assert targets.input_token_ids is None and targets.position_ids is None and targets.target_token_ids is not None
    moved = batch.to("cpu")
    assert torch.equal(moved.position_ids, batch.position_ids)


def test_errors(tokens, tmp_path):
    mm, _ = tokens
    with pytest.raises(ValueError, match=r"sequence_length=0 must be an int >= 1"):
        LMPackingDataset(mm, 0)
    with pytest.raises(ValueError, match=r"holds no window of sequence_length=12 inside one document"):
        LMPackingDataset(mm, 12, within_document_only=True)
    with pytest.raises(ValueError, match=r"holds no window of sequence_length=32 in the concatenated documents"):
        LMPackingDataset(mm, 32)
    with pytest.raises(IndexError, match=r"window index 7 out of range for 7 windows"):
        LMPackingDataset(mm, 4)[7]


def test_segment_positions_and_stack_windows():
    cu = np.array([0, 2, 5], dtype=np.int32)
    assert segment_positions(cu).tolist() == [0, 1, 0, 1, 2]
    assert segment_positions(np.array([0, 3], dtype=np.int32)).tolist() == [0, 1, 2]
    items = [
        LMPackingItem(np.arange(5), np.arange(1, 6), segment_positions(cu), cu),
        LMPackingItem(np.arange(5), np.arange(1, 6), np.arange(5), np.array([0, 5], dtype=np.int32)),
    ]
    fields = stack_windows(items, 5)
    assert fields["input_token_ids"].shape == (2, 5)
    assert fields["position_ids"][0].tolist() == [0, 1, 0, 1, 2]
    # The second window's boundaries are offset by its start in the flattened batch.
    assert fields["cumulative_seq_lengths"].tolist() == [0, 2, 5, 10]
    assert fields["cumulative_seq_lengths"].dtype == torch.int32
