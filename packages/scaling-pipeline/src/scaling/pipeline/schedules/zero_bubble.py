"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): backward split in two.

The backward of a micro-batch is split into ``BackwardInput`` (the gradient the previous
stage waits for) and ``BackwardWeight`` (the parameter gradient, which nobody waits for).
Stages run input-gradients as soon as they can and use the weight-gradients to fill
the time they would otherwise wait, while holding at most ``p - s`` micro-batches'
activations, as 1F1B does. With ``F = I = W`` the bubble falls from 1F1B's
``3 (p - 1)`` cost units per stage to about ``p - 1``.

The order is found by list-scheduling all stages together with unit costs (priority:
input-gradient, then forward within the activation limit, then weight-gradient) and
depends only on ``(p, m)``.
"""

from __future__ import annotations

from functools import lru_cache

from scaling.pipeline._instructions import BackwardInput, BackwardWeight, Forward, Instruction
from scaling.pipeline.schedules._common import accepts_old_keyword, build, check_arguments


@lru_cache(maxsize=256)
def _orders(num_stages: int, num_micro_batches: int) -> tuple[tuple[Instruction, ...], ...]:
    p, m = num_stages, num_micro_batches
    inf = float("inf")
    clock = [0.0] * p
    fwd_done = [[inf] * m for _ in range(p)]  # finish time of F(mb) on each stage
    inp_done = [[inf] * m for _ in range(p)]  # finish time of I(mb) on each stage
    next_f, next_i, next_w = [0] * p, [0] * p, [0] * p
    orders: list[list[Instruction]] = [[] for _ in range(p)]
    stalled = [False] * p  # waiting on a stage whose clock equals ours and which has not moved yet

    def finished(s: int) -> bool:
        return next_w[s] == m

    while not all(finished(s) for s in range(p)):
        s = min((st for st in range(p) if not finished(st)), key=lambda st: (clock[st], stalled[st], st))
        t = clock[s]
        i, f = next_i[s], next_f[s]
        grad_at = inp_done[s + 1][i] if s + 1 < p and i < m else (fwd_done[s][i] if i < m else inf)
        act_at = fwd_done[s - 1][f] if s > 0 and f < m else (0.0 if f < m else inf)
        if i < f and grad_at <= t:
            orders[s].append(BackwardInput(i))
            inp_done[s][i] = t + 1
            next_i[s] += 1
        elif f < m and act_at <= t and f - next_w[s] < p - s:
            orders[s].append(Forward(f))
            fwd_done[s][f] = t + 1
            next_f[s] += 1
        elif next_w[s] < next_i[s]:
            orders[s].append(BackwardWeight(next_w[s]))
            next_w[s] += 1
        else:
            # Nothing ready: wait for the next event another stage has already produced
            # or will produce (every other stage's clock is at least ``t``).
            events = [x for x in (grad_at, act_at) if t < x < inf]
            others = [o for o in range(p) if o != s and not finished(o)]
            events += [clock[o] for o in others if clock[o] > t or (clock[o] == t and not stalled[o])]
            assert events, f"ZB-H1 list scheduling stuck at stage {s}, time {t}"
            clock[s] = min(events)
            stalled[s] = clock[s] == t
            continue
        clock[s] = t + 1
        stalled = [False] * p
    return tuple(tuple(o) for o in orders)


@accepts_old_keyword
def zb_h1_schedule(num_stages: int, num_micro_batches: int, stage: int) -> list[Instruction]:
    """ZB-H1 instructions of ``stage``.

    Args:
        num_stages: pipeline stages ``p``.
        num_micro_batches: micro-batches ``m`` per step.
        stage: the stage in ``[0, p)``.

    Returns:
        The stage's instructions (``Forward``, ``BackwardInput``, ``BackwardWeight`` and
        their messages).

    Example:
        >>> [i.short for i in zb_h1_schedule(2, 2, 1) if i.is_compute]
        ['F0', 'I0', 'W0', 'F1', 'I1', 'W1']
    """
    check_arguments(num_stages, num_micro_batches, stage)
    orders = _orders(num_stages, num_micro_batches)
    return build(lambda s: orders[s], num_stages, stage, cache_key=("zb_h1", num_micro_batches))
