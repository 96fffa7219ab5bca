"""Every collective checks that its tensors are on the device its group's backend uses.

NCCL takes only CUDA tensors and Scaling's gloo groups only CPU ones. On CPU the wrong
device is a ``meta`` tensor: the check fires before anything is recorded or sent, names
the collective, the tensor and both devices, and leaves the group usable.
"""

import pytest
import torch
import torch.distributed as dist

from scaling.collectives import (
    CollectiveDeviceError,
    all_gather,
    all_reduce,
    batch_send_recv,
    broadcast,
    broadcast_pytree,
    get_recorder,
    group_device,
    reduce_scatter_async,
)
from scaling.testing import run_distributed


def _wrong_device_calls():
    group = dist.group.WORLD
    other = 1 - dist.get_rank()
    meta = torch.empty(4, 2, device="meta")
    seq_before = get_recorder()._group_state(group).seq
    calls = {
        "all_reduce": lambda: all_reduce(meta, group),
        "all_gather": lambda: all_gather(meta, group),
        "broadcast": lambda: broadcast(meta, 0, group),
        "reduce_scatter": lambda: reduce_scatter_async(torch.empty(4), torch.empty(8, device="meta"), group),
        "send": lambda: batch_send_recv([("send", meta, other)]),
    }
    messages = {}
    for op, call in calls.items():
        with pytest.raises(CollectiveDeviceError) as info:
            call()
        err = info.value
        assert (err.op, err.tensor_device, err.group_device) == (op, "meta", "cpu"), op
        messages[op] = str(err)
    # Nothing was recorded or sent: the group still works, with matching sequence numbers.
    assert get_recorder()._group_state(group).seq == seq_before
    total = all_reduce(torch.ones(2), group)
    return messages, total.tolist(), str(group_device(group))


def test_wrong_device_is_refused_by_name_before_anything_is_sent():
    for messages, total, device in run_distributed(_wrong_device_calls, 2):
        assert total == [2.0, 2.0] and device == "cpu"
        assert messages["all_reduce"] == (
            "all_reduce on group 'world' (gloo) got a tensor of shape [4, 2] (float32) on device meta, but the "
            "group communicates on cpu; move the tensor there first (e.g. tensor.to(topology.device)), or make "
            "the group on a backend for meta"
        )
        assert "send on group 'p2p' (gloo)" in messages["send"]


def _pytree_to_group_device():
    # A batch broadcast over gloo travels as CPU bytes whatever the source's device type.
    group = dist.group.WORLD
    batch = (
        {"ids": torch.arange(6).view(2, 3), "mask": torch.ones(2, dtype=torch.bool)} if dist.get_rank() == 0 else None
    )
    got = broadcast_pytree(batch, 0, group)
    return got["ids"].tolist(), got["ids"].device.type


def test_broadcast_pytree_on_gloo_delivers_on_cpu():
    for ids, device in run_distributed(_pytree_to_group_device, 2):
        assert ids == [[0, 1, 2], [3, 4, 5]] and device == "cpu"
