"""Which device a rank computes on: ``cuda:LOCAL_RANK`` or the CPU, refused where it cannot run; the
device an NCCL barrier names."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from scaling.topology._config import TopologyConfig


def local_device(config: TopologyConfig, local_rank: int) -> torch.device:
    """``cuda:local_rank`` for device cuda (or auto with CUDA present and no gloo backend), else cpu.

    Raises:
        RuntimeError: CUDA asked for where there is none, or more ranks on this node than it
            has GPUs: NCCL (the backend on CUDA) takes one GPU per rank, and two ranks on one
            GPU fail at their first collective.
    """
    want = config.device
    if want == "cuda" or (want == "auto" and config.backend != "gloo" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("topology device='cuda' but torch.cuda.is_available() is False; use device='cpu'")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"local rank {local_rank} has no GPU of its own: this node shows {count} CUDA device(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) and NCCL needs one "
                f"per rank; start at most {count} processes per node (runner.nproc_per_node, or the hosts' "
                "slots), or make more GPUs visible"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def barrier_device_ids(group: ProcessGroup | None = None) -> list[int] | None:
    """``device_ids`` for ``torch.distributed.barrier`` on ``group`` (None: the default group).

    NCCL runs a barrier as an all-reduce on a device: named here (the current CUDA device, the
    one the topology set), it does not guess one from the global rank, which can hang where
    ranks map to GPUs unevenly. Other backends take none.
    """
    return [torch.cuda.current_device()] if dist.get_backend(group) == "nccl" else None
