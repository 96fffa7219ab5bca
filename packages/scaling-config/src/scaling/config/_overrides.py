"""Dotted-key overrides (``topology.data_parallel_size=2``) merged into nested dicts."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Union

import yaml

from scaling.config._types import JsonDict, JsonMapping

Overrides = Union[JsonMapping, Sequence[str], None]


def parse_override(text: str) -> tuple[str, object]:
    """Split ``"a.b=value"`` into ``("a.b", value)``; the value is parsed as a YAML scalar.

    Raises:
        ValueError: when there is no ``=`` or the key is empty.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {text!r} is not of the form dotted.key=value; e.g. topology.data_parallel_size=2")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: JsonDict, overrides: Overrides) -> JsonDict:
    """Return a deep copy of ``data`` with each dotted override set.

    Intermediate mappings are created when missing; the schema decides later whether
    the key is allowed, so an unknown key fails validation with its dotted path.
    """
    if not overrides:
        return data
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
    elif isinstance(overrides, (str, bytes)):
        raise TypeError("overrides must be a mapping or a list of 'key=value' strings, not a single string")
    else:
        items = [parse_override(o) for o in overrides]
    out = copy.deepcopy(data)
    for dotted, value in items:
        parts = dotted.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise ValueError(
                    f"override {dotted!r}: {prefix!r} holds {child!r}, not a section; "
                    f"override {prefix!r} itself or pick a key inside a section"
                )
            node = child
        node[parts[-1]] = value
    return out
