import pytest
import torch

from scaling.topology import split_sequence, zigzag_indices


def test_zigzag_layout():
    assert zigzag_indices(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([zigzag_indices(16, r, 4) for r in range(4)]).tolist()) == list(range(16))
    x = torch.arange(16).view(1, 16)
    assert split_sequence(x, 1, 3, 4).tolist() == [zigzag_indices(16, 3, 4).tolist()]
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2 × context_parallel_size = 8"):
        zigzag_indices(12, 0, 4)
