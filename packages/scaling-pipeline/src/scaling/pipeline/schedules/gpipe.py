"""GPipe: every micro-batch forward, then every micro-batch backward.

Peak in-flight activations are ``num_micro_batches`` on every stage; the bubble is
``(p - 1) / (m + p - 1)`` of the step.
"""

from __future__ import annotations

from scaling.pipeline._instructions import Backward, Forward, Instruction
from scaling.pipeline.schedules._common import accepts_old_keyword, build, check_arguments


@accepts_old_keyword
def gpipe_schedule(num_stages: int, num_micro_batches: int, stage: int) -> list[Instruction]:
    """GPipe instructions of ``stage``.

    Args:
        num_stages: pipeline stages ``p``.
        num_micro_batches: micro-batches ``m`` per step.
        stage: the stage in ``[0, p)``.

    Returns:
        The stage's instructions.

    Example:
        >>> [i.short for i in gpipe_schedule(2, 2, 1)][:4]
        ['ra0', 'L0', 'F0', 'ra1']
    """
    check_arguments(num_stages, num_micro_batches, stage)
    forwards: list[Instruction] = [Forward(mb) for mb in range(num_micro_batches)]
    backwards: list[Instruction] = [Backward(mb) for mb in range(num_micro_batches)]
    return build(lambda s: forwards + backwards, num_stages, stage, cache_key=("gpipe", num_micro_batches))
