"""Context parallelism for an unmodified ``transformers`` causal LM (the high-level API).

Each CP rank keeps its zigzag slice of every sequence (``scaling.topology.split_sequence``).
The model's attention is replaced through transformers' ``AttentionInterface`` by
Scaling's ring or all-to-all attention; the model gets the tokens' global positions as
``position_ids`` and the targets already shifted over the whole sequence as
``shift_labels`` (shifting a slice would pair tokens across the cut), with
``num_items_in_batch`` set so that the mean over the CP ranks of their losses is the
one-process loss. Every other layer is token-wise and runs on the slice unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F

from scaling.nn import TokenLayout, all_to_all_attention, ring_attention
from scaling.topology import Topology, split_sequence, zigzag_indices

ATTENTION_NAME = "scaling_context_parallel"
_ACTIVE: contextvars.ContextVar[tuple[Topology, str, int] | None] = contextvars.ContextVar(
    "scaling_context_parallel", default=None
)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``[b, n, s, d]`` in, ``[b, s, n, d]`` out."""
    active = _ACTIVE.get()
    if active is None:
        raise RuntimeError(
            f"{ATTENTION_NAME} attention ran outside a context-parallel ParallelModel call; call the model "
            "returned by scaling.trainer.auto.parallelize"
        )
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} with context parallelism: the split attention cannot reproduce the "
            "dropout masks in its backward; set the model's attention dropout to 0"
        )
    topology, method, seq_len = active
    layout = TokenLayout(
        seq_len,
        topology.axis("cp").rank,
        topology.axis("cp").size,
        bool(getattr(module, "is_causal", True)),
    )
    group = topology.axis("cp").group
    if method == "ring":
        out = ring_attention(query, key, value, layout, group, scaling)
    else:
        out = all_to_all_attention(query, key, value, layout, group, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def enable(model: torch.nn.Module) -> None:
    """Route ``model``'s attention through :func:`_attention` (transformers' AttentionInterface)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    model.set_attn_implementation(ATTENTION_NAME)  # type: ignore[operator]


@contextlib.contextmanager
def sliced(batch: object, topology: Topology, method: str) -> Iterator[dict[str, object]]:
    """The model's keyword arguments for this CP rank's slice of ``batch``, with the attention active.

    Raises:
        ValueError: a batch that is not a mapping with ``input_ids`` and ``labels``, one with
            an ``attention_mask`` that masks something, or a sequence not divisible by ``2 * cp``.
    """
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "labels" not in batch:
        raise ValueError(
            "context parallelism in the high-level API needs mapping batches with 'input_ids' and 'labels' "
            f"(a causal LM's); got {type(batch).__name__}"
        )
    mask = batch.get("attention_mask")
    if mask is not None and not bool(torch.all(mask != 0)):
        raise ValueError(
            "context parallelism in the high-level API takes no padding: the batch's attention_mask masks "
            "tokens; pack the sequences to full length (or drop attention_mask)"
        )
    rank, cp = topology.axis("cp").rank, topology.axis("cp").size
    ids, labels = batch["input_ids"], batch["labels"]
    seq_len = ids.shape[1]
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)  # transformers' own shift, on the whole sequence
    kwargs = {k: v for k, v in batch.items() if k != "attention_mask"}
    kwargs.update(
        input_ids=split_sequence(ids, 1, rank, cp),
        labels=split_sequence(labels, 1, rank, cp),
        shift_labels=split_sequence(shifted, 1, rank, cp),
        position_ids=zigzag_indices(seq_len, rank, cp, ids.device).expand(ids.shape[0], -1),
        # The loss sums this rank's tokens and divides by the mean count per CP rank.
        num_items_in_batch=(shifted != -100).sum() / cp,
    )
    token = _ACTIVE.set((topology, method, seq_len))
    try:
        yield kwargs
    finally:
        _ACTIVE.reset(token)
