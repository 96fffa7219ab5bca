"""Flatten a pytree of tensors into a picklable spec plus tensors, and pack them into bytes.

Supported nodes: dataclasses (all fields, frozen ones too), instances of plain classes
(their instance attributes: the original library's LayerIO style), tuples, namedtuples,
lists and dicts; supported leaves: tensors, ``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``, ``torch.dtype`` and ``torch.device``. Non-tensor leaves travel inside the spec. The spec and the tensor
metadata are plain data, so comparing two of them tells whether a cached handshake
still holds.

Packing puts every tensor, whatever its dtype (bool included), into one ``uint8``
buffer at 16-byte-aligned offsets, so a whole pytree moves in one transfer and the
receiver rebuilds each tensor as a typed view of its slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

_ALIGN = 16
_SCALARS = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device)


class TensorMeta(NamedTuple):
    """Shape, dtype and ``requires_grad`` of one flattened tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * self.dtype.itemsize


#: What travels between pipeline stages and is broadcast over TP: a nest of the nodes and
#: leaves above, tensors at the leaves. ``Any`` because the nodes are the user's own classes
#: (a walkthrough LayerIO, a batch dataclass), which no static type can enumerate; the
#: runtime check is :func:`flatten`'s, naming the path of an unsupported leaf.
PyTree = Any

#: The ``ctx`` of a ``torch.autograd.Function``. ``Any``: each function stores its own
#: attributes on it, which torch's ``FunctionCtx`` does not declare (torch types it so too).
AutogradContext = Any

# Spec nodes are tuples: ("t", index) | ("v", value) | ("list"|"tuple", children)
# | ("namedtuple", cls, children) | ("dict", keys, children) | ("dc", cls, names, children)
# | ("obj", cls, names, children) (a plain class's instance attributes). Any: the tuples'
# members differ by node kind (a recursive union mypy would check no better).
Spec = tuple[Any, ...]


# Dataclass -> its field names (None: not a dataclass), so a node costs one lookup.
_FIELDS: dict[type, tuple[str, ...] | None] = {}


def _field_names(cls: type) -> tuple[str, ...] | None:
    names = _FIELDS.get(cls, ())
    if names == ():
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None
    return names


def _plain_names(obj: PyTree) -> tuple[str, ...] | None:
    """The instance attributes of a plain user class's object (None for anything else).

    Classes, modules, functions and builtins' objects are not plain: they stay unsupported.
    """
    attrs = getattr(obj, "__dict__", None)
    if attrs is None or isinstance(obj, (type, torch.nn.Module)) or callable(obj):
        return None
    return None if type(obj).__module__ == "builtins" else tuple(attrs)


def flatten(obj: PyTree, path: str = "obj") -> tuple[Spec, list[torch.Tensor]]:
    """Split ``obj`` into a spec and its tensors in depth-first order.

    Raises:
        TypeError: on a leaf type that is not supported; the message names its path
            (``path`` is the name of ``obj`` itself).
    """
    tensors: list[torch.Tensor] = []
    try:
        return _flatten(obj, tensors), tensors
    except _Unsupported:
        # The walk builds no paths (it runs for every pipeline message); find the culprit's now.
        _check(obj, path)
        raise  # unreachable: _check raises for what _flatten refused


class _Unsupported(TypeError):
    """Raised by :func:`_flatten` on an unsupported leaf or key; :func:`flatten` turns it into a named error."""


def _flatten(obj: PyTree, tensors: list[torch.Tensor]) -> Spec:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("t", len(tensors) - 1)
    if isinstance(obj, _SCALARS):
        return ("v", obj)
    names = _field_names(type(obj))
    if names is not None:
        return ("dc", type(obj), names, tuple(_flatten(getattr(obj, n), tensors) for n in names))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return ("namedtuple", type(obj), tuple(_flatten(v, tensors) for v in obj))
    if isinstance(obj, (list, tuple)):
        return ("list" if isinstance(obj, list) else "tuple", tuple(_flatten(v, tensors) for v in obj))
    if isinstance(obj, dict):
        keys = tuple(obj)
        if not all(isinstance(k, _SCALARS) for k in keys):
            raise _Unsupported
        return ("dict", keys, tuple(_flatten(obj[k], tensors) for k in keys))
    names = _plain_names(obj)
    if names is not None:
        return ("obj", type(obj), names, tuple(_flatten(getattr(obj, n), tensors) for n in names))
    raise _Unsupported


def _check(obj: PyTree, path: str) -> None:
    """Walk ``obj`` as :func:`_flatten` does, naming each node's path; raise ``TypeError`` at the first bad one."""
    if isinstance(obj, (torch.Tensor, *_SCALARS)):
        return
    names = _field_names(type(obj))
    if names is not None:
        for n in names:
            _check(getattr(obj, n), f"{path}.{n}")
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for n, v in zip(obj._fields, obj):
            _check(v, f"{path}.{n}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, _SCALARS):
                raise TypeError(
                    f"{path}: dict key {k!r} of type {type(k).__name__} is not supported; use str or int keys"
                )
            _check(v, f"{path}[{k!r}]")
    elif (plain := _plain_names(obj)) is not None:
        for n in plain:
            _check(getattr(obj, n), f"{path}.{n}")
    else:
        raise TypeError(
            f"{path}: a {type(obj).__name__} cannot be sent; supported are tensors, None, bool, int, float, str, "
            "bytes and dataclasses, plain objects, tuples, namedtuples, lists and dicts of them"
        )


def tensor_leaves(obj: PyTree, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors of ``obj`` in :func:`flatten`'s order, without building a spec or checking types.

    For objects already known to be sendable (sent or received before): this runs for
    every micro-batch of a pipeline.
    """
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            tensor_leaves(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            tensor_leaves(item, out)
    elif not isinstance(obj, _SCALARS):
        for name in _field_names(type(obj)) or _plain_names(obj) or ():
            tensor_leaves(getattr(obj, name), out)
    return out


def unflatten(spec: Spec, tensors: Sequence[torch.Tensor | None]) -> PyTree:
    """Rebuild the object ``spec`` describes, with ``tensors`` in flatten order."""
    kind = spec[0]
    if kind == "t":
        return tensors[spec[1]]
    if kind == "v":
        return spec[1]
    if kind == "list":
        return [unflatten(c, tensors) for c in spec[1]]
    if kind == "tuple":
        return tuple(unflatten(c, tensors) for c in spec[1])
    if kind == "namedtuple":
        return spec[1](*(unflatten(c, tensors) for c in spec[2]))
    if kind == "dict":
        return {k: unflatten(c, tensors) for k, c in zip(spec[1], spec[2])}
    if kind in ("dc", "obj"):
        # Set fields directly: no __init__/__post_init__ re-runs, frozen classes work.
        obj = spec[1].__new__(spec[1])
        for name, child in zip(spec[2], spec[3]):
            object.__setattr__(obj, name, unflatten(child, tensors))
        return obj
    raise AssertionError(f"unknown spec node {kind!r}")


def tensor_metas(tensors: list[torch.Tensor]) -> tuple[TensorMeta, ...]:
    return tuple(TensorMeta(tuple(t.shape), t.dtype, bool(t.requires_grad)) for t in tensors)


def offsets(metas: tuple[TensorMeta, ...]) -> tuple[list[int], int]:
    """Byte offset of each tensor in the packed buffer, and the buffer's size."""
    out, pos = [], 0
    for m in metas:
        out.append(pos)
        pos += -(-m.nbytes // _ALIGN) * _ALIGN
    return out, pos


def pack(
    tensors: list[torch.Tensor], metas: tuple[TensorMeta, ...], device: torch.device, reserve: int = 0
) -> torch.Tensor:
    """Copy ``tensors`` into one ``uint8`` buffer on ``device`` (detached).

    The first ``reserve`` bytes (a multiple of 16) are left for the caller, e.g. a message
    header sent in the same transfer; the tensors start right after them.
    """
    starts, total = offsets(metas)
    buffer = torch.empty(reserve + total, dtype=torch.uint8, device=device)
    for t, start, m in zip(tensors, starts, metas):
        if m.nbytes:
            at = reserve + start
            buffer[at : at + m.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buffer


def unpack(buffer: torch.Tensor, metas: tuple[TensorMeta, ...]) -> list[torch.Tensor]:
    """Typed views of ``buffer`` for each tensor (no copy)."""
    starts, _ = offsets(metas)
    out = []
    for start, m in zip(starts, metas):
        if m.nbytes:
            out.append(buffer[start : start + m.nbytes].view(m.dtype).view(m.shape))
        else:
            out.append(torch.empty(m.shape, dtype=m.dtype, device=buffer.device))
    return out
