import pytest
import torch
import torch.distributed as dist

from scaling.collectives import GradientBucketer, all_gather_flat, all_reduce_gradients, reduce_scatter_flat
from scaling.testing import assert_parity, make_topology, run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-7}


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


def _data_parallel_parity(bucket_size_bytes):
    topo = make_topology()  # all ranks data parallel
    dp, r = topo.data_parallel_size, topo.data_parallel_rank
    g = torch.Generator().manual_seed(11)
    x, y = (
        torch.randn(3 * dp, 4, generator=g, dtype=torch.float64),
        torch.randn(3 * dp, 2, generator=g, dtype=torch.float64),
    )
    reference, model = _model(0), _model(0)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    # A float32 extra parameter puts a second dtype into the buckets.
    extra = torch.nn.Parameter(torch.zeros(5))
    extra.grad = torch.full((5,), float(r))
    shard = slice(3 * r, 3 * (r + 1))
    torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
    all_reduce_gradients([*model.parameters(), extra], topo.data_parallel_group, bucket_size_bytes=bucket_size_bytes)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert_parity(p.grad, ref.grad, name=name, **TOL)
    assert_parity(extra.grad, torch.full((5,), sum(range(dp)) / dp), name="float32 extra", **TOL)
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bucket_size_bytes", [64, 25 * 2**20], ids=["tiny-buckets", "one-bucket"])
def test_all_reduce_gradients_matches_full_batch(world_size, bucket_size_bytes):
    assert (
        run_distributed(_data_parallel_parity, world_size, bucket_size_bytes, timeout_seconds=60) == [True] * world_size
    )


def _reduce_scatter_round_trip():
    group = dist.group.WORLD
    world, r = dist.get_world_size(), dist.get_rank()
    per_rank = [torch.arange(4.0 * world) * (i + 1) for i in range(world)]
    mean = sum(per_rank) / world
    shard = reduce_scatter_flat(per_rank[r].clone(), group)
    assert_parity(shard, mean.chunk(world)[r], name="mean shard", **TOL)
    summed = reduce_scatter_flat(per_rank[r].clone(), group, average=False)
    assert_parity(summed, sum(per_rank).chunk(world)[r], name="sum shard", **TOL)
    assert_parity(all_gather_flat(shard, group), mean, name="gathered", **TOL)
    errors = []
    for call in (lambda: reduce_scatter_flat(torch.zeros(5), group), lambda: all_gather_flat(torch.zeros(2, 2), group)):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_flat_averages_explicitly(world_size):
    errors = run_distributed(_reduce_scatter_round_trip, world_size, timeout_seconds=60)[0]
    pad = -5 % world_size
    assert f"buffer of 5 elements is not divisible by the group size {world_size}; pad it with {pad} zeros" in errors[0]
    assert "expected a 1-D shard, got shape [2, 2]" in errors[1]


def test_buckets_split_by_size_and_dtype():
    params = [torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.float64), torch.zeros(20), torch.zeros(3)]
    for p in params:
        p.grad = torch.zeros_like(p)
    params.append(torch.zeros(3))  # no grad: skipped
    bucketer = GradientBucketer(params, None, bucket_size_bytes=32)
    # 4+4 floats fill 32 bytes; the 80-byte grad gets its own bucket; float64 is separate.
    assert bucketer.buckets() == [[0, 1], [2], [3], [4]]
    bucketer.all_reduce()  # group None: a no-op


def test_bad_bucket_size_is_named():
    with pytest.raises(ValueError, match=r"bucket_size_bytes=0 must be a positive int"):
        GradientBucketer([], None, bucket_size_bytes=0)
    with pytest.raises(ValueError, match=r"bucket_size_bytes=1.5 must be a positive int"):
        all_reduce_gradients([], None, bucket_size_bytes=1.5)
