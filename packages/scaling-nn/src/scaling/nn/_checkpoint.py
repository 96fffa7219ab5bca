"""Activation checkpointing (non-reentrant) that reproduces dropout masks.

``torch.utils.checkpoint`` restores the default generators before recomputing; dropout
on TP-sharded activations draws from the RNG tracker's streams instead, so their states
are captured at the forward and put back for the recomputation (then advanced again, so
the stream continues as if nothing had been recomputed).

Per-operator checkpointing (``save=``): the outputs of the named operators are kept and only the
rest is recomputed (torch's selective checkpointing, ``create_selective_checkpoint_contexts``; what
torchtitan's ``selective`` ``op`` policy does): keeping the matrix products' and attention's outputs
(``MATMUL_AND_ATTENTION``) recomputes only the cheap element-wise work.
"""

from __future__ import annotations

import contextlib
import functools
import typing
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

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


#: The operators whose outputs per-operator checkpointing keeps by default: the matrix products and
#: the attention kernels (what costs compute to redo); everything element-wise is recomputed.
MATMUL_AND_ATTENTION: frozenset[object] = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
)


def _keep(save: Collection[object], ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def _keeping(save: Collection[object]) -> Callable[[], ContextPair]:
    """torch's selective ``context_fn`` keeping ``save``'s outputs."""
    # create_selective_checkpoint_contexts returns torch's two dispatch modes, context managers both.
    return typing.cast(
        "Callable[[], ContextPair]",
        functools.partial(create_selective_checkpoint_contexts, functools.partial(_keep, save)),
    )


def _selective_context(save: Collection[object], rng_tracker: RNGTracker | None) -> Callable[[], ContextPair]:
    """A ``context_fn`` keeping ``save``'s outputs and replaying ``rng_tracker``'s streams."""
    tracker, selective = tracker_checkpoint_context(rng_tracker), _keeping(save)

    def context_fn() -> ContextPair:
        forward, recompute = selective()
        tracker_forward, tracker_recompute = tracker()
        # The tracker's own operators (saving and restoring generator states) stay outside the
        # selective mode, which counts the region's operators and must see the same ones twice.
        return _both(tracker_forward, forward), _both(tracker_recompute, recompute)

    return context_fn


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager[object], second: contextlib.AbstractContextManager[object]
) -> Iterator[None]:
    with first, second:
        yield


def checkpoint_layer(
    layer: Callable[..., T],
    *inputs: object,
    rng_tracker: RNGTracker | None = None,
    save: Collection[object] | None = None,
) -> T:
    """Run ``layer(*inputs)`` keeping only its inputs; recompute the rest in the backward.

    Inputs and outputs may be LayerIO dataclasses. Dropout masks (default generator and
    ``rng_tracker`` streams) are the same in the recomputation, so losses and gradients
    equal those without checkpointing. Without grad mode it is a plain call. ``save``: operators
    (``torch.ops.aten`` overloads, e.g. ``MATMUL_AND_ATTENTION``) whose outputs are kept too, so
    the recomputation skips them.
    """
    if not torch.is_grad_enabled():
        return layer(*inputs)
    if torch.compiler.is_compiling():
        # Inside a compiled layer Dynamo traces checkpoint with the default context only; the
        # compiled graph draws its own dropout masks (see scaling.nn.compile_layer).
        if save is None:
            return checkpoint(layer, *inputs, use_reentrant=False)
        return checkpoint(layer, *inputs, use_reentrant=False, context_fn=_keeping(save))
    context_fn = tracker_checkpoint_context(rng_tracker) if save is None else _selective_context(save, rng_tracker)
    return checkpoint(layer, *inputs, use_reentrant=False, context_fn=context_fn)


def checkpoint_sequential_layers(layers: Sequence[Callable[[T], T]], x: T, rng_tracker: RNGTracker | None = None) -> T:
    """Run ``layers`` one after another inside one checkpoint (a whole pipeline stage):
    only the stage input is kept."""

    def run(inp: T) -> T:
        for layer in layers:
            inp = layer(inp)
        return inp

    return checkpoint_layer(run, x, rng_tracker=rng_tracker)
