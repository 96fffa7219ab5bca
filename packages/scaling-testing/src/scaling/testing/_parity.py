"""Helpers that compare a parallel run with its single-process reference."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from scaling.topology import Topology, TopologyConfig


def make_topology(
    model_parallel_size: int = 1,
    pipe_parallel_size: int = 1,
    data_parallel_size: int | None = None,
    **config: object,
) -> Topology:
    """A CPU :class:`Topology` over the already-initialised default process group.

    Call inside a function run by :func:`run_distributed`. The world size comes from
    the process group; unspecified sizes are derived. Extra keyword arguments go to
    :class:`TopologyConfig` (e.g. ``global_batch_size``, ``micro_batch_size``).
    """
    cfg = TopologyConfig(
        world_size=dist.get_world_size(),
        model_parallel_size=model_parallel_size,
        pipe_parallel_size=pipe_parallel_size,
        data_parallel_size=data_parallel_size,
        **{"device": "cpu", **config},
    )
    return Topology(cfg, dist.get_rank()).initialize_distributed()


def shard(full: torch.Tensor, dim: int, index: int, num: int) -> torch.Tensor:
    """Slice ``index`` of ``num`` equal chunks of ``full`` along ``dim`` (a contiguous copy)."""
    if full.shape[dim] % num != 0:
        raise ValueError(f"shard: size {full.shape[dim]} of dim {dim} is not divisible by {num}")
    return full.chunk(num, dim=dim)[index].contiguous().clone()


def _describe(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.double() - expected.double()).abs()
    rel = diff / expected.double().abs().clamp_min(1e-30)
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
    return (
        f"max abs diff {diff.max().item() if diff.numel() else 0:.3e}, max rel diff "
        f"{rel.max().item() if rel.numel() else 0:.3e}, worst at index {idx}: "
        f"actual {actual[idx].item() if diff.numel() else None!r} vs expected {expected[idx].item() if diff.numel() else None!r}"
    )


def assert_parity(
    actual: object,
    expected: object,
    *,
    rtol: float = 1e-6,
    atol: float = 0.0,
    name: str = "value",
    bitwise: bool = False,
) -> None:
    """Assert two pytrees of tensors (dicts, lists, tuples, scalars) match.

    ``|actual - expected| <= atol + rtol * |expected|`` element-wise, or exact equality
    with ``bitwise=True``. The error names the path inside the pytree, the worst
    element and both values.
    """
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping):
            raise AssertionError(f"{name}: a {type(actual).__name__}, expected a mapping")
        if set(actual) != set(expected):
            raise AssertionError(f"{name}: keys differ: {sorted(map(str, actual))} vs {sorted(map(str, expected))}")
        for k in expected:
            assert_parity(actual[k], expected[k], rtol=rtol, atol=atol, name=f"{name}[{k!r}]", bitwise=bitwise)
        return
    if isinstance(expected, Sequence) and not isinstance(expected, (str, bytes)):
        if not isinstance(actual, Sequence):
            raise AssertionError(f"{name}: a {type(actual).__name__}, expected a sequence")
        if len(actual) != len(expected):
            raise AssertionError(f"{name}: lengths differ: {len(actual)} vs {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_parity(a, e, rtol=rtol, atol=atol, name=f"{name}[{i}]", bitwise=bitwise)
        return
    a = torch.as_tensor(actual)
    e = torch.as_tensor(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    if bitwise:
        if a.dtype != e.dtype or not torch.equal(a, e):
            raise AssertionError(f"{name}: not bitwise equal ({a.dtype} vs {e.dtype}); {_describe(a, e)}")
        return
    ok = torch.isclose(a.double(), e.double(), rtol=rtol, atol=atol, equal_nan=False)
    if not bool(ok.all()):
        raise AssertionError(f"{name}: not within rtol={rtol}, atol={atol}; {_describe(a, e)}")
