import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import broadcast_pytree
from scaling.testing import assert_parity, make_topology, run_distributed


@dataclasses.dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    mask: torch.Tensor
    extras: dict
    position: int = 0


class Pair(NamedTuple):
    left: torch.Tensor
    right: object


def _make_batch(seed):
    g = torch.Generator().manual_seed(seed)
    return Batch(
        input_ids=torch.randint(0, 1000, (2, 5), generator=g),
        mask=torch.rand(2, 5, 5, generator=g) > 0.5,
        extras={
            "weights": torch.randn(3, 4, generator=g).to(torch.bfloat16).t(),  # non-contiguous
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.zeros(0, 3, dtype=torch.int8),
            "nested": [None, 7, 2.5, "text", True, (torch.arange(3, dtype=torch.int32), Pair(torch.ones(1), None))],
            "dtype": torch.float16,
        },
        position=seed,
    )


def _check_equal(actual, expected):
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
        assert_parity(actual, expected, bitwise=True)
        assert not actual.requires_grad
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            _check_equal(getattr(actual, f.name), getattr(expected, f.name))
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            _check_equal(actual[k], expected[k])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _check_equal(a, e)
    else:
        assert actual == expected


def _broadcast_batch(tp, src_tp_rank):
    topo = make_topology(model_parallel_size=tp)
    src = topo.axis("tp").ranks[src_tp_rank]
    expected = _make_batch(seed=100 + topo.axis("dp").rank)  # each DP replica sends its own batch
    mine = expected if dist.get_rank() == src else None
    for _ in range(2):  # a second call must not depend on state left by the first
        got = broadcast_pytree(mine, src, topo.axis("tp").group)
        _check_equal(got, expected)
        if dist.get_rank() == src:
            assert got is mine
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,tp,src_tp_rank", [(2, 2, 0), (2, 2, 1), (4, 2, 0), (4, 4, 3)])
def test_broadcast_pytree_preserves_structure_and_dtypes(world_size, tp, src_tp_rank):
    assert run_distributed(_broadcast_batch, world_size, tp, src_tp_rank, timeout_seconds=60) == [True] * world_size


def _broadcast_edge_cases():
    group = dist.group.WORLD
    no_tensors = broadcast_pytree({"a": [1, None, "x"]} if dist.get_rank() == 0 else None, 0, group)
    errors = []
    try:
        broadcast_pytree(None, 5, group)
    except ValueError as exc:
        errors.append(str(exc))
    if dist.get_rank() == 0:
        try:
            broadcast_pytree({"bad": object()}, 0, group)
        except TypeError as exc:
            errors.append(str(exc))
    alone = torch.ones(2)
    return no_tensors, errors, broadcast_pytree(alone, 0, None) is alone


@pytest.mark.distributed
def test_broadcast_pytree_edge_cases_and_errors():
    out = run_distributed(_broadcast_edge_cases, 2, timeout_seconds=60)
    for no_tensors, errors, identity in out:
        assert no_tensors == {"a": [1, None, "x"]}
        assert identity
        assert "src=5 is not a rank of the group (global ranks [0, 1])" in errors[0]
    assert "obj['bad']: a object cannot be sent" in out[0][1][1]
