"""Activation checkpointing (non-reentrant) that reproduces dropout masks.

``torch.utils.checkpoint`` restores the default generators before recomputing; dropout
on TP-sharded activations draws from the RNG tracker's streams instead, so their states
are captured at the forward and put back for the recomputation (then advanced again, so
the stream continues as if nothing had been recomputed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from scaling.topology import RNGTracker

T = TypeVar("T")
#: The pair a ``context_fn`` returns: the context of the forward, then of the recomputation.
ContextPair = tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]


def tracker_checkpoint_context(rng_tracker: RNGTracker | None) -> Callable[[], ContextPair]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` that replays ``rng_tracker``'s streams."""
    if rng_tracker is None:
        return lambda: (contextlib.nullcontext(), contextlib.nullcontext())

    def context_fn() -> ContextPair:
        saved: dict[str, torch.Tensor] = {}

        @contextlib.contextmanager
        def forward_context() -> Iterator[None]:
            saved.update(rng_tracker.state_dict())
            yield

        @contextlib.contextmanager
        def recompute_context() -> Iterator[None]:
            current = rng_tracker.state_dict()
            rng_tracker.load_state_dict(saved)
            try:
                yield
            finally:
                rng_tracker.load_state_dict(current)

        return forward_context(), recompute_context()

    return context_fn


def checkpoint_layer(layer: Callable[..., T], *inputs: object, rng_tracker: RNGTracker | None = None) -> T:
    """Run ``layer(*inputs)`` keeping only its inputs; recompute the rest in the backward.

    Inputs and outputs may be LayerIO dataclasses. Dropout masks (default generator and
    ``rng_tracker`` streams) are the same in the recomputation, so losses and gradients
    equal those without checkpointing. Without grad mode it is a plain call.
    """
    if not torch.is_grad_enabled():
        return layer(*inputs)
    if torch.compiler.is_compiling():
        # Inside a compiled layer Dynamo traces checkpoint with the default context only; the
        # compiled graph draws its own dropout masks (see scaling.nn.compile_layer).
        return checkpoint(layer, *inputs, use_reentrant=False)
    return checkpoint(layer, *inputs, use_reentrant=False, context_fn=tracker_checkpoint_context(rng_tracker))


def checkpoint_sequential_layers(layers: Sequence[Callable[[T], T]], x: T, rng_tracker: RNGTracker | None = None) -> T:
    """Run ``layers`` one after another inside one checkpoint (a whole pipeline stage):
    only the stage input is kept."""

    def run(inp: T) -> T:
        for layer in layers:
            inp = layer(inp)
        return inp

    return checkpoint_layer(run, x, rng_tracker=rng_tracker)
