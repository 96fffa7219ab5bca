"""TransformerConfig: the package configs composed, plus the transformer's own sections."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from scaling.config import BaseConfig, JsonDict
from scaling.nn import (
    CompileConfig,
    Float8Config,
    MLAConfig,
    RopeScaling,
    check_compile_layout,
    check_context_parallel,
    check_moe,
)
from scaling.pipeline import SCHEDULES, placement_of
from scaling.runner import LaunchedConfig
from scaling.trainer import TrainingAppConfig

TRAIN_SCRIPT = Path(__file__).resolve().with_name("train.py")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class MoEConfig(BaseConfig):
    """Mixture-of-experts feed-forward blocks (``scaling.nn.ParallelMoE``, SwiGLU experts)."""

    every: int = Field(
        1, ge=1, description="Block i (from 0) is MoE when (i + 1) % every == 0: 1 = every block, 2 = every other."
    )
    first_dense_layers: int = Field(
        0, ge=0, description="The first blocks stay dense whatever `every` says (DeepSeek-V3's first_k_dense_replace)."
    )
    num_experts: int = Field(8, ge=1, description="Routed experts per MoE block; divisible by expert_parallel_size.")
    top_k: int = Field(2, ge=1, description="Experts per token, <= num_experts.")
    num_shared_experts: int = Field(0, ge=0, description="Experts every token goes through (DeepSeek's shared).")
    ffn_size: int | None = Field(None, ge=1, description="Inner size of an expert; None = the dense MLP's.")
    score_function: Literal["softmax", "sigmoid"] = Field("softmax", description="Router scores.")
    normalize_top_k: bool = Field(
        True,
        description="Renormalise a token's top-k scores to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob); "
        "sigmoid scores always are.",
    )
    routed_scaling_factor: float = Field(
        1.0, gt=0.0, description="Multiplies the routed experts' weights (DeepSeek-V3: 2.5)."
    )
    num_groups: int = Field(
        1, ge=1, description="Group-limited routing: experts in this many equal groups (DeepSeek-V3's n_group)."
    )
    top_groups: int = Field(
        1, ge=1, description="A token picks its experts in its best top_groups groups only (topk_group)."
    )
    balancing: Literal["aux_loss", "aux_loss_free", "none"] = Field(
        "aux_loss", description="Load balancing: auxiliary loss, aux-loss-free per-expert bias, or none."
    )
    aux_loss_coefficient: float = Field(1e-2, ge=0.0, description="Weight of the auxiliary balancing loss.")
    sequence_aux_loss_coefficient: float = Field(
        0.0,
        ge=0.0,
        description="Weight of DeepSeek-V3's complementary sequence-wise balance loss (f and P over each sequence), "
        "with any balancing (DeepSeek-V3: 1e-4 beside aux_loss_free); 0 = none.",
    )
    global_aux_loss: bool = Field(
        False,
        description="The auxiliary loss over the same micro-batch of every DP x CP rank together (Megatron's "
        "global_aux_loss): one process's loss for the ranks' micro-batches as one.",
    )
    bias_update_rate: float = Field(1e-3, ge=0.0, description="Step of the aux-loss-free bias per optimizer step.")


class RopeScalingConfig(BaseConfig):
    """RoPE frequency scaling for contexts longer than pretraining (``scaling.nn.RopeScaling``)."""

    rope_type: Literal["linear", "llama3", "yarn"] = Field(
        "llama3",
        description="'llama3' (Llama 3.1+: long wavelengths divided by factor, short ones kept, blended between), "
        "'yarn' (DeepSeek-V3, Qwen long contexts) or 'linear' (every frequency divided by factor).",
    )
    factor: float = Field(8.0, gt=0.0, description="Context extension factor; > 0.")
    low_freq_factor: float = Field(1.0, gt=0.0, description="llama3: the long-wavelength band edge; > 0.")
    high_freq_factor: float = Field(4.0, gt=0.0, description="llama3: the short-wavelength edge; > low_freq_factor.")
    original_max_position_embeddings: int = Field(8192, ge=1, description="llama3, yarn: the pretraining context.")
    beta_fast: float = Field(32.0, gt=0.0, description="yarn: frequencies with more turns over the context are kept.")
    beta_slow: float = Field(1.0, gt=0.0, description="yarn: frequencies with fewer turns are divided by factor.")
    mscale: float | None = Field(
        None, description="yarn: the attention factor's numerator scale (with mscale_all_dim)."
    )
    mscale_all_dim: float | None = Field(
        None, description="yarn: its denominator scale; DeepSeek also scales the softmax by its square."
    )
    attention_factor: float | None = Field(
        None, description="yarn: what cos and sin are multiplied by; None = from factor and the mscales."
    )
    truncate: bool = Field(True, description="yarn: round the ramp's ends to whole channels.")

    @model_validator(mode="after")
    def _check_band(self) -> RopeScalingConfig:
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"transformer_architecture.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor} (Llama 3.1 uses 4.0 and 1.0)"
            )
        return self

    def to_nn(self) -> RopeScaling:
        return RopeScaling(**self.as_dict())

    def hf_fields(self) -> JsonDict:
        """The fields transformers reads for this ``rope_type`` (its ``rope_parameters`` keys)."""
        keys = {
            "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                     "mscale_all_dim", "attention_factor", "truncate"),
        }[self.rope_type]  # fmt: skip
        values = self.as_dict()
        return {"rope_type": self.rope_type, **{k: values[k] for k in keys if values[k] is not None}}


class LatentAttentionConfig(BaseConfig):
    """Multi-head latent attention (DeepSeek-V2/V3; ``scaling.nn.MultiHeadLatentAttention``)."""

    kv_lora_rank: int = Field(512, ge=1, description="Key/value latent size.")
    q_lora_rank: int | None = Field(1536, ge=1, description="Query latent size; None = queries projected directly.")
    qk_nope_head_dim: int = Field(128, ge=1, description="Query/key channels per head without RoPE.")
    qk_rope_head_dim: int = Field(64, ge=2, multiple_of=2, description="Query/key channels per head with RoPE; even.")
    v_head_dim: int = Field(128, ge=1, description="Value channels per head.")

    def to_nn(self, arch: TransformerArchitectureConfig) -> MLAConfig:
        return MLAConfig(
            arch.hidden_size,
            arch.num_attention_heads,
            self.kv_lora_rank,
            self.q_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            norm_eps=arch.norm_eps,
            dtype=arch.dtype,
            causal=arch.causal,
            rotary_base=arch.rotary_base,
            rotary_interleaved=arch.rotary_interleaved,
            rotary_scaling=None if arch.rope_scaling is None else arch.rope_scaling.to_nn(),
            sequence_parallel=arch.sequence_parallel,
        )

    def num_parameters(self, hidden_size: int, heads: int) -> int:
        """The attention's parameters (latent norms included)."""
        q = self.qk_nope_head_dim + self.qk_rope_head_dim
        queries = (
            hidden_size * heads * q if self.q_lora_rank is None else self.q_lora_rank * (hidden_size + 1 + heads * q)
        )
        kv = hidden_size * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return queries + kv + heads * self.v_head_dim * hidden_size


class TransformerArchitectureConfig(BaseConfig):
    """The shape of a GPT/Llama-style decoder."""

    preset: str | None = Field(
        None,
        description="Start from a named architecture (`scaling-transformer presets` lists them: llama3_8b, "
        "qwen3_30b_a3b, tiny_llama3, ...); fields set beside it replace the preset's.",
    )

    vocab_size: int = Field(
        1024,
        ge=1,
        le=2**32,
        description="Token ids the model accepts, [0, vocab_size); 1 to 2**32 (token files hold at most uint32 ids).",
    )
    hidden_size: int = Field(128, ge=1, description="Model width (embedding size); divisible by num_attention_heads.")
    num_layers: int = Field(4, ge=1, description="Transformer blocks; the model has num_layers + 2 pipeline layers.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads; divides hidden_size.")
    num_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (GQA; 1 = MQA); divides num_attention_heads. None = MHA."
    )
    head_dim: int | None = Field(
        None, ge=1, description="Channels per head (Qwen3 sets it apart from the width); None = hidden_size / heads."
    )
    mlp_type: Literal["gelu", "swiglu"] = Field("swiglu", description="Feed-forward block: 'gelu' or 'swiglu'.")
    mlp_factor: float = Field(
        8 / 3, gt=0.0, description="Intermediate size = round(mlp_factor * hidden_size), rounded up to a multiple of 8."
    )
    intermediate_size: int | None = Field(
        None, ge=1, description="Explicit MLP inner size (overrides mlp_factor); None = derived from mlp_factor."
    )
    norm: Literal["layernorm", "rmsnorm"] = Field("rmsnorm", description="Norm type: 'layernorm' or 'rmsnorm'.")
    norm_eps: float = Field(1e-5, gt=0.0, description="Epsilon added to the variance in every norm; > 0.")
    rotary_base: float = Field(10000.0, gt=0.0, description="RoPE frequency base (theta); > 0.")
    rotary_interleaved: bool = Field(
        False, description="Rotate interleaved channel pairs (Meta/GPT-J) instead of half-split (HF Llama/NeoX)."
    )
    rotary_percentage: float = Field(
        1.0, ge=0.0, le=1.0, description="Fraction of each head rotated by RoPE, in [0, 1]; 0 = no RoPE."
    )
    rope_scaling: RopeScalingConfig | None = Field(
        None, description="RoPE frequency scaling (Llama 3.1+ checkpoints carry 'llama3'); None = plain RoPE."
    )
    max_sequence_length: int = Field(
        2048, ge=1, description="Longest sequence (positions) the model is trained or asked to generate for."
    )
    bias: bool = Field(False, description="Biases on the attention and MLP projections (and LayerNorm).")
    qkv_bias: bool = Field(
        False, description="Biases on the query, key and value projections only (Qwen2/2.5); implied by bias."
    )
    tied_embeddings: bool = Field(True, description="The LM head reuses the input embedding matrix.")
    embedding_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout after the embedding, in [0, 1).")
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities, [0, 1).")
    hidden_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention and MLP outputs before the residual add, [0, 1)."
    )
    qk_norm: bool = Field(
        False, description="RMS-normalise queries and keys per head before RoPE (Qwen3, OLMo 2), with norm_eps."
    )
    latent_attention: LatentAttentionConfig | None = Field(
        None,
        description="Multi-head latent attention (DeepSeek-V3) instead of MHA/GQA: every head's keys and values "
        "from one low-rank latent; rotary_interleaved says DeepSeek's RoPE layout. None = MHA/GQA.",
    )
    causal: bool = Field(True, description="Causal (decoder) attention; False = bidirectional.")
    init_std: float = Field(
        0.02, gt=0.0, description="Std of the normal initialisation; output projections use init_std/sqrt(2*layers)."
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Parameter and activation dtype; bf16/fp16 keep fp32 master weights in the optimizer."
    )
    sequence_parallel: bool = Field(
        False, description="Split norms, dropout and residuals along the sequence over the TP ranks."
    )
    activation_checkpointing: Literal["none", "every_layer", "selective", "operators"] = Field(
        "none",
        description="'every_layer' recomputes each block in the backward; 'selective' only softmax(QK^T)V; "
        "'operators' recomputes each block except its matrix products and attention, whose outputs are kept "
        "(torchtitan's per-operator selective checkpointing).",
    )
    document_masking: bool = Field(
        True,
        description="Attention stays within each packed document and positions restart at document starts "
        "(on CUDA in bf16/fp16: flash attention's variable-length kernel; elsewhere SDPA with the document mask).",
    )
    moe: MoEConfig | None = Field(
        None, description="Mixture-of-experts blocks (routed SwiGLU experts); None = every block dense."
    )
    context_parallel_method: Literal["ring", "all_to_all"] = Field(
        "ring",
        description="With topology.context_parallel_size > 1: 'ring' passes key/value blocks round the CP ranks; "
        "'all_to_all' trades heads for sequence (needs the heads of a TP rank to divide by the CP size).",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: object) -> object:
        from scaling.transformer.presets import apply_preset

        return apply_preset(data) if isinstance(data, dict) else data

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        """Channels per head: ``head_dim``, else ``hidden_size / num_attention_heads``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        size = int(round(self.mlp_factor * self.hidden_size))
        return -(-size // 8) * 8

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (from 0) is a mixture of experts (``moe.every``, ``moe.first_dense_layers``)."""
        moe = self.moe
        return moe is not None and index >= moe.first_dense_layers and (index + 1) % moe.every == 0

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the whole model (tied embedding counted once); ``active``: those one token uses
        (with mixture-of-experts blocks: the router, its top-k and the shared experts)."""
        h, v, f, layers = self.hidden_size, self.vocab_size, self.ffn_size, self.num_layers
        d, nq, nkv = self.head_size, self.num_attention_heads, self.kv_heads
        bias = int(self.bias)
        attn = h * (nq + 2 * nkv) * d + nq * d * h + bias * h + 2 * d * int(self.qk_norm)
        attn += (nq + 2 * nkv) * d * int(self.bias or self.qkv_bias)
        if self.latent_attention is not None:
            attn = self.latent_attention.num_parameters(h, nq)
        inner = 2 if self.mlp_type == "swiglu" else 1
        mlp = (inner + 1) * h * f + bias * (inner * f + h)
        # Two norms per block and the final one: weights, and biases for a LayerNorm with bias.
        norm = h * (2 if self.norm == "layernorm" and self.bias else 1)
        embeddings = v * h * (1 if self.tied_embeddings else 2)
        mlps = layers * mlp
        if self.moe is not None:
            moe, blocks = self.moe, sum(self.is_moe_block(i) for i in range(layers))
            experts = (moe.top_k if active else moe.num_experts) + moe.num_shared_experts
            mlps += blocks * (moe.num_experts * h + experts * 3 * h * (moe.ffn_size or f) - mlp)
        return embeddings + layers * (attn + 2 * norm) + mlps + norm

    @model_validator(mode="after")
    def _check_shape(self) -> TransformerArchitectureConfig:
        heads, kv = self.num_attention_heads, self.kv_heads
        if self.head_dim is None and self.hidden_size % heads:
            raise ValueError(
                f"transformer_architecture.num_attention_heads={heads} does not divide hidden_size="
                f"{self.hidden_size}; choose num_attention_heads in {_divisors(self.hidden_size)} or set head_dim"
            )
        if heads % kv:
            raise ValueError(
                f"transformer_architecture.num_attention_heads={heads} is not divisible by num_kv_heads={kv}; "
                f"choose num_kv_heads in {_divisors(heads)}"
            )
        if self.rotary_percentage > 0 and int(self.head_size * self.rotary_percentage) < 2:
            raise ValueError(
                f"transformer_architecture.rotary_percentage={self.rotary_percentage} rotates fewer than 2 of the "
                f"{self.head_size} channels per head; raise it or set 0 to disable RoPE"
            )
        latent = self.latent_attention
        if latent is not None:
            clashes = {
                "num_kv_heads": (self.num_kv_heads, (None, heads)),
                "head_dim": (self.head_dim, (None,)),
                "qk_norm": (self.qk_norm, (False,)),
                "bias": (self.bias, (False,)),
                "qkv_bias": (self.qkv_bias, (False,)),
                "rotary_percentage": (self.rotary_percentage, (1.0,)),
                "attention_dropout": (self.attention_dropout, (0.0,)),
                "activation_checkpointing": (self.activation_checkpointing, ("none", "operators", "every_layer")),
            }
            bad = {k: v for k, (v, allowed) in clashes.items() if v not in allowed}
            if bad:
                field, value = next(iter(bad.items()))
                raise ValueError(
                    f"transformer_architecture.latent_attention is set with {field}={value!r}, which latent attention "
                    f"does not have; use {field}={clashes[field][1][-1]!r} or latent_attention: null"
                )
        if self.moe is not None and not any(self.is_moe_block(i) for i in range(self.num_layers)):
            # The run would train a dense model while the config says MoE.
            raise ValueError(
                f"transformer_architecture.moe.every={self.moe.every} with first_dense_layers="
                f"{self.moe.first_dense_layers} leaves none of the num_layers={self.num_layers} blocks a mixture of "
                "experts; lower them or set moe: null"
            )
        return self


class FinetuningConfig(BaseConfig):
    """Parameter-efficient fine-tuning; every method freezes the base model."""

    method: Literal["none", "lora", "bitfit", "adapter"] = Field(
        "none",
        description="'lora' (low-rank updates of the block's linear layers), 'bitfit' (biases only; needs "
        "transformer_architecture.bias=true), 'adapter' (bottleneck adapters after attention and MLP), "
        "'none' (train everything, or what training.groups selects).",
    )
    rank: int = Field(8, ge=1, description="LoRA rank r; >= 1.")
    alpha: float = Field(16.0, gt=0.0, description="LoRA alpha: the update is (alpha / rank) * B A x; > 0.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input while training, [0, 1).")
    target_modules: str | None = Field(
        None,
        description="Regex (re.fullmatch) over module names inside a block, e.g. 'attention\\.(qkv|dense)'. "
        "None = every linear layer (lora) or 'attention|mlp' (adapter).",
    )
    adapter_size: int = Field(16, ge=1, description="Bottleneck width of each adapter; divisible by the TP size.")

    @model_validator(mode="after")
    def _check_regex(self) -> FinetuningConfig:
        if self.target_modules is not None:
            try:
                re.compile(self.target_modules)
            except re.error as err:
                raise ValueError(
                    f"finetuning.target_modules={self.target_modules!r} is not a valid regex ({err}); "
                    "write e.g. 'attention\\.(qkv|dense)'"
                ) from err
        return self


class TrainingGroupConfig(BaseConfig):
    """One optimizer group selected by regexes (``re.search``) over parameter names."""

    name: str = Field(min_length=1, description="Unique group name (keys its LR in the logs).")
    include: list[str] = Field(
        min_length=1, description="Regexes; a parameter whose name one of them matches joins the group."
    )
    exclude: list[str] = Field(default_factory=list, description="Regexes removing parameters from `include`.")
    learning_rate: float | None = Field(
        None, ge=0.0, description="Peak LR of this group (the schedule is scaled); None = learning_rate_scheduler's."
    )
    weight_decay: float | None = Field(None, ge=0.0, description="Weight decay; None = training.weight_decay.")
    method: Literal["adamw", "adam", "sgd", "muon"] | None = Field(
        None, description="Update rule of this group ('adamw', 'muon', ...); None = optimizer.method."
    )

    @model_validator(mode="after")
    def _check_regexes(self) -> TrainingGroupConfig:
        for field in ("include", "exclude"):
            for pattern in getattr(self, field):
                try:
                    re.compile(pattern)
                except re.error as err:
                    raise ValueError(
                        f"training.groups[{self.name!r}].{field}: {pattern!r} is not a valid regex ({err}); "
                        "escape literal dots and brackets, e.g. 'attention\\.qkv'"
                    ) from err
        return self


class TransformerTrainingConfig(BaseConfig):
    weight_decay: float = Field(0.01, ge=0.0, description="Weight decay of matrices (norms and biases get none).")
    schedule: Literal["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zb_v"] = Field(
        "1f1b",
        description="Pipeline schedule; interleaved_1f1b runs num_virtual_stages model chunks per stage; zb_v runs two per stage in a V (stage s holds virtual stages s and 2p-1-s) with the backward split as zb_h1's.",
    )
    num_virtual_stages: int = Field(
        1,
        ge=1,
        description="Model chunks per pipeline stage (> 1 only with schedule='interleaved_1f1b'; zb_v always runs 2).",
    )

    @property
    def chunks_per_stage(self) -> int:
        """Model chunks each pipeline stage holds: ``num_virtual_stages``, or ZB-V's two."""
        return 2 if self.schedule == "zb_v" else self.num_virtual_stages

    @property
    def placement(self) -> str:
        """Where a stage's chunks sit in the model (``scaling.pipeline.virtual_stage``)."""
        return placement_of(SCHEDULES[self.schedule])

    static_shapes: bool = Field(
        False,
        description="Activation shapes are the same for every micro-batch (Megatron-LM's default): pipeline hand-offs then carry no header after the first; a changed shape raises on the sending stage. False = shapes may vary.",
    )
    compile: CompileConfig = Field(
        default_factory=CompileConfig,
        description="torch.compile each layer (regional compilation; identical blocks share one graph).",
    )
    fp8: Float8Config = Field(
        default_factory=Float8Config,
        description="Float8 products in the blocks' column- and row-parallel linears (attention projections, MLP); "
        "embeddings, LM head, MoE router and experts stay in transformer_architecture.precision.",
    )
    groups: list[TrainingGroupConfig] = Field(
        default_factory=list,
        description="Optimizer groups by parameter-name regexes, each with its own LR and weight decay; "
        "trainable parameters in no group are frozen. Empty = two groups (matrices decay, vectors do not).",
    )


class BlendSourceConfig(BaseConfig):
    """One token dataset of a blend."""

    prefix: Path = Field(description="Token files (.bin/.idx) prefix.")
    weight: float = Field(gt=0.0, description="Relative weight (normalised over the blend); > 0.")


class TransformerDataConfig(BaseConfig):
    data_prefix: Path | None = Field(
        None, description="Training token files (.bin/.idx) prefix; None = the default corpus built by `preprocess`."
    )
    evaluation_prefix: Path | None = Field(
        None, description="Evaluation token files prefix; None = the default corpus's validation split (or none)."
    )
    tokenizer_path: Path | None = Field(
        None, description="tokenizer.json used by generate; None = the one next to the default corpus."
    )
    sequence_length: int = Field(128, ge=1, description="Tokens per training window; <= max_sequence_length.")
    default_corpus_dir: Path = Field(
        Path("runs/transformer/corpus"), description="Where `preprocess` writes the default corpus and tokenizer."
    )
    blend: list[BlendSourceConfig] = Field(
        default_factory=list,
        description="Train on several token datasets mixed by weight (replaces data_prefix), e.g. "
        "[{prefix: a/train, weight: 3}, {prefix: b/train, weight: 1}].",
    )
    finetuning_jsonl: Path | None = Field(
        None,
        description='Prompt/completion JSONL ({"prompt": ..., "completion": ...} per line) to train on instead '
        "of token files; the loss covers the completion tokens only. Tokenised with data.tokenizer_path.",
    )
    finetuning_jsonl_evaluation: Path | None = Field(
        None, description="Prompt/completion JSONL for evaluation (with finetuning_jsonl); None = none."
    )

    @model_validator(mode="after")
    def _check_sources(self) -> TransformerDataConfig:
        chosen = [
            name
            for name, value in (
                ("data_prefix", self.data_prefix),
                ("blend", self.blend),
                ("finetuning_jsonl", self.finetuning_jsonl),
            )
            if value
        ]
        if len(chosen) > 1:
            raise ValueError(
                f"data.{chosen[0]} and data.{chosen[1]} are both set; choose one training source "
                "(data_prefix, blend or finetuning_jsonl)"
            )
        return self


class TransformerConfig(TrainingAppConfig, LaunchedConfig):
    """The whole transformer app config; `scaling-transformer train --template` prints it commented."""

    default_script = TRAIN_SCRIPT

    training: TransformerTrainingConfig = Field(
        default_factory=TransformerTrainingConfig, description="Weight decay and pipeline schedule."
    )
    transformer_architecture: TransformerArchitectureConfig = Field(
        default_factory=TransformerArchitectureConfig, description="Model shape and numerics."
    )
    data: TransformerDataConfig = Field(default_factory=TransformerDataConfig, description="Token data.")
    finetuning: FinetuningConfig = Field(
        default_factory=FinetuningConfig, description="LoRA, BitFit or adapters on a frozen base."
    )

    @model_validator(mode="after")
    def _check_layout(self) -> TransformerConfig:
        tp, pp, world = self.topology.model_parallel_size, self.topology.pipe_parallel_size, self.topology.world_size
        # TopologyConfig's own validator has already derived every size it left as None.
        assert tp is not None and pp is not None and world is not None
        check_layout(self.transformer_architecture, tp, pp)
        arch = self.transformer_architecture
        if self.data.sequence_length > arch.max_sequence_length:
            raise ValueError(
                f"data.sequence_length={self.data.sequence_length} exceeds transformer_architecture."
                f"max_sequence_length={arch.max_sequence_length}; shorten the sequence or raise max_sequence_length"
            )
        if arch.moe is not None:
            check_moe(
                arch.moe.num_experts,
                arch.moe.top_k,
                self.topology.expert_parallel_size,
                arch.moe.score_function,
                arch.moe.balancing,
                arch.moe.num_groups,
                arch.moe.top_groups,
            )
            if (arch.moe.ffn_size or arch.ffn_size) % tp:
                raise ValueError(
                    f"transformer_architecture.moe.ffn_size={arch.moe.ffn_size or arch.ffn_size} is not divisible by "
                    f"topology.model_parallel_size={tp}; choose a multiple of {tp}"
                )
        elif self.topology.expert_parallel_size > 1:
            raise ValueError(
                f"topology.expert_parallel_size={self.topology.expert_parallel_size} needs mixture-of-experts "
                "blocks: set transformer_architecture.moe, or expert_parallel_size=1"
            )
        cp, seq = self.topology.context_parallel_size, self.data.sequence_length
        if cp > 1 and arch.latent_attention is not None:
            raise ValueError(
                f"topology.context_parallel_size={cp} with transformer_architecture.latent_attention: latent "
                "attention has no context-parallel form yet; set context_parallel_size=1"
            )
        if cp > 1:
            if seq % (2 * cp):
                raise ValueError(
                    f"data.sequence_length={seq} is not divisible by 2 × topology.context_parallel_size = {2 * cp} "
                    f"(each CP rank holds two of {2 * cp} equal chunks); choose a multiple of {2 * cp}"
                )
            check_context_parallel(
                arch.num_attention_heads // tp, cp, arch.context_parallel_method, arch.attention_dropout
            )
        if arch.sequence_parallel and (seq // cp) % tp:
            cp_note = f" / topology.context_parallel_size={cp} = {seq // cp} tokens per CP rank" if cp > 1 else ""
            raise ValueError(
                f"data.sequence_length={seq}{cp_note} is not divisible by topology.model_parallel_size="
                f"{self.topology.model_parallel_size}, which sequence_parallel=true needs"
            )
        virtual = self.training.chunks_per_stage
        if self.training.num_virtual_stages > 1 and self.training.schedule not in ("interleaved_1f1b", "zb_v"):
            raise ValueError(
                f"training.num_virtual_stages={virtual} needs training.schedule='interleaved_1f1b' "
                f"(got {self.training.schedule!r}); set the schedule or num_virtual_stages=1"
            )
        if self.training.schedule == "zb_v" and self.training.num_virtual_stages not in (1, 2):
            raise ValueError(
                f"training.num_virtual_stages={self.training.num_virtual_stages}: schedule='zb_v' runs exactly 2 "
                "chunks per stage; leave num_virtual_stages at 1 or set 2"
            )
        if pp * virtual > arch.num_layers + 2:
            raise ValueError(
                f"topology.pipe_parallel_size={pp} x {virtual} chunks per stage exceed the model's "
                f"{arch.num_layers + 2} pipeline layers (num_layers={arch.num_layers} + embedding + head); "
                "lower num_virtual_stages or add layers"
            )
        if virtual > 1 and (arch.num_layers + 2) % (pp * virtual):
            raise ValueError(
                f"transformer_architecture.num_layers={arch.num_layers} + embedding + head = {arch.num_layers + 2} "
                f"pipeline layers do not split into topology.pipe_parallel_size={pp} x {virtual} chunks per stage "
                f"of equal size (schedule {self.training.schedule!r}); choose num_layers + 2 a multiple of {pp * virtual}"
            )
        if self.finetuning.method == "bitfit" and not arch.bias:
            raise ValueError(
                "finetuning.method='bitfit' trains biases only, but transformer_architecture.bias=false; "
                "set bias=true or choose finetuning.method 'lora' or 'adapter'"
            )
        if self.finetuning.method == "adapter" and self.finetuning.adapter_size % tp:
            raise ValueError(
                f"finetuning.adapter_size={self.finetuning.adapter_size} is not divisible by "
                f"topology.model_parallel_size={tp}; choose a multiple of {tp}"
            )
        check_fits(arch, world)
        layout = {
            "model_parallel_size": tp,
            "context_parallel_size": cp,
            "expert_parallel_size": self.topology.expert_parallel_size,
        }
        collectives = [f"topology.{name}={size}" for name, size in layout.items() if size > 1]
        check_compile_layout(self.training.compile, "training.compile", collectives=collectives)
        if arch.precision == "fp16" and not self.optimizer.loss_scaler.enable:
            raise ValueError(
                "transformer_architecture.precision='fp16' needs optimizer.loss_scaler.enable=true "
                "(fp16 gradients underflow without loss scaling); enable it or use precision='bf16'"
            )
        return self


# More model-weight bytes per rank than this is beyond any machine a rank runs on (the largest
# hosts have a few TiB; an accelerator's memory is a fraction of one), however the run shards.
MAX_WEIGHT_BYTES_PER_RANK = 4 * 2**40


def check_fits(arch: TransformerArchitectureConfig, world_size: int) -> None:
    """Raise ValueError when the weights alone, spread evenly over every rank (the least any
    layout can hold: ZeRO-3 over all of them), exceed :data:`MAX_WEIGHT_BYTES_PER_RANK`.

    A shape typed with a few digits too many (a vocabulary of 10**12) is refused here with its
    size, rather than by an out-of-memory error on every rank after launch.
    """
    parameters = arch.num_parameters()
    per_rank = parameters * arch.dtype.itemsize / world_size
    if per_rank > MAX_WEIGHT_BYTES_PER_RANK:
        raise ValueError(
            f"transformer_architecture has {parameters:.3g} parameters (vocab_size={arch.vocab_size}, "
            f"hidden_size={arch.hidden_size}, num_layers={arch.num_layers}): {per_rank / 2**40:.3g} TiB of "
            f"{arch.precision} weights per rank even spread over all {world_size} ranks, beyond the "
            f"{MAX_WEIGHT_BYTES_PER_RANK // 2**40} TiB any machine holds; check these sizes"
        )


def check_layout(arch: TransformerArchitectureConfig, tp: int, pp: int) -> None:
    """Raise ValueError naming the field when the TP/PP sizes do not fit ``arch``."""
    heads, kv = arch.num_attention_heads, arch.kv_heads
    valid = [t for t in _divisors(heads) if kv % t == 0]
    if tp not in valid:
        raise ValueError(
            f"topology.model_parallel_size={tp} cannot shard num_attention_heads={heads} with num_kv_heads={kv}; "
            f"choose model_parallel_size in {valid}"
        )
    if arch.ffn_size % tp:
        raise ValueError(
            f"MLP intermediate size {arch.ffn_size} is not divisible by topology.model_parallel_size={tp}; "
            "set transformer_architecture.intermediate_size to a multiple of it"
        )
    if arch.hidden_size % tp:
        raise ValueError(
            f"transformer_architecture.hidden_size={arch.hidden_size} is not divisible by "
            f"topology.model_parallel_size={tp}; choose model_parallel_size in {_divisors(arch.hidden_size)}"
        )
    if pp > arch.num_layers + 2:
        raise ValueError(
            f"topology.pipe_parallel_size={pp} exceeds the model's {arch.num_layers + 2} pipeline layers "
            f"(num_layers={arch.num_layers} + embedding + head); use at most {arch.num_layers + 2} stages"
        )
