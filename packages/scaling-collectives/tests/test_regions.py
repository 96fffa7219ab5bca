"""Region functions vs the same computation on full tensors in one process.

Every rank builds the full tensors from one seed, runs the region function on its
shard and a rank-specific downstream computation (as a TP layer would), and compares
forward values and input gradients with single-process autograd on the full tensors.
"""

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from scaling.testing import assert_parity, make_topology, run_distributed

SHAPE = (2, 4, 8)  # [b, s, h]
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _case(name, n, r, group, dim):
    """Return (local output, local loss, local inputs, reference output, reference loss, reference inputs)."""
    g = torch.Generator().manual_seed(1234)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    if name == "copy":
        x_full, w = randn(*SHAPE), [randn(SHAPE[-1], 6) for _ in range(n)]
        grads = [randn(*SHAPE[:-1], 6) for _ in range(n)]
        x = _leaf(x_full)
        out = copy_to_model_parallel_region(x, group) @ w[r]
        ref_x = _leaf(x_full)
        ref_outs = [ref_x @ w[i] for i in range(n)]
        return (
            out,
            (out * grads[r]).sum(),
            [x],
            ref_outs[r],
            sum((o * gr).sum() for o, gr in zip(ref_outs, grads)),
            [ref_x],
        )
    if name == "reduce":
        parts, grad = [randn(*SHAPE) for _ in range(n)], randn(*SHAPE)
        x = _leaf(parts[r])
        out = reduce_from_model_parallel_region(x, group)
        ref_parts = [_leaf(p) for p in parts]
        ref_out = sum(ref_parts)
        return out, (out * grad).sum(), [x], ref_out, (ref_out * grad).sum(), [ref_parts[r]]
    if name in ("scatter", "scatter_sp"):
        d = SHAPE.__len__() - 1 if name == "scatter" else dim
        x_full = randn(*SHAPE)
        chunk_shape = list(SHAPE)
        chunk_shape[d] //= n
        grads = [randn(*chunk_shape) for _ in range(n)]
        x = _leaf(x_full)
        fn = scatter_to_model_parallel_region if name == "scatter" else scatter_to_sequence_parallel_region
        out = fn(x, group) if name == "scatter" else fn(x, group, dim)
        ref_x = _leaf(x_full)
        ref_outs = ref_x.chunk(n, d)
        return (
            out,
            (out * grads[r]).sum(),
            [x],
            ref_outs[r],
            sum((o * gr).sum() for o, gr in zip(ref_outs, grads)),
            [ref_x],
        )
    if name in ("gather", "gather_sp_split"):
        d = len(SHAPE) - 1 if name == "gather" else dim
        chunk_shape = list(SHAPE)
        chunk_shape[d] //= n
        chunks, grad = [randn(*chunk_shape) for _ in range(n)], randn(*SHAPE)
        x = _leaf(chunks[r])
        if name == "gather":
            out = gather_from_model_parallel_region(x, group)
        else:
            out = gather_from_sequence_parallel_region(x, group, dim, tensor_parallel_output_grad=False)
        ref_chunks = [_leaf(c) for c in chunks]
        ref_out = torch.cat(ref_chunks, d)
        return out, (out * grad).sum(), [x], ref_out, (ref_out * grad).sum(), [ref_chunks[r]]
    if name == "gather_sp":
        chunk_shape = list(SHAPE)
        chunk_shape[dim] //= n
        chunks, grads = [randn(*chunk_shape) for _ in range(n)], [randn(*SHAPE) for _ in range(n)]
        x = _leaf(chunks[r])
        out = gather_from_sequence_parallel_region(x, group, dim)
        ref_chunks = [_leaf(c) for c in chunks]
        ref_out = torch.cat(ref_chunks, dim)
        ref_loss = sum((ref_out * gr).sum() for gr in grads)
        return out, (out * grads[r]).sum(), [x], ref_out, ref_loss, [ref_chunks[r]]
    if name == "reduce_scatter_sp":
        chunk_shape = list(SHAPE)
        chunk_shape[dim] //= n
        parts, grads = [randn(*SHAPE) for _ in range(n)], [randn(*chunk_shape) for _ in range(n)]
        x = _leaf(parts[r])
        out = reduce_scatter_to_sequence_parallel_region(x, group, dim)
        ref_parts = [_leaf(p) for p in parts]
        ref_outs = sum(ref_parts).chunk(n, dim)
        ref_loss = sum((o * gr).sum() for o, gr in zip(ref_outs, grads))
        return out, (out * grads[r]).sum(), [x], ref_outs[r], ref_loss, [ref_parts[r]]
    raise AssertionError(name)


def _region_parity(name, tp, dim):
    torch.set_num_threads(1)
    topo = make_topology(model_parallel_size=tp)
    group = topo.axis("tp").group
    n, r = topo.axis("tp").size, topo.axis("tp").rank
    out, loss, inputs, ref_out, ref_loss, ref_inputs = _case(name, n, r, group, dim)
    loss.backward()
    ref_loss.backward()
    assert_parity(out.detach(), ref_out.detach(), name=f"{name} forward", **TOL)
    for i, (a, e) in enumerate(zip(inputs, ref_inputs)):
        assert_parity(a.grad, e.grad, name=f"{name} input grad {i}", **TOL)
    return True


CASES = ["copy", "reduce", "scatter", "gather", "scatter_sp", "gather_sp", "gather_sp_split", "reduce_scatter_sp"]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,tp", [(2, 2), (4, 4), (4, 2)], ids=["tp2", "tp4", "tp2xdp2"])
@pytest.mark.parametrize("name", CASES)
def test_region_matches_single_process(name, world_size, tp):
    assert run_distributed(_region_parity, world_size, name, tp, 1, timeout_seconds=60) == [True] * world_size


@pytest.mark.distributed
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("name", ["scatter_sp", "gather_sp", "reduce_scatter_sp"])
def test_sequence_regions_other_dims(name, dim):
    assert run_distributed(_region_parity, 2, name, 2, dim, timeout_seconds=60) == [True, True]


def _gradcheck_composites(tp):
    """float64 gradcheck of compositions whose input and output are replicated.

    Every rank perturbs the same element of the same replicated input at the same
    time, so the numerical Jacobian is the one of the global function and the check
    covers the backward collectives of all seven regions.
    """
    torch.set_num_threads(1)
    topo = make_topology(model_parallel_size=tp)
    group, n, r = topo.axis("tp").group, topo.axis("tp").size, topo.axis("tp").rank
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, 4, generator=g, dtype=torch.float64)
    a = torch.randn(4, 6, generator=g, dtype=torch.float64)
    b = torch.randn(6, 4, generator=g, dtype=torch.float64)
    a_r, b_r, w_r = a.chunk(n, 1)[r], b.chunk(n, 0)[r], w.chunk(n, -1)[r]

    def scatter_gather(t):
        return gather_from_model_parallel_region(scatter_to_model_parallel_region(t, group) * w_r, group)

    def tensor_parallel_mlp(t):
        return reduce_from_model_parallel_region(torch.tanh(copy_to_model_parallel_region(t, group) @ a_r) @ b_r, group)

    def sequence_parallel_mlp(t):
        s = scatter_to_sequence_parallel_region(t, group)
        h = torch.tanh(gather_from_sequence_parallel_region(s, group) @ a_r) @ b_r
        y = reduce_scatter_to_sequence_parallel_region(h, group)
        return gather_from_sequence_parallel_region(y, group, tensor_parallel_output_grad=False)

    reference = {"scatter_gather": x * w, "tp_mlp": torch.tanh(x @ a) @ b, "sp_mlp": torch.tanh(x @ a) @ b}
    for key, fn in [
        ("scatter_gather", scatter_gather),
        ("tp_mlp", tensor_parallel_mlp),
        ("sp_mlp", sequence_parallel_mlp),
    ]:
        assert_parity(fn(x).detach(), reference[key].detach(), rtol=1e-12, atol=1e-12, name=key)
        assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8, rtol=1e-6), key
    return True


@pytest.mark.distributed
def test_float64_gradcheck():
    assert run_distributed(_gradcheck_composites, 2, 2, timeout_seconds=120) == [True, True]


def _errors(tp):
    topo = make_topology(model_parallel_size=tp)
    group = topo.axis("tp").group
    x = torch.zeros(2, 3, 5)
    messages = []
    for call in (
        lambda: scatter_to_model_parallel_region(x, group),
        lambda: scatter_to_sequence_parallel_region(x, group),
        lambda: reduce_scatter_to_sequence_parallel_region(x, group, dim=0 if tp == 3 else 1),
        lambda: gather_from_sequence_parallel_region(x, group, dim=3),
    ):
        try:
            call()
        except ValueError as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.distributed
def test_bad_input_names_dim_size_and_group():
    messages = run_distributed(_errors, 2, 2, timeout_seconds=60)[0]
    assert len(messages) == 4
    assert "has size 5 in dim=2, which is not divisible by the group size 2" in messages[0]
    assert "has size 3 in dim=1, which is not divisible by the group size 2" in messages[1]
    assert "has size 3 in dim=1" in messages[2]
    assert "dim=3 is out of range for a tensor of shape [2, 3, 5]" in messages[3]


def test_identity_without_group():
    x = torch.randn(2, 4, 8, requires_grad=True)
    for fn in (
        copy_to_model_parallel_region,
        reduce_from_model_parallel_region,
        scatter_to_model_parallel_region,
        gather_from_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
        gather_from_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    ):
        assert fn(x, None) is x


def _identity_single_rank():
    group = dist.new_group([dist.get_rank()]) if dist.get_world_size() == 1 else None
    x = torch.randn(2, 4, 8)
    return scatter_to_model_parallel_region(x, group) is x and gather_from_sequence_parallel_region(x, group) is x


@pytest.mark.distributed
def test_identity_on_one_rank_group():
    assert run_distributed(_identity_single_rank, 1, timeout_seconds=60) == [True]
