from __future__ import annotations

import os
import sys

import pytest

from scaling.pipeline import count_parameters, partition_layers

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_test_model import specs  # noqa: E402


def test_uniform_gives_remainder_to_early_stages() -> None:
    assert partition_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]


def test_balanced_by_weight_minimises_heaviest_stage() -> None:
    assert partition_layers(4, 2, "cost", weights=[5, 1, 1, 1]) == [range(0, 1), range(1, 4)]
    assert partition_layers(5, 3, "parameters", weights=[1, 1, 1, 1, 8]) == [range(0, 2), range(2, 4), range(4, 5)]


def test_count_parameters_builds_on_meta_device() -> None:
    assert count_parameters(specs(2, 6)) == [42, 42]


def test_explicit_and_virtual_stages() -> None:
    assert partition_layers(5, 2, "explicit", boundaries=[0, 1, 5]) == [range(0, 1), range(1, 5)]
    assert partition_layers(8, 2, num_virtual=2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match=r"num_layers=3 into pipe_parallel_size=4 x num_virtual_stages=1 = 4"):
        partition_layers(3, 4)


def test_boundaries_must_cover_layers() -> None:
    with pytest.raises(
        ValueError, match=r"partition_boundaries=\[0, 2, 4\] must be 3 strictly increasing .* num_layers=5"
    ):
        partition_layers(5, 2, "explicit", boundaries=[0, 2, 4])
    with pytest.raises(ValueError, match="needs partition_boundaries"):
        partition_layers(5, 2, "explicit")


def test_virtual_stages_need_divisible_layers() -> None:
    with pytest.raises(ValueError, match=r"num_layers=6 is not divisible into .* = 4 equal virtual stages"):
        partition_layers(6, 2, num_virtual=2)


def test_unknown_method_and_bad_weights() -> None:
    with pytest.raises(ValueError, match=r"partition_method='flops' is unknown; choose one of \['uniform'"):
        partition_layers(4, 2, "flops")
    with pytest.raises(ValueError, match="needs one weight per layer: 4, got 3"):
        partition_layers(4, 2, "cost", weights=[1, 2, 3])
