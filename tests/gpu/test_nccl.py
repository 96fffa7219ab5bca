"""The collectives and the topology on CUDA with NCCL, on the single-rank group one GPU allows.

A group of one rank makes Scaling's wrappers the identity, so the NCCL kernels behind
them (all-gather and reduce-scatter into one tensor, all-reduce, object broadcast) are
also called directly on the topology's NCCL groups; the device check is exercised
through point-to-point ops, which are checked before they are posted.
"""

import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import (
    CollectiveDeviceError,
    _compat,
    all_gather,
    all_gather_async,
    all_reduce,
    batch_send_recv,
    broadcast_object,
    broadcast_pytree,
    group_device,
    reduce_scatter,
    reduce_scatter_async,
)
from scaling.testing import make_topology, run_distributed
from scaling.topology import barrier_device_ids

pytestmark = pytest.mark.gpu


def _topology_worker():
    topo = make_topology(device="auto", backend="auto")
    return (
        str(topo.device),
        topo.backend,
        dist.get_backend(topo.axis("dp").group),
        str(group_device(topo.axis("tp").group)),
    )


def test_auto_topology_is_cuda_with_nccl():
    ((device, backend, group_backend, wire),) = run_distributed(_topology_worker, 1, backend="nccl")
    assert (device, backend, group_backend, wire) == ("cuda:0", "nccl", "nccl", "cuda:0")


def _collectives_worker():
    topo = make_topology(device="cuda", backend="nccl")
    dev = topo.device
    group = topo.axis("dp").group
    x = torch.arange(6.0, device=dev)
    out = {
        "wrappers": [
            all_reduce(x.clone(), group).tolist(),
            all_gather(x, group).tolist(),
            reduce_scatter(x, group).tolist(),
            broadcast_object({"k": 1}, 0, group),
            broadcast_pytree({"ids": x}, 0, group)["ids"].device.type,
        ]
    }
    gathered, scattered = torch.empty(6, device=dev), torch.empty(6, device=dev)
    all_gather_async(gathered, x, group).wait()
    reduce_scatter_async(scattered, x.clone(), group).wait()
    # The NCCL kernels themselves, on the same group (the wrappers skip a group of one).
    nccl_sum = x.clone()
    dist.all_reduce(nccl_sum, group=group)
    nccl_gather, nccl_scatter = torch.empty(6, device=dev), torch.empty(6, device=dev)
    _compat.all_gather_single(nccl_gather, x, group=group)
    _compat.reduce_scatter_single(nccl_scatter, x, group=group)
    box = [{"step": 3}]
    dist.broadcast_object_list(box, src=0, group=group, device=group_device(group))
    out["barrier"] = barrier_device_ids(group)  # the device an NCCL barrier names: this rank's
    dist.barrier(group=group, device_ids=out["barrier"])
    out["async"] = [gathered.tolist(), scattered.tolist()]
    out["nccl"] = [nccl_sum.tolist(), nccl_gather.tolist(), nccl_scatter.tolist(), box[0]]
    torch.cuda.synchronize()
    return out


def test_collectives_run_on_an_nccl_group():
    (out,) = run_distributed(_collectives_worker, 1, backend="nccl")
    r = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert out["wrappers"] == [r, r, r, {"k": 1}, "cuda"]
    assert out["async"] == [r, r]
    assert out["nccl"] == [r, r, r, {"step": 3}]
    assert out["barrier"] == [0]


def _wrong_device_worker():
    make_topology(device="cuda", backend="nccl")
    with pytest.raises(CollectiveDeviceError) as info:
        batch_send_recv([("send", torch.ones(3), 0)])
    return str(info.value), info.value.tensor_device, info.value.group_device


def test_cpu_tensor_on_nccl_is_refused_by_name():
    ((message, tensor_device, group_device_type),) = run_distributed(_wrong_device_worker, 1, backend="nccl")
    assert (tensor_device, group_device_type) == ("cpu", "cuda")
    assert message.startswith("send on group 'p2p' (nccl) got a tensor of shape [3] (float32) on device cpu")


def test_a_rank_beyond_the_nodes_gpus_is_refused_with_nccl():
    """The node's real GPU count: local rank N on a node of N GPUs has none of its own under NCCL."""
    from scaling.topology import Topology, TopologyConfig

    count = torch.cuda.device_count()
    config = TopologyConfig(world_size=count + 1, device="cuda", backend="nccl")
    assert Topology(config, count - 1, local_rank=count - 1).device == torch.device("cuda", count - 1)
    with pytest.raises(RuntimeError, match=f"local rank {count} has no GPU of its own: this node shows {count} CUDA"):
        _ = Topology(config, count, local_rank=count).device


STUCK = textwrap.dedent(
    """
    import sys, time
    import torch, torch.distributed as dist
    from scaling.topology import Topology, TopologyConfig, set_flight_recorder_folder

    topology = Topology(TopologyConfig(world_size=1, device="cuda", timeout_seconds=5), 0)
    topology.initialize_distributed(init_method="file://" + sys.argv[2])
    set_flight_recorder_folder(topology.backend, sys.argv[1])  # what run_training does with diagnostics_dir
    x = torch.ones(4, device=topology.device)
    dist.all_reduce(x, group=topology.axis("dp").group)  # collective 1 completes
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 40)  # the GPU spins for minutes, so collective 2 cannot start
    dist.all_reduce(x, group=topology.axis("dp").group)
    time.sleep(200)  # waits without holding the GIL, which the dump's Python stacks need
    print("never reached", flush=True)
    """
)


def test_a_collective_stuck_on_the_gpu_is_ended_by_the_watchdog_and_leaves_its_flight_record(tmp_path):
    """On NCCL the host does not wait in a collective, so Scaling's own diagnosis never fires: NCCL's
    watchdog ends the process after the topology's timeout (5 s here), having dumped torch's flight
    record (turned on by initialize_distributed) into the folder the trainer names, where torch's
    analyser reads it."""
    folder = tmp_path / "diagnostics"
    run = subprocess.run(
        [sys.executable, "-c", STUCK, str(folder), str(tmp_path / "rendezvous")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode != 0 and "never reached" not in run.stdout, run.stderr[-3000:]
    dump_file = folder / "flight_recorder_rank_0"
    assert dump_file.is_file(), f"no flight record in {sorted(folder.iterdir())}; stderr: {run.stderr[-3000:]}"
    with dump_file.open("rb") as f:
        entries = [e for e in pickle.load(f)["entries"] if e["profiling_name"] == "nccl:all_reduce"]
    assert [e["collective_seq_id"] for e in entries][-2:] == [1, 2]
    assert not entries[-1]["retired"]  # collective 2 never completed
    printed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder)]
        + ["--prefix", "flight_recorder_rank_", "-j"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert printed.returncode == 0, printed.stderr[-2000:]  # it parsed the record and its group table
