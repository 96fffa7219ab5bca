"""Shared by every schedule: argument checks and turning a compute order into instructions.

A schedule decides only the order of its stage's compute (forward, backward, or the
zero-bubble split of backward); :func:`lower` adds the loads and messages around it:
a receive right before the compute that needs it, a send right after the compute that
produced it, and :func:`fuse_exchanges` posts mirrored send + receive pairs together.
:func:`lower_lockstep` is the alternative for schedules with a ring (interleaved): the
stages advance in rounds and every message is sent and received in the same round's
exchange, so blocking sends cannot deadlock (the Megatron-LM pattern).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

from scaling.pipeline._instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Exchange,
    Forward,
    Instruction,
    LoadMicroBatch,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    _Message,
    stage_of,
    virtual_stage,
)

F = TypeVar("F", bound=Callable[..., object])


def accepts_old_keyword(fn: F) -> F:
    """Let ``fn`` take ``num_microbatches=`` (the spelling before 0.1's one-spelling rename) with a
    DeprecationWarning, as ``num_micro_batches=``; the old keyword goes in 0.2."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        if "num_microbatches" in kwargs:
            warnings.warn(
                f"{fn.__name__}(num_microbatches=...) is deprecated; use num_micro_batches=",
                DeprecationWarning,
                stacklevel=2,
            )
            kwargs["num_micro_batches"] = kwargs.pop("num_microbatches")
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def placement_of(schedule: Callable[..., object]) -> str:
    """Where ``schedule`` puts each stage's chunks: its ``placement`` attribute (``"v"`` for ZB-V),
    else ``"loop"`` (:func:`scaling.pipeline.virtual_stage`)."""
    return str(getattr(schedule, "placement", "loop"))


def check_arguments(num_stages: int, num_micro_batches: int, stage: int, num_virtual: int = 1) -> None:
    """Raise ``ValueError`` naming the value when a schedule's arguments are out of range."""
    for name, value in (
        ("num_stages", num_stages),
        ("num_micro_batches", num_micro_batches),
        ("num_virtual", num_virtual),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage!r} must be in [0, num_stages={num_stages})")


def lower(
    compute: Iterable[Instruction],
    num_stages: int,
    stage: int,
    num_virtual: int = 1,
    placement: str = "loop",
) -> list[Instruction]:
    """Wrap a stage's compute order with loads, receives and sends.

    A chunk's input comes from the stage holding the previous virtual stage and its output
    goes to the one holding the next (``placement``: :func:`virtual_stage`); where that is
    this stage (one stage; the turn of a V) the hand-off is local: no message.

    Args:
        compute: ``Forward``/``Backward``/``BackwardInput``/``BackwardWeight`` in run order.
        num_stages: pipeline stages ``p``.
        stage: this stage.
        num_virtual: chunks per stage ``v``.
        placement: ``"loop"`` or ``"v"``.
    """
    last_vs = num_stages * num_virtual - 1
    out: list[Instruction] = []
    loaded: set[int] = set()
    for ins in compute:
        assert isinstance(ins, (Forward, Backward, BackwardInput, BackwardWeight)), ins
        vs = virtual_stage(stage, ins.chunk, num_stages, placement)
        mb, chunk = ins.micro_batch, ins.chunk
        prev = stage_of(vs - 1, num_stages, placement)[0] if vs > 0 else stage
        nxt = stage_of(vs + 1, num_stages, placement)[0] if vs < last_vs else stage
        if isinstance(ins, Forward):
            if prev != stage:
                # Receive before any weight-gradient passes that directly follow a
                # SendGrad, so the SendGrad + RecvActivation pair stays adjacent (ZB-H1).
                at = len(out)
                while at > 0 and isinstance(out[at - 1], BackwardWeight):
                    at -= 1
                if at == len(out) or (at > 0 and isinstance(out[at - 1], SendGrad)):
                    out.insert(at, RecvActivation(mb, chunk, prev))
                else:
                    out.append(RecvActivation(mb, chunk, prev))
            # Loading after the receive keeps a SendGrad + RecvActivation pair adjacent.
            if (vs == 0 or vs == last_vs) and mb not in loaded:
                loaded.add(mb)
                out.append(LoadMicroBatch(mb))
            out.append(ins)
            if nxt != stage:
                out.append(SendActivation(mb, chunk, nxt))
        elif isinstance(ins, BackwardWeight):
            out.append(ins)
        else:
            if nxt != stage:
                out.append(RecvGrad(mb, chunk, nxt))
            out.append(ins)
            if prev != stage:
                out.append(SendGrad(mb, chunk, prev))
    return out


#: Unit costs the timed lowering plans with: a backward is an input pass and a weight pass.
PLAN_COSTS: dict[type[Instruction], int] = {Forward: 1, Backward: 2, BackwardInput: 1, BackwardWeight: 1}


def timed_orders(
    orders: Sequence[Sequence[Instruction]], num_stages: int, num_virtual: int, placement: str
) -> list[list[tuple[int, int, Instruction]]]:
    """Each stage's compute order with ``(start, end)`` times: every compute as early as its stage
    and its input allow (:data:`PLAN_COSTS`), what :func:`lower_timed` places the messages by.

    Raises:
        AssertionError: the orders wait for each other (a compute whose input never comes).
    """
    p, last_vs = num_stages, num_stages * num_virtual - 1
    # (forward?, virtual stage, mb) -> end time: a forward's output, an input pass's gradient.
    done: dict[tuple[bool, int, int], int] = {}
    position, clock = [0] * p, [0] * p
    timed: list[list[tuple[int, int, Instruction]]] = [[] for _ in range(p)]
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                ins = orders[s][position[s]]
                mb, vs = ins.micro_batch, virtual_stage(s, ins.chunk, p, placement)  # type: ignore[attr-defined]
                if isinstance(ins, Forward):
                    ready = 0 if vs == 0 else done.get((True, vs - 1, mb))
                elif isinstance(ins, BackwardWeight):  # after its input pass
                    ready = done.get((False, vs, mb))
                else:  # the loss's gradient on the last virtual stage, else the next one's input gradient
                    ready = done.get((True, vs, mb)) if vs == last_vs else done.get((False, vs + 1, mb))
                if ready is None:
                    break
                start = max(clock[s], ready)
                clock[s] = end = start + PLAN_COSTS[type(ins)]
                timed[s].append((start, end, ins))
                if isinstance(ins, Forward):
                    done[(True, vs, mb)] = end
                elif isinstance(ins, (Backward, BackwardInput)):
                    done[(False, vs, mb)] = end
                position[s] += 1
                progressed = True
    assert all(position[s] == len(orders[s]) for s in range(p)), f"compute orders stuck at {position}"
    return timed


def lower_timed(
    timed: Sequence[Sequence[tuple[int, int, Instruction]]], num_stages: int, num_virtual: int, placement: str
) -> list[list[Instruction]]:
    """Lower every stage's compute, given with its start and end times, into programs.

    A message is sent when the compute producing it ends and received by its peer at that
    same time, before anything the peer starts then: so between two stages the receives
    come in the order of the sends (gloo and NCCL pair the messages between two ranks in
    order, whatever their kind), and a receive is posted before the compute that reads it.
    At each time a stage posts its send first, then its receives, the one from the send's
    peer first, so that :func:`fuse_exchanges` can pair mirrored transfers.

    Args:
        timed: per stage, ``(start, end, compute instruction)`` in run order; the compute that
            reads a message starts no earlier than the one producing it ends.
        num_stages: pipeline stages ``p``.
        num_virtual: chunks per stage ``v``.
        placement: ``"loop"`` or ``"v"`` (:func:`virtual_stage`).
    """
    p, last_vs = num_stages, num_stages * num_virtual - 1
    # (time, phase, order within the phase) -> instruction; phases: 0 send, 1 receive, 2 load, 3 compute.
    items: list[list[tuple[tuple[int, int, int], Instruction]]] = [[] for _ in range(p)]
    loaded: list[set[int]] = [set() for _ in range(p)]
    for s in range(p):
        for start, end, ins in timed[s]:
            mb, chunk = ins.micro_batch, ins.chunk  # type: ignore[attr-defined]
            vs = virtual_stage(s, chunk, p, placement)
            if isinstance(ins, Forward) and vs in (0, last_vs) and mb not in loaded[s]:
                loaded[s].add(mb)
                items[s].append(((start, 2, 0), LoadMicroBatch(mb)))
            items[s].append(((start, 3, 0), ins))
            if isinstance(ins, Forward) and vs < last_vs:
                peer, peer_chunk = stage_of(vs + 1, p, placement)
                send, recv = SendActivation(mb, chunk, peer), RecvActivation(mb, peer_chunk, s)
            elif isinstance(ins, (Backward, BackwardInput)) and vs > 0:
                peer, peer_chunk = stage_of(vs - 1, p, placement)
                send, recv = SendGrad(mb, chunk, peer), RecvGrad(mb, peer_chunk, s)  # type: ignore[assignment]
            else:
                continue
            if peer != s:
                items[s].append(((end, 0, 0), send))
                items[peer].append(((end, 1, s), recv))
    programs = []
    for s in range(p):
        sent_to = {time: ins.peer for (time, _, _), ins in items[s] if isinstance(ins, _SENDS)}
        keyed = [((t, phase, phase == 1 and peer != sent_to.get(t), peer), ins) for (t, phase, peer), ins in items[s]]
        programs.append([ins for _, ins in sorted(keyed, key=lambda item: item[0])])
    return fuse_exchanges(programs, p, placement)


def fuse_exchanges(
    programs: list[list[Instruction]], num_stages: int, placement: str = "loop"
) -> list[list[Instruction]]:
    """Turn adjacent send + receive pairs into :class:`Exchange` where the peer mirrors them.

    Stage ``s`` fuses ``send(x) , receive(y)`` with peer ``t`` only when ``t`` has
    ``send(y) , receive(x)`` adjacent too, so both sides post the same batched transfer
    (the 1F1B steady state: an activation out, a gradient in; in a V also an activation
    out and the other chunk's activation in, or two gradients).
    """
    # (role, *label): role is "send" or "recv".
    where: dict[tuple[str, str, int, int, int, int], tuple[int, int]] = {}
    for s, prog in enumerate(programs):
        for k, ins in enumerate(prog):
            if isinstance(ins, _Message):
                role = "send" if isinstance(ins, (SendActivation, SendGrad)) else "recv"
                key = (role, *ins.label(s, num_stages, placement))
                where[key] = (s, k)
    starts: list[set[int]] = [set() for _ in programs]
    for s, prog in enumerate(programs):
        for k in range(len(prog) - 1):
            a, b = prog[k], prog[k + 1]
            if not (isinstance(a, _Message) and isinstance(b, _Message)):
                continue
            if not (isinstance(a, _SENDS) and isinstance(b, _RECEIVES)) or a.peer != b.peer:
                continue
            recv_of_a = where.get(("recv", *a.label(s, num_stages, placement)))
            send_of_b = where.get(("send", *b.label(s, num_stages, placement)))
            if recv_of_a and send_of_b and recv_of_a[0] == send_of_b[0] and recv_of_a[1] == send_of_b[1] + 1:
                starts[s].add(k)
    fused = []
    for s, prog in enumerate(programs):
        out: list[Instruction] = []
        k = 0
        while k < len(prog):
            if k in starts[s]:
                out.append(Exchange((prog[k], prog[k + 1])))
                k += 2
            else:
                out.append(prog[k])
                k += 1
        fused.append(out)
    return fused


_SENDS, _RECEIVES = (SendActivation, SendGrad), (RecvActivation, RecvGrad)
_OP_ORDER: dict[type[Instruction], int] = {SendActivation: 0, RecvActivation: 1, SendGrad: 2, RecvGrad: 3}


def lower_lockstep(
    steps: Sequence[Sequence[Sequence[Instruction]]], num_stages: int, num_virtual: int
) -> list[list[Instruction]]:
    """Lower every stage's compute, given as steps, into programs that exchange in rounds.

    In each round every stage runs its next step (one forward, one forward + one
    backward, or one backward) if the inputs it needs arrived in an earlier round, then
    posts one exchange: the sends of the step, and the receives of whatever its
    neighbours sent in this round (used in a later step). Each message's send and
    receive sit in the same round on both sides, so every exchange meets its partners
    and none waits on a later round: deadlock-free with blocking sends, including the
    ring from the last stage to the first. Ops within an exchange are in a fixed order
    (send activation, receive activation, send gradient, receive gradient), so two
    stages that talk both ways (``p == 2``) post their transfers in matching order.

    Args:
        steps: per stage, its steps in run order; each step a list of ``Forward`` /
            ``Backward``.
        num_stages: pipeline stages ``p``.
        num_virtual: chunks per stage ``v``.
    """
    p, last_vs = num_stages, num_stages * num_virtual - 1
    have: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]  # received in earlier rounds
    loaded: list[set[int]] = [set() for _ in range(p)]
    pos = [0] * p
    programs: list[list[Instruction]] = [[] for _ in range(p)]

    def need(ins: Instruction, s: int) -> tuple[str, int, int] | None:
        vs = virtual_stage(s, ins.chunk, p)  # type: ignore[attr-defined]
        if p == 1:
            return None
        if isinstance(ins, Forward):
            return ("act", ins.micro_batch, ins.chunk) if vs > 0 else None
        return ("grad", ins.micro_batch, ins.chunk) if vs < last_vs else None  # type: ignore[attr-defined]

    while any(pos[s] < len(steps[s]) for s in range(p)):
        ops: list[list[Instruction]] = [[] for _ in range(p)]
        ready = [
            s
            for s in range(p)
            if pos[s] < len(steps[s]) and all(need(i, s) in have[s] or need(i, s) is None for i in steps[s][pos[s]])
        ]
        # Every round some stage can run: the order is a valid schedule (checked by the simulator).
        assert ready, f"lockstep lowering stuck at steps {pos}"
        for s in ready:
            for ins in steps[s][pos[s]]:
                assert isinstance(ins, (Forward, Backward)), ins
                mb, c, vs = ins.micro_batch, ins.chunk, virtual_stage(s, ins.chunk, p)
                if isinstance(ins, Forward) and vs in (0, last_vs) and mb not in loaded[s]:
                    loaded[s].add(mb)
                    programs[s].append(LoadMicroBatch(mb))
                programs[s].append(ins)
                if p > 1 and isinstance(ins, Forward) and vs < last_vs:
                    nxt = (s + 1) % p
                    ops[s].append(SendActivation(mb, c, nxt))
                    ops[nxt].append(RecvActivation(mb, c + (nxt == 0), s))
                    have[nxt].add(("act", mb, c + (nxt == 0)))
                elif p > 1 and isinstance(ins, Backward) and vs > 0:
                    prv = (s - 1) % p
                    ops[s].append(SendGrad(mb, c, prv))
                    ops[prv].append(RecvGrad(mb, c - (s == 0), s))
                    have[prv].add(("grad", mb, c - (s == 0)))
            pos[s] += 1
        for s in range(p):
            round_ops = sorted(ops[s], key=lambda op: _OP_ORDER[type(op)])
            if len(round_ops) > 1:
                programs[s].append(Exchange(tuple(round_ops)))
            elif round_ops:
                programs[s].append(round_ops[0])
    return programs


def build(
    # Any: instructions, or with lockstep=True rounds of them (one list per round).
    compute_order: Callable[[int], Iterable[Any]],
    num_stages: int,
    stage: int,
    num_virtual: int = 1,
    *,
    cache_key: Hashable = None,
    lockstep: bool = False,
    timed: bool = False,
    placement: str = "loop",
) -> list[Instruction]:
    """Lower every stage's compute order, fuse mirrored exchanges, return ``stage``'s list.

    Fusing needs every stage's list, so all are built; with ``cache_key`` (the schedule
    and its arguments) they are kept, and asking for each stage in turn costs one build.
    With ``lockstep`` the compute order is a list of steps, lowered by :func:`lower_lockstep`
    (``"loop"`` placement only); with ``timed`` it is ``(start, instruction)`` pairs, lowered by
    :func:`lower_timed`; ``placement``: where each chunk sits (:func:`virtual_stage`).
    """
    key = (cache_key, num_stages, num_virtual, lockstep, timed, placement)
    programs = _CACHE.get(key) if cache_key is not None else None
    if programs is None:
        if lockstep:
            stage_steps = [list(compute_order(s)) for s in range(num_stages)]
            lowered = lower_lockstep(stage_steps, num_stages, num_virtual)
            programs = tuple(tuple(p) for p in lowered)
        elif timed:
            stage_timed = [list(compute_order(s)) for s in range(num_stages)]
            programs = tuple(tuple(p) for p in lower_timed(stage_timed, num_stages, num_virtual, placement))
        else:
            lowered = [lower(compute_order(s), num_stages, s, num_virtual, placement) for s in range(num_stages)]
            programs = tuple(tuple(p) for p in fuse_exchanges(lowered, num_stages, placement))
        if cache_key is not None:
            if len(_CACHE) >= _CACHE_SIZE:
                _CACHE.pop(next(iter(_CACHE)))
            _CACHE[key] = programs
    return list(programs[stage])


_CACHE_SIZE = 512
_CACHE: dict[Hashable, tuple[tuple[Instruction, ...], ...]] = {}
