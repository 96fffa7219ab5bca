import itertools
import time

import pytest
import torch
import torch.distributed as dist

from scaling.testing import run_distributed
from scaling.topology import (
    AXIS_NAMES,
    RankCoordinates,
    Topology,
    TopologyConfig,
    barrier_device_ids,
    destroy_process_group,
)

CP_LAYOUTS = [(1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2), (1, 1, 1, 4), (2, 1, 2, 2)]
LAYOUTS = [
    (1, 1, 1),
    (2, 1, 1),
    (1, 2, 1),
    (1, 1, 2),
    (2, 2, 1),
    (2, 1, 2),
    (1, 2, 2),
    (4, 1, 1),
    (2, 2, 2),
    (1, 4, 2),
    (2, 1, 4),
    (8, 1, 1),
]


def _expected(rank, tp, dp, pp, cp=1):
    """The formula of ARCHITECTURE.md: TP fastest, then CP, then DP, then PP."""
    t = rank % tp
    c = (rank // tp) % cp
    d = (rank // (tp * cp)) % dp
    p = rank // (tp * cp * dp)
    return p, d, t, c


def _where(world, layout, **fixed):
    names = ("pp", "dp", "tp", "cp")
    return [r for r in range(world) if all(_expected(r, *layout)[names.index(k)] == v for k, v in fixed.items())]


@pytest.mark.parametrize(("tp", "dp", "pp", "cp"), [(*layout, 1) for layout in LAYOUTS] + CP_LAYOUTS)
def test_coordinates_match_formula(tp, dp, pp, cp):
    cfg = TopologyConfig(model_parallel_size=tp, data_parallel_size=dp, pipe_parallel_size=pp, context_parallel_size=cp)
    assert cfg.world_size == tp * dp * pp * cp
    layout, world = (tp, dp, pp, cp), cfg.world_size
    seen = set()
    for rank in range(world):
        topo = Topology(cfg, rank)
        p, d, t, c = _expected(rank, *layout)
        assert topo.coordinates() == RankCoordinates(pp=p, dp=d, tp=t, cp=c)
        assert topo.rank_of(p, d, t, c) == rank
        assert topo.axis("tp").ranks == _where(world, layout, pp=p, dp=d, cp=c)
        assert topo.axis("dp").ranks == _where(world, layout, pp=p, tp=t, cp=c)
        assert topo.axis("cp").ranks == _where(world, layout, pp=p, dp=d, tp=t)
        assert topo.axis("dp_cp").ranks == _where(world, layout, pp=p, tp=t)
        assert topo.axis("dp_cp").rank == d * cp + c
        assert topo.axis("pp").ranks == _where(world, layout, dp=d, tp=t, cp=c)
        assert topo.axis("replica").ranks == _where(world, layout, dp=d, cp=c)
        assert topo.axis("pp").is_first == (p == 0)
        assert topo.axis("pp").is_last == (p == pp - 1)
        assert topo.axis("pp").previous == (None if p == 0 else rank - tp * cp * dp)
        assert topo.axis("pp").next == (None if p == pp - 1 else rank + tp * cp * dp)
        seen.add((p, d, t, c))
    assert seen == set(itertools.product(range(pp), range(dp), range(tp), range(cp)))


def test_rank_out_of_range():
    cfg = TopologyConfig(world_size=2)
    with pytest.raises(ValueError, match=r"global_rank=2 is outside \[0, world_size=2\)"):
        Topology(cfg, 2)


def test_from_env():
    cfg = TopologyConfig(world_size=4, model_parallel_size=2, device="cpu")
    topo = Topology.from_env(cfg, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (topo.global_rank, topo.local_rank, topo.axis("tp").rank) == (3, 1, 1)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 from the launcher does not match topology world_size=4"):
        Topology.from_env(cfg, {"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"\['RANK', 'WORLD_SIZE'\] not set"):
        Topology.from_env(cfg, {})


def test_more_nccl_ranks_on_a_node_than_gpus_is_refused_before_any_group(monkeypatch):
    """NCCL takes one GPU per rank: local rank 2 on a node showing 2 GPUs is refused, naming the
    counts and the fix, when the device is asked for (before initialize_distributed's
    init_process_group). The real CUDA query is in tests/gpu/test_nccl.py; here the GPU count is
    set, as on a node with 2 GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    config = TopologyConfig(world_size=4, device="cuda", backend="nccl")
    assert Topology(config, 1, local_rank=1).device == torch.device("cuda", 1)
    with pytest.raises(RuntimeError) as info:
        _ = Topology(config, 2, local_rank=2).device
    assert str(info.value) == (
        "local rank 2 has no GPU of its own: this node shows 2 CUDA device(s) (CUDA_VISIBLE_DEVICES=0,1) and NCCL "
        "needs one per rank; start at most 2 processes per node (runner.nproc_per_node, or the hosts' slots), or "
        "make more GPUs visible"
    )
    # auto picks CUDA with NCCL where there is CUDA: the same refusal.
    with pytest.raises(RuntimeError, match="local rank 3 has no GPU of its own"):
        _ = Topology(TopologyConfig(world_size=4), 3, local_rank=3).device


def test_groups_need_initialisation():
    topo = Topology(TopologyConfig(world_size=1, device="cpu"), 0)
    with pytest.raises(RuntimeError, match="initialize_distributed"):
        _ = topo.axis("tp").group
    assert topo.device == torch.device("cpu") and topo.backend == "gloo"


def test_destroy_process_group(tmp_path):
    destroy_process_group()  # nothing initialised: nothing to do
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        x = torch.ones(1)
        dist.all_reduce(x, group=group)
        destroy_process_group()
        assert not dist.is_initialized()
        assert group not in dist.distributed_c10d._world.pg_map  # the subgroups go too
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _members(group):
    members = [None] * dist.get_world_size(group)
    dist.all_gather_object(members, dist.get_rank(), group=group)
    return members


def _check_groups(tp, dp, pp, cp, shard):
    cfg = TopologyConfig(
        model_parallel_size=tp,
        data_parallel_size=dp,
        pipe_parallel_size=pp,
        context_parallel_size=cp,
        data_parallel_shard_size=shard,
        device="cpu",
    )
    topo = Topology.from_env(cfg).initialize_distributed()
    out = {}
    for name in GROUPS:
        axis = topo.axis(name)
        out[name] = (_members(axis.group), axis.ranks, axis.size, axis.rank)
    out["result_group_is_separate"] = topo.axis("pp_result").group is not topo.axis("pp").group
    for name in ("dp_shard", "dp_replicate"):
        group = topo.axis(name).group
        out[name] = None if group is None else _members(group)
    out["shard_rank"] = topo.axis("dp_shard").rank
    mesh = topo.device_mesh
    out["mesh"] = (mesh.mesh_dim_names, mesh.mesh.tolist(), mesh.get_coordinate())
    out["coords"] = topo.coordinates()
    # A real reduction over each axis: sum of global ranks of the group.
    x = torch.tensor([float(topo.global_rank)])
    dist.all_reduce(x, group=topo.axis("tp").group)
    out["tp_sum"] = x.item()
    topo.destroy()
    return out


GROUPS = ("tp", "dp", "cp", "dp_cp", "pp", "replica", "pp_result")


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("tp", "dp", "pp", "cp", "shard"),
    [
        (1, 1, 1, 1, None),
        (2, 1, 1, 1, None),
        (1, 2, 1, 1, None),
        (1, 1, 2, 1, None),
        (2, 2, 1, 1, None),
        (1, 2, 2, 1, None),
        (2, 1, 2, 1, None),
        pytest.param(1, 1, 1, 2, None, marks=pytest.mark.slow),
        pytest.param(1, 2, 1, 2, None, marks=pytest.mark.slow),
        pytest.param(1, 2, 1, 2, 1, marks=pytest.mark.slow),
        pytest.param(2, 2, 2, 1, None, marks=pytest.mark.slow),
        pytest.param(1, 4, 1, 2, 2, marks=pytest.mark.slow),
        pytest.param(2, 1, 2, 2, None, marks=pytest.mark.slow),
    ],
)
def test_process_groups_on_real_ranks(tp, dp, pp, cp, shard):
    world = tp * dp * pp * cp
    layout = (tp, dp, pp, cp)
    shard_dp = shard or dp
    results = run_distributed(_check_groups, world, *layout, shard, timeout_seconds=90)
    for rank, out in enumerate(results):
        p, d, t, c = _expected(rank, *layout)
        for name in GROUPS:
            members, expected_ranks, size, axis_rank = out[name]
            assert members == expected_ranks and size == len(members) and members[axis_rank] == rank, (name, rank)
        assert out["result_group_is_separate"] == (pp > 1)
        # ZeRO shards over shard_dp DP ranks with all their CP ranks; replicas share the CP rank.
        same_shard = [
            r for r in _where(world, layout, pp=p, tp=t) if _expected(r, *layout)[1] // shard_dp == d // shard_dp
        ]
        assert out["dp_shard"] == (None if len(same_shard) == 1 and shard_dp < dp else same_shard)
        assert out["shard_rank"] == same_shard.index(rank)
        replicas = [
            r for r in _where(world, layout, pp=p, tp=t, cp=c) if _expected(r, *layout)[1] % shard_dp == d % shard_dp
        ]
        assert out["dp_replicate"] == (None if shard_dp == dp else replicas)
        names, mesh, coord = out["mesh"]
        assert names == ("pp", "dp", "cp", "tp")
        assert mesh == torch.arange(world).view(pp, dp, cp, tp).tolist()
        assert list(coord) == [p, d, c, t]
        assert out["tp_sum"] == sum(out["tp"][1])


def _group_timeouts():
    cfg = TopologyConfig(model_parallel_size=2, data_parallel_size=2, device="cpu", timeout_seconds=3)
    topo = Topology.from_env(cfg).initialize_distributed()
    # A real hang: only rank 0 enters an all-reduce on its TP group. It must fail after the
    # configured 3 s, not torch's 30-minute default for new groups.
    if topo.global_rank != 0:
        time.sleep(6)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.zeros(1), group=topo.axis("tp").group)
    except RuntimeError:
        return time.monotonic() - start
    return float("inf")


@pytest.mark.slow
@pytest.mark.waits
@pytest.mark.distributed
def test_subgroups_use_the_configured_timeout():
    elapsed = run_distributed(_group_timeouts, 4, timeout_seconds=60)[0]
    assert 2.5 < elapsed < 5.5


def _check_expert_groups(dp, cp, ep):
    cfg = TopologyConfig(data_parallel_size=dp, context_parallel_size=cp, expert_parallel_size=ep, device="cpu")
    topo = Topology.from_env(cfg).initialize_distributed()
    out = {}
    for name in ("ep", "edp"):
        group = topo.axis(name).group
        out[name] = None if group is None else _members(group)
    out["ep_rank"] = topo.axis("ep").rank
    out["edp_rank"] = topo.axis("edp").rank
    topo.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("dp", "cp", "ep"), [(4, 1, 2), (2, 2, 2)])
def test_expert_groups_on_real_ranks(dp, cp, ep):
    world = dp * cp
    layout = (1, dp, 1, cp)
    for rank, out in enumerate(run_distributed(_check_expert_groups, world, dp, cp, ep, timeout_seconds=90)):
        _, d, _, c = _expected(rank, *layout)
        # Experts split over consecutive DP ranks with the same CP rank ...
        assert out["ep"] == _where(world, layout, cp=c)[(d // ep) * ep : (d // ep + 1) * ep]
        assert out["ep_rank"] == d % ep
        # ... and the ranks holding the same experts (every CP rank too) reduce their gradients.
        same = [r for r in range(world) if _expected(r, *layout)[1] % ep == d % ep]
        assert out["edp"] == (None if len(same) == 1 else same)
        assert out["edp_rank"] == same.index(rank)  # its ZeRO shard index for the experts


def _barrier_ids():
    ids = (barrier_device_ids(), barrier_device_ids(dist.group.WORLD))
    dist.barrier(device_ids=ids[0])  # what the callers pass: accepted by gloo as no device
    return ids


@pytest.mark.distributed
def test_a_gloo_barrier_names_no_device():
    """Only NCCL runs a barrier on a device (the CUDA side: tests/gpu/test_nccl.py)."""
    assert run_distributed(_barrier_ids, 2, timeout_seconds=60) == [(None, None), (None, None)]


def test_the_topology_is_a_table_of_axes():
    """Topology's public surface stays small (<= 25 members, #48); every axis is one object."""
    public = [name for name in dir(Topology) if not name.startswith("_")]
    topo = Topology(TopologyConfig(world_size=8, model_parallel_size=2, pipe_parallel_size=2, device="cpu"), 5)
    public += [name for name in vars(topo) if not name.startswith("_")]
    assert len(public) <= 25, public
    assert {name: (a.size, a.rank, a.ranks, a.mesh_dim) for name in AXIS_NAMES for a in [topo.axis(name)]} == {
        "pp": (2, 1, [1, 5], "pp"),
        "dp": (2, 0, [5, 7], "dp"),
        "cp": (1, 0, [5], "cp"),
        "tp": (2, 1, [4, 5], "tp"),
        "replica": (4, 3, [0, 1, 4, 5], None),
        "dp_cp": (2, 0, [5, 7], None),
        "pp_result": (2, 1, [1, 5], None),
        "dp_shard": (2, 0, [5, 7], None),
        "dp_replicate": (1, 0, [5], None),
        "ep": (1, 0, [5], None),
        "edp": (2, 0, [5, 7], None),
    }
    with pytest.raises(ValueError, match="no axis 'mp'; the axes are pp, dp, cp, tp, replica"):
        topo.axis("mp")


def test_the_names_of_0_1_still_answer_and_warn():
    """The walkthrough's era names (``model_parallel_group``, ``is_first_pipe_stage``, ...) read the
    axes at run time with a DeprecationWarning naming the replacement; removed in 0.2."""
    topo = Topology(TopologyConfig(world_size=8, model_parallel_size=2, pipe_parallel_size=2, device="cpu"), 5)
    with pytest.deprecated_call(match=r'Topology.model_parallel_ranks is deprecated; use topology.axis\("tp"\).ranks'):
        assert topo.model_parallel_ranks == [4, 5]
    with pytest.deprecated_call(match=r'use topology.axis\("pp"\).previous'):
        assert topo.previous_pipe_rank == 1
    with pytest.deprecated_call(match=r'use topology.axis\("replica"\).ranks'):
        assert topo.model_pipe_parallel_ranks == [0, 1, 4, 5]
    with pytest.deprecated_call():
        assert (topo.data_context_parallel_size, topo.expert_data_parallel_rank, topo.pipe_rank_of_stage(0)) == (
            2,
            0,
            1,
        )
    with pytest.deprecated_call():
        assert topo.data_context_parallel_ranks_of(0) == [0, 2]
    with pytest.raises(AttributeError, match="'Topology' object has no attribute 'model_parallel_colour'"):
        _ = topo.model_parallel_colour
