"""destroy_process_group: torch's, after a pause that works round a torch 2.6 gloo deadlock."""

from __future__ import annotations

import time

import torch.distributed as dist

# How long destroy_process_group() lets go of the GIL before destroying the groups.
_GLOO_SETTLE_SECONDS = 0.01


def destroy_process_group() -> None:
    """Destroy the default process group and every subgroup, if one is initialised.

    ``torch.distributed.destroy_process_group`` after a short pause: on torch 2.6 gloo can
    deadlock there. A gloo thread, holding its work mutex, frees a finished collective
    whose tensors need the GIL to drop their Python objects, while the caller holds the
    GIL and waits for that mutex in ``~ProcessGroupGloo`` (seen under load: ranks hung at
    the end of a run). Letting go of the GIL for 10 ms lets such a thread finish first.
    This narrows the race; it does not close it. Upstream, pytorch/pytorch#154976 (merged
    June 2025) releases the GIL in the process group's destructor; the suite has not hung
    there on torch 2.10 or newer.
    """
    if dist.is_initialized():
        time.sleep(_GLOO_SETTLE_SECONDS)
        dist.destroy_process_group()
