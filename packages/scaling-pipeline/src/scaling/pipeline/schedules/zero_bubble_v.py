"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6): two chunks per stage in a V.

The model is cut into ``2p`` virtual stages; stage ``s`` holds virtual stage ``s`` (chunk 0)
and ``2p - 1 - s`` (chunk 1), so a micro-batch goes down the stages and back up, turning on
the last stage without a message, and its loss is computed on stage 0, which also holds the
embedding (a tied head needs no cross-stage sum). The backward is split as in ZB-H1
(``BackwardInput`` the previous virtual stage waits for, ``BackwardWeight`` nobody waits
for), and each stage holds at most ``2p`` chunk activations (from a chunk's forward to its
weight pass): as many bytes as 1F1B's first stage, ``p`` whole-stage activations, on every
stage.

Each stage's order is the paper's handcrafted one: stage ``s`` warms up with ``2(p - s) - 1``
chunk-0 forwards, then ``s`` pairs (chunk-1 forward, chunk-0 forward), then ``p - s`` rounds of
(chunk-1 forward, input-gradient, weight-gradient), then the steady state alternates a
chunk-0 and a chunk-1 round of (forward, input-gradient, weight-gradient), and the cool-down
runs the remaining input-gradients with the weight-gradients filling the wait. With equal
costs per chunk (``F = I = W``) a step takes ``6m + p - 1`` units: every stage is busy ``6m``
and idle only for the ``p - 1`` units the first micro-batch takes to reach the last stage, the
least any schedule can idle (the simulator checks it for ``p`` in 2, 4, 8 and ``m`` in
``[2p, 4p]``). So the bubble is ``(p - 1)`` times one chunk's forward, a sixth of a stage's
forward and backward: 1F1B's is ``(p - 1)`` times a whole stage's ``F + B``, six times as long.
Every stage peaks at ``2p`` chunk activations.

Messages are placed by the same timed plan (:func:`scaling.pipeline.schedules._common.lower_timed`):
a stage posts each receive when its sender sends, so that between any two stages the
receives come in the order of the sends (gloo and NCCL pair messages between two ranks in
order), and mirrored send + receive pairs are posted as one exchange.
"""

from __future__ import annotations

from functools import lru_cache

from scaling.pipeline._instructions import BackwardInput, BackwardWeight, Forward, Instruction
from scaling.pipeline.schedules._common import accepts_old_keyword, build, check_arguments, timed_orders

Timed = tuple[tuple[tuple[int, int, Instruction], ...], ...]


def _order(p: int, m: int, s: int) -> list[Instruction]:
    """Stage ``s``'s compute order (the module docstring's phases); micro-batches past ``m`` are
    left out (the pattern is laid out for at least ``2p - 1``)."""
    n = max(2 * p - 1, m)
    order: list[Instruction] = []
    forwards, inputs = [0, 0], [0, 0]

    def forward(chunk: int) -> None:
        order.append(Forward(forwards[chunk], chunk))
        forwards[chunk] += 1

    def backward(chunk: int, weight: bool = True) -> None:
        order.append(BackwardInput(inputs[chunk], chunk))
        if weight:
            order.append(BackwardWeight(inputs[chunk], chunk))
        inputs[chunk] += 1

    for _ in range(2 * (p - s) - 1):
        forward(0)
    for _ in range(s):
        forward(1)
        forward(0)
    for _ in range(p - s):
        forward(1)
        backward(1)
    while forwards[1] < forwards[0] or forwards[0] < n:
        if forwards[0] < n:
            forward(0)
        backward(0)
        forward(1)
        backward(1)
    weights = list(inputs)  # the next weight-gradient of each chunk
    for _ in range(s):
        backward(0, weight=False)
        backward(1, weight=False)
    for _ in range(p - s):
        backward(0, weight=False)
        order.append(BackwardWeight(weights[0], 0))
        weights[0] += 1
    order += [BackwardWeight(mb, 1) for mb in range(weights[1], inputs[1])]
    order += [BackwardWeight(mb, 0) for mb in range(weights[0], inputs[0])]
    return [ins for ins in order if ins.micro_batch < m]  # type: ignore[attr-defined]


@lru_cache(maxsize=256)
def _timed(num_stages: int, num_micro_batches: int) -> Timed:
    orders = [_order(num_stages, num_micro_batches, s) for s in range(num_stages)]
    return tuple(tuple(t) for t in timed_orders(orders, num_stages, 2, "v"))


@accepts_old_keyword
def zb_v_schedule(num_stages: int, num_micro_batches: int, stage: int, num_virtual: int = 2) -> list[Instruction]:
    """ZB-V instructions of ``stage`` (two chunks per stage, placed in a V).

    Args:
        num_stages: pipeline stages ``p``.
        num_micro_batches: micro-batches ``m`` per step.
        stage: the stage in ``[0, p)``.
        num_virtual: chunks per stage; ZB-V has exactly 2.

    Returns:
        The stage's instructions (``Forward``, ``BackwardInput``, ``BackwardWeight`` of chunks
        0 and 1, and their messages).

    Raises:
        ValueError: ``num_virtual`` other than 2.

    Example:
        >>> [i.short for i in zb_v_schedule(1, 2, 0) if i.is_compute]
        ['F0', 'F0.1', 'I0.1', 'W0.1', 'F1', 'I0', 'W0', 'F1.1', 'I1.1', 'W1.1', 'I1', 'W1']
    """
    check_arguments(num_stages, num_micro_batches, stage, num_virtual)
    if num_virtual != 2:
        raise ValueError(f"zb_v: num_virtual_stages={num_virtual}; ZB-V runs exactly 2 chunks per stage")
    timed = _timed(num_stages, num_micro_batches)
    return build(
        lambda s: timed[s], num_stages, stage, 2, cache_key=("zb_v", num_micro_batches), timed=True, placement="v"
    )


zb_v_schedule.placement = "v"  # type: ignore[attr-defined]
