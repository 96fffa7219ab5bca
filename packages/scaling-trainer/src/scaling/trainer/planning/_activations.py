"""Activation bytes a pipeline stage holds: its in-flight micro-batches, from the schedule itself.

A model's planner says what one micro-batch's forward leaves held on each model chunk (the app knows
its layers: ``scaling.transformer.memory``); the schedule says how many forwards a stage has run
whose backward has not yet begun. The stage's activation peak is the most it holds when a backward
begins: 1F1B's first stage holds ``min(p, m)`` micro-batches, GPipe's all ``m``, interleaved 1F1B
more of its earlier chunks. A backward (or ZB-H1's input backward) frees its micro-batch's chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from scaling.pipeline import SCHEDULES, Backward, BackwardInput, Forward


def in_flight_peak(
    chunk_bytes: Sequence[int],
    schedule: str,
    num_stages: int,
    num_micro_batches: int,
    stage: int,
    at_backward: int = 0,
) -> int:
    """The most activation bytes ``stage`` holds when one of its backwards begins.

    Args:
        chunk_bytes: what one micro-batch's forward leaves held on each local model chunk
            (one entry; ``num_virtual_stages`` under interleaving).
        schedule: a name in ``scaling.pipeline.SCHEDULES``.
        num_stages, num_micro_batches, stage: the pipeline's ``p``, ``m`` and this stage.
        at_backward: bytes the backward's micro-batch adds when it begins (a received gradient).
    """
    kwargs = {"num_virtual": len(chunk_bytes)} if schedule == "interleaved_1f1b" else {}
    program = SCHEDULES[schedule](num_stages, num_micro_batches, stage, **kwargs)
    held: set[tuple[int, int]] = set()
    peak = 0
    for instruction in program:
        if isinstance(instruction, Forward):
            held.add((instruction.micro_batch, instruction.chunk))
        elif isinstance(instruction, (Backward, BackwardInput)):
            peak = max(peak, sum(chunk_bytes[chunk] for _, chunk in held) + at_backward)
            held.discard((instruction.micro_batch, instruction.chunk))
    return peak
