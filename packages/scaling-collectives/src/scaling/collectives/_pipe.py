"""Point-to-point transport of pytrees between neighbouring pipeline stages.

Every message is up to three batched transfers:

1. a header ``int64[3]``: (metadata changed?, metadata bytes, payload bytes);
2. only when the structure, a shape, a dtype or a ``requires_grad`` flag changed since
   the last message on that channel: the pickled spec and tensor metadata (the
   handshake; receivers cache it, so steady-state micro-batches skip it);
3. the payload: every tensor packed into one byte buffer.

Each step posts its send and its receive together through
``torch.distributed.batch_isend_irecv``, so two stages that send to each other
(``send_forward_recv_backward`` on one side, ``send_backward_recv_forward`` on the
other) make progress in lockstep instead of deadlocking.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from scaling.collectives import _ops, _pytree

_FORWARD, _BACKWARD = "forward", "backward"


def tensors_requiring_grad(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` with ``requires_grad``, in flatten order.

    On a stage that got ``obj`` from :meth:`PipeTransport.recv_forward`, these are the
    leaves whose ``.grad`` goes back with :meth:`PipeTransport.send_backward`.
    """
    return [t for t in _pytree.flatten(obj)[1] if t.requires_grad]


class PipeTransport:
    """Send pytrees to the next stage and their gradients back to the previous one.

    Args:
        prev_rank: global rank of the previous stage, ``None`` on the first stage.
        next_rank: global rank of the next stage, ``None`` on the last stage.
        device: where received tensors are allocated (``topology.device``).
        group: the process group the peers belong to (default: the default group);
            ranks are global either way.

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
        self, prev_rank: int | None, next_rank: int | None, device: torch.device, group: dist.ProcessGroup | None = None
    ) -> None:
        for name, rank in (("prev_rank", prev_rank), ("next_rank", next_rank)):
            if rank is not None and (not isinstance(rank, int) or rank < 0):
                raise ValueError(f"PipeTransport: {name}={rank!r} must be a global rank (int >= 0) or None")
        if prev_rank is not None and prev_rank == next_rank:
            raise ValueError(
                f"PipeTransport: prev_rank and next_rank are both {prev_rank}; a stage cannot talk to one rank in both "
                "directions (use topology.previous_pipe_rank and topology.next_pipe_rank)"
            )
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = torch.device(device)
        self.group = group
        # Last metadata sent / received per channel: the handshake cache.
        self._sent: dict[str, Any] = {_FORWARD: None, _BACKWARD: None}
        self._received: dict[str, Any] = {_FORWARD: None, _BACKWARD: None}
        self.handshakes_sent = 0
        self.handshakes_received = 0

    def __repr__(self) -> str:
        return f"PipeTransport(prev_rank={self.prev_rank}, next_rank={self.next_rank}, device={self.device})"

    # ------------------------------------------------------------------ public
    def send_forward(self, obj: Any) -> None:
        """Send ``obj`` (this stage's output) to the next stage."""
        self._exchange(outgoing=(_FORWARD, self._peer("next_rank", "send_forward"), obj))

    def recv_forward(self) -> Any:
        """Receive the previous stage's output; tensors that required grad arrive as grad leaves."""
        return self._exchange(incoming=(_FORWARD, self._peer("prev_rank", "recv_forward")))

    def send_backward(self, grads: list[torch.Tensor | None]) -> None:
        """Send the gradients of the received inputs (flatten order) to the previous stage."""
        self._exchange(outgoing=(_BACKWARD, self._peer("prev_rank", "send_backward"), _grad_list(grads)))

    def recv_backward(self) -> list[torch.Tensor | None]:
        """Receive the gradients of what this stage sent forward, in flatten order."""
        return self._exchange(incoming=(_BACKWARD, self._peer("next_rank", "recv_backward")))

    def send_forward_recv_backward(self, obj: Any) -> list[torch.Tensor | None]:
        """Send ``obj`` to the next stage while receiving gradients from it (1F1B steady state)."""
        peer = self._peer("next_rank", "send_forward_recv_backward")
        return self._exchange(outgoing=(_FORWARD, peer, obj), incoming=(_BACKWARD, peer))

    def send_backward_recv_forward(self, grads: list[torch.Tensor | None]) -> Any:
        """Send gradients to the previous stage while receiving its next output."""
        peer = self._peer("prev_rank", "send_backward_recv_forward")
        return self._exchange(outgoing=(_BACKWARD, peer, _grad_list(grads)), incoming=(_FORWARD, peer))

    # ---------------------------------------------------------------- protocol
    def _peer(self, attr: str, method: str) -> int:
        rank = getattr(self, attr)
        if rank is None:
            stage = "first" if attr == "prev_rank" else "last"
            raise ValueError(f"{method}: this is the {stage} pipeline stage ({attr}=None); there is no peer to talk to")
        return int(rank)

    def _exchange(self, outgoing: tuple[str, int, Any] | None = None, incoming: tuple[str, int] | None = None) -> Any:
        ops: list[tuple[str, torch.Tensor, int]] = []
        if outgoing is not None:
            channel, dst, obj = outgoing
            spec, tensors = _pytree.flatten(obj, path=f"{channel} pytree")
            meta = (spec, _pytree.tensor_metas(tensors))
            new_meta = meta != self._sent[channel]
            meta_bytes = pickle.dumps(meta) if new_meta else b""
            payload = _pytree.pack(tensors, meta[1], self.device)
            header = torch.tensor(
                [int(new_meta), len(meta_bytes), payload.numel()], dtype=torch.int64, device=self.device
            )
            ops.append(("send", header, dst))
        if incoming is not None:
            in_header = torch.empty(3, dtype=torch.int64, device=self.device)
            ops.append(("recv", in_header, incoming[1]))
        _ops.batch_send_recv(ops, self.group)

        # Handshake step: only in the directions whose metadata changed.
        ops = []
        if outgoing is not None and new_meta:
            ops.append(("send", torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8).to(self.device), dst))
        in_new, in_meta_len, in_payload_len = (
            (int(v) for v in in_header.tolist()) if incoming is not None else (0, 0, 0)
        )
        if incoming is not None and in_new:
            in_meta_buf = torch.empty(in_meta_len, dtype=torch.uint8, device=self.device)
            ops.append(("recv", in_meta_buf, incoming[1]))
        _ops.batch_send_recv(ops, self.group)
        if outgoing is not None and new_meta:
            self._sent[outgoing[0]] = meta
            self.handshakes_sent += 1
        if incoming is not None and in_new:
            self._received[incoming[0]] = pickle.loads(in_meta_buf.cpu().numpy().tobytes())
            self.handshakes_received += 1

        ops = []
        if outgoing is not None and payload.numel():
            ops.append(("send", payload, dst))
        if incoming is not None:
            in_spec, in_metas = self._received[incoming[0]]
            in_payload = torch.empty(_pytree.offsets(in_metas)[1], dtype=torch.uint8, device=self.device)
            # Both sides derive the payload size from the same metadata; a mismatch is a protocol bug.
            assert in_payload.numel() == in_payload_len, (in_payload.numel(), in_payload_len)
            if in_payload_len:
                ops.append(("recv", in_payload, incoming[1]))
        _ops.batch_send_recv(ops, self.group)
        if incoming is None:
            return None
        received = _pytree.unpack(in_payload, in_metas)
        if incoming[0] == _FORWARD:
            for t, m in zip(received, in_metas):
                if m.requires_grad:
                    t.requires_grad_(True)
        return _pytree.unflatten(in_spec, received)


def _grad_list(grads: Any) -> list[torch.Tensor | None]:
    if not isinstance(grads, (list, tuple)) or not all(g is None or isinstance(g, torch.Tensor) for g in grads):
        raise TypeError(
            f"grads must be a list of tensors (or None) in the flatten order of the received inputs, got "
            f"{type(grads).__name__}; build it with [t.grad for t in tensors_requiring_grad(inputs)]"
        )
    return list(grads)
