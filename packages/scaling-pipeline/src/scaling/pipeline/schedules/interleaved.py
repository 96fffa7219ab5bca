"""Interleaved 1F1B (Megatron-LM): each stage holds ``v`` model chunks (virtual stages).

Chunk ``c`` of stage ``s`` is virtual stage ``c * p + s``, so a micro-batch visits every
stage ``v`` times and the pipeline fills ``v`` times faster: the bubble shrinks to
``(p - 1) / (v * m + p - 1)``. Micro-batches go in groups of ``p``: a group passes
chunk 0 on every stage, then chunk 1, and so on; the backward walks the chunks in
reverse. Stage ``s`` warms up with ``2 (p - s - 1) + (v - 1) p`` chunk-forwards.

The messages are lowered in lockstep rounds (:func:`lower_lockstep`): a step is one
warm-up forward, one steady-state forward + backward or one cool-down backward, and
after each step a stage posts one batched exchange (send forward / receive forward /
send backward / receive backward, Megatron-LM's combined calls). Sends that wait for
their receiver, as gloo's and NCCL's do, therefore cannot deadlock on the ring from
the last stage back to the first.
"""

from __future__ import annotations

from scaling.pipeline._instructions import Backward, Forward, Instruction
from scaling.pipeline.schedules._common import accepts_old_keyword, build, check_arguments


def group_size(num_stages: int, num_micro_batches: int) -> int:
    """Micro-batches per round: ``m / max(1, m // p)`` (``p`` when ``p`` divides ``m``; ``m`` when ``m < p``)."""
    return num_micro_batches // max(1, num_micro_batches // num_stages)


def _order(num_micro_batches: int, group: int, num_virtual: int, backward: bool) -> list[tuple[int, int]]:
    chunks = range(num_virtual - 1, -1, -1) if backward else range(num_virtual)
    order = []
    for start in range(0, num_micro_batches, group):
        members = range(start, start + group)
        order += [(mb, c) for c in chunks for mb in members]
    return order


@accepts_old_keyword
def interleaved_1f1b_schedule(
    num_stages: int, num_micro_batches: int, stage: int, num_virtual: int = 2
) -> list[Instruction]:
    """Interleaved 1F1B instructions of ``stage`` with ``num_virtual`` chunks per stage.

    Args:
        num_stages: pipeline stages ``p``.
        num_micro_batches: micro-batches ``m`` per step.
        stage: the stage in ``[0, p)``.
        num_virtual: model chunks per stage ``v`` (the model has ``p * v`` virtual stages).

    Returns:
        The stage's instructions.
    """
    check_arguments(num_stages, num_micro_batches, stage, num_virtual)
    group = group_size(num_stages, num_micro_batches)
    if num_micro_batches % group:
        rounds = num_micro_batches // group
        ok = [k for k in range(1, num_micro_batches + num_stages + 1) if k % max(1, k // num_stages) == 0]
        raise ValueError(
            f"interleaved 1F1B: num_micro_batches={num_micro_batches} does not split into {rounds} rounds of "
            f"equal size >= num_stages={num_stages}; choose num_micro_batches from {ok} "
            "(below num_stages, or a multiple of the number of rounds)"
        )
    forwards = _order(num_micro_batches, group, num_virtual, backward=False)
    backwards = _order(num_micro_batches, group, num_virtual, backward=True)

    def steps(s: int) -> list[list[Instruction]]:
        total = len(forwards)
        warmup = min(total, 2 * (num_stages - s - 1) + (num_virtual - 1) * group)
        out: list[list[Instruction]] = [[Forward(mb, c)] for mb, c in forwards[:warmup]]
        out += [[Forward(*forwards[warmup + i]), Backward(*backwards[i])] for i in range(total - warmup)]
        return out + [[Backward(mb, c)] for mb, c in backwards[total - warmup :]]

    return build(steps, num_stages, stage, num_virtual, cache_key=("interleaved", num_micro_batches), lockstep=True)
