"""The high-level API's context-parallel batch slicing (one process; the parity runs are in test_parity.py)."""

from __future__ import annotations

import pytest
import torch

from scaling.topology import Topology, TopologyConfig
from scaling.trainer.auto._context import _attention, sliced


def _topology(rank: int) -> Topology:
    return Topology(TopologyConfig(context_parallel_size=2, device="cpu"), rank)


def test_a_rank_gets_its_zigzag_slice_with_globally_shifted_targets():
    ids = torch.arange(16).view(2, 8)
    labels = ids.clone()
    labels[1, 3] = -100
    with sliced({"input_ids": ids, "labels": labels, "attention_mask": torch.ones(2, 8)}, _topology(1), "ring") as kw:
        assert "attention_mask" not in kw
        assert kw["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]  # chunks 1 and 2 of 4
        assert kw["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
        # Token 5's target is token 6, held by the other rank: the shift is taken on the whole sequence.
        assert kw["shift_labels"].tolist() == [[3, 4, 5, 6], [-100, 12, 13, 14]]
        assert float(kw["num_items_in_batch"]) == (16 - 2 - 1) / 2  # last positions and one ignored target


def test_bad_batches_are_refused_with_the_fix():
    topo = _topology(0)
    with pytest.raises(ValueError, match=r"needs mapping batches with 'input_ids' and 'labels'"):
        with sliced(torch.zeros(2, 8), topo, "ring"):
            pass
    padded = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"takes no padding.*pack the sequences"):
        with sliced({**padded, "attention_mask": torch.tensor([[1] * 7 + [0]])}, topo, "ring"):
            pass
    short = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "labels": torch.zeros(1, 6, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 2 × context_parallel_size = 4"):
        with sliced(short, topo, "ring"):
            pass
    with pytest.raises(RuntimeError, match=r"ran outside a context-parallel ParallelModel call"):
        q = torch.zeros(1, 2, 4, 8)
        _attention(torch.nn.Module(), q, q, q, None)
