"""Vocab-parallel embedding and cross-entropy that never gathers the full logits.

A vocabulary of ``V`` rows is padded to ``ceil(V / tp) * tp`` and split into equal
contiguous row blocks (rank ``r`` owns ids ``[r * V_p / tp, (r + 1) * V_p / tp)``); the
padding rows sit at the end of the last ranks, which is ``torch.chunk`` (and DTensor
``Shard(0)``) placement of the ``V`` real rows. Padding rows are zero, never looked up,
and masked out of the loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaling.collectives import (
    all_reduce,
    group_rank,
    group_size,
    reduce_from_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from scaling.nn._init import InitMethod, check_dtype, sharded_parameter, tp_info

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scaling.topology import Axis, Topology


def vocab_range(vocab_size: int, model_parallel_size: int, model_parallel_rank: int) -> tuple[int, int]:
    """The ``[start, end)`` vocabulary ids owned by ``model_parallel_rank`` (end may exceed ``vocab_size``: padding)."""
    per_rank = -(-vocab_size // model_parallel_size)
    start = model_parallel_rank * per_rank
    return start, start + per_rank


def vocab_parallel_embedding(
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    vocab_start: int,
    vocab_end: int,
    group: ProcessGroup | None,
    *,
    sequence_parallel: bool = False,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """Look ``input_ids`` up in this rank's vocabulary rows ``[vocab_start, vocab_end)`` and sum over TP.

    Ids outside the range look up zeros; the partial results are all-reduced (reduce-scattered
    along dim 1 with ``sequence_parallel``). The one implementation, used by
    :class:`VocabParallelEmbedding` and the auto API's wrapper of ``nn.Embedding``.

    Args:
        input_ids: integer ids ``[b, s]``.
        weight: this rank's ``[vocab_end - vocab_start, D]`` rows.
        group: the TP process group (None: one rank, a plain lookup).
        padding_idx: the local row whose gradient stays zero (``F.embedding``'s), or None.
    """
    if group is None:
        return F.embedding(input_ids, weight, padding_idx)
    outside = (input_ids < vocab_start) | (input_ids >= vocab_end)
    local_ids = (input_ids - vocab_start).masked_fill(outside, 0)
    out = F.embedding(local_ids, weight, padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(out, group)
    return reduce_from_model_parallel_region(out, group)


class VocabParallelEmbedding(torch.nn.Module):
    """``torch.nn.Embedding`` with the vocabulary split over TP ranks.

    Args:
        num_embeddings: vocabulary size ``V`` (any size; padded to a multiple of the TP size).
        embedding_dim: embedding size.
        topology: a :class:`scaling.topology.Topology`; ``None`` means one device on CPU.
        dtype: parameter dtype.
        init_method: fills the full ``[V, D]`` weight in place (default: ``torch.nn.Embedding``'s N(0, 1)).
        sequence_parallel: return the output split along dim 1 (reduce-scatter instead of all-reduce).

    The local weight has ``ceil(V / tp)`` rows; its meta's ``logical_shape`` is ``(V, D)``.

    ``tp`` and ``device`` (keyword-only): the tensor-parallel axis and the parameters' device,
    instead of ``topology`` (see :class:`ColumnParallelLinear`).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        topology: Topology | None = None,
        dtype: torch.dtype = torch.float32,
        init_method: InitMethod | None = None,
        sequence_parallel: bool = False,
        *,
        tp: Axis | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings={num_embeddings} and embedding_dim={embedding_dim} "
                "must both be >= 1"
            )
        check_dtype(dtype, "VocabParallelEmbedding")
        self._tp = tp_info(topology, tp, device, "VocabParallelEmbedding")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sequence_parallel = sequence_parallel
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, self._tp.size, self._tp.rank)
        padded = (self.vocab_end - self.vocab_start) * self._tp.size
        self.weight = sharded_parameter(
            (num_embeddings, embedding_dim),
            init_method or torch.nn.init.normal_,
            self._tp,
            0,
            dtype,
            "weight",
            padded_size=padded,
        )

    @property
    def model_parallel_group(self) -> ProcessGroup | None:
        """The TP process group (None without TP)."""
        return self._tp.group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``: integer ids in ``[0, V)`` of shape ``[b, s]`` -> ``[b, s, D]``
        (``[b, s/tp, D]`` under sequence parallelism)."""
        return vocab_parallel_embedding(
            input_ids,
            self.weight,
            self.vocab_start,
            self.vocab_end,
            self._tp.group,
            sequence_parallel=self.sequence_parallel,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, model_parallel_size={self._tp.size}, "
            f"local_ids=[{self.vocab_start}, {self.vocab_end})"
        )


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    group: ProcessGroup | None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    loss_weights: torch.Tensor | None = None,
    vocab_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy over logits split along the vocabulary (last) dim, without gathering them.

    Equals ``F.cross_entropy(full_logits.flatten(0, -2), targets.flatten(), ignore_index=...,
    label_smoothing=...)`` of the gathered logits. Only ``[..., 1]``-sized statistics
    (max, sum of exponentials, target logit) cross ranks. With one rank (``group`` is
    ``None`` or has size 1) it is torch's fused ``F.cross_entropy`` on the real columns.

    Args:
        logits_shard: ``[..., V_p / tp]`` logits of this rank's vocabulary block (rank ``r``
            owns ids ``vocab_range(V, tp, r)``).
        targets: ``[...]`` integer ids; ``ignore_index`` entries do not count.
        group: the TP process group (``None``: the logits are complete).
        ignore_index: target value that is skipped.
        label_smoothing: in ``[0, 1)``, as in ``torch.nn.functional.cross_entropy``.
        loss_weights: optional ``[...]`` per-token weights; the mean becomes
            ``sum(w * loss) / sum(w)`` over non-ignored tokens.
        vocab_size: the real vocabulary size ``V`` when the columns are padded; padding
            columns are masked out (default: no padding).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-token losses, 0 where ignored).

    Raises:
        ValueError: for an unknown ``reduction`` or ``label_smoothing`` outside ``[0, 1)``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r}; choose 'mean', 'sum' or 'none'")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing} must be in [0, 1)")
    # Read eagerly (not folded into a compiled graph with a guard on the group's type only).
    size = group_size(group) if group is not None else 1
    if size == 1:
        return _cross_entropy_one_rank(
            logits_shard, targets, ignore_index, label_smoothing, loss_weights, vocab_size, reduction
        )
    rank = group_rank(group)
    local_vocab = logits_shard.shape[-1]
    start = rank * local_vocab
    real_vocab = vocab_size if vocab_size is not None else local_vocab * size
    logits = logits_shard.float()
    # Decided on Python ints, so no device sync: only the last ranks hold padding columns.
    padding = torch.arange(start, start + local_vocab, device=logits.device) >= real_vocab
    if start + local_vocab > real_vocab:
        logits = logits.masked_fill(padding, float("-inf"))

    # The max only stabilises exp(); it carries no gradient, so a plain all-reduce suffices.
    logits_max = logits.detach().amax(dim=-1, keepdim=True)
    all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
    shifted = logits - logits_max

    outside = (targets < start) | (targets >= start + local_vocab)
    local_targets = (targets - start).masked_fill(outside, 0).unsqueeze(-1)
    target_logit = shifted.gather(-1, local_targets).squeeze(-1).masked_fill(outside, 0.0)
    sum_exp = shifted.exp().sum(dim=-1)
    # Forward all-reduce, identity backward: each rank differentiates its own block.
    target_logit = reduce_from_model_parallel_region(target_logit, group)
    sum_exp = reduce_from_model_parallel_region(sum_exp, group)
    log_z = torch.log(sum_exp)
    loss = log_z - target_logit
    if label_smoothing > 0.0:
        sum_shifted = reduce_from_model_parallel_region(shifted.masked_fill(padding, 0.0).sum(dim=-1), group)
        smooth = log_z - sum_shifted / real_vocab
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth

    return _weighted(loss, targets, ignore_index, loss_weights, reduction)


def _weighted(
    loss: torch.Tensor, targets: torch.Tensor, ignore_index: int, loss_weights: torch.Tensor | None, reduction: str
) -> torch.Tensor:
    """Per-token ``loss`` with ignored targets zeroed, times ``loss_weights``, then reduced."""
    keep = (targets != ignore_index).to(loss.dtype)
    weights = keep if loss_weights is None else keep * loss_weights.to(loss.dtype)
    loss = loss * weights
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / weights.sum()


def _cross_entropy_one_rank(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    loss_weights: torch.Tensor | None,
    vocab_size: int | None,
    reduction: str,
) -> torch.Tensor:
    """The whole vocabulary on one rank: torch's fused log-softmax + NLL, same math and reductions.

    The split path's max/exp/gather/sum chain makes several full passes over ``[tokens, V]``
    in the forward and backward; the fused kernel makes one each way.
    """
    logits = logits.float()
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = logits[..., :vocab_size]  # padding columns take no part in the softmax
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if loss_weights is None and reduction != "none":
        return F.cross_entropy(
            flat_logits, flat_targets, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction
        )
    loss = F.cross_entropy(
        flat_logits, flat_targets, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"
    ).view(targets.shape)
    return _weighted(loss, targets, ignore_index, loss_weights, reduction)
