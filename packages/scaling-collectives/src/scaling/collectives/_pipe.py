"""Point-to-point transport of pytrees between neighbouring pipeline stages.

Every message is one frame, plus a second transfer only when its metadata changed:

1. the frame: a 32-byte header ``int64[4]`` (metadata changed?, metadata bytes,
   payload bytes, 0) followed by the payload, every tensor packed into one byte
   buffer. The receiver sizes it from the metadata it cached for that channel, so in
   the steady state a message is exactly one transfer (one round trip);
2. only when the structure, a shape, a dtype or a ``requires_grad`` flag changed since
   the last message on that channel (the first message included): the frame carries
   the header and filler of the cached size, then the pickled spec and tensor metadata
   and the new payload follow in a second batched step (the handshake; both sides
   update their cache).

Each step posts all of a call's sends and receives together (through
``torch.distributed.batch_isend_irecv``; on gloo, which does not coalesce, straight to
the process group, which is what it does there) in a fixed order (the sends, forward then
backward, then the receives, forward then backward; ``transfer`` names each op's peer and
keeps the caller's order), so two stages that send to each other
(``send_forward_recv_backward`` on one side, ``send_backward_recv_forward`` on the
other; both directions of a two-stage ring) make progress in lockstep instead of
deadlocking, and transfers between the same two ranks pair up in order.

With ``static_shapes=True`` (shapes fixed after the first message, as torch's pipeline
schedules and Megatron-LM assume unless told ``--variable-seq-lengths``), a channel's
first message handshakes as above and every later one is the payload alone, with no
header: the receiver trusts the cached metadata, and a sender whose pytree changed raises
instead of sending. A pytree of one tensor then travels as that tensor (its own memory,
dtype and shape, into a receive tensor of the same), as torch's schedules send it.

Sends can stay in flight (``wait=False`` / ``wait_sends=False``): the call returns once
its receives are done, and :meth:`PipeTransport.wait_sends` (the end of a pipeline step)
waits for the rest. Every frame is a fresh buffer (with ``static_shapes``, a
single-tensor message may be the tensor itself: leave it unmodified until then);
a send that never completes is diagnosed (its peer named) when it is waited on. The
frames themselves (header, payload layout, the cached ``Layout``) are in ``_frames.py``, and
the handshake cache that builds and reads them per channel and peer in ``_handshake.py``:
``PipeTransport`` names the peers, posts the transfers and waits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from scaling.collectives import _p2p_diagnosis, _pytree
from scaling.collectives._handshake import BACKWARD as _BACKWARD
from scaling.collectives._handshake import FORWARD as _FORWARD
from scaling.collectives._handshake import Handshake, HandshakeCache, Op
from scaling.collectives._pytree import PyTree
from scaling.collectives._recorder import CollectiveRecord, get_recorder


class _NoSend:
    """Default of ``send_forward`` in :meth:`PipeTransport.exchange`: no forward send (``None`` is a pytree)."""

    def __repr__(self) -> str:
        return "<no send>"


# Any: the sentinel stands in for a PyTree argument (send_forward's default).
_NO_SEND: Any = _NoSend()


def tensors_requiring_grad(obj: PyTree) -> list[torch.Tensor]:
    """The tensors of ``obj`` with ``requires_grad``, in flatten order.

    On a stage that got ``obj`` from :meth:`PipeTransport.recv_forward`, these are the
    leaves whose ``.grad`` goes back with :meth:`PipeTransport.send_backward`.
    """
    return [t for t in _pytree.tensor_leaves(obj) if t.requires_grad]


class PipeTransport:
    """Send pytrees to the next stage and their gradients back to the previous one.

    Args:
        prev_rank: global rank of the previous stage, ``None`` on the first stage
            (without a ring).
        next_rank: global rank of the next stage, ``None`` on the last stage (without a
            ring).
        device: where received tensors are allocated (``topology.device``).
        group: the process group the peers belong to (default: the default group);
            ranks are global either way.
        ring: the stages form a ring (interleaved schedules: the last stage sends its
            output to the first stage's next model chunk). With two stages both
            neighbours are the same rank, which is refused otherwise.
        static_shapes: every message on a channel has the first one's structure, shapes,
            dtypes and grad flags; later messages then carry no header (cheaper per
            hand-off) and a change raises ``ValueError`` on the sender. Both sides must
            agree on it.

    A forward pytree may hold dataclasses, tuples, namedtuples, lists and dicts of
    tensors, ``None``, bools, ints, floats and strings. Its tensors that required grad
    on the sender arrive as leaves with ``requires_grad=True``; ``grads`` sent back is
    the list of their gradients in flatten order (``None`` for one without a gradient).

    Example::

        >>> transport = PipeTransport(pp.previous, pp.next, topology.device)  # pp = topology.axis("pp")
        >>> x = transport.recv_forward()          # on stage 1
        >>> loss = stage(x); loss.backward()
        >>> transport.send_backward([t.grad for t in tensors_requiring_grad(x)])
    """

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        *,
        ring: bool = False,
        static_shapes: bool = False,
    ) -> None:
        for name, rank in (("prev_rank", prev_rank), ("next_rank", next_rank)):
            if rank is not None and (not isinstance(rank, int) or rank < 0):
                raise ValueError(f"PipeTransport: {name}={rank!r} must be a global rank (int >= 0) or None")
        if prev_rank is not None and prev_rank == next_rank and not ring:
            raise ValueError(
                f"PipeTransport: prev_rank and next_rank are both {prev_rank}; a stage cannot talk to one rank in both "
                "directions unless the stages form a ring of two (ring=True); otherwise use "
                'topology.axis("pp").previous and .next'
            )
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = torch.device(device)
        self.group = group
        self.ring = ring
        self.static_shapes = bool(static_shapes)
        self._handshakes = HandshakeCache(self.device, self.static_shapes)
        self._in_flight: list[
            tuple[dist.Work, CollectiveRecord]
        ] = []  # (work, record) of unfinished sends, oldest first
        self._resolved_group: tuple[dist.ProcessGroup, bool] | None = None
        self._group_ranks: dict[int, int] = {}  # global rank -> rank in the group

    def __repr__(self) -> str:
        extra = (", ring=True" if self.ring else "") + (", static_shapes=True" if self.static_shapes else "")
        return f"PipeTransport(prev_rank={self.prev_rank}, next_rank={self.next_rank}, device={self.device}{extra})"

    # ------------------------------------------------------------------ public
    def send_forward(self, obj: PyTree, *, wait: bool = True) -> None:
        """Send ``obj`` (this stage's output) to the next stage (``wait=False``: leave it in flight)."""
        self.exchange(send_forward=obj, wait_sends=wait)

    def recv_forward(self) -> PyTree:
        """Receive the previous stage's output; tensors that required grad arrive as grad leaves."""
        return self.exchange(recv_forward=True)[0]

    def send_backward(self, grads: Sequence[torch.Tensor | None], *, wait: bool = True) -> None:
        """Send the gradients of the received inputs (flatten order) to the previous stage."""
        self.exchange(send_backward=grads, wait_sends=wait)

    def recv_backward(self) -> list[torch.Tensor | None]:
        """Receive the gradients of what this stage sent forward, in flatten order."""
        return self.exchange(recv_backward=True)[1]

    def send_forward_recv_backward(self, obj: PyTree) -> list[torch.Tensor | None]:
        """Send ``obj`` to the next stage while receiving gradients from it (1F1B steady state)."""
        return self.exchange(send_forward=obj, recv_backward=True)[1]

    def send_backward_recv_forward(self, grads: Sequence[torch.Tensor | None]) -> PyTree:
        """Send gradients to the previous stage while receiving its next output."""
        return self.exchange(send_backward=grads, recv_forward=True)[0]

    def send_forward_recv_forward(self, obj: PyTree) -> PyTree:
        """Send ``obj`` to the next stage while receiving the previous stage's output (interleaved warm-up)."""
        return self.exchange(send_forward=obj, recv_forward=True)[0]

    def send_backward_recv_backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Send gradients to the previous stage while receiving the next stage's (interleaved cool-down)."""
        return self.exchange(send_backward=grads, recv_backward=True)[1]

    def exchange(
        self,
        *,
        send_forward: PyTree = _NO_SEND,
        recv_forward: bool = False,
        send_backward: Sequence[torch.Tensor | None] | None = None,
        recv_backward: bool = False,
        wait_sends: bool = True,
    ) -> tuple[PyTree, PyTree]:
        """Any combination of the four transfers, posted as one batched exchange.

        Args:
            send_forward: pytree for the next stage; omitted: no forward send
                (``None`` is a pytree and is sent).
            recv_forward: receive the previous stage's output.
            send_backward: gradients for the previous stage (``None``: no backward send).
            recv_backward: receive gradients from the next stage.
            wait_sends: wait for this call's sends too (the default); ``False`` returns
                once the receives are done and leaves the sends in flight until
                :meth:`wait_sends` (later messages on the same channel still arrive in order).

        Returns:
            ``(received forward pytree or None, received gradients or None)``.
        """
        # One frame per message: the sends (forward, backward), then the receives (forward, backward).
        sends: list[tuple[str, int, PyTree]] = []
        receives: list[tuple[str, int]] = []
        if send_forward is not _NO_SEND:
            sends.append((_FORWARD, self._peer("next_rank", "send_forward"), send_forward))
        if recv_forward:
            receives.append((_FORWARD, self._peer("prev_rank", "recv_forward")))
        if send_backward is not None:
            sends.append((_BACKWARD, self._peer("prev_rank", "send_backward"), send_backward))
        if recv_backward:
            receives.append((_BACKWARD, self._peer("next_rank", "recv_backward")))
        got = self.transfer(sends, receives, wait_sends=wait_sends)
        forward = got.pop(0) if recv_forward else None
        return forward, (got.pop(0) if recv_backward else None)

    def transfer(
        self,
        sends: Sequence[tuple[str, int, PyTree]] = (),
        receives: Sequence[tuple[str, int]] = (),
        *,
        wait_sends: bool = True,
    ) -> list[PyTree]:
        """Sends and receives with explicit peers, posted as one batched exchange.

        What :meth:`exchange` does with the stage's neighbours, for any peers of the group
        (a V-shaped schedule sends one chunk's activations down the stages and the other's
        back up). The handshake cache is kept per channel and peer.

        Args:
            sends: ``(channel, global rank, pytree)``; channel ``"forward"`` (an activation)
                or ``"backward"`` (gradients: a list in flatten order, as :meth:`send_backward`).
            receives: ``(channel, global rank)``.
            wait_sends: as in :meth:`exchange`.

        Returns:
            The received pytrees, in the order of ``receives`` (a forward one's tensors that
            required grad arrive as grad leaves; a backward one is a list).
        """
        cache = self._handshakes
        ops: list[Op] = []
        handshakes: list[Handshake] = []
        for channel, peer, obj in sends:
            frame, handshake = cache.frame(channel, peer, _grad_list(obj) if channel == _BACKWARD else obj)
            ops.append(("send", frame, peer))
            if handshake is not None:
                handshakes.append(handshake)
        incoming = [cache.receive(channel, peer) for channel, peer in receives]
        ops += [("recv", buffer[0], peer) for _, peer, buffer, _ in incoming]
        works, recs = self._start(ops)
        expected = cache.expected(incoming)  # while the messages travel
        self._wait(ops, works, recs, wait_sends)
        step_two, changed = cache.second_step(handshakes, incoming)
        self._post(step_two, wait_sends)
        return cache.received(incoming, expected, changed)

    @property
    def handshakes_sent(self) -> int:
        """Messages whose metadata changed, so that a second step carried it (the first one included)."""
        return self._handshakes.handshakes_sent

    @property
    def handshakes_received(self) -> int:
        """Received messages whose metadata changed (the first one on each channel and peer included)."""
        return self._handshakes.handshakes_received

    @property
    def pending_sends(self) -> int:
        """Sends posted with ``wait=False`` that :meth:`wait_sends` has not collected yet."""
        return len(self._in_flight)

    def wait_sends(self) -> None:
        """Wait for every send left in flight (call it before the step ends).

        Raises:
            CollectiveTimeoutError: a send did not complete within the group timeout; the
                message names the peer and whether it ever posted the matching receive.
        """
        pending, self._in_flight = self._in_flight, []
        start = time.perf_counter()
        for i, (work, _) in enumerate(pending):
            try:
                work.wait()
            except RuntimeError as exc:
                raise _p2p_diagnosis.p2p_failure([rec for _, rec in pending[i:]], self.group, exc) from exc
        get_recorder().add_wait("send_recv", time.perf_counter() - start)

    # ---------------------------------------------------------------- protocol
    def _peer(self, attr: str, method: str) -> int:
        rank = getattr(self, attr)
        if rank is None:
            stage = "first" if attr == "prev_rank" else "last"
            raise ValueError(f"{method}: this is the {stage} pipeline stage ({attr}=None); there is no peer to talk to")
        return int(rank)

    def _resolved(self) -> tuple[dist.ProcessGroup, bool]:
        """The process group (default group resolved once) and whether to post ops one by one (gloo)."""
        if self._resolved_group is None:
            group = self.group if self.group is not None else dist.group.WORLD
            assert group is not None, "PipeTransport needs an initialised process group"
            self._resolved_group = (group, dist.get_backend(group) == "gloo")
        return self._resolved_group

    def _group_rank(self, peer: int) -> int:
        rank = self._group_ranks.get(peer)
        if rank is None:
            rank = self._group_ranks[peer] = dist.get_group_rank(self._resolved()[0], peer)
        return rank

    def _post(self, ops: list[tuple[str, torch.Tensor, int]], wait_sends: bool) -> None:
        """Post ``ops`` together and wait for the receives (and the sends unless left in flight)."""
        works, recs = self._start(ops)
        self._wait(ops, works, recs, wait_sends)

    def _start(self, ops: list[tuple[str, torch.Tensor, int]]) -> tuple[list[dist.Work], list[CollectiveRecord]]:
        """Post ``ops`` together (recorded like ``batch_send_recv``); the handles and records.

        The bookkeeping (recording the ops, collecting earlier sends that finished) runs
        after posting, while the messages travel, not before the sends go out.
        """
        if not ops:
            return [], []
        group, direct = self._resolved()
        try:
            if direct:
                # What batch_isend_irecv does on a backend without coalescing (gloo), minus its
                # per-op argument handling: this runs for every message.
                works = [
                    group.send([tensor], self._group_rank(peer), 0)
                    if kind == "send"
                    else group.recv([tensor], self._group_rank(peer), 0)
                    for kind, tensor, peer in ops
                ]
            else:
                works = dist.batch_isend_irecv(
                    [dist.P2POp(dist.isend if k == "send" else dist.irecv, t, peer, group) for k, t, peer in ops]
                )
        except RuntimeError as exc:
            raise _p2p_diagnosis.p2p_failure(get_recorder()._record_p2p(ops), self.group, exc) from exc
        recs = get_recorder()._record_p2p(ops)
        # Collect the sends of earlier calls that finished meanwhile (a failed one raises, named).
        while self._in_flight and self._in_flight[0][0].is_completed():
            work, rec = self._in_flight.pop(0)
            try:
                work.wait()
            except RuntimeError as exc:
                raise _p2p_diagnosis.p2p_failure([rec], self.group, exc) from exc
        return works, recs

    def _wait(
        self,
        ops: list[tuple[str, torch.Tensor, int]],
        works: list[dist.Work],
        recs: list[CollectiveRecord],
        wait_sends: bool,
    ) -> None:
        """Wait for the receives of a :meth:`_start` (and its sends, or leave them in flight)."""
        start = time.perf_counter()
        try:
            if len(works) != len(ops):  # one handle for the whole batch (coalescing backends): wait for it
                for work in works:
                    work.wait()
            else:
                for (kind, _, _), work, rec in zip(ops, works, recs):
                    if kind == "send" and not wait_sends:
                        self._in_flight.append((work, rec))
                    else:
                        work.wait()
        except RuntimeError as exc:
            raise _p2p_diagnosis.p2p_failure(recs, self.group, exc) from exc
        get_recorder().add_wait("send_recv", time.perf_counter() - start)


def _grad_list(grads: PyTree) -> list[torch.Tensor | None]:
    if not isinstance(grads, (list, tuple)) or not all(g is None or isinstance(g, torch.Tensor) for g in grads):
        raise TypeError(
            f"grads must be a list of tensors (or None) in the flatten order of the received inputs, got "
            f"{type(grads).__name__}; build it with [t.grad for t in tensors_requiring_grad(inputs)]"
        )
    return list(grads)
