"""scaling.collectives: communication for every parallel feature.

Autograd-aware tensor/sequence-parallel regions, pytree broadcast and pipeline
transport, data-parallel gradient reduction, and thin collective wrappers that record
every call so a hang or a mismatched collective is reported with the ranks at fault.
"""

from scaling.collectives._broadcast import broadcast_pytree
from scaling.collectives._context import (
    all_to_all_tokens,
    gather_heads_scatter_sequence,
    ring_shift_async,
    scatter_heads_gather_sequence,
)
from scaling.collectives._diagnosis import check_consistency
from scaling.collectives._errors import (
    CollectiveDeviceError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
)
from scaling.collectives._gradients import (
    all_gather_flat,
    reduce_scatter_flat,
)
from scaling.collectives._ops import (
    PendingCollective,
    all_gather,
    all_gather_async,
    all_reduce,
    all_reduce_async,
    barrier,
    batch_send_recv,
    broadcast,
    broadcast_async,
    broadcast_object,
    group_device,
    group_rank,
    group_size,
    recv,
    reduce_scatter,
    reduce_scatter_async,
    send,
)
from scaling.collectives._pipe import PipeTransport, tensors_requiring_grad
from scaling.collectives._pytree import AutogradContext, PyTree
from scaling.collectives._recorder import CollectiveRecord, CollectiveRecorder, get_recorder
from scaling.collectives._regions import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_model_parallel_region,
    scatter_to_sequence_parallel_region,
)

__all__ = [
    "AutogradContext",
    "CollectiveDeviceError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveRecord",
    "CollectiveRecorder",
    "CollectiveTimeoutError",
    "PendingCollective",
    "PipeTransport",
    "PyTree",
    "all_gather",
    "all_gather_async",
    "all_gather_flat",
    "all_reduce",
    "all_reduce_async",
    "all_to_all_tokens",
    "barrier",
    "batch_send_recv",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "broadcast_pytree",
    "check_consistency",
    "copy_to_model_parallel_region",
    "gather_from_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_heads_scatter_sequence",
    "get_recorder",
    "group_device",
    "group_rank",
    "group_size",
    "recv",
    "reduce_from_model_parallel_region",
    "reduce_scatter",
    "reduce_scatter_async",
    "reduce_scatter_flat",
    "reduce_scatter_to_sequence_parallel_region",
    "ring_shift_async",
    "scatter_heads_gather_sequence",
    "scatter_to_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "send",
    "tensors_requiring_grad",
]
