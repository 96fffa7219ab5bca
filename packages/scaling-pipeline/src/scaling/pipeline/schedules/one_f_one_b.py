"""1F1B (PipeDream-flush): a short warm-up of forwards, then one forward / one backward.

Stage ``s`` runs ``p - s - 1`` warm-up forwards, so at most ``p - s`` micro-batches
hold activations at once (GPipe holds all ``m``); the bubble equals GPipe's,
``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

from scaling.pipeline._instructions import Backward, Forward, Instruction
from scaling.pipeline.schedules._common import accepts_old_keyword, build, check_arguments


@accepts_old_keyword
def one_f_one_b_schedule(num_stages: int, num_micro_batches: int, stage: int) -> list[Instruction]:
    """1F1B instructions of ``stage``.

    Args:
        num_stages: pipeline stages ``p``.
        num_micro_batches: micro-batches ``m`` per step.
        stage: the stage in ``[0, p)``.

    Returns:
        The stage's instructions.

    Example:
        >>> [i.short for i in one_f_one_b_schedule(2, 2, 0) if i.is_compute]
        ['F0', 'F1', 'B0', 'B1']
    """
    check_arguments(num_stages, num_micro_batches, stage)
    return build(
        lambda s: _order(num_stages, num_micro_batches, s), num_stages, stage, cache_key=("1f1b", num_micro_batches)
    )


def _order(num_stages: int, m: int, stage: int) -> list[Instruction]:
    warmup = min(num_stages - stage - 1, m)
    compute: list[Instruction] = [Forward(mb) for mb in range(warmup)]
    for i in range(m - warmup):
        compute += [Forward(warmup + i), Backward(i)]
    compute += [Backward(mb) for mb in range(m - warmup, m)]
    return compute
