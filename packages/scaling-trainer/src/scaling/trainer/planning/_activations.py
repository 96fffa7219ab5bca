"""Activation bytes a pipeline stage holds: its in-flight micro-batches, from the schedule itself.

A model's planner says what one micro-batch's forward leaves held on each model chunk (the app knows
its layers: ``scaling.transformer.memory``); the schedule says how many forwards a stage has run
whose backward has not yet begun. The stage's activation peak is the most it holds when a backward
begins: 1F1B's first stage holds ``min(p, m)`` micro-batches, GPipe's all ``m``, interleaved 1F1B
more of its earlier chunks. A backward frees its micro-batch's chunk; a zero-bubble schedule's
weight pass does (its input pass keeps the graph for it, and the gradients it starts from).

On gloo a send's buffer lives until the step's end: gloo's send handle reports completion only
once waited for, so ``PipeTransport`` cannot collect finished sends as it goes (NCCL's can) and
waits for them all after the last instruction; ``kept_sends`` counts those buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

from scaling.pipeline import (
    SCHEDULES,
    Backward,
    BackwardInput,
    BackwardWeight,
    Exchange,
    Forward,
    SendActivation,
    SendGrad,
)


def in_flight_peak(
    chunk_bytes: Sequence[int],
    schedule: str,
    num_stages: int,
    num_micro_batches: int,
    stage: int,
    at_backward: int = 0,
    kept_sends: tuple[int, int] = (0, 0),
    after_first: int = 0,
    weight_pass: Sequence[int] = (),
) -> int:
    """The most activation bytes ``stage`` holds when one of its backwards begins.

    Args:
        chunk_bytes: what one micro-batch's forward leaves held on each local model chunk
            (one entry; ``num_virtual_stages`` under interleaving, 2 under ZB-V).
        schedule: a name in ``scaling.pipeline.SCHEDULES``.
        num_stages, num_micro_batches, stage: the pipeline's ``p``, ``m`` and this stage.
        at_backward: bytes the backward's micro-batch adds when it begins (a received gradient).
        kept_sends: bytes of each activation send and each gradient send held until the step ends
            (gloo; ``(0, 0)`` where finished sends are freed).
        after_first: bytes held from the stage's first backward on (the gradients it made).
        weight_pass: per chunk, what a zero-bubble input pass keeps for its weight pass until that
            runs (the gradients where the parameters' paths leave the input chain; empty: none).
    """
    kwargs = {"num_virtual": len(chunk_bytes)} if len(chunk_bytes) > 1 else {}
    program = SCHEDULES[schedule](num_stages, num_micro_batches, stage, **kwargs)
    held: set[tuple[int, int]] = set()
    peak = sent = backwards = kept = 0
    for instruction in program:
        for op in instruction.ops if isinstance(instruction, Exchange) else (instruction,):
            sent += (
                kept_sends[0] if isinstance(op, SendActivation) else kept_sends[1] if isinstance(op, SendGrad) else 0
            )
        if isinstance(instruction, Forward):
            held.add((instruction.micro_batch, instruction.chunk))
        elif isinstance(instruction, (Backward, BackwardInput)):
            grads = after_first if backwards else 0
            peak = max(peak, sum(chunk_bytes[chunk] for _, chunk in held) + at_backward + sent + grads + kept)
            backwards += 1
            if isinstance(instruction, BackwardInput):  # the graph is kept for the weight pass
                kept += weight_pass[instruction.chunk] if weight_pass else 0
            else:
                held.discard((instruction.micro_batch, instruction.chunk))
        elif isinstance(instruction, BackwardWeight):  # a backward too, holding its input pass's leftovers
            peak = max(peak, sum(chunk_bytes[chunk] for _, chunk in held) + sent + after_first + kept)
            kept -= weight_pass[instruction.chunk] if weight_pass else 0
            held.discard((instruction.micro_batch, instruction.chunk))
    return peak
