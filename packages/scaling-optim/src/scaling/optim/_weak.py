"""Hooks that hold their owner weakly."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def weak_hook(owner: T, fn: Callable[Concatenate[T, P], object]) -> Callable[P, None]:
    """``fn(owner, *args)`` as a hook that holds ``owner`` weakly: a no-op once the owner is gone.

    A tensor hook's references are invisible to the garbage collector, so a hook holding the
    optimizer, its reducer or gatherer, or a slot (each of which holds parameters) strongly
    would make parameter -> hook -> owner -> parameter a cycle never freed: a dropped
    optimizer would keep its model, buffers and process groups alive. ``fn`` must take the
    owner as its argument, not capture it. The hook returns None whatever ``fn`` returns (a
    value from a forward pre-hook would replace the module's inputs).
    """
    ref = weakref.ref(owner)

    def hook(*args: P.args, **kwargs: P.kwargs) -> None:
        obj = ref()
        if obj is not None:
            fn(obj, *args, **kwargs)

    return hook
