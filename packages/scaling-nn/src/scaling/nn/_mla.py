"""Multi-head latent attention (DeepSeek-V2/V3), tensor-parallel over heads.

Shape legend: b batch, s sequence (``s / tp`` under sequence parallelism), h hidden, n heads
(``n / tp`` on a TP rank), c latent sizes, d head dims.

Queries and keys/values pass through low-rank latents: ``c_q = norm(x W_qa)`` (or no query
latent: ``q = x W_q``), ``q = c_q W_qb``; ``[c_kv, k_rope] = x W_kva``, ``[k_nope, v] =
norm(c_kv) W_kvb``. Each head's query and key are ``[nope | rope]``, RoPE on the ``rope``
channels only, the key's ``rope`` part one for all heads. Attention runs on
``F.scaled_dot_product_attention`` (scale ``1 / sqrt(d_nope + d_rope)``, times DeepSeek's YaRN
correction ``mscale_all_dim`` where the RoPE scaling has one; the value head size may differ),
then ``o = out W_o``.

Tensor parallelism: the latent projections ``W_qa`` and ``W_kva`` (and their norms) are
replicated on every TP rank and see every token; ``W_qb``, ``W_kvb`` are column-split and
``W_o`` row-split by heads, as in :class:`ParallelSelfAttention`. The latents enter the TP
region through ``copy_to_model_parallel_region`` (the shared ``k_rope`` too), so their
gradient is summed over the ranks' heads. Under sequence parallelism each rank projects its
own tokens into the latents, which are then gathered along the sequence (their gradient
keeps the rank's slice), and the replicated weights' gradients are summed over TP
(``reduce_over_tp``).

Interleaved RoPE pairs (DeepSeek's checkpoints, transformers' ``rope_interleave``) rotate
``(0, 1), (2, 3), ...``; transformers returns them de-interleaved, a permutation of the same
channels that queries and keys share, so the attention scores are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from scaling.collectives import copy_to_model_parallel_region, gather_from_sequence_parallel_region
from scaling.nn._init import InitMethod, axis_from, check_dtype, default_weight_init, sharded_parameter, tp_info
from scaling.nn._linear import ColumnParallelLinear, RowParallelLinear
from scaling.nn._norm import RMSNorm
from scaling.nn._rotary import KVCache, RopeScaling, RotaryEmbedding, document_ids_and_positions, packed_attention_mask

if TYPE_CHECKING:
    from scaling.topology import Axis, Topology


@dataclass(frozen=True)
class MLAConfig:
    """What a :class:`MultiHeadLatentAttention` computes, apart from the axes it runs over.

    Attributes:
        hidden_size: model width ``h``.
        num_attention_heads: heads (query and key/value alike).
        kv_lora_rank: the key/value latent size.
        q_lora_rank: the query latent size; None: queries projected directly (DeepSeek-V2-Lite).
        qk_nope_head_dim, qk_rope_head_dim: each head's query/key channels without and with RoPE.
        v_head_dim: each head's value channels.
        norm_eps: epsilon of the latents' RMS norms.
        dtype: parameter dtype.
        causal: causal (decoder) or bidirectional attention.
        rotary_base, rotary_interleaved, rotary_scaling: RoPE of the ``rope`` channels (see
            :class:`RotaryEmbedding`; DeepSeek's checkpoints are interleaved).
        sequence_parallel: input and output split along dim 1 over TP.
        init_method, output_init_method: weight initialisers (default ``torch.nn.Linear``'s).

    Example::

        MLAConfig(hidden_size=7168, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536)  # DeepSeek-V3
    """

    hidden_size: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    causal: bool = True
    rotary_base: float = 10000.0
    rotary_interleaved: bool = True
    rotary_scaling: RopeScaling | None = None
    sequence_parallel: bool = False
    init_method: InitMethod | None = None
    output_init_method: InitMethod | None = None


class MultiHeadLatentAttention(torch.nn.Module):
    """DeepSeek's multi-head latent attention; the module docstring has the maths and the layout.

    Args:
        config: what it computes (:class:`MLAConfig`).
        tp: the tensor-parallel axis its heads are split over; None: one rank.
        cp: the context-parallel axis; more than one rank is refused (not supported yet).
        device: where its parameters live.
        topology: instead of ``tp``, ``cp`` and ``device``: a topology they are taken from.

    Raises:
        ValueError: heads not divisible by the TP size (the valid sizes listed), or a
            context-parallel axis of more than one rank.

    Example::

        attention = MultiHeadLatentAttention(MLAConfig(512, 8, kv_lora_rank=64), tp=topology.axis("tp"))
    """

    def __init__(
        self,
        config: MLAConfig,
        *,
        tp: Axis | None = None,
        cp: Axis | None = None,
        device: torch.device | str | None = None,
        topology: Topology | None = None,
    ) -> None:
        super().__init__()
        c = self.config = config
        check_dtype(c.dtype, "MultiHeadLatentAttention")
        tp_ = self._tp = tp_info(topology, tp, device, "MultiHeadLatentAttention")
        tp_axis = topology.axis("tp") if topology is not None else tp
        cp_axis = axis_from(topology, "cp", cp, "MultiHeadLatentAttention")
        if cp_axis is not None and cp_axis.size > 1:
            raise ValueError(
                f"MultiHeadLatentAttention: context_parallel_size={cp_axis.size} is not supported yet; "
                "use context_parallel_size=1 with latent attention"
            )
        n = c.num_attention_heads
        if n % tp_.size:
            valid = [t for t in range(1, n + 1) if n % t == 0]
            raise ValueError(
                f"MultiHeadLatentAttention: model_parallel_size={tp_.size} cannot shard num_attention_heads={n}; "
                f"choose model_parallel_size in {valid}"
            )
        self.num_local_heads = n // tp_.size
        self.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        init, sp = c.init_method or default_weight_init, c.sequence_parallel

        def replicated(rows: int, cols: int, name: str) -> torch.nn.Parameter:
            return sharded_parameter((rows, cols), init, tp_, None, c.dtype, name, sp)

        def column(rows_in: int, cols_out: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                rows_in, cols_out, bias=False, dtype=c.dtype, init_method=init, tp=tp_axis, device=tp_.device
            )

        def norm(size: int) -> RMSNorm:
            return RMSNorm(size, c.norm_eps, dtype=c.dtype, sequence_parallel=sp, tp=tp_axis, device=tp_.device)

        if c.q_lora_rank is None:
            self.q = column(c.hidden_size, n * self.qk_head_dim)
        else:
            self.q_a = replicated(c.q_lora_rank, c.hidden_size, "q_a")
            self.q_a_norm = norm(c.q_lora_rank)
            self.q_b = column(c.q_lora_rank, n * self.qk_head_dim)
        self.kv_a = replicated(c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size, "kv_a")
        self.kv_a_norm = norm(c.kv_lora_rank)
        self.kv_b = column(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim))
        self.rotary = RotaryEmbedding(c.qk_rope_head_dim, 1.0, c.rotary_base, c.rotary_interleaved, c.rotary_scaling)
        # DeepSeek's YaRN also scales the softmax (mscale_all_dim); None: SDPA's 1 / sqrt(d_nope + d_rope).
        factor = 1.0 if c.rotary_scaling is None else c.rotary_scaling.softmax_scale_factor()
        self.softmax_scale = None if factor == 1.0 else factor / self.qk_head_dim**0.5
        self.dense = RowParallelLinear(
            n * c.v_head_dim,
            c.hidden_size,
            bias=False,
            dtype=c.dtype,
            init_method=c.output_init_method or init,
            sequence_parallel=sp,
            tp=tp_axis,
            device=tp_.device,
        )

    def _latents(self, x_bsh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query input, c_kv, k_rope)`` for every token of the TP group: the normalised query
        latent (``x`` itself without one), the normalised key/value latent, the shared RoPE key."""
        c = self.config
        c_kv, k_rope = F.linear(x_bsh, self.kv_a).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_norm(c_kv)
        q_in = x_bsh if c.q_lora_rank is None else self.q_a_norm(F.linear(x_bsh, self.q_a))
        if not c.sequence_parallel:
            return q_in, c_kv, k_rope
        # Each rank projected its own tokens; gathered, the gradient keeps this rank's slice.
        latent = torch.cat([q_in, c_kv, k_rope], dim=-1)
        latent = gather_from_sequence_parallel_region(latent, self._tp.group, tensor_parallel_output_grad=False)
        q_in, c_kv, k_rope = latent.split([q_in.shape[-1], c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        return q_in, c_kv, k_rope

    def forward(
        self,
        x_bsh: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Attend over ``x_bsh`` (``[b, s, h]``; ``[b, s/tp, h]`` under sequence parallelism); the
        arguments are :class:`ParallelSelfAttention`'s."""
        c, n = self.config, self.num_local_heads
        q_in, c_kv, k_rope = self._latents(x_bsh)
        b, s = c_kv.shape[0], c_kv.shape[1]
        q = (self.q if c.q_lora_rank is None else self.q_b)(q_in).view(b, s, n, self.qk_head_dim).transpose(1, 2)
        kv = self.kv_b(c_kv).view(b, s, n, c.qk_nope_head_dim + c.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        # The shared RoPE key: its gradient is summed over the TP ranks' heads.
        k_rope = copy_to_model_parallel_region(k_rope, self._tp.group).unsqueeze(1)  # [b, 1, s, d_rope]
        offset = kv_cache.seq_len if kv_cache is not None else 0
        mask, is_causal = None, c.causal
        if cu_seqlens is not None:
            if kv_cache is not None:
                raise ValueError("MultiHeadLatentAttention: cu_seqlens (packed sequences) cannot be used with kv_cache")
            doc_ids, positions = document_ids_and_positions(cu_seqlens, b, s)
            mask, is_causal = packed_attention_mask(doc_ids, c.causal), False
        else:
            positions = position_ids if position_ids is not None else torch.arange(offset, offset + s, device=q.device)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, self.rotary(q_rope, positions)], dim=-1)
        k = torch.cat([k_nope, self.rotary(k_rope, positions).expand(-1, n, -1, -1)], dim=-1)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
            if c.causal and offset > 0:
                rows = torch.arange(offset, offset + s, device=q.device).unsqueeze(-1)
                mask, is_causal = rows >= torch.arange(k.shape[2], device=q.device), False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.softmax_scale)
        return self.dense(out.transpose(1, 2).reshape(b, s, n * c.v_head_dim))
