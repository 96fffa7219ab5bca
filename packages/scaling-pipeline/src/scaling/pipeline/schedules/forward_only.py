"""Forward-only schedule for evaluation: every micro-batch forward, no backward, no step."""

from __future__ import annotations

from scaling.pipeline._instructions import Forward, Instruction
from scaling.pipeline.schedules._common import accepts_old_keyword, build, check_arguments


@accepts_old_keyword
def forward_only_schedule(
    num_stages: int, num_micro_batches: int, stage: int, num_virtual: int = 1, placement: str = "loop"
) -> list[Instruction]:
    """Evaluation instructions of ``stage``: loads, receives, forwards and sends only.

    ``placement`` is the training schedule's (:func:`scaling.pipeline.virtual_stage`); in a V
    every micro-batch goes down the stages (chunk 0) before any comes back up (chunk 1).

    Example:
        >>> [i.short for i in forward_only_schedule(2, 2, 0)]
        ['L0', 'F0', 'sa0', 'L1', 'F1', 'sa1']
    """
    check_arguments(num_stages, num_micro_batches, stage, num_virtual)
    if placement == "v":
        order = [Forward(mb, c) for c in range(num_virtual) for mb in range(num_micro_batches)]
    else:
        order = [Forward(mb, c) for mb in range(num_micro_batches) for c in range(num_virtual)]
    key = ("forward_only", num_micro_batches)
    return build(lambda s: order, num_stages, stage, num_virtual, cache_key=key, placement=placement)
