"""Names for the loosely typed mappings that cross package seams, each with the reason it is loose.

Each is ``dict[str, Any]`` (or its read-only ``Mapping``): the same type to a checker, a
name to a reader, and the one place the ``Any`` in it is explained.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

#: A ``state_dict()``: what modules, optimizers, schedulers, loaders and distributed checkpoint
#: pass around (torch's own ``STATE_DICT_TYPE``): tensors, numbers, strings, and dicts and
#: lists of them, each owner deciding its layout. ``Any``: torch's state dicts are typed so.
StateDict: TypeAlias = dict[str, Any]

#: A mapping as YAML or JSON parse it (config files, runner payloads, plan files, checkpoint
#: markers, file headers): nested values of JSON's types. ``Any``: JSON is recursive, and every
#: reader checks the values it takes (pydantic for configs, the named checks elsewhere).
JsonDict: TypeAlias = dict[str, Any]
#: :data:`JsonDict` taken read-only.
JsonMapping: TypeAlias = Mapping[str, Any]

#: One step's metrics by name: floats, ints and bools once reduced; before that, what a user's
#: loss function returned (tensors or numbers). ``Any``: the loss function is the user's.
Metrics: TypeAlias = dict[str, Any]
