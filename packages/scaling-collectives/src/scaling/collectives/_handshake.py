"""What the two ends of a pipe channel know of each other's messages: the handshake cache.

Every message is one frame, sized by the metadata both sides cached for its (channel, peer)
(:class:`~scaling.collectives._frames.Layout`); when the sender's metadata changed (the first
message included), the frame carries a header saying so and a second step sends the pickled
metadata and the payload. :class:`HandshakeCache` builds the frames and receive buffers, the
second step's transfers and the received pytrees; :class:`~scaling.collectives.PipeTransport`
posts them and waits.
"""

from __future__ import annotations

import pickle

import torch

from scaling.collectives import _pytree
from scaling.collectives._frames import (
    FRAMED,
    HEADER,
    PAYLOAD_ONLY,
    TYPED,
    Buffer,
    Layout,
    empty_buffer,
    header,
    read_header,
)
from scaling.collectives._pytree import PyTree

FORWARD, BACKWARD = "forward", "backward"
#: A transfer to post: ``("send" | "recv", buffer, global rank)``.
Op = tuple[str, torch.Tensor, int]


class HandshakeCache:
    """The metadata last sent to and received from each peer per channel, and the frames built from it.

    Args:
        device: where frames and buffers live.
        static_shapes: see :class:`~scaling.collectives.PipeTransport`.
    """

    def __init__(self, device: torch.device, static_shapes: bool) -> None:
        self.device, self.static_shapes = device, static_shapes
        self._empty = Layout(None, device)
        self._sent: dict[tuple[str, int], Layout] = {}
        self._received: dict[tuple[str, int], Layout] = {}
        self.handshakes_sent = 0
        self.handshakes_received = 0

    def frame(self, channel: str, dst: int, obj: PyTree) -> tuple[torch.Tensor, Handshake | None]:
        """The frame of ``obj`` for ``dst``; if its metadata changed, the handshake for the second step."""
        spec, tensors = _pytree.flatten(obj, path=_PATHS[channel])
        cached = self._sent.get((channel, dst), self._empty)
        if cached.fits(spec, tensors):
            if cached.form == TYPED:  # the tensor itself, in its own dtype and shape
                frame = tensors[0].detach()
                if not (frame.is_contiguous() and frame.device == self.device):
                    frame = frame.contiguous().to(self.device)
                return frame, None
            if cached.form == PAYLOAD_ONLY:  # two or more tensors, no header
                return torch.cat(cached.payload_pieces(tensors, self.device)), None
            return torch.cat([cached.header, *cached.payload_pieces(tensors, self.device)]), None
        if self.static_shapes and cached.spec is not None:
            raise ValueError(
                f"PipeTransport(static_shapes=True): the {_PATHS[channel]} for rank {dst} changed after its first "
                f"message: {_describe(cached.spec, cached.metas)} became "
                f"{_describe(spec, _pytree.tensor_metas(tensors))}; send the same structure, shapes, dtypes and "
                "requires_grad every time, or use static_shapes=False (one header per message)"
            )
        # Filler of the size the receiver expects, then metadata + payload in step 2.
        meta = (spec, _pytree.tensor_metas(tensors))
        layout = Layout(meta, self.device, self.static_shapes)
        meta_bytes = pickle.dumps(meta)
        pieces = layout.payload_pieces(tensors, self.device)
        payload = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=self.device)
        frame = torch.cat(
            [
                header(1, len(meta_bytes), payload.numel(), self.device),
                torch.zeros(cached.size, dtype=torch.uint8, device=self.device),
            ]
        )
        return frame, (channel, dst, meta_bytes, payload, layout)

    def receive(self, channel: str, src: int) -> Incoming:
        """A receive buffer of the size the cached metadata of ``(channel, src)`` gives."""
        layout = self._received.get((channel, src), self._empty)
        if layout.form == TYPED:
            meta = layout.metas[0]
            buffer: Buffer = (torch.empty(meta.shape, dtype=meta.dtype, device=self.device), None)
        else:
            buffer = empty_buffer(layout.form + layout.size, self.device)
        return channel, src, buffer, layout

    @staticmethod
    def expected(incoming: list[Incoming]) -> list[PyTree]:
        """The steady-state pytrees as views of the receive buffers (views read no data: built while
        the messages travel, only the header check is left once the data is in)."""
        return [
            layout.unpack_typed(buffer[0], channel == FORWARD)
            if layout.form == TYPED
            else layout.unpack(buffer, layout.form, channel == FORWARD)
            for channel, _, buffer, layout in incoming
        ]

    def second_step(
        self, handshakes: list[Handshake], incoming: list[Incoming]
    ) -> tuple[list[Op], dict[int, tuple[torch.Tensor, Buffer]]]:
        """The second step's transfers, once the frames are in, and the buffers of the changed receives
        (by index in ``incoming``). Both sides know which messages changed: the sender from its cache,
        the receiver from the frame's header."""
        ops: list[Op] = []
        changed: dict[int, tuple[torch.Tensor, Buffer]] = {}
        for channel, dst, meta_bytes, payload, layout in handshakes:
            ops.append(("send", torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8).to(self.device), dst))
            if payload.numel():
                ops.append(("send", payload, dst))
            self._sent[(channel, dst)] = layout
            self.handshakes_sent += 1
        for index, (channel, src, (frame, array), layout) in enumerate(incoming):
            if layout.form != FRAMED:  # static shapes, steady state: no header, nothing changed
                continue
            flag, meta_len, payload_len, _ = read_header(frame, array)
            if flag:
                meta_buf = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
                payload_buf = empty_buffer(payload_len, self.device)
                ops.append(("recv", meta_buf, src))
                if payload_len:
                    ops.append(("recv", payload_buf[0], src))
                changed[index] = (meta_buf, payload_buf)
            elif payload_len != frame.numel() - HEADER:
                raise RuntimeError(
                    f"PipeTransport: {channel} message of {payload_len} payload bytes from rank {src} does not match "
                    f"the cached metadata ({frame.numel() - HEADER} bytes); the two sides disagree on "
                    "the message order"
                )
        return ops, changed

    def received(
        self, incoming: list[Incoming], expected: list[PyTree], changed: dict[int, tuple[torch.Tensor, Buffer]]
    ) -> list[PyTree]:
        """The received pytrees, in order: ``expected``, or where the metadata changed, read from the
        second step (and cached for the next message)."""
        received: list[PyTree] = []
        for index, ((channel, src, _, _), obj) in enumerate(zip(incoming, expected)):
            if index in changed:
                meta_buf, buffer = changed[index]
                meta = pickle.loads(meta_buf.cpu().numpy().tobytes())
                layout = self._received[(channel, src)] = Layout(meta, self.device, self.static_shapes)
                self.handshakes_received += 1
                obj = layout.unpack(buffer, 0, grad_leaves=channel == FORWARD)
            received.append(obj)
        return received


#: A handshake to send in step 2: (channel, peer, pickled metadata, payload, the new layout).
Handshake = tuple[str, int, bytes, torch.Tensor, Layout]
#: A posted receive: (channel, peer, buffer, the layout it was sized from).
Incoming = tuple[str, int, Buffer, Layout]
_PATHS = {FORWARD: "forward pytree", BACKWARD: "backward pytree"}


def _describe(spec: _pytree.Spec, metas: tuple[_pytree.TensorMeta, ...]) -> str:
    """A pytree's structure and tensors, short: what a static-shapes error shows."""
    tensors = ", ".join(
        f"{tuple(m.shape)} {str(m.dtype).replace('torch.', '')}{' grad' if m.requires_grad else ''}" for m in metas
    )
    kind = (
        spec[1].__name__
        if spec[0] in ("dc", "obj", "namedtuple")
        else {"t": "tensor", "v": "value"}.get(spec[0], spec[0])
    )
    return f"{kind} of [{tensors}]"
