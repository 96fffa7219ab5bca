"""The whole model in one process (pp = 1, tp = 1), loaded from a checkpoint of any layout.

Shape legend: b batch, s new tokens, t cached + new tokens, h hidden, n heads, d head dim.

Checkpoints are keyed by the layout-independent ``layers.{i}.{name}``, so a DCP
checkpoint written at any (dp, tp, pp, ZeRO) layout loads here through
``scaling.trainer.load_checkpoint``. With tied embeddings a pipeline-parallel run also
saved the head's copy (``layers.{N+1}.embedding.weight``); it equals the embedding and
is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from scaling.config import JsonDict
from scaling.nn import KVCache, ParallelSelfAttention, named_parameters_with_meta, set_layer_index
from scaling.trainer import checkpoint, committed_steps
from scaling.transformer.config import TransformerArchitectureConfig, TransformerConfig
from scaling.transformer.finetuning import apply_finetuning
from scaling.transformer.model import EmbeddingLayer, LMHeadLayer, TransformerBlock, layer_specs


class TransformerLM(torch.nn.Module):
    """Embedding, blocks and head of one process; parameters named ``layers.{i}.*`` like the pipeline's.

    Args:
        arch: the architecture (``sequence_parallel`` is ignored: one process).
        seed: layer ``i`` is initialised from ``seed + i``, as in ``ParallelModule``.
    """

    def __init__(self, arch: TransformerArchitectureConfig, seed: int = 42) -> None:
        super().__init__()
        self.arch = arch.model_copy(update={"sequence_parallel": False, "activation_checkpointing": "none"})
        self.layers = torch.nn.ModuleList()
        for i, spec in enumerate(layer_specs(self.arch, None)):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + i)
                self.layers.append(set_layer_index(spec.initialize(), i))
        if self.arch.tied_embeddings:
            self.head.embedding.weight = self.embedding.embedding.weight

    @property
    def embedding(self) -> EmbeddingLayer:
        return self.layers[0]  # type: ignore[return-value]

    @property
    def blocks(self) -> list[TransformerBlock]:
        return list(self.layers[1:-1])  # type: ignore[arg-type]

    @property
    def head(self) -> LMHeadLayer:
        return self.layers[-1]  # type: ignore[return-value]

    def forward(self, input_ids_bs: torch.Tensor) -> torch.Tensor:
        """Full logits ``[b, s, V]`` of a plain (unpacked) batch."""
        x = self.embedding.embedding(input_ids_bs)
        for block in self.blocks:
            x = block.block(x)
        return self.head.logits(x)[..., : self.arch.vocab_size]

    def forward_cached(
        self,
        input_ids_bs: torch.Tensor,
        caches: list[KVCache],
        key_padding_bt: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[b, s, V]`` of new tokens given the cached ones; appends to ``caches``.

        Args:
            key_padding_bt: ``True`` where a cached-or-new position is a real token; needed
                when rows are left-padded to a common length. ``None`` = no padding.
        """
        x = self.embedding.embedding(input_ids_bs)
        for block, cache in zip(self.blocks, caches):
            if key_padding_bt is None:
                x = block.block(x, kv_cache=cache)
            else:
                x = _padded_block(block, x, cache, key_padding_bt)
        return self.head.logits(x)[..., : self.arch.vocab_size]


def _padded_block(block: TransformerBlock, x_bsh: torch.Tensor, cache: KVCache, real_bt: torch.Tensor) -> torch.Tensor:
    """``TransformerBlock.block`` with a key padding mask and per-row positions.

    ``ParallelSelfAttention.forward`` takes no padding mask together with a KV cache, so
    this reproduces its cached path (same projections, RoPE and SDPA) with one added.
    """
    attn = block.attention
    if not isinstance(attn, ParallelSelfAttention):
        raise ValueError(
            "left-padded batches (prompts of different lengths) are not supported with latent attention yet; "
            "generate the prompts one at a time"
        )
    h = block.input_norm(x_bsh)
    q, k, v = attn._project(h)
    if attn.qk_norm:
        q = F.rms_norm(q, (attn.head_dim,), attn.q_norm, attn.qk_norm_eps)
        k = F.rms_norm(k, (attn.head_dim,), attn.k_norm, attn.qk_norm_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    s, offset = q.shape[2], cache.seq_len
    positions_bt = (real_bt.long().cumsum(-1) - 1).clamp(min=0)
    positions_bs = positions_bt[:, offset : offset + s]
    if attn.rotary is not None:
        q, k = attn.rotary(q, positions_bs), attn.rotary(k, positions_bs)
    k, v = cache.update(k, v)
    t = k.shape[2]
    queries_s1 = torch.arange(offset, offset + s, device=real_bt.device).unsqueeze(-1)
    keys_t = torch.arange(t, device=real_bt.device)
    mask = ((queries_s1 >= keys_t).unsqueeze(0) & real_bt[:, None, :t]).unsqueeze(1)
    # A left-padding query row sees no real key; let it see itself so softmax stays finite.
    mask = mask | (queries_s1 == keys_t).unsqueeze(0).unsqueeze(0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    out = attn.dense(out.transpose(1, 2).reshape(x_bsh.shape[0], s, -1))
    adapter = getattr(attn, "adapter", None)  # finetuning.method='adapter' hooks the attention's output
    if isinstance(adapter, torch.nn.Module):
        out = adapter(out)
    x_bsh = x_bsh + out
    return x_bsh + block.mlp(block.mlp_norm(x_bsh))


def latest_config(checkpoint_dir: str | Path) -> JsonDict:
    """The config dict saved with the newest committed checkpoint in ``checkpoint_dir``.

    Raises:
        FileNotFoundError: when the folder holds no committed checkpoint.
    """
    root = Path(checkpoint_dir)
    steps = committed_steps(root) if root.is_dir() else []
    if not steps:
        inner = root / "checkpoint"  # import-hf writes OUT/config.yml and OUT/checkpoint
        hint = f"; did you mean {str(inner)!r}?" if inner.is_dir() and committed_steps(inner) else ""
        raise FileNotFoundError(f"checkpoint={str(root)!r} holds no committed checkpoint (step_*/commit.json){hint}")
    extra = json.loads((root / f"step_{steps[-1]:08d}" / "extra.json").read_text())
    if "config" not in extra:
        raise FileNotFoundError(f"{root}: extra.json of step {steps[-1]} has no 'config'; pass --config")
    return dict(extra["config"])


def load_model(
    checkpoint_dir: str | Path, config: TransformerConfig | None = None, step: int | None = None
) -> tuple[TransformerLM, TransformerConfig]:
    """Build the one-process model and fill it from a checkpoint of any layout.

    Args:
        checkpoint_dir: a ``trainer.save_dir`` (or an ``import-hf`` output).
        config: the run's config; default: the one saved with the checkpoint.
        step: load this step instead of ``latest``.
    """
    if config is None:
        config = TransformerConfig.from_dict(latest_config(checkpoint_dir))
    model = TransformerLM(config.transformer_architecture, seed=config.trainer.seed)
    # Adapters trained with the checkpoint (finetuning.method) are part of the model.
    apply_finetuning(list(enumerate(model.layers)), config.finetuning, seed=config.trainer.seed)
    params = list(named_parameters_with_meta(model))
    head_copy = rf"model\.layers\.{len(model.layers) - 1}\.embedding\.weight"
    checkpoint.load_checkpoint(
        checkpoint_dir,
        {"model": checkpoint.model_state_dict(params, None)},
        None,
        step=step,
        allowed_unexpected=[
            r"optimizer\..*",
            *([head_copy] if config.transformer_architecture.tied_embeddings else []),
        ],
    )
    model.eval()
    return model, config
