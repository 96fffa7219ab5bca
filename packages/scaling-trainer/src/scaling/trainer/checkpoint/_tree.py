"""Pytrees <-> (tensors, JSON): how state is split between DCP shards and JSON files.

Nothing here pickles. ``flatten_state`` walks dicts, lists and tuples and names each
leaf by its dotted path (``optimizer.state.layers.0.linear.weight.exp_avg``); tensor
leaves go to DCP, scalar leaves (int, float, str, bool, None) to JSON.
``encode_pytree`` / ``decode_pytree`` round-trip per-rank state (RNG states: tuples of
ints, numpy arrays, tensors) exactly, tensors going to a safetensors file.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from scaling.config import StateDict

_SCALARS = (int, float, str, bool, type(None))
Scalar = int | float | str | bool | None
_PLAIN = frozenset({int, float, str, bool, type(None)})


def _children(node: Mapping[object, object] | Sequence[object]) -> Iterator[tuple[object, object]]:
    if isinstance(node, Mapping):
        yield from node.items()
    else:
        yield from enumerate(node)


def iter_leaves(tree: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor | Scalar]]:
    """``(dotted_key, leaf)`` for every tensor or scalar leaf of ``tree``.

    Raises:
        TypeError: a leaf is neither a tensor nor a JSON scalar (the key is named).
    """
    if isinstance(tree, (Mapping, list, tuple)):
        for k, child in _children(tree):
            yield from iter_leaves(child, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, torch.Tensor) or isinstance(tree, _SCALARS):
        yield prefix, tree
    else:
        raise TypeError(
            f"checkpoint state entry {prefix!r} has type {type(tree).__name__}; only tensors, DTensors and "
            "int/float/str/bool/None (inside dicts, lists and tuples) can be saved"
        )


def flatten_state(tree: object) -> tuple[dict[str, torch.Tensor], StateDict]:
    """Split ``tree`` into ``({key: tensor}, {key: scalar})``.

    Raises:
        ValueError: two leaves get the same dotted key (e.g. keys ``"a.b"`` and ``a -> b``).
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: StateDict = {}
    for key, leaf in iter_leaves(tree):
        if key in tensors or key in scalars:
            raise ValueError(f"checkpoint state key {key!r} appears twice after flattening; rename one of them")
        if isinstance(leaf, torch.Tensor):
            tensors[key] = leaf
        else:
            scalars[key] = leaf
    return tensors, scalars


def fill_state(tree: StateDict, values: Mapping[str, object]) -> StateDict:
    """A copy of ``tree``'s containers with each leaf replaced by ``values[key]`` if present."""
    return {k: _fill(v, values, str(k)) for k, v in tree.items()}


def _fill(tree: object, values: Mapping[str, object], prefix: str) -> object:
    if isinstance(tree, Mapping):
        return {k: _fill(v, values, f"{prefix}.{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        out = [_fill(v, values, f"{prefix}.{i}") for i, v in enumerate(tree)]
        return type(tree)(out)
    return values.get(prefix, tree)


def encode_pytree(obj: object, tensors: dict[str, torch.Tensor], path: str = "root") -> object:
    """JSON-able form of ``obj``; tensors and numpy arrays are moved into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(obj).view(np.uint8).reshape(-1).copy())
        return {"__ndarray__": path, "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, (tuple, list)) and all(type(v) in _PLAIN for v in obj):  # e.g. Python's RNG state
        return {"__tuple__": list(obj)} if isinstance(obj, tuple) else list(obj)
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_pytree(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_pytree(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{path}: dict keys must be str to be saved as JSON, got {bad!r}")
        return {"__dict__": {k: encode_pytree(v, tensors, f"{path}.{k}") for k, v in obj.items()}}
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, _SCALARS):
        return obj
    raise TypeError(f"{path}: cannot save {type(obj).__name__} without pickling; use tensors, arrays and scalars")


def decode_pytree(obj: object, tensors: Mapping[str, torch.Tensor]) -> object:
    """Inverse of :func:`encode_pytree`."""
    if isinstance(obj, list):
        return [decode_pytree(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            raw = tensors[obj["__ndarray__"]].numpy().tobytes()
            return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
        if "__tuple__" in obj:
            return tuple(decode_pytree(v, tensors) for v in obj["__tuple__"])
        return {k: decode_pytree(v, tensors) for k, v in obj["__dict__"].items()}
    return obj
