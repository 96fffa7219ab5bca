"""The frames :class:`~scaling.collectives.PipeTransport` sends: a header, then every tensor of a pytree.

A frame is ``HEADER`` bytes, ``int64[4]`` (metadata changed?, metadata bytes, payload
bytes, 0), followed by the payload: each tensor's bytes at a 16-byte-aligned offset. A
:class:`Layout` caches, per channel, the metadata both sides agreed on and where each
tensor sits, so a steady-state frame is built with one ``torch.cat`` and read with one
view per tensor. On CPU a receive buffer wraps a numpy array, whose header reads and
views cost a fraction of torch's (``bench/pipe_transport.py`` times a hand-off).
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from scaling.collectives import _pytree

HEADER = 32  # bytes before the payload in a frame: int64[4], keeps the payload 16-byte aligned
# How a steady-state message of a layout travels (``Layout.form``): a header + payload frame
# (the value is the payload's offset), the payload alone, or one tensor as it is.
FRAMED, PAYLOAD_ONLY, TYPED = HEADER, 0, -1

# torch dtype -> numpy dtype, for the CPU receive path (dtypes numpy lacks, e.g. bfloat16, take the torch path).
_NUMPY_DTYPES: dict[torch.dtype, type[np.generic]] = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}


#: A channel's metadata as sent once at the handshake: the pytree's spec and its tensors' metas.
Meta: TypeAlias = "tuple[_pytree.Spec, tuple[_pytree.TensorMeta, ...]]"


class Layout:
    """A channel's cached metadata and where each tensor sits in a frame's payload.

    Both sides build it from the same metadata (at the handshake), so the steady state
    needs neither ``offsets`` nor a header other than the cached one. ``form`` says how a
    steady-state message travels: ``FRAMED`` unless ``static`` (shapes fixed, no header
    needed); then ``TYPED`` for one tensor, ``PAYLOAD_ONLY`` for several, ``FRAMED`` for
    none (an empty payload keeps its header). Both sides derive it alike.
    """

    __slots__ = ("form", "header", "meta", "metas", "np_dtypes", "pads", "size", "slices", "spec")

    def __init__(self, meta: Meta | None, device: torch.device, static: bool = False) -> None:
        self.meta = meta
        self.spec: _pytree.Spec | None = None if meta is None else meta[0]
        self.metas: tuple[_pytree.TensorMeta, ...] = () if meta is None else meta[1]
        starts, self.size = _pytree.offsets(self.metas)
        self.slices = [(start, start + m.nbytes) for start, m in zip(starts, self.metas)]
        ends = [*starts[1:], self.size]
        # Zero filler up to the next 16-byte boundary after each tensor.
        self.pads = [
            torch.zeros(nxt - end, dtype=torch.uint8, device=device) if nxt > end else None
            for (_, end), nxt in zip(self.slices, ends)
        ]
        self.header = header(0, 0, self.size, device)
        if not static or self.size == 0:
            self.form = FRAMED
        else:
            self.form = TYPED if len(self.metas) == 1 else PAYLOAD_ONLY
        # On CPU a received tensor is a numpy view of the frame (a third of the cost of torch's views).
        np_dtypes = [_NUMPY_DTYPES[m.dtype] for m in self.metas if m.dtype in _NUMPY_DTYPES]
        self.np_dtypes = np_dtypes if device.type == "cpu" and len(np_dtypes) == len(self.metas) else None

    def fits(self, spec: _pytree.Spec, tensors: list[torch.Tensor]) -> bool:
        """Whether a flattened pytree matches this layout (same spec, shapes, dtypes, grad flags): the steady state."""
        if spec != self.spec or len(tensors) != len(self.metas):
            return False
        for t, m in zip(tensors, self.metas):
            if t.dtype != m.dtype or t.requires_grad != m.requires_grad or t.shape != m.shape:
                return False
        return True

    def payload_pieces(self, tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """The byte views (and fillers) whose concatenation is the packed payload."""
        pieces = []
        for t, (start, end), pad in zip(tensors, self.slices, self.pads):
            if end > start:
                # reshape copies only a non-contiguous tensor; .to only one on another device.
                piece = t.detach().reshape(-1).view(torch.uint8)
                pieces.append(piece if piece.device == device else piece.to(device))
            if pad is not None:
                pieces.append(pad)
        return pieces

    def unpack(self, buffer: Buffer, base: int, grad_leaves: bool) -> _pytree.PyTree:
        """The pytree whose payload starts at byte ``base`` of ``buffer`` (typed views, no copy).

        Views read no data, so this may run before the buffer is filled. ``None`` while
        nothing is cached (a channel's first message always comes with its metadata).
        """
        spec = self.spec
        if spec is None:
            return None
        tensor, array = buffer
        np_dtypes = self.np_dtypes
        tensors = []
        for i, ((start, end), m) in enumerate(zip(self.slices, self.metas)):
            if end == start:
                t = torch.empty(m.shape, dtype=m.dtype, device=tensor.device)
            elif np_dtypes is not None and array is not None:
                t = torch.from_numpy(array[base + start : base + end].view(np_dtypes[i]).reshape(m.shape))
            else:
                t = tensor[base + start : base + end].view(m.dtype).view(m.shape)
            if grad_leaves and m.requires_grad:
                t.requires_grad_(True)
            tensors.append(t)
        return _pytree.unflatten(spec, tensors)

    def unpack_typed(self, tensor: torch.Tensor, grad_leaf: bool) -> _pytree.PyTree:
        """The pytree of a single-tensor layout around ``tensor``, received as it is (dtype and shape)."""
        assert self.spec is not None  # a TYPED layout holds one tensor's metadata
        if grad_leaf and self.metas[0].requires_grad:
            tensor.requires_grad_(True)
        return _pytree.unflatten(self.spec, [tensor])


# A receive buffer: the uint8 tensor, and on CPU the numpy array it wraps (cheap header reads and views).
Buffer: TypeAlias = "tuple[torch.Tensor, npt.NDArray[np.uint8] | None]"


def empty_buffer(nbytes: int, device: torch.device) -> Buffer:
    """A receive buffer of ``nbytes`` on ``device`` (numpy-backed on CPU)."""
    if device.type == "cpu":
        array = np.empty(nbytes, dtype=np.uint8)
        return torch.from_numpy(array), array
    return torch.empty(nbytes, dtype=torch.uint8, device=device), None


def header(changed: int, meta_len: int, payload_len: int, device: torch.device) -> torch.Tensor:
    """A frame's first ``HEADER`` bytes: ``int64[4]`` (metadata changed?, metadata bytes, payload bytes, 0)."""
    return torch.tensor([changed, meta_len, payload_len, 0], dtype=torch.int64).view(torch.uint8).to(device)


def read_header(frame: torch.Tensor, array: npt.NDArray[np.uint8] | None) -> list[int]:
    """The four header fields of a received frame (through its numpy array on CPU)."""
    fields = frame[:HEADER].view(torch.int64) if array is None else array[:HEADER].view(np.int64)
    return list(fields.tolist())
