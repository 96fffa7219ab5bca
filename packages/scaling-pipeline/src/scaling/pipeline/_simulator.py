"""Offline simulator: run every stage's instruction list together in one process.

Semantics (default ``rendezvous``, what gloo and NCCL do and the executor relies on): a
send completes only when the peer posts the matching receive; the send and receive of an
``Exchange`` are posted as one batched transfer. Messages
between two stages pair up in order, so every receive must expect exactly the message
its peer sends next: a schedule whose receive order differs from the send order would
hand one micro-batch's tensor to another and is rejected. Compute
takes the given cost; a message takes the ``transfer`` cost (0 by default: free, so time
only moves with compute and waiting).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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
from scaling.pipeline._render import render_program_grid, render_timeline, save_timeline_png
from scaling.pipeline.schedules._common import accepts_old_keyword, placement_of

DEFAULT_COSTS: Mapping[str, float] = {
    "forward": 1.0,
    "backward": 2.0,
    "backward_input": 1.0,
    "backward_weight": 1.0,
    "transfer": 0.0,
}
_COST_KEY: dict[type[Instruction], str] = {
    Forward: "forward",
    Backward: "backward",
    BackwardInput: "backward_input",
    BackwardWeight: "backward_weight",
}


class ScheduleError(ValueError):
    """A schedule deadlocks, mismatches messages or orders compute wrongly; ``grid`` shows where."""

    def __init__(self, message: str, grid: str) -> None:
        super().__init__(f"{message}\n{grid}")
        self.grid = grid


@dataclass(frozen=True)
class SimulationResult:
    """What a simulated step looks like.

    Attributes:
        makespan: time from the first instruction to the last stage finishing.
        busy: compute time per stage.
        peak_activations: most (micro-batch, chunk) activations held at once, per stage
            (held from the forward until the backward, or the weight backward, is done).
        bubble_fraction: idle share of all stages' time, ``1 - sum(busy) / (p * makespan)``.
        timeline: per stage, ``(start, end, instruction)`` for every compute instruction.
    """

    makespan: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]
    bubble_fraction: float
    timeline: tuple[tuple[tuple[float, float, Instruction], ...], ...]

    def render(self) -> str:
        """The stage × time grid as text (one row per stage, ``.`` = idle)."""
        return render_timeline(self.timeline, self.makespan)

    def save_png(self, path: str) -> None:
        """Draw the stage × time grid into a PNG (needs matplotlib: ``pip install scaling-pipeline[plot]``)."""
        save_timeline_png(self.timeline, self.makespan, path)


@dataclass
class _Posted:
    """A message a stage has posted, and the stage whose matching message it met (None: not yet)."""

    msg: _Message
    partner: int | None = None


def _message(op: Instruction) -> _Message:
    if not isinstance(op, _Message):
        raise TypeError(f"{op!r} inside a communication instruction is not a message")
    return op


def simulate(
    programs: Sequence[Sequence[Instruction]],
    costs: Mapping[str, float] | None = None,
    *,
    send_semantics: str = "rendezvous",
    placement: str = "loop",
) -> SimulationResult:
    """Run ``programs[s]`` (stage ``s``'s instructions) for all stages together.

    Args:
        programs: one instruction list per stage.
        costs: compute cost per kind (``forward``, ``backward``, ``backward_input``,
            ``backward_weight``) and ``transfer``, the time a message takes from its send to
            its receive (its latency; 0 by default: messages are free); defaults to
            :data:`DEFAULT_COSTS`.
        send_semantics: ``"rendezvous"`` (default; what gloo and NCCL do): a send
            completes only when the peer posts the matching receive, and a send directly
            sends and receives of an :class:`Exchange` are posted together, as the executor
            does; an exchange finishes when all its transfers (and those of every exchange
            linked to it) have met their partners. ``"buffered"``:
            sends never wait (an upper bound on what any transport can achieve).
        placement: where each stage's chunks sit in the model, ``"loop"`` or ``"v"``
            (:func:`scaling.pipeline.virtual_stage`; the schedule's ``placement``).

    Raises:
        ScheduleError: deadlock, a receive that does not match the next message, a
            compute before its input, a message left unreceived, or a micro-batch whose
            forward or backward is missing or repeated; the message shows the rank × step grid.
    """
    if send_semantics not in ("rendezvous", "buffered"):
        raise ValueError(f"send_semantics={send_semantics!r} is unknown; choose 'rendezvous' or 'buffered'")
    rendezvous = send_semantics == "rendezvous"
    if not rendezvous:  # sends never block: an exchange is just its send, then its receive
        programs = [[op for i in prog for op in (i.ops if isinstance(i, Exchange) else (i,))] for prog in programs]
    cost = {**DEFAULT_COSTS, **(costs or {})}
    p = len(programs)
    num_chunks = 1 + max((i.chunk for prog in programs for i in prog if hasattr(i, "chunk")), default=0)
    pc = [0] * p
    clock = [0.0] * p
    channels: dict[tuple[int, int], deque[tuple[tuple[str, int, int], float]]] = {}
    have: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]  # (what, mb, chunk) available per stage
    held = [0] * p
    peak = [0] * p
    timeline: list[list[tuple[float, float, Instruction]]] = [[] for _ in range(p)]
    done: dict[tuple[str, int, int], int] = {}

    def fail(message: str) -> None:
        raise ScheduleError(message, render_program_grid(programs, pc))

    def needs(ins: Instruction, stage: int) -> tuple[str, int, int] | None:
        mb, c = ins.micro_batch, ins.chunk  # type: ignore[attr-defined]
        vs, last = virtual_stage(stage, c, p, placement), num_chunks * p - 1
        if isinstance(ins, Forward):
            if vs == 0:
                return ("load", mb, 0)
            held_by, chunk = stage_of(vs - 1, p, placement)  # a local hand-off reads the chunk's output
            return ("act", mb, c) if held_by != stage else ("out", mb, chunk)
        if isinstance(ins, BackwardWeight):
            return ("input_grad_done", mb, c)
        if vs == last:
            return ("out", mb, c)
        held_by, chunk = stage_of(vs + 1, p, placement)
        return ("grad", mb, c) if held_by != stage else ("grad_in", mb, chunk)

    posted: list[list[_Posted] | None] = [None] * p  # rendezvous: each stage's posted messages
    post_time = [0.0] * p

    def match(s: int) -> bool:
        matched = False
        for op in posted[s] or []:
            ins = op.msg
            peer_group = posted[ins.peer]
            if op.partner is not None or peer_group is None:
                continue
            sending = isinstance(ins, (SendActivation, SendGrad))
            for other in peer_group:
                o = other.msg
                if other.partner is not None or o.peer != s or isinstance(o, (SendActivation, SendGrad)) == sending:
                    continue
                sent, got = (ins, o) if sending else (o, ins)
                sender, receiver = (s, ins.peer) if sending else (ins.peer, s)
                want, label = got.label(receiver, p, placement)[:3], sent.label(sender, p, placement)[:3]
                if want != label:
                    fail(f"stage {receiver}: {got!r} expects {want} but stage {sender} sends {label}")
                op.partner, other.partner, matched = ins.peer, s, True
                break
        return matched

    def component(s: int) -> list[int] | None:
        """Stages whose exchanges are linked to ``s``'s by matched messages, or None while any op is unmatched.

        An exchange moves its messages in lockstep steps (header, metadata, payload) for
        all its ops together, so it finishes only when every op of every linked
        exchange has met its partner.
        """
        seen, todo = {s}, [s]
        while todo:
            group = posted[todo.pop()]
            if group is None or any(op.partner is None for op in group):
                return None
            for partner in {op.partner for op in group} - seen:
                assert partner is not None  # checked above
                seen.add(partner)
                todo.append(partner)
        return sorted(seen)

    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            prog = programs[s]
            while pc[s] < len(prog):
                ins = prog[pc[s]]
                if ins.is_communication and rendezvous:
                    if posted[s] is None:
                        ops = ins.ops if isinstance(ins, Exchange) else (ins,)
                        posted[s] = [_Posted(_message(op)) for op in ops]
                        post_time[s] = clock[s]
                        progressed = match(s) or progressed
                    linked = component(s)
                    if linked is None:
                        break  # blocked until every linked exchange has met its partners
                    finish = max(post_time[o] for o in linked) + cost["transfer"]
                    for o in linked:  # the linked exchanges finish together
                        group = posted[o]
                        assert group is not None
                        clock[o] = finish
                        for op in group:
                            if isinstance(op.msg, (RecvActivation, RecvGrad)):
                                kind = "act" if isinstance(op.msg, RecvActivation) else "grad"
                                have[o].add((kind, op.msg.micro_batch, op.msg.chunk))
                        pc[o] += 1
                        posted[o] = None
                    progressed = True
                    continue
                if isinstance(ins, (SendActivation, SendGrad)):
                    channels.setdefault((s, ins.peer), deque()).append((ins.label(s, p, placement)[:3], clock[s]))
                elif isinstance(ins, (RecvActivation, RecvGrad)):
                    queue = channels.get((ins.peer, s))
                    if not queue:
                        break  # blocked: the sender has not sent yet
                    label, sent_at = queue[0]
                    expected = ins.label(s, p, placement)[:3]
                    if label != expected:
                        fail(f"stage {s}: {ins!r} expects {expected} but the next message is {label}")
                    queue.popleft()
                    clock[s] = max(clock[s], sent_at + cost["transfer"])
                    have[s].add(("act" if isinstance(ins, RecvActivation) else "grad", ins.micro_batch, ins.chunk))
                elif isinstance(ins, LoadMicroBatch):
                    have[s].add(("load", ins.micro_batch, 0))
                elif ins.is_compute:
                    need = needs(ins, s)
                    if need is not None and need not in have[s]:
                        fail(f"stage {s}: {ins!r} runs before its input {need} is available")
                    mb, c = ins.micro_batch, ins.chunk  # type: ignore[attr-defined]
                    kind = _COST_KEY[type(ins)]
                    key = (kind, mb, virtual_stage(s, c, p, placement))
                    done[key] = done.get(key, 0) + 1
                    start, clock[s] = clock[s], clock[s] + cost[kind]
                    timeline[s].append((start, clock[s], ins))
                    if isinstance(ins, Forward):
                        have[s].add(("out", mb, c))
                        held[s] += 1
                        peak[s] = max(peak[s], held[s])
                    elif isinstance(ins, (Backward, BackwardWeight)):
                        held[s] -= 1
                    if isinstance(ins, (Backward, BackwardInput)):
                        have[s].add(("grad_in", mb, c))
                        have[s].add(("input_grad_done", mb, c))
                pc[s] += 1
                progressed = True
    if any(pc[s] < len(programs[s]) for s in range(p)):
        fail(
            "deadlock: every unfinished stage is blocked on a transfer whose partner is never posted (stuck at [brackets])"
        )
    leftover = {k: [lbl for lbl, _ in q] for k, q in channels.items() if q}
    if leftover:
        fail(f"messages sent but never received (sender, receiver) -> labels: {leftover}")
    _check_coverage(done, p * num_chunks, programs, pc, fail)
    makespan = max(clock) if p else 0.0
    busy = tuple(sum(e - b for b, e, _ in row) for row in timeline)
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    return SimulationResult(makespan, busy, tuple(peak), bubble, tuple(tuple(r) for r in timeline))


def _check_coverage(
    done: dict[tuple[str, int, int], int],
    num_virtual_stages: int,
    programs: Sequence[Sequence[Instruction]],
    pc: list[int],
    fail: Callable[[str], None],
) -> None:
    micro_batches = sorted({mb for _, mb, _ in done})
    train = any(kind != "forward" for kind, _, _ in done)
    kinds = ["forward"]
    if train:
        split = any(kind == "backward_input" for kind, _, _ in done)
        kinds += ["backward_input", "backward_weight"] if split else ["backward"]
    for mb in micro_batches:
        for vs in range(num_virtual_stages):
            for kind in kinds:
                if done.get((kind, mb, vs), 0) != 1:
                    fail(f"micro-batch {mb} ran {kind} {done.get((kind, mb, vs), 0)} times on virtual stage {vs}")


@accepts_old_keyword
def simulate_schedule(
    schedule: Callable[..., list[Instruction]],
    num_stages: int,
    num_micro_batches: int,
    num_virtual: int | None = None,
    costs: Mapping[str, float] | None = None,
    *,
    send_semantics: str = "rendezvous",
) -> SimulationResult:
    """Build ``schedule``'s list for every stage and :func:`simulate` them.

    Example:
        >>> from scaling.pipeline.schedules import gpipe_schedule
        >>> round(simulate_schedule(gpipe_schedule, 4, 8).bubble_fraction, 4)  # 3 / 11
        0.2727
    """
    extra = () if num_virtual is None else (num_virtual,)
    programs = [schedule(num_stages, num_micro_batches, s, *extra) for s in range(num_stages)]
    return simulate(programs, costs, send_semantics=send_semantics, placement=placement_of(schedule))
