"""The one place that adapts to torch versions and touches private torch APIs.

The multi-tensor kernels (``torch._foreach_*``, ``torch._fused_adam(w)_``)
are what ``torch.optim`` itself runs with ``foreach=True`` / ``fused=True``; they exist
with these signatures from torch 2.4 on (CPU fused Adam included).
``torch._C._current_graph_task_id`` (-1 outside a backward, since torch 2.1) is how
FSDP tells a forward run by activation checkpointing's recomputation from a real one.
"""

from __future__ import annotations

import torch

foreach_copy_ = torch._foreach_copy_
foreach_mul_ = torch._foreach_mul_
foreach_norm = torch._foreach_norm
fused_adam_ = torch._fused_adam_
fused_adamw_ = torch._fused_adamw_


def in_backward() -> bool:
    """Whether autograd is running a backward in this thread (e.g. a checkpointed recomputation)."""
    return bool(torch._C._current_graph_task_id() != -1)


__all__ = [
    "foreach_copy_",
    "foreach_mul_",
    "foreach_norm",
    "fused_adam_",
    "fused_adamw_",
    "in_backward",
]
