"""Weights held on several pipeline stages (a tied LM head and input embedding, say).

Each stage keeps its own copy; the copies start equal (broadcast from the first holder) and
stay equal because their gradients are summed over the holders before every update, which
is what a one-process model's single shared parameter gets from autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from scaling.collectives import all_reduce, broadcast
from scaling.topology import Topology

K = TypeVar("K", bound=Hashable)


class TiedGroups(Generic[K]):
    """One process group per tied weight, over the ranks of one pipe that hold a copy.

    Args:
        topology: the initialised topology.
        stages_by_key: for every tied weight (any key: a tied-layer key, a parameter path),
            the pipeline stages holding a copy; keys held on one stage only are skipped.
            Every rank must pass the same keys in the same order (``new_group`` is
            collective over the default group, so every rank creates every group).
    """

    def __init__(self, topology: Topology, stages_by_key: Mapping[K, Sequence[int]]) -> None:
        #: key -> (this rank's group of holders, global rank of the first holder).
        self.groups: dict[K, tuple[dist.ProcessGroup, int]] = {}
        for key, stages in stages_by_key.items():
            if len(set(stages)) < 2:
                continue
            for ranks in topology.stage_rank_lists(sorted(set(stages))):
                group = dist.new_group(ranks)
                if topology.global_rank in ranks:
                    self.groups[key] = (group, ranks[0])

    def __bool__(self) -> bool:
        return bool(self.groups)

    def keys(self) -> list[K]:
        """The tied keys this rank holds a copy of."""
        return list(self.groups)

    @torch.no_grad()
    def broadcast_values(self, params: Callable[[K], Iterable[torch.Tensor]]) -> None:
        """Make every copy equal to the first holder's (``params(key)``: this rank's copies)."""
        for key, (group, src) in self.groups.items():
            for param in params(key):
                broadcast(param.data, src, group)

    def reduce_gradients(self, params: Callable[[K], Iterable[torch.nn.Parameter]]) -> None:
        """Sum the copies' gradients over their holders (a copy without a gradient adds zeros)."""
        for key, (group, _) in self.groups.items():
            for param in params(key):
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                all_reduce(param.grad, group)
