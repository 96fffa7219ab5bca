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

Each step posts all of a call's sends and receives together through
``torch.distributed.batch_isend_irecv`` in a fixed order (send forward, receive
forward, send backward, receive backward), so two stages that send to each other
(``send_forward_recv_backward`` on one side, ``send_backward_recv_forward`` on the
other; both directions of a two-stage ring) make progress in lockstep instead of
deadlocking, and transfers between the same two ranks pair up in order.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from scaling.collectives import _ops, _pytree

_FORWARD, _BACKWARD = "forward", "backward"
_HEADER = 32  # bytes before the payload in a frame: int64[4], keeps the payload 16-byte aligned


class _NoSend:
    """Default of ``send_forward`` in :meth:`PipeTransport.exchange`: no forward send (``None`` is a pytree)."""

    def __repr__(self) -> str:
        return "<no send>"


_NO_SEND: Any = _NoSend()


def tensors_requiring_grad(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` with ``requires_grad``, in flatten order.

    On a stage that got ``obj`` from :meth:`PipeTransport.recv_forward`, these are the
    leaves whose ``.grad`` goes back with :meth:`PipeTransport.send_backward`.
    """
    return [t for t in _pytree.flatten(obj)[1] if t.requires_grad]


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

    A forward pytree may hold dataclasses, tuples, namedtuples, lists and dicts of
    tensors, ``None``, bools, ints, floats and strings. Its tensors that required grad
    on the sender arrive as leaves with ``requires_grad=True``; ``grads`` sent back is
    the list of their gradients in flatten order (``None`` for one without a gradient).

    Example::

        >>> transport = PipeTransport(topology.previous_pipe_rank, topology.next_pipe_rank, topology.device)
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
    ) -> None:
        for name, rank in (("prev_rank", prev_rank), ("next_rank", next_rank)):
            if rank is not None and (not isinstance(rank, int) or rank < 0):
                raise ValueError(f"PipeTransport: {name}={rank!r} must be a global rank (int >= 0) or None")
        if prev_rank is not None and prev_rank == next_rank and not ring:
            raise ValueError(
                f"PipeTransport: prev_rank and next_rank are both {prev_rank}; a stage cannot talk to one rank in both "
                "directions unless the stages form a ring of two (ring=True); otherwise use "
                "topology.previous_pipe_rank and topology.next_pipe_rank"
            )
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = torch.device(device)
        self.group = group
        self.ring = ring
        # Last metadata sent / received per channel: the handshake cache.
        self._sent: dict[str, Any] = {_FORWARD: None, _BACKWARD: None}
        self._received: dict[str, Any] = {_FORWARD: None, _BACKWARD: None}
        self.handshakes_sent = 0
        self.handshakes_received = 0

    def __repr__(self) -> str:
        ring = ", ring=True" if self.ring else ""
        return f"PipeTransport(prev_rank={self.prev_rank}, next_rank={self.next_rank}, device={self.device}{ring})"

    # ------------------------------------------------------------------ public
    def send_forward(self, obj: Any) -> None:
        """Send ``obj`` (this stage's output) to the next stage."""
        self.exchange(send_forward=obj)

    def recv_forward(self) -> Any:
        """Receive the previous stage's output; tensors that required grad arrive as grad leaves."""
        return self.exchange(recv_forward=True)[0]

    def send_backward(self, grads: list[torch.Tensor | None]) -> None:
        """Send the gradients of the received inputs (flatten order) to the previous stage."""
        self.exchange(send_backward=grads)

    def recv_backward(self) -> list[torch.Tensor | None]:
        """Receive the gradients of what this stage sent forward, in flatten order."""
        return self.exchange(recv_backward=True)[1]

    def send_forward_recv_backward(self, obj: Any) -> list[torch.Tensor | None]:
        """Send ``obj`` to the next stage while receiving gradients from it (1F1B steady state)."""
        return self.exchange(send_forward=obj, recv_backward=True)[1]

    def send_backward_recv_forward(self, grads: list[torch.Tensor | None]) -> Any:
        """Send gradients to the previous stage while receiving its next output."""
        return self.exchange(send_backward=grads, recv_forward=True)[0]

    def send_forward_recv_forward(self, obj: Any) -> Any:
        """Send ``obj`` to the next stage while receiving the previous stage's output (interleaved warm-up)."""
        return self.exchange(send_forward=obj, recv_forward=True)[0]

    def send_backward_recv_backward(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Send gradients to the previous stage while receiving the next stage's (interleaved cool-down)."""
        return self.exchange(send_backward=grads, recv_backward=True)[1]

    def exchange(
        self,
        *,
        send_forward: Any = _NO_SEND,
        recv_forward: bool = False,
        send_backward: list[torch.Tensor | None] | None = None,
        recv_backward: bool = False,
    ) -> tuple[Any, Any]:
        """Any combination of the four transfers, posted as one batched exchange.

        Args:
            send_forward: pytree for the next stage; omitted: no forward send
                (``None`` is a pytree and is sent).
            recv_forward: receive the previous stage's output.
            send_backward: gradients for the previous stage (``None``: no backward send).
            recv_backward: receive gradients from the next stage.

        Returns:
            ``(received forward pytree or None, received gradients or None)``.
        """
        outgoing: list[tuple[str, int, Any]] = []
        incoming: list[tuple[str, int]] = []
        if send_forward is not _NO_SEND:
            outgoing.append((_FORWARD, self._peer("next_rank", "send_forward"), send_forward))
        if recv_forward:
            incoming.append((_FORWARD, self._peer("prev_rank", "recv_forward")))
        if send_backward is not None:
            outgoing.append((_BACKWARD, self._peer("prev_rank", "send_backward"), _grad_list(send_backward)))
        if recv_backward:
            incoming.append((_BACKWARD, self._peer("next_rank", "recv_backward")))
        got = self._exchange(outgoing, incoming)
        return got.get(_FORWARD), got.get(_BACKWARD)

    # ---------------------------------------------------------------- protocol
    def _peer(self, attr: str, method: str) -> int:
        rank = getattr(self, attr)
        if rank is None:
            stage = "first" if attr == "prev_rank" else "last"
            raise ValueError(f"{method}: this is the {stage} pipeline stage ({attr}=None); there is no peer to talk to")
        return int(rank)

    def _exchange(self, outgoing: list[tuple[str, int, Any]], incoming: list[tuple[str, int]]) -> dict[str, Any]:
        # Step 1: one frame per message, in the fixed order send fwd, recv fwd, send bwd, recv bwd.
        ops: list[tuple[str, torch.Tensor, int]] = []
        handshakes: list[tuple[str, int, bytes, torch.Tensor, Any]] = []
        frames: dict[str, torch.Tensor] = {}
        for channel in (_FORWARD, _BACKWARD):
            for ch, dst, obj in outgoing:
                if ch != channel:
                    continue
                spec, tensors = _pytree.flatten(obj, path=f"{channel} pytree")
                meta = (spec, _pytree.tensor_metas(tensors))
                if meta == self._sent[channel]:
                    frame = _pytree.pack(tensors, meta[1], self.device, reserve=_HEADER)
                    _write_header(frame, 0, 0, frame.numel() - _HEADER)
                else:
                    # Filler of the size the receiver expects, then metadata + payload in step 2.
                    meta_bytes = pickle.dumps(meta)
                    payload = _pytree.pack(tensors, meta[1], self.device)
                    frame = torch.empty(
                        _HEADER + _payload_size(self._sent[channel]), dtype=torch.uint8, device=self.device
                    )
                    _write_header(frame, 1, len(meta_bytes), payload.numel())
                    handshakes.append((channel, dst, meta_bytes, payload, meta))
                ops.append(("send", frame, dst))
            for ch, src in incoming:
                if ch == channel:
                    expected = _HEADER + _payload_size(self._received[channel])
                    frames[channel] = torch.empty(expected, dtype=torch.uint8, device=self.device)
                    ops.append(("recv", frames[channel], src))
        _ops.batch_send_recv(ops, self.group)

        # Step 2, only for the messages whose metadata changed (both sides know which).
        ops, changed = [], {}
        for channel, dst, meta_bytes, payload, meta in handshakes:
            ops.append(("send", torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8).to(self.device), dst))
            if payload.numel():
                ops.append(("send", payload, dst))
            self._sent[channel] = meta
            self.handshakes_sent += 1
        for channel, src in incoming:
            flag, meta_len, payload_len, _ = frames[channel][:_HEADER].view(torch.int64).tolist()
            if flag:
                meta_buf = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
                payload_buf = torch.empty(payload_len, dtype=torch.uint8, device=self.device)
                ops.append(("recv", meta_buf, src))
                if payload_len:
                    ops.append(("recv", payload_buf, src))
                changed[channel] = (meta_buf, payload_buf)
            elif payload_len != frames[channel].numel() - _HEADER:
                raise RuntimeError(
                    f"PipeTransport: {channel} message of {payload_len} payload bytes from rank {src} does not match "
                    f"the cached metadata ({frames[channel].numel() - _HEADER} bytes); the two sides disagree on "
                    "the message order"
                )
        _ops.batch_send_recv(ops, self.group)

        received: dict[str, Any] = {}
        for channel, _ in incoming:
            if channel in changed:
                meta_buf, payload_buf = changed[channel]
                self._received[channel] = pickle.loads(meta_buf.cpu().numpy().tobytes())
                self.handshakes_received += 1
            else:
                payload_buf = frames[channel][_HEADER:]
            spec, metas = self._received[channel]
            tensors = _pytree.unpack(payload_buf, metas)
            if channel == _FORWARD:
                for t, m in zip(tensors, metas):
                    if m.requires_grad:
                        t.requires_grad_(True)
            received[channel] = _pytree.unflatten(spec, tensors)
        return received


def _payload_size(meta: Any) -> int:
    """Payload bytes of a message with cached ``meta`` (0 before the first message)."""
    return 0 if meta is None else _pytree.offsets(meta[1])[1]


def _write_header(frame: torch.Tensor, changed: int, meta_len: int, payload_len: int) -> None:
    header = torch.tensor([changed, meta_len, payload_len, 0], dtype=torch.int64)
    frame[:_HEADER].view(torch.int64).copy_(header)


def _grad_list(grads: Any) -> list[torch.Tensor | None]:
    if not isinstance(grads, (list, tuple)) or not all(g is None or isinstance(g, torch.Tensor) for g in grads):
        raise TypeError(
            f"grads must be a list of tensors (or None) in the flatten order of the received inputs, got "
            f"{type(grads).__name__}; build it with [t.grad for t in tensors_requiring_grad(inputs)]"
        )
    return list(grads)
