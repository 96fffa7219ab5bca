"""Context parallelism: self-attention over a sequence split across the CP ranks.

Shape legend: b batch, n heads, s this rank's tokens, S the whole sequence, d head dim.

**Layout (zigzag).** The sequence is cut into ``2 * cp`` equal chunks and CP rank ``r``
holds chunks ``r`` and ``2 cp - 1 - r``, in that order (``scaling.topology.zigzag_indices``). Under a
causal mask every rank then has the same amount of work: an early chunk, which sees
little, paired with a late one, which sees much (Megatron-Core's load balancing).

**Ring attention** (:func:`ring_attention`). Key/value blocks travel round the CP ring
(:func:`scaling.collectives.ring_shift_async`, overlapped with the compute) while each
rank attends with its queries to the block it holds; the partial results are merged
with their log-sum-exp in fp32 (online softmax). The backward runs a second ring: the
blocks travel again, each with its key/value gradient, which arrives back at its owner
after the last step. Only this rank's queries, keys, values, output and log-sum-exp are
kept for the backward: activation memory is ``1 / cp`` of one rank's. Which query rows
and key columns of a block can interact is decided from the tokens' global positions
and documents, so fully masked blocks are skipped and, under the zigzag layout, a causal
block costs half a full one.

**All-to-all attention** (:func:`all_to_all_attention`, DeepSpeed-Ulysses). Two
all-to-alls trade heads for sequence: each rank attends over the whole sequence with
``n / cp`` heads (the fused kernel, any mask), then trades back. Needs the local heads
to divide by ``cp``; key/value heads fewer than that are repeated first.

Both take the mask as global token positions (causal) and, for packed documents, the
document of each token (:class:`TokenLayout`), so attention never crosses a document.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from scaling.collectives import gather_heads_scatter_sequence, ring_shift_async, scatter_heads_gather_sequence
from scaling.nn._attention_kernels import _causal, block_attention_backward, block_attention_forward
from scaling.topology import zigzag_indices

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scaling.collectives import AutogradContext

CONTEXT_PARALLEL_METHODS = ("ring", "all_to_all")


@dataclass(frozen=True)
class TokenLayout:
    """Where this rank's tokens sit in the whole sequence, for the attention mask.

    Attributes:
        seq_len: ``S``, tokens of the whole sequence.
        rank, size: this rank's place in the CP group and its size.
        causal: a token attends only to earlier positions.
        document_ids: ``[b, S]`` document of every token of the whole sequence (packed
            documents), or None (one document per row).
    """

    seq_len: int
    rank: int
    size: int
    causal: bool
    document_ids: torch.Tensor | None = None

    def positions(self, rank: int, device: torch.device) -> torch.Tensor:
        return zigzag_indices(self.seq_len, rank, self.size, device)

    def mask(self, q_rank: int, k_rank: int, device: torch.device) -> torch.Tensor | None:
        """``[b | 1, s, s]`` bool: which of ``q_rank``'s tokens may attend to which of ``k_rank``'s (None: all)."""
        pq, pk = self.positions(q_rank, device), self.positions(k_rank, device)
        mask = (pq.unsqueeze(-1) >= pk).unsqueeze(0) if self.causal else None
        if self.document_ids is not None:
            same = self.document_ids[:, pq].unsqueeze(-1) == self.document_ids[:, pk].unsqueeze(-2)
            mask = same if mask is None else mask & same
        return mask


# ------------------------------------------------------------------ heads


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand_heads`: sum over the repeated heads."""
    b, n, s, d = grad.shape
    return grad if n == heads else grad.view(b, heads, n // heads, s, d).sum(2)


# ------------------------------------------------------------------ ring attention


def _select(any_1d: torch.Tensor) -> slice | torch.Tensor:
    """The positions where ``any_1d`` holds, as a slice when they are contiguous."""
    idx = any_1d.nonzero().flatten()
    first, last = int(idx[0]), int(idx[-1])
    return slice(first, last + 1) if last - first + 1 == idx.numel() else idx


def _rows(x: torch.Tensor, sel: slice | torch.Tensor) -> torch.Tensor:
    """``x[:, :, sel]`` for ``[b, n, s, ...]`` tensors."""
    return x[:, :, sel] if isinstance(sel, slice) else x.index_select(2, sel)


@dataclass
class _Block:
    """The part of a (queries, key/value block) pair that interacts: rows, columns, mask."""

    rows: slice | torch.Tensor
    cols: slice | torch.Tensor
    mask: torch.Tensor | None  # [b | 1, 1, rows, cols] bool, None: all (or causal)
    causal: bool
    empty_rows: torch.Tensor | None  # [b | 1, 1, rows]: rows of some batch entry that see nothing


def _block(layout: TokenLayout, src: int, device: torch.device) -> _Block | None:
    """The part of this rank's queries and ``src``'s key/value block that interacts (None: nothing).

    Working it out reads the mask on the host (several device syncs each time on a GPU), so
    for a layout without documents, where it depends only on the sizes and ranks, it is
    worked out once per process and shared by every layer, micro-batch and step, forward and
    backward; with documents, once per batch's document ids (every layer of a micro-batch
    gets the same tensor, see ``document_ids_and_positions``) and shared by its layers,
    forward and backward. Only the latest document ids' blocks are kept.
    """
    ids = layout.document_ids
    if ids is None:
        return _block_without_documents(layout.seq_len, layout.rank, layout.size, layout.causal, src, device)
    if _DOCUMENT_BLOCKS.ids() is not ids:
        _DOCUMENT_BLOCKS.ids, _DOCUMENT_BLOCKS.blocks = weakref.ref(ids), {}
    key = (layout.seq_len, layout.rank, layout.size, layout.causal, src, device)
    if key not in _DOCUMENT_BLOCKS.blocks:
        with torch.inference_mode(False):
            _DOCUMENT_BLOCKS.blocks[key] = _find_block(layout, src, device)
    return _DOCUMENT_BLOCKS.blocks[key]


@dataclass
class _BlocksOf:
    """The blocks worked out for one batch's document ids (held weakly)."""

    ids: weakref.ref[torch.Tensor] | Callable[[], None]
    blocks: dict[tuple[int, int, int, bool, int, torch.device], _Block | None]


_DOCUMENT_BLOCKS = _BlocksOf(lambda: None, {})


@functools.lru_cache(maxsize=256)
def _block_without_documents(
    seq_len: int, rank: int, size: int, causal: bool, src: int, device: torch.device
) -> _Block | None:
    with torch.inference_mode(False):  # kept for later calls, which may record autograd
        return _find_block(TokenLayout(seq_len, rank, size, causal), src, device)


def _find_block(layout: TokenLayout, src: int, device: torch.device) -> _Block | None:
    full = layout.mask(layout.rank, src, device)
    if full is None:
        return _Block(slice(None), slice(None), None, False, None)
    rows_any, cols_any = full.any(-1).any(0), full.any(-2).any(0)
    if not bool(rows_any.any()):
        return None
    rows, cols = _select(rows_any), _select(cols_any)
    sub = full[:, rows] if isinstance(rows, slice) else full.index_select(1, rows)
    sub = sub[:, :, cols] if isinstance(cols, slice) else sub.index_select(2, cols)
    if bool(sub.all()):
        return _Block(rows, cols, None, False, None)
    sq, sk = sub.shape[-2:]
    if sq == sk and bool((sub == _causal(sq, sk, device)).all()):
        return _Block(rows, cols, None, True, None)
    empty = ~sub.any(-1)
    return _Block(rows, cols, sub.unsqueeze(1), False, empty.unsqueeze(1) if bool(empty.any()) else None)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: AutogradContext,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: TokenLayout,
        group: ProcessGroup | None,
        scale: float,
    ) -> torch.Tensor:
        b, n, s, d = q.shape
        out = torch.zeros(b, n, s, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, n, s), float("-inf"), dtype=torch.float32, device=q.device)
        buffers = [torch.stack((k, v)), torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)]
        for step in range(layout.size):
            kv = buffers[step % 2]
            shift = (
                ring_shift_async(kv, buffers[(step + 1) % 2], group)
                if group is not None and step < layout.size - 1
                else None
            )
            block = _block(layout, (layout.rank - step) % layout.size, q.device)
            if block is not None:
                kb, vb = (_expand_heads(_rows(t, block.cols), n) for t in kv)
                o_blk, l_blk = block_attention_forward(_rows(q, block.rows), kb, vb, block.mask, block.causal, scale)
                if block.empty_rows is not None:  # rows that see nothing hold no weight
                    l_blk = l_blk.masked_fill(block.empty_rows, float("-inf"))
                    o_blk = o_blk.masked_fill(block.empty_rows.unsqueeze(-1), 0.0)
                _merge(out, lse, block.rows, o_blk, l_blk)
            if shift is not None:
                shift.wait()
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.layout, ctx.group, ctx.scale = layout, group, scale
        return result

    @staticmethod
    def backward(ctx: AutogradContext, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        layout, group, scale = ctx.layout, ctx.group, ctx.scale
        n, n_kv = q.shape[1], k.shape[1]
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        buffers = [torch.stack((k, v)), torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)]
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        for step in range(layout.size):
            kv = buffers[step % 2]
            shift = (
                ring_shift_async(kv, buffers[(step + 1) % 2], group)
                if group is not None and step < layout.size - 1
                else None
            )
            block = _block(layout, (layout.rank - step) % layout.size, q.device)
            if block is not None:
                kb, vb = (_expand_heads(_rows(t, block.cols), n) for t in kv)
                g = _rows(grad_out, block.rows)
                if block.empty_rows is not None:
                    g = g.masked_fill(block.empty_rows.unsqueeze(-1), 0.0)
                dq_b, dk_b, dv_b = block_attention_backward(
                    g,
                    _rows(q, block.rows),
                    kb,
                    vb,
                    _rows(out, block.rows),
                    _rows(lse, block.rows),
                    block.mask,
                    block.causal,
                    scale,
                )
                _add_rows(dq, block.rows, dq_b)
                _add_rows(dkv[0], block.cols, _fold_heads(dk_b, n_kv))
                _add_rows(dkv[1], block.cols, _fold_heads(dv_b, n_kv))
            if shift is not None:
                shift.wait()
            # The block's gradient follows it round the ring; after the last step it is home.
            arrived = torch.empty_like(dkv)
            ring_shift_async(dkv, arrived, group).wait()
            dkv = arrived
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _merge(
    out: torch.Tensor, lse: torch.Tensor, rows: slice | torch.Tensor, o_blk: torch.Tensor, l_blk: torch.Tensor
) -> None:
    """Fold a block's ``(out, lse)`` into the running ones (fp32, in place) on ``rows``."""
    old_out, old_lse = _rows(out, rows), _rows(lse, rows)
    new_lse = torch.logaddexp(old_lse, l_blk)
    merged = old_out * torch.exp(old_lse - new_lse).unsqueeze(-1) + o_blk.float() * torch.exp(
        l_blk - new_lse
    ).unsqueeze(-1)
    if isinstance(rows, slice):
        out[:, :, rows] = merged
        lse[:, :, rows] = new_lse
    else:
        out.index_copy_(2, rows, merged)
        lse.index_copy_(2, rows, new_lse)


def _add_rows(acc: torch.Tensor, rows: slice | torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        acc[:, :, rows] += value
    else:
        acc.index_add_(2, rows, value.to(acc.dtype))


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TokenLayout,
    group: ProcessGroup | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys/values, by ring.

    Args:
        q: ``[b, n, s, d]`` this rank's queries (zigzag layout, RoPE applied).
        k, v: ``[b, n_kv, s, d]`` this rank's keys and values (``n_kv`` divides ``n``).
        layout: positions and documents of the tokens (:class:`TokenLayout`).
        group: the CP process group (``layout.size`` ranks).
        scale: softmax scale (default ``1 / sqrt(d)``).

    Returns:
        ``[b, n, s, d]``, this rank's rows of the one-process attention output.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, layout, group, scale)


# ------------------------------------------------------------------ all-to-all attention


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TokenLayout,
    group: ProcessGroup | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention by trading heads for sequence (DeepSpeed-Ulysses), same contract as :func:`ring_attention`.

    Args:
        scale: softmax scale (default ``1 / sqrt(d)``).

    Raises:
        ValueError: when the heads of ``q`` are not a multiple of the CP size.
    """
    cp, n = layout.size, q.shape[1]
    if n % cp:
        raise ValueError(
            f"all-to-all context parallelism: {n} query heads on this rank do not divide over "
            f"context_parallel_size={cp}; use context_parallel_method='ring' or a CP size dividing {n}"
        )
    n_kv = k.shape[1]
    kv_heads = n_kv * cp // math.gcd(n_kv, cp)  # the fewest key/value heads that split over cp
    k, v = _expand_heads(k, kv_heads), _expand_heads(v, kv_heads)
    order = torch.cat([layout.positions(r, q.device) for r in range(cp)])  # gathered slot -> position
    natural = torch.argsort(order)
    q, k, v = (scatter_heads_gather_sequence(t, group).index_select(2, natural) for t in (q, k, v))
    mask = None
    if layout.document_ids is not None:
        ids = layout.document_ids
        mask = (ids.unsqueeze(-1) == ids.unsqueeze(-2)).unsqueeze(1)
        if layout.causal:
            mask = mask & _causal(layout.seq_len, layout.seq_len, q.device)
    is_causal = layout.causal and mask is None
    gqa = k.shape[1] != q.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    return gather_heads_scatter_sequence(out.index_select(2, order), group)
