"""Forward-only schedule for evaluation: every micro-batch forward, no backward, no step."""

from __future__ import annotations

from scaling.pipeline._instructions import Forward, Instruction
from scaling.pipeline.schedules._common import accepts_old_keyword, build, check_arguments


@accepts_old_keyword
def forward_only_schedule(
    num_stages: int, num_micro_batches: int, stage: int, num_virtual: int = 1
) -> list[Instruction]:
    """Evaluation instructions of ``stage``: loads, receives, forwards and sends only.

    Example:
        >>> [i.short for i in forward_only_schedule(2, 2, 0)]
        ['L0', 'F0', 'sa0', 'L1', 'F1', 'sa1']
    """
    check_arguments(num_stages, num_micro_batches, stage, num_virtual)
    order = [Forward(mb, c) for mb in range(num_micro_batches) for c in range(num_virtual)]
    return build(lambda s: order, num_stages, stage, num_virtual, cache_key=("forward_only", num_micro_batches))
