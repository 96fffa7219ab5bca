"""Expert parameters' gradients under expert parallelism (``ParameterMeta.is_expert``).

With ``expert_parallel_size = ep > 1`` an expert lives on one rank of each expert-parallel
group, and its gradient there already sums the contributions of every token of that
group (the token all-to-all's backward brings them home). The data-parallel mean over
the DP × CP ranks is then the sum over the ranks holding the expert
(``topology.expert_data_parallel_group``), divided by DP × CP: an average over that group,
bucketed and overlapped with backward like the dense gradients, then divided by ``ep``.

In the global norm an expert's gradient counts on the first rank holding it.
"""

from __future__ import annotations

from collections.abc import Sequence

from scaling.optim._comm import group_size
from scaling.optim._reducer import GradientReducer
from scaling.optim._slots import ParamSlot
from scaling.topology import Topology


class ExpertGradients:
    """The expert slots' reduction (ZeRO 0; ZeRO 1-3 with expert parallelism are refused)."""

    def __init__(self, slots: Sequence[ParamSlot], topology: Topology, bucket_size_bytes: int) -> None:
        self.slots = list(slots)
        self.ids = {id(s) for s in self.slots}
        self.ep = topology.expert_parallel_size
        group = topology.expert_data_parallel_group
        self.reducer = (
            GradientReducer(self.slots, group, bucket_size_bytes, "all_reduce")
            if self.slots and group is not None and group_size(group) > 1
            else None
        )
        # The first rank of the expert-data-parallel group: DP ranks [0, ep) at CP rank 0.
        self.counts_in_norm = topology.data_context_parallel_rank < self.ep * topology.context_parallel_size and (
            topology.context_parallel_rank == 0
        )

    def discard(self) -> None:
        if self.reducer is not None:
            self.reducer.discard()

    def finish(self) -> None:
        """Wait for the reduction; ``.grad`` then holds the DP × CP mean."""
        if self.reducer is not None:
            self.reducer.finish()
        for slot in self.slots:
            if slot.param.grad is not None:
                slot.param.grad.div_(self.ep)
