"""Pipeline instructions: the small frozen actions a schedule is made of.

A schedule is a list of these per stage. ``micro_batch`` counts from 0; ``chunk`` is the
local model chunk (0 unless the schedule runs several chunks per stage); which virtual stage
it holds is the schedule's *placement* (:func:`virtual_stage`): ``"loop"`` (interleaved
schedules: chunk ``c`` of stage ``s`` of ``p`` holds virtual stage ``c * p + s``, so the
model loops over the stages ``v`` times) or ``"v"`` (ZB-V: chunk 0 of stage ``s`` holds
virtual stage ``s`` and chunk 1 holds ``2p - 1 - s``, so the model goes down the stages and
back up, and the first and the last virtual stage share stage 0). ``peer`` is the pipeline
stage a message goes to or comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


def virtual_stage(stage: int, chunk: int, num_stages: int, placement: str = "loop") -> int:
    """Position in the model of local ``chunk`` of ``stage``: ``chunk * p + stage`` under ``"loop"``;
    under ``"v"`` the odd chunks run back up the stages (chunk 1 of stage ``s`` is ``2p - 1 - s``)."""
    if placement == "v" and chunk % 2:
        return (chunk + 1) * num_stages - 1 - stage
    return chunk * num_stages + stage


def stage_of(vs: int, num_stages: int, placement: str = "loop") -> tuple[int, int]:
    """``(stage, chunk)`` holding virtual stage ``vs``: the inverse of :func:`virtual_stage`."""
    chunk, offset = divmod(vs, num_stages)
    if placement == "v" and chunk % 2:
        return num_stages - 1 - offset, chunk
    return offset, chunk


@dataclass(frozen=True)
class Instruction:
    """Base class of every pipeline instruction."""

    @property
    def short(self) -> str:
        """A 2-5 character label for grids (``F3``, ``B3.1`` ...)."""
        raise NotImplementedError

    @property
    def is_communication(self) -> bool:
        return False

    @property
    def is_compute(self) -> bool:
        return False


@dataclass(frozen=True, repr=False)
class _MicroBatchInstruction(Instruction):
    micro_batch: int
    chunk: int = 0

    _letter = "?"

    @property
    def short(self) -> str:
        return f"{self._letter}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mb={self.micro_batch}, chunk={self.chunk})"


@dataclass(frozen=True, repr=False)
class LoadMicroBatch(Instruction):
    """Take micro-batch ``micro_batch`` (inputs on the first stage, targets on the last)."""

    micro_batch: int

    @property
    def short(self) -> str:
        return f"L{self.micro_batch}"

    def __repr__(self) -> str:
        return f"LoadMicroBatch(mb={self.micro_batch})"


@dataclass(frozen=True, repr=False)
class Forward(_MicroBatchInstruction):
    """Run the forward pass of ``chunk`` on ``micro_batch`` (the loss too on the last virtual stage)."""

    _letter = "F"

    @property
    def is_compute(self) -> bool:
        return True


@dataclass(frozen=True, repr=False)
class Backward(_MicroBatchInstruction):
    """Full backward of ``chunk`` for ``micro_batch``: input and weight gradients together."""

    _letter = "B"

    @property
    def is_compute(self) -> bool:
        return True


@dataclass(frozen=True, repr=False)
class BackwardInput(_MicroBatchInstruction):
    """Zero-bubble split, part 1: gradient w.r.t. the chunk's input only (what the previous stage waits for)."""

    _letter = "I"

    @property
    def is_compute(self) -> bool:
        return True


@dataclass(frozen=True, repr=False)
class BackwardWeight(_MicroBatchInstruction):
    """Zero-bubble split, part 2: gradient w.r.t. the chunk's parameters (deferrable into bubbles)."""

    _letter = "W"

    @property
    def is_compute(self) -> bool:
        return True


class MessageLabel(NamedTuple):
    """What a message carries, equal on a send and its matching receive."""

    kind: str  # "activation" or "grad"
    micro_batch: int
    virtual_stage: int  # the receiving virtual stage
    sender: int
    receiver: int


@dataclass(frozen=True, repr=False)
class _Message(Instruction):
    micro_batch: int
    chunk: int
    peer: int

    _arrow = "?"
    _kind = "?"
    _sends = False
    _step = 0  # the receiving virtual stage, relative to this chunk's, when sending

    def label(self, stage: int, num_stages: int, placement: str = "loop") -> MessageLabel:
        """This message's :class:`MessageLabel` as posted by ``stage`` of ``num_stages``."""
        vs = virtual_stage(stage, self.chunk, num_stages, placement)
        if self._sends:
            return MessageLabel(self._kind, self.micro_batch, vs + self._step, stage, self.peer)
        return MessageLabel(self._kind, self.micro_batch, vs, self.peer, stage)

    @property
    def short(self) -> str:
        return f"{self._arrow}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")

    @property
    def is_communication(self) -> bool:
        return True

    def __repr__(self) -> str:
        direction = "to" if isinstance(self, (SendActivation, SendGrad)) else "from"
        return f"{type(self).__name__}(mb={self.micro_batch}, chunk={self.chunk}, {direction}={self.peer})"


@dataclass(frozen=True, repr=False)
class SendActivation(_Message):
    """Send the output of ``chunk`` for ``micro_batch`` to stage ``peer`` (non-blocking)."""

    _arrow = "sa"
    _kind = "activation"
    _sends = True
    _step = 1


@dataclass(frozen=True, repr=False)
class RecvActivation(_Message):
    """Receive the input of ``chunk`` for ``micro_batch`` from stage ``peer`` (blocking)."""

    _arrow = "ra"
    _kind = "activation"


@dataclass(frozen=True, repr=False)
class SendGrad(_Message):
    """Send the gradient w.r.t. the input of ``chunk`` for ``micro_batch`` to stage ``peer``."""

    _arrow = "sg"
    _kind = "grad"
    _sends = True
    _step = -1


@dataclass(frozen=True, repr=False)
class RecvGrad(_Message):
    """Receive the gradient w.r.t. the output of ``chunk`` for ``micro_batch`` from stage ``peer``."""

    _arrow = "rg"
    _kind = "grad"


COMPUTE_TYPES = (Forward, Backward, BackwardInput, BackwardWeight)


@dataclass(frozen=True, repr=False)
class Exchange(Instruction):
    """A send and a receive with the same peer posted as one batched transfer.

    Schedules emit it where both neighbours exchange at the same point (the 1F1B steady
    state: ``SendActivation`` + ``RecvGrad`` on one side, ``SendGrad`` +
    ``RecvActivation`` on the other); posted separately, the two blocking sends would
    wait for each other.
    """

    ops: tuple[Instruction, ...]

    @property
    def short(self) -> str:
        return "+".join(op.short for op in self.ops)

    @property
    def is_communication(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Exchange({', '.join(map(repr, self.ops))})"
