"""Tensor-parallel self-attention: MHA, GQA and MQA on ``F.scaled_dot_product_attention``.

Shape legend: b batch, s sequence, h hidden, n heads, d head dim.

Heads are split over TP ranks. Key/value heads are split too when the TP size divides
their number; when it does not (fewer kv heads than ranks, TP a multiple of them), every
rank keeps the full, replicated key/value weights and uses the one kv head its query
heads belong to; those weights enter the TP region through
``copy_to_model_parallel_region`` so their gradient is summed over the ranks in the
backward and stays replicated.

Context parallelism (a ``cp`` axis of more than one rank): the input holds this rank's
zigzag slice of each sequence (see ``scaling.nn._context_parallel``) and attention runs
over the whole sequence by ring or by all-to-all (``context_parallel_method``); RoPE
positions and document masks are those of the tokens' places in the whole sequence.

Packed documents (``cu_seqlens``): attention stays within each document. On CUDA in fp16/bf16
(compute capability 8.0 and up, head size a multiple of 8 up to 256, no attention dropout)
flash attention's variable-length kernel computes it (:func:`packed_flash_attention`), as
flash-attention's varlen API and Megatron's packed (THD) format do; elsewhere
``F.scaled_dot_product_attention`` with the document mask.

Fused QKV weight layout (rows of ``qkv.weight``), per kv head ``g``: the ``n_q / n_kv``
query heads of group ``g``, then key ``g``, then value ``g``. Contiguous TP slices of
that layout hold whole groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from scaling.collectives import copy_to_model_parallel_region, gather_from_sequence_parallel_region
from scaling.nn._attention_kernels import packed_flash_attention, packed_flash_available
from scaling.nn._checkpoint import tracker_checkpoint_context
from scaling.nn._context_parallel import (
    CONTEXT_PARALLEL_METHODS,
    TokenLayout,
    all_to_all_attention,
    ring_attention,
)
from scaling.nn._init import (
    InitMethod,
    TPInfo,
    axis_from,
    check_dtype,
    default_bias_init,
    default_weight_init,
    sharded_parameter,
    tp_info,
)
from scaling.nn._linear import ColumnParallelLinear, RowParallelLinear
from scaling.nn._rotary import (
    KVCache,
    RopeScaling,
    RotaryEmbedding,
    document_ids_and_positions,
    packed_attention_mask,
)
from scaling.topology import zigzag_indices

if TYPE_CHECKING:
    from scaling.topology import Axis, RNGTracker, Topology


def valid_model_parallel_sizes(num_attention_heads: int, num_kv_heads: int, fused_qkv: bool) -> list[int]:
    """TP sizes that can shard these heads (kv heads split, or replicated when fewer than ranks)."""
    return [
        t
        for t in range(1, num_attention_heads + 1)
        if num_attention_heads % t == 0 and (num_kv_heads % t == 0 or (not fused_qkv and t % num_kv_heads == 0))
    ]


class _ReplicatedLinear(torch.nn.Module):
    """Key or value projection kept whole on every rank; this rank uses rows ``[start, end)``."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPInfo, dtype: torch.dtype, init: InitMethod
    ) -> None:
        super().__init__()
        self._tp = tp
        self.weight = sharded_parameter((out_features, in_features), init, tp, None, dtype, "weight")
        self.bias = (
            sharded_parameter((out_features,), default_bias_init(in_features), tp, None, dtype, "bias")
            if bias
            else None
        )
        self.rows = (0, out_features)

    def forward(self, x_full: torch.Tensor) -> torch.Tensor:
        # Identity forward, all-reduce backward: sums the per-rank partial weight gradients.
        group = self._tp.group
        weight = copy_to_model_parallel_region(self.weight, group)[self.rows[0] : self.rows[1]]
        bias = (
            None if self.bias is None else copy_to_model_parallel_region(self.bias, group)[self.rows[0] : self.rows[1]]
        )
        return F.linear(x_full, weight, bias)


@dataclass(frozen=True)
class AttentionConfig:
    """What a :class:`ParallelSelfAttention` computes, apart from the axes it runs over.

    Attributes:
        hidden_size: model width ``h``.
        num_attention_heads: query heads.
        num_kv_heads: key/value heads (default: ``num_attention_heads``; 1 is MQA).
        head_dim: channels per head (default ``hidden_size // num_attention_heads``).
        bias: biases on the QKV and output projections.
        qkv_bias: biases on the QKV projection (Qwen2's layout: no output bias); None: ``bias``.
        dtype: parameter dtype.
        fused_qkv: one ``qkv`` projection (layout in the module docstring) instead of
            ``query``, ``key``, ``value``.
        causal: causal (decoder) or bidirectional attention.
        rotary_percentage: fraction of each head rotated by RoPE; 0 disables RoPE.
        rotary_base: RoPE frequency base.
        rotary_interleaved: interleaved instead of half-split RoPE channel pairs.
        rotary_scaling: RoPE frequency scaling for long contexts (:class:`RopeScaling`).
        qk_norm: RMS-normalise queries and keys per head (weights ``q_norm``, ``k_norm``).
        qk_norm_eps: epsilon of those norms.
        attention_dropout: dropout on the attention probabilities (training only).
        sequence_parallel: input and output split along dim 1 over TP.
        checkpoint_core_attention: recompute softmax(QK^T)V in the backward (selective
            activation checkpointing); dropout masks are reproduced.
        init_method, output_init_method: weight initialisers (default ``torch.nn.Linear``'s).
        context_parallel_method: with a CP axis of more than one rank: ``"ring"``
            (key/value blocks round the CP ring) or ``"all_to_all"`` (heads traded for
            sequence; the heads on a TP rank must divide by the CP size).

    Example::

        AttentionConfig(hidden_size=512, num_attention_heads=8, num_kv_heads=2, qk_norm=True)
    """

    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    bias: bool = True
    qkv_bias: bool | None = None
    dtype: torch.dtype = torch.float32
    fused_qkv: bool = True
    causal: bool = True
    rotary_percentage: float = 1.0
    rotary_base: float = 10000.0
    rotary_interleaved: bool = False
    rotary_scaling: RopeScaling | None = None
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    attention_dropout: float = 0.0
    sequence_parallel: bool = False
    checkpoint_core_attention: bool = False
    init_method: InitMethod | None = None
    output_init_method: InitMethod | None = None
    context_parallel_method: str = "ring"


class ParallelSelfAttention(torch.nn.Module):
    """Multi-head / grouped-query / multi-query self-attention, tensor-parallel over heads.

    Args:
        config: what it computes (:class:`AttentionConfig`).
        tp: the tensor-parallel axis (``topology.axis("tp")``) its heads are split over;
            None: one rank.
        cp: the context-parallel axis (``topology.axis("cp")``) its sequence is split
            over; None: one rank.
        device: where its parameters live (default: CPU without ``tp``, torch's default
            device with it).
        rng_tracker: a :class:`scaling.topology.RNGTracker`; dropout draws from its
            ``"model-parallel-rng"`` stream (each TP rank holds different heads).
        topology: instead of ``tp``, ``cp`` and ``device``: a
            :class:`scaling.topology.Topology` they are taken from at once.

    Raises:
        ValueError: when heads, kv heads or ``hidden_size`` do not fit the TP size (the
            message lists the valid TP sizes), context parallelism cannot split this
            attention (all-to-all heads, attention dropout), or ``topology`` comes with an axis.

    Example::

        attention = ParallelSelfAttention(AttentionConfig(512, 8, num_kv_heads=2), tp=topology.axis("tp"))
    """

    def __init__(
        self,
        config: AttentionConfig,
        *,
        tp: Axis | None = None,
        cp: Axis | None = None,
        device: torch.device | str | None = None,
        rng_tracker: RNGTracker | None = None,
        topology: Topology | None = None,
    ) -> None:
        super().__init__()
        c = self.config = config
        check_dtype(c.dtype, "ParallelSelfAttention")
        tp_ = self._tp = tp_info(topology, tp, device, "ParallelSelfAttention")
        tp_axis = topology.axis("tp") if topology is not None else tp
        cp_axis = axis_from(topology, "cp", cp, "ParallelSelfAttention")
        hidden_size = c.hidden_size
        nq, nkv = c.num_attention_heads, c.num_kv_heads or c.num_attention_heads
        if c.head_dim is None and hidden_size % nq != 0:
            raise ValueError(
                f"ParallelSelfAttention: num_attention_heads={nq} does not divide hidden_size={hidden_size}; "
                "pass head_dim or choose a head count dividing hidden_size"
            )
        if nq % nkv != 0:
            raise ValueError(
                f"ParallelSelfAttention: num_kv_heads={nkv} does not divide num_attention_heads={nq}; "
                f"choose num_kv_heads in {[k for k in range(1, nq + 1) if nq % k == 0]}"
            )
        valid = valid_model_parallel_sizes(nq, nkv, c.fused_qkv)
        if tp_.size not in valid:
            raise ValueError(
                f"ParallelSelfAttention: model_parallel_size={tp_.size} cannot shard num_attention_heads={nq}, "
                f"num_kv_heads={nkv} (fused_qkv={c.fused_qkv}); choose model_parallel_size in {valid}"
                + (
                    " or fused_qkv=False"
                    if c.fused_qkv and tp_.size in valid_model_parallel_sizes(nq, nkv, False)
                    else ""
                )
            )
        if c.attention_dropout > 0.0 and tp_.size > 1 and rng_tracker is None:
            raise ValueError(
                f"ParallelSelfAttention: attention_dropout={c.attention_dropout} with model_parallel_size={tp_.size} "
                "needs rng_tracker (scaling.topology.seed_all(...)) so each TP rank draws its own heads' masks"
            )
        cp_size = cp_axis.size if cp_axis is not None else 1
        check_context_parallel(nq // tp_.size, cp_size, c.context_parallel_method, c.attention_dropout)
        self._cp_group = cp_axis.group if cp_axis is not None and cp_size > 1 else None
        self._cp_rank: int = cp_axis.rank if cp_axis is not None and cp_size > 1 else 0
        self._cp_size: int = cp_size
        self.context_parallel_method = c.context_parallel_method
        self.hidden_size, self.num_attention_heads, self.num_kv_heads = hidden_size, nq, nkv
        d = self.head_dim = c.head_dim or hidden_size // nq
        self.num_local_heads = nq // tp_.size
        self.kv_replicated = nkv % tp_.size != 0
        self.num_local_kv_heads = 1 if self.kv_replicated else nkv // tp_.size
        self.fused_qkv, self.causal, self.sequence_parallel = c.fused_qkv, c.causal, c.sequence_parallel
        self.attention_dropout, self.rng_tracker = c.attention_dropout, rng_tracker
        self.checkpoint_core_attention = c.checkpoint_core_attention
        init = c.init_method or default_weight_init
        qkv_bias = c.bias if c.qkv_bias is None else c.qkv_bias
        column = partial(
            ColumnParallelLinear,
            bias=qkv_bias,
            dtype=c.dtype,
            init_method=init,
            sequence_parallel=c.sequence_parallel,
            tp=tp_axis,
            device=tp_.device,
        )
        if c.fused_qkv:
            self.qkv = column(hidden_size, (nq + 2 * nkv) * d)
        else:
            self.query = column(hidden_size, nq * d)
            if self.kv_replicated:
                key = _ReplicatedLinear(hidden_size, nkv * d, qkv_bias, tp_, c.dtype, init)
                value = _ReplicatedLinear(hidden_size, nkv * d, qkv_bias, tp_, c.dtype, init)
                group_index = tp_.rank * nkv // tp_.size
                for proj in (key, value):
                    proj.rows = (group_index * d, (group_index + 1) * d)
                self.key: torch.nn.Module = key
                self.value: torch.nn.Module = value
            else:
                self.key = column(hidden_size, nkv * d)
                self.value = column(hidden_size, nkv * d)
        self.rotary = (
            RotaryEmbedding(d, c.rotary_percentage, c.rotary_base, c.rotary_interleaved, c.rotary_scaling)
            if c.rotary_percentage > 0
            else None
        )
        if c.qk_norm:
            self.q_norm = sharded_parameter((d,), torch.nn.init.ones_, tp_, None, c.dtype, "q_norm")
            self.k_norm = sharded_parameter((d,), torch.nn.init.ones_, tp_, None, c.dtype, "k_norm")
        self.qk_norm, self.qk_norm_eps = c.qk_norm, c.qk_norm_eps
        self.dense = RowParallelLinear(
            nq * d,
            hidden_size,
            bias=c.bias,
            dtype=c.dtype,
            init_method=c.output_init_method or init,
            sequence_parallel=c.sequence_parallel,
            tp=tp_axis,
            device=tp_.device,
        )

    def _project(self, x_bsh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = x_bsh.shape[0]
        d, nq, nkv = self.head_dim, self.num_local_heads, self.num_local_kv_heads
        if self.fused_qkv:
            qkv = self.qkv(x_bsh)
            s = qkv.shape[1]
            groups = qkv.view(b, s, nkv, nq // nkv + 2, d)
            return groups[:, :, :, :-2].reshape(b, s, nq, d), groups[:, :, :, -2], groups[:, :, :, -1]
        q = self.query(x_bsh)
        if self.kv_replicated:
            group = self._tp.group
            x_full = (
                gather_from_sequence_parallel_region(x_bsh, group)
                if self.sequence_parallel
                else copy_to_model_parallel_region(x_bsh, group)
            )
            k, v = self.key(x_full), self.value(x_full)
        else:
            k, v = self.key(x_bsh), self.value(x_bsh)
        s = q.shape[1]
        return q.view(b, s, nq, d), k.view(b, s, nkv, d), v.view(b, s, nkv, d)

    def _core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if packed is not None:  # cu_seqlens for the variable-length kernel (see packed_flash_available)
            return packed_flash_attention(q, k, v, packed, self.causal)
        p = self.attention_dropout if self.training else 0.0
        fork = self.rng_tracker.fork() if (p > 0.0 and self.rng_tracker is not None) else contextlib.nullcontext()
        with fork:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
            )

    def forward(
        self,
        x_bsh: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Attend over ``x_bsh`` (``[b, s, h]``; ``[b, s/tp, h]`` under sequence parallelism).

        Args:
            cu_seqlens: packed sequences: cumulative document lengths over the flattened
                ``b * s`` tokens; attention stays within a document and positions restart.
            position_ids: ``[b, s]`` or ``[s]`` RoPE positions (default ``0..s-1``).
            kv_cache: generation: keys/values of earlier tokens are read from it and the
                new ones appended; positions continue from its length.

        Raises:
            ValueError: for ``cu_seqlens`` together with a KV cache, a KV cache on a
                bidirectional layer, or malformed ``cu_seqlens``.
        """
        if kv_cache is not None and not self.causal:
            raise ValueError(
                "ParallelSelfAttention: kv_cache needs causal=True (a bidirectional layer lets earlier tokens "
                "attend to later ones, so cached keys would go stale)"
            )
        q, k, v = self._project(x_bsh)
        b, s = q.shape[0], q.shape[1]
        if self.qk_norm:
            group = self._tp.group
            eps = self.qk_norm_eps
            q = F.rms_norm(q, (self.head_dim,), copy_to_model_parallel_region(self.q_norm, group), eps)
            k = F.rms_norm(k, (self.head_dim,), copy_to_model_parallel_region(self.k_norm, group), eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, n, s, d]
        if self._cp_size > 1:
            if kv_cache is not None:
                raise ValueError(
                    "ParallelSelfAttention: kv_cache (generation) with context_parallel_size > 1 is not supported; "
                    "generate with a topology whose context_parallel_size is 1"
                )
            out = self._context_parallel(q, k, v, cu_seqlens, position_ids)
            return self.dense(out.transpose(1, 2).reshape(b, s, self.num_local_heads * self.head_dim))
        mask: torch.Tensor | None = None
        packed: torch.Tensor | None = None
        is_causal = self.causal
        offset = kv_cache.seq_len if kv_cache is not None else 0
        if cu_seqlens is not None:
            if kv_cache is not None:
                raise ValueError("ParallelSelfAttention: cu_seqlens (packed sequences) cannot be used with kv_cache")
            doc_ids, positions = document_ids_and_positions(cu_seqlens, b, s)
            if packed_flash_available(q, self.attention_dropout if self.training else 0.0):
                packed = cu_seqlens
            else:
                mask, is_causal = packed_attention_mask(doc_ids, self.causal), False
        else:
            positions = position_ids if position_ids is not None else torch.arange(offset, offset + s, device=q.device)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
            if self.causal and offset > 0:
                total = k.shape[2]
                rows = torch.arange(offset, offset + s, device=q.device).unsqueeze(-1)
                mask, is_causal = rows >= torch.arange(total, device=q.device), False
        out = self._maybe_checkpointed(self._core, q, k, v, mask, is_causal, packed)
        return self.dense(out.transpose(1, 2).reshape(b, s, self.num_local_heads * self.head_dim))

    def _maybe_checkpointed(self, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        """``fn(*args)``, recomputed in the backward under ``checkpoint_core_attention``."""
        if self.checkpoint_core_attention and torch.is_grad_enabled():
            context_fn = tracker_checkpoint_context(self.rng_tracker)
            return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
        return fn(*args)

    def _context_parallel(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention over the whole sequence, of which ``q``/``k``/``v`` hold this CP rank's zigzag slice."""
        b, s = q.shape[0], q.shape[2]
        rank, size = self._cp_rank, self._cp_size
        seq_len = s * size
        mine = zigzag_indices(seq_len, rank, size, q.device)
        doc_ids = None
        if cu_seqlens is not None:  # packed documents: cu_seqlens cover the whole sequences
            doc_ids, positions = document_ids_and_positions(cu_seqlens, b, seq_len)
            positions = positions[:, mine]
        else:
            positions = position_ids if position_ids is not None else mine
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        layout = TokenLayout(seq_len, rank, size, self.causal, doc_ids)
        if self.context_parallel_method == "ring":
            return self._maybe_checkpointed(ring_attention, q, k, v, layout, self._cp_group)
        return self._maybe_checkpointed(all_to_all_attention, q, k, v, layout, self._cp_group)


def check_context_parallel(local_heads: int, context_parallel_size: int, method: str, attention_dropout: float) -> None:
    """Refuse a context-parallel split this attention cannot run (before any process group starts).

    Args:
        local_heads: query heads on one TP rank (``num_attention_heads / model_parallel_size``).

    Raises:
        ValueError: an unknown method; all-to-all with ``local_heads`` not divisible by
            the CP size; attention dropout with context parallelism.
    """
    if method not in CONTEXT_PARALLEL_METHODS:
        raise ValueError(f"context_parallel_method={method!r}; choose one of {list(CONTEXT_PARALLEL_METHODS)}")
    if context_parallel_size == 1:
        return
    if method == "all_to_all" and local_heads % context_parallel_size:
        raise ValueError(
            f"context_parallel_method='all_to_all' needs the {local_heads} query heads of each tensor-parallel rank "
            f"to divide by context_parallel_size={context_parallel_size}; use context_parallel_method='ring', or "
            f"a context_parallel_size dividing {local_heads}"
        )
    if attention_dropout > 0.0:
        raise ValueError(
            f"attention_dropout={attention_dropout} with context_parallel_size={context_parallel_size}: the split "
            "attention cannot reproduce the dropout masks in its backward; set attention_dropout=0"
        )
