"""The transformer as LayerSpecs: embedding, N blocks, final norm + LM head; its loss.

Shape legend: b batch, s sequence (s/tp under sequence parallelism), h hidden, v local
vocabulary block (``ceil(V / tp)`` ids).

Pipeline layers: ``0`` embedding, ``1..N`` blocks, ``N + 1`` norm and head. With tied
embeddings layers ``0`` and ``N + 1`` are :class:`TiedLayerSpec` s sharing
``embedding.weight`` (key ``"embedding"``), so the pipeline keeps the copies equal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from scaling.collectives import all_reduce, copy_to_model_parallel_region, gather_from_sequence_parallel_region
from scaling.nn import (
    MATMUL_AND_ATTENTION,
    AttentionConfig,
    BaseLayer,
    KVCache,
    LayerNorm,
    LayerSpec,
    MoEConfig,
    MultiHeadLatentAttention,
    ParallelMLP,
    ParallelMoE,
    ParallelSelfAttention,
    ParallelSwiGLUMLP,
    RMSNorm,
    TiedLayerSpec,
    VocabParallelEmbedding,
    check_float8,
    checkpoint_layer,
    vocab_parallel_cross_entropy,
)
from scaling.topology import RNGTracker, Topology
from scaling.transformer.config import TransformerArchitectureConfig, TransformerConfig
from scaling.transformer.data import TransformerBatch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

TIED_KEY = "embedding"


@dataclass
class TransformerLayerIO:
    """What flows between layers: the residual stream and the packing metadata."""

    activations: torch.Tensor
    position_ids: torch.Tensor | None = None
    cumulative_seq_lengths: torch.Tensor | None = None


@dataclass
class TransformerHeadOutput:
    """Logits of this rank's vocabulary block, ``[b, s, v]``."""

    logits: torch.Tensor


def normal_init(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def init(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init


def _group(topology: Topology | None) -> ProcessGroup | None:
    return None if topology is None else topology.axis("tp").group


def make_norm(arch: TransformerArchitectureConfig, topology: Topology | None) -> torch.nn.Module:
    if arch.norm == "rmsnorm":
        return RMSNorm(
            arch.hidden_size,
            eps=arch.norm_eps,
            topology=topology,
            dtype=arch.dtype,
            sequence_parallel=arch.sequence_parallel,
        )
    return LayerNorm(
        arch.hidden_size,
        eps=arch.norm_eps,
        bias=arch.bias,
        topology=topology,
        dtype=arch.dtype,
        sequence_parallel=arch.sequence_parallel,
    )


class _Dropout(torch.nn.Module):
    """Dropout on the residual stream; sharded (sequence parallel) streams draw per TP rank.

    A module (no parameters), not a plain callable: torch 2.6's Dynamo guards a plain object
    a compiled layer calls by its identity, so every block recompiled (one graph per block).
    """

    def __init__(self, p: float, sharded: bool, rng_tracker: RNGTracker | None) -> None:
        super().__init__()
        self.p, self.sharded, self.rng_tracker = p, sharded, rng_tracker

    def forward(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        if self.p == 0.0 or not training:
            return x
        fork = self.rng_tracker.fork() if self.sharded and self.rng_tracker is not None else contextlib.nullcontext()
        with fork:
            return F.dropout(x, self.p, training=True)


class EmbeddingLayer(BaseLayer[TransformerBatch, TransformerLayerIO]):
    """Token embedding (vocabulary split over TP; sequence-split output under SP)."""

    def __init__(
        self,
        arch: TransformerArchitectureConfig,
        topology: Topology | None = None,
        rng_tracker: RNGTracker | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.embedding = VocabParallelEmbedding(
            arch.vocab_size,
            arch.hidden_size,
            topology=topology,
            dtype=arch.dtype,
            init_method=normal_init(arch.init_std),
            sequence_parallel=arch.sequence_parallel,
        )
        self.dropout = _Dropout(arch.embedding_dropout, arch.sequence_parallel, rng_tracker)

    def forward(self, x: TransformerBatch) -> TransformerLayerIO:
        assert x.input_token_ids is not None  # the first stage always receives inputs
        h_bsh = self.dropout(self.embedding(x.input_token_ids), self.training)
        if not self.arch.document_masking:
            return TransformerLayerIO(activations=h_bsh)
        return TransformerLayerIO(h_bsh, x.position_ids, x.cumulative_seq_lengths)


class TransformerBlock(BaseLayer[TransformerLayerIO, TransformerLayerIO]):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(
        self,
        arch: TransformerArchitectureConfig,
        topology: Topology | None = None,
        rng_tracker: RNGTracker | None = None,
        moe: bool = False,
    ) -> None:
        super().__init__()
        self.arch, self.rng_tracker = arch, rng_tracker
        output_init = normal_init(arch.init_std / math.sqrt(2 * arch.num_layers))
        self.input_norm = make_norm(arch, topology)
        self.attention: ParallelSelfAttention | MultiHeadLatentAttention
        if arch.latent_attention is not None:
            config = arch.latent_attention.to_nn(arch)
            config = dataclasses.replace(config, init_method=normal_init(arch.init_std), output_init_method=output_init)
            self.attention = MultiHeadLatentAttention(config, topology=topology)
        else:
            self.attention = ParallelSelfAttention(
                AttentionConfig(
                    arch.hidden_size,
                    arch.num_attention_heads,
                    arch.kv_heads,
                    head_dim=arch.head_size,
                    bias=arch.bias,
                    qkv_bias=arch.bias or arch.qkv_bias,
                    dtype=arch.dtype,
                    causal=arch.causal,
                    rotary_percentage=arch.rotary_percentage,
                    rotary_base=arch.rotary_base,
                    rotary_interleaved=arch.rotary_interleaved,
                    rotary_scaling=None if arch.rope_scaling is None else arch.rope_scaling.to_nn(),
                    qk_norm=arch.qk_norm,
                    qk_norm_eps=arch.norm_eps,
                    attention_dropout=arch.attention_dropout,
                    sequence_parallel=arch.sequence_parallel,
                    checkpoint_core_attention=arch.activation_checkpointing == "selective",
                    init_method=normal_init(arch.init_std),
                    output_init_method=output_init,
                    context_parallel_method=arch.context_parallel_method,
                ),
                topology=topology,
                rng_tracker=rng_tracker,
            )
        self.mlp_norm = make_norm(arch, topology)
        mlp_class = ParallelSwiGLUMLP if arch.mlp_type == "swiglu" else ParallelMLP
        self.mlp: torch.nn.Module
        if moe:
            assert arch.moe is not None
            self.mlp = ParallelMoE(
                MoEConfig(
                    arch.hidden_size,
                    arch.moe.ffn_size or arch.ffn_size,
                    arch.moe.num_experts,
                    top_k=arch.moe.top_k,
                    score_function=arch.moe.score_function,
                    normalize_top_k=arch.moe.normalize_top_k,
                    routed_scaling_factor=arch.moe.routed_scaling_factor,
                    num_groups=arch.moe.num_groups,
                    top_groups=arch.moe.top_groups,
                    num_shared_experts=arch.moe.num_shared_experts,
                    balancing=arch.moe.balancing,
                    aux_loss_coefficient=arch.moe.aux_loss_coefficient,
                    sequence_aux_loss_coefficient=arch.moe.sequence_aux_loss_coefficient,
                    global_aux_loss=arch.moe.global_aux_loss,
                    bias_update_rate=arch.moe.bias_update_rate,
                    sequence_parallel=arch.sequence_parallel,
                    dtype=arch.dtype,
                    init_method=normal_init(arch.init_std),
                    output_init_method=output_init,
                ),
                topology=topology,
            )
        else:
            self.mlp = mlp_class(
                arch.hidden_size,
                arch.ffn_size,
                bias=arch.bias,
                topology=topology,
                dtype=arch.dtype,
                sequence_parallel=arch.sequence_parallel,
                init_method=normal_init(arch.init_std),
                output_init_method=output_init,
            )
        self.dropout = _Dropout(arch.hidden_dropout, arch.sequence_parallel, rng_tracker)

    def block(
        self,
        x_bsh: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """The block on a plain tensor (also used by generation with a KV cache)."""
        attn = self.attention(
            self.input_norm(x_bsh), cu_seqlens=cu_seqlens, position_ids=position_ids, kv_cache=kv_cache
        )
        x_bsh = x_bsh + self.dropout(attn, self.training)
        return x_bsh + self.dropout(self.mlp(self.mlp_norm(x_bsh)), self.training)

    def forward(self, x: TransformerLayerIO) -> TransformerLayerIO:
        cu, pos = x.cumulative_seq_lengths, x.position_ids
        policy = self.arch.activation_checkpointing
        if policy in ("every_layer", "operators"):
            save = MATMUL_AND_ATTENTION if policy == "operators" else None
            out = checkpoint_layer(self.block, x.activations, cu, pos, rng_tracker=self.rng_tracker, save=save)
        else:
            out = self.block(x.activations, cu, pos)
        return TransformerLayerIO(out, pos, cu)


class LMHeadLayer(BaseLayer[TransformerLayerIO, TransformerHeadOutput]):
    """Final norm and the LM head ``x @ E^T`` over this rank's vocabulary block."""

    def __init__(self, arch: TransformerArchitectureConfig, topology: Topology | None = None) -> None:
        super().__init__()
        self.arch, self._group = arch, _group(topology)
        self.norm = make_norm(arch, topology)
        # The output matrix has the embedding's layout ([V, h], vocabulary split over TP),
        # so tying is sharing one parameter and the padded rows are handled alike.
        self.embedding = VocabParallelEmbedding(
            arch.vocab_size,
            arch.hidden_size,
            topology=topology,
            dtype=arch.dtype,
            init_method=normal_init(arch.init_std),
        )

    def logits(self, x_bsh: torch.Tensor) -> torch.Tensor:
        """``[b, s, h]`` residual stream -> ``[b, s_full, v]`` local logits."""
        x_bsh = self.norm(x_bsh)
        if self.arch.sequence_parallel:
            x_bsh = gather_from_sequence_parallel_region(x_bsh, self._group)
        else:
            x_bsh = copy_to_model_parallel_region(x_bsh, self._group)
        return F.linear(x_bsh, self.embedding.weight)

    def forward(self, x: TransformerLayerIO) -> TransformerHeadOutput:
        return TransformerHeadOutput(logits=self.logits(x.activations))


def layer_specs(
    arch: TransformerArchitectureConfig, topology: Topology | None, rng_tracker: RNGTracker | None = None
) -> list[LayerSpec]:
    """The model: ``[embedding, block x num_layers, head]``."""
    # Any: LayerSpec passes its keywords on to each layer class, which types them.
    common: dict[str, Any] = dict(arch=arch, topology=topology)
    if arch.tied_embeddings:
        first: LayerSpec = TiedLayerSpec(
            TIED_KEY, ["embedding.weight"], EmbeddingLayer, rng_tracker=rng_tracker, **common
        )
        last: LayerSpec = TiedLayerSpec(TIED_KEY, ["embedding.weight"], LMHeadLayer, **common)
    else:
        first = LayerSpec(EmbeddingLayer, rng_tracker=rng_tracker, **common)
        last = LayerSpec(LMHeadLayer, **common)
    blocks = [
        LayerSpec(TransformerBlock, rng_tracker=rng_tracker, moe=arch.is_moe_block(i), **common)
        for i in range(arch.num_layers)
    ]
    return [first, *blocks, last]


class TransformerLoss:
    """``loss_function(output, batch)``: vocab-parallel cross-entropy, weighted by ``batch.loss_weights``.

    Args:
        vocab_size: the real vocabulary size (padding columns are masked out).
        topology: the topology (its TP group), or None in one process.
    """

    def __init__(self, vocab_size: int, topology: Topology | None) -> None:
        self.vocab_size, self.group = vocab_size, _group(topology)
        cp = 1 if topology is None else topology.axis("cp").size
        self.cp_group = topology.axis("cp").group if topology is not None and cp > 1 else None
        self.cp_size = cp

    def __call__(
        self, output: TransformerHeadOutput, batch: TransformerBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert batch.target_token_ids is not None  # the last stage always receives targets
        targets, weights = batch.target_token_ids, batch.loss_weights
        reduction = "mean" if self.cp_group is None else "sum"
        loss = vocab_parallel_cross_entropy(
            output.logits, targets, self.group, loss_weights=weights, vocab_size=self.vocab_size, reduction=reduction
        )
        if self.cp_group is None:
            return loss, {}
        # Context parallelism: this rank holds part of each sequence. Its loss is its share
        # of the weighted sum over the whole sequences, divided by the CP ranks' mean
        # weight, so the mean over the CP ranks (what the step reports, and what the
        # gradient average over DP × CP differentiates) is the one-process loss.
        kept = (targets != -100).to(loss.dtype)
        total_weight = (kept if weights is None else kept * weights.to(loss.dtype)).sum().detach()
        all_reduce(total_weight, self.cp_group)
        return loss / (total_weight / self.cp_size), {}


def flops_per_token(arch: TransformerArchitectureConfig, sequence_length: int) -> float:
    """Training FLOPs per token: ``6 N + 12 L H S`` (N active parameters, L layers, H the attention width:
    heads × head size, the hidden size unless ``head_dim`` is set; S sequence)."""
    return 6.0 * arch.num_parameters(active=True) + 12.0 * arch.num_layers * attention_width(arch) * sequence_length


def attention_width(arch: TransformerArchitectureConfig) -> float:
    """Attention's channels over all heads, as its two products see them: heads x head size; with
    latent attention the mean of QK^T's (query/key channels) and AV's (value channels)."""
    latent = arch.latent_attention
    if latent is None:
        return float(arch.num_attention_heads * arch.head_size)
    return arch.num_attention_heads * (latent.qk_nope_head_dim + latent.qk_rope_head_dim + latent.v_head_dim) / 2


def check_fp8(config: TransformerConfig) -> None:
    """Refuse ``training.fp8`` where it cannot run (device, torch version, a block's linear sizes at
    this TP size), before anything launches: the CLI calls it with the other checks."""
    fp8 = config.training.fp8
    if not fp8.enabled:
        return
    arch, topology = config.transformer_architecture, config.topology
    assert topology.micro_batch_size is not None
    seq = config.data.sequence_length
    tokens = topology.micro_batch_size * seq // topology.context_parallel_size
    if tokens % 16:
        raise ValueError(
            f"training.fp8.enabled=true: {tokens} tokens per micro-batch and rank (topology.micro_batch_size="
            f"{topology.micro_batch_size} x data.sequence_length={seq} / topology.context_parallel_size="
            f"{topology.context_parallel_size}); float8 products need a multiple of 16: change one of them, or "
            "set training.fp8.enabled=false"
        )
    with torch.device("meta"):  # shapes only
        blocks = torch.nn.ModuleDict({"block": TransformerBlock(arch, None, moe=False)})
        if arch.moe is not None:
            blocks["moe_block"] = TransformerBlock(arch, None, moe=True)
    cuda = topology.device == "cuda" or (
        topology.device == "auto" and topology.backend != "gloo" and torch.cuda.is_available()
    )
    assert topology.model_parallel_size is not None
    check_float8(
        blocks, fp8, topology.model_parallel_size, torch.device("cuda" if cuda else "cpu"), setting="training.fp8"
    )
